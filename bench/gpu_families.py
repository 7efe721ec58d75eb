"""Each new family's draft training step beside speculators 0.9.0's, same shapes, weights and batch.

    python bench/gpu_families.py --shape qwen3-8b --out DIR                    # all four, one GPU
    python bench/gpu_families.py --families dspark,dflash2 --seq-len 4096
    python bench/gpu_families.py --shape tiny --device cpu --steps 1 --warmup 0   # smoke test on a CPU

Needs torch, transformers and ``speculators==0.9.0`` with what its import needs (``datasets``,
``openai``, ``redis``, ``kernels``, ``cryptography``, ``loguru``, ``pydantic``; no Prefect or
network: ``pip download`` the wheels for a node without one, ``openai`` below 3, whose 3.x imports
``httpx2``). Families (``--families``): ``dspark``, ``dflash2`` (``draft.dflash.dflash2``),
``dflash`` and ``eagle31`` (EAGLE-3.1: ``draft.fc_norm`` + ``draft.norm_output``). Per family two
processes run one after the other, each a subprocess of this script so that memory and compile
caches do not mix:

- **ours**: the step the trainer runs (``launch/builder.py``'s draft and objective behind
  ``loop/trainer.build_step``: FSDP2 root, bf16 compute over fp32 master weights, AdamW with
  clipping), our attention default (``auto``), ``training.compile`` off (our default;
  ``--ours-compile`` turns it on). It writes
  the draft's initial weights and its settings for the reference to load.
- **reference**: speculators' draft of the same family built from those weights (its module
  names, with the target's embedding, head and final norm in ``embed_tokens``, ``lm_head`` /
  ``verifier_lm_head`` and ``verifier_norm``), stepped as its ``Trainer.train_epoch`` steps:
  fp32 model, ``torch.autocast(bf16)`` around the forward, ``loss.backward()``,
  ``clip_grad_norm_(…, 1.0)``, ``torch.optim.AdamW``. At its best = its own defaults on CUDA,
  which are its fastest documented settings: ``simple_flex_attention`` (block masks built by a
  compiled ``create_block_mask``), its Triton ``fused`` losses, and its ``forward`` under
  ``torch.compile`` (``conditional_torch_compile``), the fused loss called outside the compiled
  graph (on torch 2.11 dynamo fails to trace it: ``keep_fused_losses_out_of_the_compiled_forward``).
  On a CPU: eager attention and eager losses
  (the only ones it has there), no compile.

Both processes run with ``OMP_WAIT_POLICY=PASSIVE`` unless it is set, as ``python -m
specforge_core.train`` runs a rank (``system/host.py``): with torch's spinning waits our host
work, and so our step, was much slower than in training
(``bench/results/families-host-threads-h100-2026-12-07.json``). Each side records the wait policy
and its intra-op thread count (``omp_wait_policy``, ``intra_op_threads``).

Inputs: one packed row of ``--seq-len`` tokens (speculators trains on ``[1, T]`` rows), random
"captured" target features made from a seed on the device by both processes alike, so the target
forward is excluded from both sides: the aux hidden states, and the target's last hidden state
(pre-norm for speculators, which applies its frozen ``verifier_norm``; normed for ours, which
reads it normed). Row p of the pre-norm last hidden is the target head's row of token p+1, so the
target's greedy token after p is the next token of the row, as on regenerated data: the DFlash
families' hard targets (speculators' ``ce`` takes the argmax of the target logits; ours reads the
next token) are the same tokens. Loss mask: every position but the last ``block - 1`` (EAGLE: the
last one): ours admits an anchor a where ``lm[a]`` and ``lm[a+1]``, speculators where ``lm[a]``
and ``a < T - block``; this mask makes the two the same set, with every block inside the row.

Settings (one draft layer everywhere; where the two defaults differ both sides get ours):

- dspark: speculators' DSpark defaults, which are ours (block 8, 512 anchors, γ 4, KL, vanilla
  Markov head of rank 256, confidence head with Markov, sample from anchor).
- dflash: block 16, 512 anchors, hard-target CE with the fixed decay γ 7 (ours; speculators'
  ``dflash`` defaults to D-PACE weights with γ 4).
- dflash2: dflash's settings plus the DFlash2 defaults (taps 2, groups of 16, selector rank 256,
  top-16, α 1) (speculators' ``dflash2`` defaults to block 8, KL and γ 4).
- eagle31: 7 TTT steps decaying by 0.8 (ours; speculators defaults to 3 and 1.0), draft vocab
  32000, ``fc_norm`` and ``norm_output`` on, ``norm_before_fc`` off on both. The two EAGLE-3
  objectives are different functions (ours: SpecForge's soft CE against the target renormalised
  over the draft vocab where its argmax is a draft token, over B·T; speculators': KL against the
  draft-vocab rows of the head under its shift), so their loss values are reported, not compared.

Both sides clip the gradient norm at their own value (ours 0.5, its trainer 1.0; the cost is the
same). Where each side's recipe does different work, each does its own: speculators' DFlash
families make full-vocab target logits for every block slot and take their argmax as the hard
target, ours reads the next token; speculators' EAGLE-3 teacher is the draft-vocab rows of the
head, ours the full vocab (its argmax decides which positions count). The allocator: ours turns
on expandable segments itself (``init_distributed``), the reference runs under the default its
trainer has (``PYTORCH_CUDA_ALLOC_CONF`` is removed from its environment).

Per side: ``--warmup`` untimed steps (compiles included), then ``--steps`` steps each timed by
CUDA events (median; tokens/s = seq-len / median seconds), then three windows of ``--steps`` more
back to back, each waited for once (``back_to_back_step_s``: the median window's mean step,
``back_to_back_windows_s`` all three; both trainers wait for the device only when they log, so
there a step's host work overlaps the step before; ``gc_full_collections``: Python's full garbage
collections over the timed steps, a host pause that shows in a window), the peak allocated memory
over the whole run (weights, optimizer state and activations), and the loss of the first step
(before any update), in the form both sides compute: speculators divides the DFlash families'
weighted sums by Σ mask, ours by Σ w (a constant factor per batch, which AdamW does not see), so
ours is shown over Σ mask; DFlash2's unary and selector terms are shown apart. The first-step
losses agreeing (``first_loss_rel_diff``; ``tests/runtime/test_gpu_families_bench.py`` holds it
to 1e-5 on a CPU, in fp32) is what shows both sides step the same computation. Every family prints
``RESULT {json}`` (with ``ours_over_reference``, ours tokens/s over the reference's, and
``ours_over_reference_back_to_back``) and
``--out DIR`` writes ``DIR/families.json``; the exit status is 1 when a side failed. A side
that runs out of ``--side-timeout`` reports the tail of its progress lines (one per warmup step).
``BENCH_PROFILE=FILE`` with ``--side`` writes the one-by-one timed steps' profiler table (CUDA
time) to FILE (a folder instead of FILE, with or without ``--side``: one file per family and side
in it; ``BENCH_PROFILE_SORT=self_cpu_time_total`` sorts it by the host's time instead; a FILE
ending in ``.json`` gets the profiler's timeline as a Chrome trace instead of the table);
``BENCH_SYNC_DEBUG=FILE`` (CUDA) one more step after the timed ones under
``torch.cuda.set_sync_debug_mode("warn")``, and writes to FILE each call site that made the host
wait for the device, with its count (a step that waits leaves the GPU idle while it refills).

``--warm-parallel N`` first runs every family's two sides once (one step, untimed, N families at a
time) so that torch.compile's on-disk caches (inductor's FX graph and Triton caches, shared by
every process of the machine) hold each compiled graph; the timed comparisons then run one after
the other as without it. A cold compile of speculators' forward takes minutes on one CPU thread:
warming in parallel spends those minutes side by side. The timed figures are unchanged by it
(warmup steps are never timed); ``warmup_s`` then shows a warm start.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("dspark", "dflash2", "dflash", "eagle31")
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1e6, mask_token_id=151669, draft_vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, rope_theta=1e6, mask_token_id=4095, draft_vocab_size=1024),
}
# Where both sides' defaults differ, both get these (module docstring).
DFLASH_SETTINGS = dict(block_size=16, num_anchors=512, gamma=7.0)
EAGLE_SETTINGS = dict(ttt_length=7, decay=0.8)


# ---- shared by both sides: the target, its captured features, the batch ----------------------------


def target_config(shape: str):
    from transformers import Qwen3Config

    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("rope_theta", "mask_token_id", "draft_vocab_size")}
    config = Qwen3Config(**spec, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": SHAPES[shape]["rope_theta"]})
    config._attn_implementation = "sdpa"
    return config


def compute_dtype(device):
    """bf16 compute on a GPU (both sides' training setting); fp32 on a CPU, where the first-step
    losses are compared and bf16 rounding would hide a real difference."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def captured(shape: str, seq_len: int, layers: int, block: int, device, seed: int) -> dict:
    """The target's frozen weights and one row's captured features, drawn on ``device`` from
    ``seed``: identical in both processes."""
    import torch

    s = SHAPES[shape]
    h, v = s["hidden_size"], s["vocab_size"]
    dtype = compute_dtype(device)
    g = torch.Generator(device=device).manual_seed(seed)
    embed = (torch.randn(v, h, generator=g, device=device) * 0.02).to(dtype)
    head = (torch.randn(v, h, generator=g, device=device) * 0.02).to(dtype)
    norm = torch.ones(h, device=device, dtype=dtype)
    ids = torch.randint(3, v - 1, (1, seq_len), generator=g, device=device)  # never the mask token
    aux = torch.randn(1, seq_len, layers * h, generator=g, device=device, dtype=dtype)
    pre = head[torch.roll(ids, -1, dims=1)[0]][None] * 50  # row p: the head row of token p+1
    pre = pre + 0.001 * torch.randn(pre.shape, generator=g, device=device, dtype=dtype)
    last = torch.nn.functional.rms_norm(pre.float(), (h,), norm.float(), s["rms_norm_eps"]).to(dtype)
    loss_mask = torch.ones(1, seq_len, dtype=torch.long, device=device)
    loss_mask[:, seq_len - max(block - 1, 1):] = 0  # module docstring: the same anchors on both sides
    return dict(embed=embed, head=head, norm=norm, ids=ids, aux=aux, pre=pre, last=last, loss_mask=loss_mask)


BACK_TO_BACK_WINDOWS = 3


class FullCollections:
    """Python's full (generation 2) garbage collections while it listens, and the seconds they took:
    a pause of the host that a step-by-step median hides and a back-to-back window shows."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, None

    def record(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start

    def as_dict(self) -> dict:
        return {"count": self.count, "seconds": round(self.seconds, 4)}


def time_steps(step, device, warmup: int, steps: int) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones (CUDA events; wall clock on a CPU):
    the first step's loss (``step(True)`` returns it, read before any update; later steps are
    ``step(False)`` and read nothing the training loop would not), the median seconds, the
    seconds of the warmup and the peak allocated GiB; then ``BACK_TO_BACK_WINDOWS`` windows of
    ``steps`` more back to back, each waited for once: ``back_to_back_windows_s`` their mean step
    seconds, ``back_to_back_step_s`` the median of those; ``gc_full_collections`` counts Python's
    full collections over the timed steps and windows, with their seconds."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first = None
    for i in range(warmup):
        loss = step(first is None)
        first = first or loss
        print(f"warmup step {i + 1}/{warmup} done at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    pauses = FullCollections()
    gc.callbacks.append(pauses.record)
    times = []
    profile = os.environ.get("BENCH_PROFILE")  # a path: the timed steps' CUDA-time table goes there
    kinds = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    tracing = (torch.profiler.profile(activities=kinds, with_stack=profile.endswith(".json")) if profile
               else contextlib.nullcontext())
    with tracing:
        for _ in range(steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = step(first is None)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                loss = step(first is None)
                times.append(time.perf_counter() - t)
            first = first or loss
    # Windows of as many steps back to back, each waited for once at its end: both trainers wait for
    # the device only when they log, so a step's host work overlaps the one before it there. The
    # median window: one slow step (a pause of the host) moves one window's mean, not the figure.
    windows = []
    for _ in range(BACK_TO_BACK_WINDOWS):
        t = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(steps):
            step(False)
        if cuda:
            end.record()
            end.synchronize()
        windows.append((start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t) / max(steps, 1))
    gc.callbacks.remove(pauses.record)
    if profile and profile.endswith(".json"):  # the timeline, for where the device idles
        tracing.export_chrome_trace(profile)
    elif profile:
        order = os.environ.get("BENCH_PROFILE_SORT") or ("self_device_time_total" if cuda else "self_cpu_time_total")
        Path(profile).write_text(tracing.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=90))
    if cuda and os.environ.get("BENCH_SYNC_DEBUG"):
        Path(os.environ["BENCH_SYNC_DEBUG"]).write_text(json.dumps(sync_sites(step), indent=1))
    return dict(first_loss=first, step_s=statistics.median(times), back_to_back_step_s=statistics.median(windows),
                back_to_back_windows_s=windows, gc_full_collections=pauses.as_dict(), warmup_s=warm_s,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                device_name=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), intra_op_threads=torch.get_num_threads(),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""))


def sync_sites(step) -> list:
    """``[[site, count], ...]`` of one ``step(False)`` under the sync debug mode, most frequent
    first; a site is the innermost three frames of this project or speculators (else torch's)."""
    import collections
    import traceback
    import warnings

    import torch

    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "specforge_core" in f.filename or "speculators" in f.filename]
        sites[" < ".join(reversed(frames[-3:])) or f"{Path(filename).name}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(False)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites.most_common()


# ---- ours -------------------------------------------------------------------------------------------


def our_overrides(family: str, shape: str, cpu: bool, seq_len: int, compile_: bool) -> list[str]:
    s = SHAPES[shape]
    # 512 anchors (both defaults), fewer for a row that cannot hold them: speculators computes
    # every one of its max_anchors blocks, valid or not, and a short CPU row has fewer candidates.
    anchors = min(DFLASH_SETTINGS["num_anchors"], seq_len)
    common = ["training.param_dtype=" + ("float32" if cpu else "bfloat16"), "training.learning_rate=1e-4",
              f"capture.device={'cpu' if cpu else 'cuda'}", "training.seed=0", f"training.compile={compile_}"]
    if family == "eagle31":
        return common + ["draft.family=eagle3", "draft.fc_norm=true", "draft.norm_output=true",
                         f"draft.draft_vocab_size={s['draft_vocab_size']}",
                         f"training.ttt_length={EAGLE_SETTINGS['ttt_length']}",
                         f"training.ploss_decay={EAGLE_SETTINGS['decay']}"]
    if family == "dspark":
        return common + ["draft.family=dspark", "draft.dspark.num_layers=1", f"draft.dspark.num_anchors={anchors}",
                         f"draft.dspark.mask_token_id={s['mask_token_id']}"]
    d = DFLASH_SETTINGS
    return common + ["draft.family=dflash", "draft.dflash.num_layers=1",
                     f"draft.dflash.mask_token_id={s['mask_token_id']}", f"draft.dflash.block_size={d['block_size']}",
                     f"draft.dflash.num_anchors={anchors}",
                     f"draft.dflash.loss_decay_gamma={d['gamma']}", f"draft.dflash.dflash2={family == 'dflash2'}"]


def random_vocab(vocab_size: int, draft_vocab_size: int):
    import torch

    from specforge_core.data.vocab import VocabMap

    used = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return VocabMap(key="random", path=Path("random"), d2t=used - torch.arange(draft_vocab_size), t2d=t2d,
                    coverage=None)


def run_ours(args, work: Path) -> dict:
    from types import SimpleNamespace

    import torch

    from specforge_core.capture.base import CapturedBatch, HostMasks
    from specforge_core.config import load_config
    from specforge_core.drafts import get_family
    from specforge_core.launch.builder import build_draft, build_objective
    from specforge_core.loop.trainer import build_step, sum_loss_grad_scale
    from specforge_core.system.distributed import init_distributed

    family, cpu = args.family, args.device == "cpu"
    d = init_distributed("cpu" if cpu else "cuda")
    cfg = load_config(None, our_overrides(family, args.shape, cpu, args.seq_len, args.ours_compile))
    fam = get_family(cfg.draft.family)
    tcfg = target_config(args.shape)
    layer_ids = fam.capture_layer_ids(cfg, tcfg)
    eagle = family == "eagle31"
    block = 1 if eagle else (cfg.draft.dspark if family == "dspark" else cfg.draft.dflash).block_size
    x = captured(args.shape, args.seq_len, len(layer_ids), block, d.device, args.seed)
    del x["pre"]  # speculators' form of the last hidden state
    backend = SimpleNamespace(target_config=tcfg, layer_ids=layer_ids, device=d.device, embed_weight=x["embed"],
                              lm_head_weight=x["head"], hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size)
    vocab = random_vocab(tcfg.vocab_size, cfg.draft.draft_vocab_size) if eagle else None
    draft = build_draft(cfg, fam, backend, vocab)
    save_for_reference(cfg, family, draft, layer_ids, block, work)
    objective, _ = build_objective(cfg, fam, backend)
    root, optimizer = build_step(cfg, d, draft, objective, total_steps=1000, accumulation_steps=1)
    ones = torch.ones_like(x["ids"])
    batch = CapturedBatch(input_ids=x["ids"], attention_mask=ones, loss_mask=x["loss_mask"], aux_hidden=x["aux"],
                          last_hidden=x["last"] if family in ("dspark", "eagle31") else None, task_ids=("bench-0",),
                          host_masks=HostMasks(ones.cpu(), x["loss_mask"].cpu()))  # as a capture keeps them

    def step(record: bool) -> dict | None:
        loss, sums = root(batch)
        optimizer.backward(loss)
        scale = sum_loss_grad_scale(d, sums["weight_sum"], 1) if fam.loss_is_sum else None  # as the trainer does
        weight = float(sums["weight_sum"]) if record and fam.loss_is_sum else None
        seen = {"loss": float(loss.detach()) / weight if weight else float(loss.detach())} if record else None
        if record and family in ("dflash", "dflash2"):  # over Σ mask, as speculators divides (ours: over Σ w)
            slots = float(sums["total"].sum())
            seen = {"loss": float(sums["loss_sum"]) / slots}
            if family == "dflash2":  # loss_sum holds α·selector too: the unary term and the selector's apart
                selector = float(sums["selector_loss_sum"])
                seen = {"loss": (float(sums["loss_sum"]) - cfg.draft.dflash.selector_loss_alpha * selector) / slots,
                        "selector_loss": selector / slots}
        del loss, sums
        optimizer.step(scale)
        return seen

    return time_steps(step, d.device, args.warmup, args.steps)


def save_for_reference(cfg, family: str, draft, layer_ids, block: int, work: Path) -> None:
    """The draft's initial weights in speculators' names and the settings its model is built with."""
    import torch

    if family == "eagle31":
        from specforge_core.drafts.eagle3.speculators_format import speculators_config, speculators_key

        state = {speculators_key(k): v for k, v in draft.draft_state_dict().items()}
        settings = {"speculators_config": speculators_config(draft.config, verifier=str(work / "target"),
                                                             verifier_architectures=["Qwen3ForCausalLM"],
                                                             speculative_tokens=EAGLE_SETTINGS["ttt_length"],
                                                             dtype="float32")}
    else:
        state = dict(draft.state_dict())
        d = cfg.draft.dspark if family == "dspark" else cfg.draft.dflash
        settings = {"layer_config": draft.config.to_dict(), "block_size": block, "layer_ids": list(layer_ids),
                    "mask_token_id": draft.mask_token_id, "num_anchors": d.num_anchors, "gamma": d.loss_decay_gamma}
        if family == "dspark":
            from specforge_core.drafts.dspark.settings import dspark_fields

            settings |= {"fields": dspark_fields(draft.config), "loss_terms": dict(d.loss_terms),
                         "per_position_loss_weight": d.per_position_loss_weight, "dpace_alpha": d.dpace_alpha,
                         "confidence_head_alpha": d.confidence_head_alpha}
        if family == "dflash2":
            from specforge_core.drafts.dflash.family import dflash2_run_fields

            settings |= {"fields": dflash2_run_fields(d), "selector_loss_alpha": d.selector_loss_alpha}
    settings["layer_ids"] = list(layer_ids)
    torch.save({k: (v.float() if v.is_floating_point() else v).detach().cpu() for k, v in state.items()},
               work / "draft.pt")
    (work / "settings.json").write_text(json.dumps(settings, default=str))


# ---- speculators ------------------------------------------------------------------------------------


def reference_model(args, settings: dict, device):
    """speculators' draft of ``args.family`` (fp32, as its trainer holds it)."""
    import speculators.models.attention  # noqa: F401  (registers simple_flex_attention with transformers)
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    family = args.family
    # its trainer's default (--draft-attn-impl) on CUDA; on a CPU the one it can run there
    attention = "eager" if device.type == "cpu" else "simple_flex_attention"
    verifier = VerifierConfig(name_or_path=str(args.work / "target"), architectures=["Qwen3ForCausalLM"])
    if family == "eagle31":
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        data = dict(settings["speculators_config"])
        data.pop("speculators_version", None)
        config = Eagle3SpeculatorConfig(**data)
        config.transformer_layer_config._attn_implementation = attention
        return Eagle3DraftModel(config)
    layer = Qwen3Config(**settings["layer_config"])
    layer._attn_implementation = attention
    block = settings["block_size"]
    common = dict(transformer_layer_config=layer, draft_vocab_size=layer.vocab_size, block_size=block,
                  aux_hidden_state_layer_ids=settings["layer_ids"], mask_token_id=settings["mask_token_id"])

    def spec(algorithm: str, tokens: int):
        return SpeculatorsConfig(algorithm=algorithm, default_proposal_method="greedy", verifier=verifier,
                                 proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)])

    if family == "dspark":
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

        return DSparkDraftModel(DSparkSpeculatorConfig(**common, **settings["fields"],
                                                       speculators_config=spec("dspark", block)))
    if family == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

        return DFlash2DraftModel(DFlash2SpeculatorConfig(**common, **settings["fields"], sample_from_anchor=False,
                                                         speculators_config=spec("dflash2", block - 1)))
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    return DFlashDraftModel(DFlashSpeculatorConfig(**common, sample_from_anchor=False,
                                                   speculators_config=spec("dflash", block - 1)))


