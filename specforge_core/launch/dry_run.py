"""The dry run: a launch's layout resolved and checked on a CPU, without weights, tokenizer or processes.

    python -m specforge_core.train --config C.yaml --dry-run [--world N] [--rows N] [--gpu-gib G]
    python -m specforge_core.train --manifest RUN/run.json --dry-run         # a recorded run's inputs
    report = dry_run(cfg, DatasetSize.counted(cfg), world_size=8)
    print(*report.lines(), sep="\\n");  report.as_dict()                   # what the command prints

It runs the checks a launch runs, by calling the code the launch calls, up to where a launch needs a
tokenizer, weights, a GPU or other processes:

1. config validation (``load_config`` made ``cfg``) and ``Topology.launched(cfg, W)``: ``--world N``
   is the number of ranks torchrun will start, and a number other than the config's
   ``deployment.nproc_per_node × nnodes`` is refused as every rank refuses it;
2. preflight's :func:`~specforge_core.launch.preflight.check_target_files` (the target's
   config.json and the given draft files): draft family and vocabulary, context headroom, TP heads,
   capture layers, layer ids SGLang can capture, a given draft config;
3. the draft config the family generates (``family.draft_config``). A token id the family would
   read from the tokenizer (DFlash's mask token, unless ``draft.dflash.mask_token_id`` is set) is
   reported unresolved; id 0 stands in for it while sizing (which row is MASK changes no shape);
4. the plan, ``PromptPlan.from_config(cfg, rows, topology=...)`` (a dataset smaller than one
   optimizer step is refused), compared with a recorded plan (``--plan``, a manifest's) by
   ``check_plan_against_config``;
5. with ``capture.backend: sglang``: ``SGLangEngineArgs.resolve(cfg, topology)``; the pools SGLang
   0.5.14 would size on a GPU of ``gpu_bytes`` (the rule below), refused by ``check_engine_pools``
   as the engine start refuses them; the largest TP-wide batch through ``check_engine_request``.

Left to the launch: the tokenizer against the target's embedding, a GPU and the pinned SGLang on
the node, the data rows themselves (prepare), the output directory (run lock, resume).

**Dataset size** (the plan's N): :meth:`DatasetSize.given` (``--rows N``); else a prompt cache's
train split (a manifest's, or the flow's: exact, with every row's length); else
:meth:`DatasetSize.counted`: the rows of ``data.train_files`` (non-blank JSONL lines, JSON-array
elements) capped by ``data.max_rows``, less ``data.eval_holdout`` — an upper bound, since prepare
drops bad rows and rows with too few supervised tokens.

**Memory per GPU** (an estimate of the bytes allocated at the step's peak; reserved memory adds the
allocator's slack, and the CUDA context adds ≈ 0.5–1 GiB). T = the largest micro-step of any rank
in tokens: from the plan and every row's length when a prompt cache gives them
(``PromptPlan.local_lengths``), else the bound ``training.batch_size × data.max_length``.

- target weights: ``P_t × b`` with ``hf`` (every TP peer holds the whole target); ``P_t × b / tp``
  with ``sglang``, plus its embedding and LM head read in full for the teacher (``V × H × b`` each,
  once when tied). ``P_t`` is counted from config.json on the meta device; b = 2 (bf16), 4 with
  ``model.dtype: float32``;
- SGLang KV pool: ``min(max_total_tokens, ⌊(mem_fraction_static × G − P_t·b/tp) / kv⌋) × kv`` with
  ``kv = layers × 2 × max(1, kv_heads // tp) × head_dim × b`` bytes per token: SGLang's rule (the
  GPU's free memory G at engine start — the engine starts before the draft exists — times
  ``mem_fraction_static``, less what its weights took) capped by ``max_total_tokens``; request
  slots ``min(max_running_requests, pool // 2)``;
- draft states: ``P_d × 16 / W`` for the trainable ``P_d`` (fp32 master, AdamW's two moments, fp32
  gradient: FSDP2 shards them over the world) + ``P_d × 2c`` (the gathered compute copy and its
  gradient; c = 2 with ``training.param_dtype: bfloat16``, else 4) + the frozen ``P_f × c`` (EAGLE3's
  embedding), all counted on the meta device from the draft config;
- captured features: ``T × (K + 1 if the family reads the last hidden) × H × b`` (K capture layers;
  with ``hf`` and tp > 1 each peer briefly holds the whole TP-wide batch's, not counted);
- activations: ``family.activation_bytes(cfg, draft_config, tokens=T, samples=B)`` (each family's
  docstring states its formula).
"""

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specforge_core.capture.target_info import text_config
from specforge_core.errors import ConfigError, ModelError
from specforge_core.run.plan import PromptPlan
from specforge_core.run.topology import Topology