def call_kwargs(model, settings: dict, family: str, cpu: bool) -> dict:
    """The forward's keyword arguments from the model class's own ``get_trainer_kwargs``."""
    implementation = "eager" if cpu else "fused"  # fused = its Triton kernels (CUDA only)
    if family == "eagle31":
        return type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation=implementation,
                                              ttt_steps=EAGLE_SETTINGS["ttt_length"],
                                              ttt_step_loss_decay=EAGLE_SETTINGS["decay"])[0]
    kw = dict(loss_implementation=implementation, dflash_decay_gamma=settings["gamma"],
              max_anchors=settings["num_anchors"], per_position_loss_weight="fixed-exp-decay")
    if family == "dspark":
        kw |= dict(loss_fn=json.dumps(settings["loss_terms"]),
                   per_position_loss_weight=settings["per_position_loss_weight"], dpace_alpha=settings["dpace_alpha"],
                   confidence_head_alpha=settings["confidence_head_alpha"])
    else:
        kw |= dict(loss_fn="ce")
    if family == "dflash2":
        kw |= dict(selector_loss_alpha=settings["selector_loss_alpha"])
    return type(model).get_trainer_kwargs(**kw)[0]


def keep_fused_losses_out_of_the_compiled_forward() -> None:
    """On torch 2.11 speculators' compiled ``forward`` fails while dynamo traces its fused Triton
    loss (``AssertionError: ListVariable(length=21) is already tracked for mutation`` from the
    forward and backward kernels' shared ``configs`` list). The kernels are hand-written Triton
    and gain nothing from being traced: run them as they are, with one graph break around the
    loss, and keep the compiled forward and flex attention it defaults to."""
    import torch
    from speculators.losses import utils

    fetch = utils._fused_kernel
    utils._fused_kernel = lambda name: torch.compiler.disable(fetch(name), recursive=True)


def run_reference(args, work: Path) -> dict:
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        keep_fused_losses_out_of_the_compiled_forward()
    settings = json.loads((work / "settings.json").read_text())
    target_config(args.shape).save_pretrained(work / "target")  # the verifier speculators' config names
    family, cpu = args.family, device.type == "cpu"
    block = 1 if family == "eagle31" else settings["block_size"]
    x = captured(args.shape, args.seq_len, len(settings["layer_ids"]), block, device, args.seed)
    model = reference_model(args, settings, device)
    state = torch.load(work / "draft.pt", weights_only=True)
    head = x["head"].float().cpu()
    if family == "eagle31":
        used = torch.arange(state["d2t"].numel()) + state["d2t"]
        state |= {"verifier_lm_head.weight": head[used]}
    else:
        state |= {"lm_head.weight": head, "verifier_lm_head.weight": head}
    state |= {"embed_tokens.weight": x["embed"].float().cpu(), "verifier_norm.weight": x["norm"].float().cpu()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"t2d", "d2t"}:
        raise SystemExit(f"{family}: our weights do not fill speculators' model: missing {missing}, "
                         f"unexpected {unexpected}")
    del state, head, x["embed"], x["head"]  # its fp32 copies are in the model: not counted twice in its peak
    model.to(device).train()
    kwargs = call_kwargs(model, settings, family, cpu)
    row = dict(hidden_states=x["aux"], input_ids=x["ids"], loss_mask=x["loss_mask"],
               verifier_last_hidden_states=x["pre"], document_ids=torch.zeros_like(x["ids"]),
               position_ids=torch.arange(args.seq_len, device=device)[None])
    if family == "eagle31":
        row["position_ids"] = row["position_ids"] + 1  # its own default (1-based)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-4, weight_decay=0.0)

    def step(record: bool) -> dict | None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not cpu):
            _, loss, metrics = model(**row, **kwargs)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if not record:
            return None
        if family == "dflash2":
            return {"loss": float(metrics["unary_loss_sum"]), "selector_loss": float(metrics["selector_loss_sum"])}
        return {"loss": float(loss.detach())}

    return time_steps(step, device, args.warmup, args.steps)