GIB = 1 << 30
DEFAULT_GPU_GIB = 80.0  # an 80 GB H100 when no GPU is visible; an H200 has ≈ 140 GiB (--gpu-gib 140)


@dataclass(frozen=True)
class DatasetSize:
    """The training rows the plan is made for, where that number came from, and (from a prompt
    cache) every row's token count."""

    rows: int
    source: str
    lengths: np.ndarray | None = None

    @classmethod
    def given(cls, rows: int) -> "DatasetSize":
        if rows < 1:
            raise ConfigError(f"--rows {rows}: a plan needs at least one row", where="--rows",
                              fix="give the number of training rows, e.g. --rows 100000")
        return cls(rows, "--rows")

    @classmethod
    def of_prompt_cache(cls, rows, where: str) -> "DatasetSize":
        """The train split of a prompt cache (``PromptCache.rows("train")``): exact, with lengths."""
        return cls(len(rows), f"prompt cache {where}", rows.column("length").astype(np.int64))

    @classmethod
    def counted(cls, cfg) -> "DatasetSize":
        """The rows of ``data.train_files`` counted without tokenizing (an upper bound: see the module)."""
        from specforge_core.data.formats import count_records

        d = cfg.data
        if not d.train_files:
            raise ConfigError("no training data to plan for", where="data.train_files",
                              fix="list the JSONL/JSON files there, or give --rows N")
        rows = sum(count_records(url, d.storage_options) for url in d.train_files)
        if d.max_rows is not None:
            rows = min(rows, d.max_rows)
        holdout = 0 if d.eval_files else d.eval_holdout
        if rows <= holdout:
            raise ConfigError(f"data.eval_holdout={holdout} leaves none of the {rows} rows for training",
                              where="data.eval_holdout", fix="lower data.eval_holdout or add training data")
        return cls(rows - holdout, "counted in data.train_files (an upper bound: prepare drops bad rows)")


def manifest_dataset(manifest, cfg, checked, world_size: int) -> DatasetSize:
    """The prompt cache a run manifest records, opened and checked as rank 0 of a ``world_size``-rank
    launch opens it (``builder.inputs_from_manifest``: each input's key, the recorded plan)."""
    from specforge_core.launch.builder import inputs_from_manifest
    from specforge_core.system.distributed import Dist

    topology = Topology.launched(cfg, world_size)
    rank0 = Dist(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="none", mesh=None)
    inputs = inputs_from_manifest(manifest, rank0, checked, cfg=cfg, topology=topology)
    return DatasetSize.of_prompt_cache(inputs.rows, manifest.prompt_cache.path)