# ---- the two processes of a family, and the comparison -------------------------------------------


def child(args) -> int:
    from specforge_core.system.host import prefer_passive_omp_wait

    prefer_passive_omp_wait()  # before torch is imported, as python -m specforge_core.train does (each side)
    for name, file in (("BENCH_PROFILE", "profile-{}.txt"), ("BENCH_SYNC_DEBUG", "sync-{}.json")):
        if os.environ.get(name) and Path(os.environ[name]).is_dir():  # a folder: one file per family and side
            os.environ[name] = str(Path(os.environ[name]) / file.format(f"{args.family}-{args.side}"))
    args.work = Path(args.work)
    out = run_ours(args, args.work) if args.side == "ours" else run_reference(args, args.work)
    (args.work / f"{args.side}.json").write_text(json.dumps(out))
    return 0


def run_side(args, family: str, side: str, work: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--family", family, "--work", str(work),
           "--shape", args.shape, "--device", args.device, "--seq-len", str(args.seq_len), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    if args.ours_compile:
        cmd.append("--ours-compile")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if side == "reference":  # the allocator its trainer runs under (ours turns expandable segments on itself)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.side_timeout)
    except subprocess.TimeoutExpired as stopped:  # its progress lines say where the time went
        err = stopped.stderr.decode(errors="replace") if isinstance(stopped.stderr, bytes) else stopped.stderr or ""
        return {"error": f"no result within --side-timeout {args.side_timeout} s", "stderr_tail": err[-3000:]}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: " + done.stderr[-3000:]}
    result = json.loads((work / f"{side}.json").read_text()) | {"process_s": round(time.perf_counter() - t, 1)}
    # the side's figures as soon as it ends, so that a run cut short keeps the sides it finished
    windows = " / ".join(f"{w:.4f}" for w in result["back_to_back_windows_s"])
    print(f"{family} {side}: step {result['step_s']:.4f} s (back to back {windows} s; "
          f"{result['gc_full_collections']['count']} full GC), process {result['process_s']} s",
          file=sys.stderr, flush=True)
    return result


def compare_family(args, family: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"families-{family}-") as tmp:
        work = Path(tmp)
        ours = run_side(args, family, "ours", work)
        ref = run_side(args, family, "reference", work) if "error" not in ours else {"error": "ours failed first"}
    row = {"family": family, "shape": args.shape, "device": args.device, "seq_len": args.seq_len,
           "steps": args.steps, "warmup": args.warmup, "ours": ours, "reference": ref}
    for side in (ours, ref):
        if "step_s" in side:
            side["tokens_per_s"] = args.seq_len / side["step_s"]
    if "tokens_per_s" in ours and "tokens_per_s" in ref:
        row["ours_over_reference"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        row["ours_over_reference_back_to_back"] = ref["back_to_back_step_s"] / ours["back_to_back_step_s"]
        if family != "eagle31":  # module docstring: the two EAGLE-3 objectives are different functions
            a, b = ours["first_loss"], ref["first_loss"]
            row["first_loss_rel_diff"] = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b)
    return row


def warm_caches(args, families: list[str]) -> None:
    """One untimed step of each family's two sides, ``--warm-parallel`` families at a time."""
    from concurrent.futures import ThreadPoolExecutor

    once = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0})
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.warm_parallel) as pool:
        for row in pool.map(lambda f: compare_family(once, f), families):
            failed = [side for side in ("ours", "reference") if "error" in row[side]]
            print(f"warm {row['family']}: {'failed ' + ','.join(failed) if failed else 'done'}",
                  file=sys.stderr, flush=True)
    print(f"compile caches warmed in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq-len", type=int, default=None, help="tokens in the row (default 8192; tiny: 64)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles included)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write DIR/families.json")
    ap.add_argument("--ours-compile", action="store_true",
                    help="ours with training.compile (compiled norms, MLPs and unroll passes; minutes of compiling)")
    ap.add_argument("--warm-parallel", type=int, default=0, metavar="N",
                    help="first fill the compile caches: every family once, N at a time, untimed")
    ap.add_argument("--side-timeout", type=float, default=900, help="seconds one side's process may take")
    ap.add_argument("--side", choices=["ours", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--family", choices=FAMILIES, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.seq_len = args.seq_len or (64 if args.shape == "tiny" else 8192)
    unknown = set(args.families.split(",")) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}: choose from {', '.join(FAMILIES)}")
    return args


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    args = parse_args(argv)
    if args.side:
        return child(args)
    families = args.families.split(",")
    if args.warm_parallel:
        warm_caches(args, families)
    rows = []
    for family in families:
        row = compare_family(args, family)
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        if args.out:  # after every family: a run stopped by a time limit keeps the families it finished
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "families.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("ours_over_reference" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