@dataclass
class DryRunReport:
    """Everything the dry run resolved; :meth:`lines` for people, :meth:`as_dict` for the JSON line."""

    topology: Topology
    plan: PromptPlan
    dataset: DatasetSize
    family: str
    layer_ids: tuple[int, ...]
    draft_params: dict[str, int]
    tokens: dict[str, Any]  # per rank per micro-step: max, mean (plan basis only), basis
    memory: dict[str, int]  # part -> bytes, and "peak"
    gpu_bytes: int
    gpu_known: bool = True  # given (--gpu-gib) or the visible GPU's; False: the default stands in
    sglang: dict[str, Any] | None = None
    unresolved: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.gpu_bytes

    def as_dict(self) -> dict:
        p, t = self.plan, self.topology
        return {
            "dry_run": True,
            "topology": {**t.as_dict(), "islands": [list(i) for i in t.islands()]},
            "dataset": {"rows": self.dataset.rows, "source": self.dataset.source},
            "plan": {**p.to_json()["derived"], "key": p.key,
                     "samples_per_micro_step_per_rank": p.batch_size,
                     "samples_per_optimizer_step_per_rank": p.local_samples_per_optimizer_step,
                     "micro_steps_per_optimizer_step": p.accumulation_steps},
            "tokens_per_micro_step_per_rank": self.tokens,
            "draft": {"family": self.family, "capture_layer_ids": list(self.layer_ids), **self.draft_params},
            "sglang": self.sglang,
            "memory": {"gpu_bytes": self.gpu_bytes, "parts_bytes": {k: v for k, v in self.memory.items() if k != "peak"},
                       "peak_bytes": self.memory["peak"], "fits": self.fits},
            "unresolved": self.unresolved,
        }

    def lines(self) -> list[str]:
        p, t, tok = self.plan, self.topology, self.tokens
        islands = t.islands()
        shown = ", ".join(str(list(i)) for i in islands[:4]) + (f", … ({len(islands)} in all)" if len(islands) > 4 else "")
        mean = f", mean {tok['mean']:.0f}" if tok.get("mean") is not None else ""
        out = [
            "dry run: nothing loaded, nothing started",
            f"topology: world {t.world_size} = {t.num_islands} island{'s' * (t.num_islands != 1)} × tp {t.tp_size}; "
            f"island ranks {shown}",
            f"draft: {self.family}, capture layers {list(self.layer_ids)}, "
            f"{self.draft_params['trainable_params'] / 1e6:.1f}M trainable + {self.draft_params['frozen_params'] / 1e6:.1f}M frozen parameters",
            f"data: {self.dataset.rows} training rows ({self.dataset.source})",
            f"per rank: {p.batch_size} samples per micro-step (TP-wide batch {t.island_batch_size}), "
            f"{p.local_samples_per_optimizer_step} per optimizer step; tokens per micro-step ≤ {tok['max']}{mean} ({tok['basis']})",
            f"plan: {p.samples_per_optimizer_step} samples per optimizer step in all; {p.steps_per_epoch} steps per epoch "
            f"× {p.epochs} epoch{'s' * (p.epochs != 1)} → {p.total_optimizer_steps} optimizer steps "
            f"({p.dropped_per_epoch} rows dropped per epoch)",
        ]
        if self.sglang is not None:
            s = self.sglang
            out.append(
                f"sglang: tp {s['engine_args']['tp_size']}, pools {s['pool_requests']} requests / {s['pool_tokens']} tokens "
                f"(need {s['engine_args']['max_running_requests']} / {s['engine_args']['max_total_tokens']}); "
                f"KV {s['kv_bytes_per_token'] / 1024:.0f} KiB per token → {s['pool_bytes'] / GIB:.2f} GiB; "
                f"mem_fraction_static {s['engine_args']['mem_fraction_static']} of {self.gpu_bytes / GIB:.0f} GiB "
                f"would allow {s['capacity_tokens']} tokens")
        parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.memory.items() if k != "peak")
        out.append(f"memory per GPU (estimate, GiB, at {tok['max']} tokens per micro-step): {parts} = "
                   f"{self.memory['peak'] / GIB:.1f} of {self.gpu_bytes / GIB:.0f}")
        if not self.fits and not self.gpu_known:
            out.append(f"warning: the estimate exceeds {self.gpu_bytes / GIB:.0f} GiB, the size assumed without a "
                       "GPU here: give --gpu-gib to have a layout that does not fit refused")
        out += [f"unresolved: {u}" for u in self.unresolved]
        return out

    def check_fits(self, cfg) -> None:
        """Refuse (ConfigError) a layout whose estimate exceeds the GPU, naming the field that
        drives its largest part and the ways to lower it. Only against a known GPU size
        (``gpu_known``), and never for a run captured on the CPU."""
        if self.fits or not self.gpu_known or cfg.capture.device == "cpu":
            return
        parts = {k: v for k, v in self.memory.items() if k != "peak"}
        largest = max(parts, key=parts.get)
        engine = "capture.backend=sglang with a larger capture.tp_size"
        tokens = self.tokens["max"]
        if largest in ("activations", "features"):
            where = "training.token_budget" if cfg.training.token_budget is not None else "data.max_length"
            fix = (f"lower data.max_length, training.batch_size or training.token_budget (each micro-step holds "
                   f"up to {tokens} tokens and its {largest} grow with them)")
            if self.family in ("dflash", "dspark"):
                fix += f", or draft.{self.family}.num_anchors (the block queries of each sample)"
            elif not cfg.training.activation_checkpointing:
                fix += ", or set training.activation_checkpointing: true (each step's MLP block recomputed in backward)"
            fix += f"; or make room by sharding the target ({engine})"
        elif largest in ("target", "kv_pool"):
            where, fix = "capture.tp_size", f"shard the target: {engine}" + (" (or lower capture.sglang.mem_fraction_static)"
                                                     if largest == "kv_pool" else "")
        else:
            where, fix = "draft", "train a smaller draft (fewer layers, a smaller draft vocabulary), or more ranks"
        raise ConfigError(
            f"the memory estimate, {self.memory['peak'] / GIB:.1f} GiB per GPU, exceeds the GPU's "
            f"{self.gpu_bytes / GIB:.0f} GiB (largest part: {largest}, {parts[largest] / GIB:.1f} GiB)",
            where=where, fix=fix)


def default_gpu_bytes() -> int:
    """The visible GPU's memory, else :data:`DEFAULT_GPU_GIB`."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return int(DEFAULT_GPU_GIB * GIB)


def dry_run(cfg, dataset: DatasetSize, *, world_size: int | None = None, gpu_bytes: int | None = None,
            plan_path: str | None = None, checked=None) -> DryRunReport:
    """Resolve and check the launch of ``cfg`` on ``world_size`` ranks (default: the config's) over
    ``dataset``; see the module docstring. ``checked``: preflight's ``check_target_files(cfg)`` when
    the caller ran it. Raises the launch's own SpecForgeError (field and fix) for a broken layout."""
    from specforge_core.launch.builder import check_plan_against_config
    from specforge_core.launch.preflight import check_target_files

    topology = Topology.launched(cfg, cfg.deployment.world_size if world_size is None else world_size)
    checked = checked or check_target_files(cfg)
    family, target_config = checked.family, checked.target_config
    unresolved = [f"{name}: read from the tokenizer at launch (id 0 stands in for sizing here)"
                  for name in family.tokenizer_token_ids(cfg)]
    draft_config = family.draft_config(_with_stand_ins(cfg, family.tokenizer_token_ids(cfg)), target_config,
                                       checked.layer_ids)
    plan = PromptPlan.from_config(cfg, dataset.rows, topology=topology)
    if plan_path is not None:
        check_plan_against_config(cfg, PromptPlan.load(plan_path, topology=topology), topology, dataset.rows, plan_path)
    tokens, widest_batch = _tokens_per_micro_step(cfg, plan, dataset)
    gpu = default_gpu_bytes() if gpu_bytes is None else int(gpu_bytes)

    text = text_config(target_config)
    b = 4 if cfg.model.dtype == "float32" else 2  # the target's dtype on a GPU ("auto": bf16)
    target_params = _target_parameters(cfg, target_config)
    memory: dict[str, int] = {}
    sglang = None
    if cfg.capture.backend == "sglang":
        head_rows = 1 if getattr(target_config, "tie_word_embeddings", False) else 2
        memory["target"] = target_params * b // topology.tp_size + head_rows * text.vocab_size * text.hidden_size * b
        sglang = _sglang_pools(cfg, topology, text, weights=target_params * b // topology.tp_size, gpu=gpu,
                               value_bytes=b, widest_batch=widest_batch)
        memory["kv_pool"] = sglang["pool_bytes"]
    else:
        memory["target"] = target_params * b
    trainable, frozen = _draft_parameters(family, draft_config)
    c = 2 if cfg.training.param_dtype == "bfloat16" else 4
    memory["draft_states"] = trainable * 16 // topology.world_size + trainable * 2 * c + frozen * c
    width = (len(checked.layer_ids) + int(family.captures_last_hidden)) * text.hidden_size
    memory["features"] = tokens["max"] * width * b
    memory["activations"] = family.activation_bytes(cfg, draft_config, tokens=tokens["max"], samples=plan.batch_size)
    memory["peak"] = sum(memory.values())
    return DryRunReport(topology=topology, plan=plan, dataset=dataset, family=family.name, layer_ids=checked.layer_ids,
                        draft_params={"trainable_params": trainable, "frozen_params": frozen}, tokens=tokens,
                        memory=memory, gpu_bytes=gpu, gpu_known=gpu_bytes is not None or torch.cuda.is_available(),
                        sglang=sglang, unresolved=unresolved)


def _with_stand_ins(cfg, fields: tuple[str, ...]):
    """``cfg`` with token id 0 in each of ``fields`` (a copy; ``cfg`` itself is not changed)."""
    if not fields:
        return cfg
    out = cfg.model_copy(deep=True)
    for dotted in fields:
        *path, name = dotted.split(".")
        section = out
        for part in path:
            section = getattr(section, part)
        setattr(section, name, 0)
    return out


def _tokens_per_micro_step(cfg, plan: PromptPlan, dataset: DatasetSize):
    """Per rank per micro-step tokens (``max``, ``mean``, ``basis``) and, from the plan, the row
    lengths of its largest TP-wide batch (None on the bound basis)."""
    if dataset.lengths is None:
        bound = plan.batch_size * cfg.data.max_length
        return {"max": bound, "mean": None, "basis": "bound: batch_size × data.max_length"}, None
    local = plan.local_lengths(dataset.lengths)  # [micro-steps, world, batch]
    per_rank = local.sum(-1)
    if cfg.training.token_budget is None:  # unpacked rows are right-padded to the longest sample
        per_rank = local.amax(-1) * plan.batch_size
    islands = local.view(local.shape[0], plan.num_islands, plan.island_batch_size)
    step, island = divmod(int(islands.sum(-1).argmax()), plan.num_islands)
    tokens = {"max": int(per_rank.max()), "mean": float(per_rank.double().mean()), "basis": "plan and row lengths"}
    return tokens, islands[step, island].tolist()


def _target_parameters(cfg, target_config) -> int:
    """The target's parameter count, from its config on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config, trust_remote_code=cfg.model.trust_remote_code)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot build the target from its config to count its parameters ({e})",
                         where="model.target config.json", fix="point model.target at a causal LM's directory") from None
    return sum(p.numel() for p in model.parameters())


def _draft_parameters(family, draft_config) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts of the family's draft, built on the meta device."""
    with torch.device("meta"):
        draft = family.new_draft(draft_config)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in draft.parameters()) - trainable


def _sglang_pools(cfg, topology: Topology, text, *, weights: int, gpu: int, value_bytes: int,
                  widest_batch: list[int] | None) -> dict:
    """The engine arguments, the pools SGLang would size (module docstring) and the engine's own
    refusals of them (``check_engine_pools``, ``check_engine_request``)."""
    from specforge_core.capture.sglang_backend import SGLangEngineArgs
    from specforge_core.capture.sglang_backend import check_engine_pools, check_engine_request

    args = SGLangEngineArgs.resolve(cfg, topology)
    tp = topology.tp_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    kv = text.num_hidden_layers * 2 * max(1, kv_heads // tp) * head_dim * value_bytes
    capacity = max(0, math.floor((args.get("mem_fraction_static") * gpu - weights) / kv))
    need_rows, need_tokens = args.get("max_running_requests"), args.get("max_total_tokens")
    tokens = min(capacity, need_tokens)
    rows = min(need_rows, tokens // 2)
    where = (f"capture.sglang.mem_fraction_static (dry run: SGLang's pool sizing on a {gpu / GIB:.4g} GiB GPU, "
             f"tp {tp}: {weights / GIB:.1f} GiB of weights per rank)")
    check_engine_pools(rows=rows, tokens=tokens, need_rows=need_rows, need_tokens=need_tokens, where=where)
    widest = widest_batch or [cfg.data.max_length] * topology.island_batch_size  # the bound: every row full
    check_engine_request([range(n) for n in widest], context_len=args.get("context_length"), max_rows=rows,
                         max_tokens=tokens, where="the plan's largest TP-wide batch (dry run)")
    return {"engine_args": args.kwargs(), "kv_bytes_per_token": kv, "capacity_tokens": capacity,
            "pool_tokens": tokens, "pool_requests": rows, "pool_bytes": tokens * kv}
