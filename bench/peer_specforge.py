"""The peer: SpecForge 0.2.0's EAGLE3 trainer on the real check's answers, for the same minutes as ours.

    python bench/peer_specforge.py --config examples/sharegpt-realcheck-gpu.yaml --data .cache/sharegpt \
        --answers 20000 --prompt-turns all --minutes 8 output.dir=DIR            # one GPU (CUDA_VISIBLE_DEVICES)
    TRITON_INTERPRET=1 OMP_NUM_THREADS=2 PYTHONPATH=. python bench/peer_specforge.py \
        --config examples/sharegpt-realcheck.yaml --data .cache/sharegpt-smoke --answers 8 --answer-tokens 16 \
        --validation-prompts 4 --heldout-prompts 4 --eval-new-tokens 16 --minutes 0.2 \
        output.dir=runs/peer-smoke                                                     # the CPU, a few steps

Needs ``specforge==0.2.0`` importable beside this project (``pip install --no-deps --target
/tmp/site specforge-0.2.0-py3-none-any.whl`` and ``PYTHONPATH=.:/tmp/site``; the wheel's own
dependencies pin sglang and torch 2.11, none of which the modules used here import). Every flag
but ``--minutes``, ``--attention-backend`` and ``--probe-steps`` is the real check's
(``scripts/sharegpt_realcheck.py``): the same config, data folder and counts name the same train
file, which holds the target's answers, and the same held-out prompts.

What SpecForge 0.2.0 ships and what this script adds. The wheel trains online only through a
patched SGLang server and Mooncake (``specforge train``); its in-process target backends went with
``scripts/train_eagle3.py`` (last at commit 20e2e3f0). This script is that script's loop rebuilt
on the wheel's own modules, one process, one device:

- data: ``Dataset.from_generator(safe_conversations_generator)`` over the train file, then
  ``build_eagle3_dataset`` with a chat template registered in its ``TEMPLATE_REGISTRY`` from the
  target's own template (the assistant header and end-of-turn token our ``ChatRenderer`` finds,
  no system prompt added: the rendering our run trains on), truncated at ``data.max_length``;
  ``generate_vocab_mapping_file`` for the ``draft.draft_vocab_size`` most frequent supervised
  tokens; ``prepare_dp_dataloaders`` (shuffled, a new order each epoch, ``drop_last``);
- draft: ``AutoDraftModel.from_config`` (``LlamaForCausalLMEagle3``) of the same draft config as
  our EAGLE3 run (one layer, the target's width, the same capture layers and draft vocab size),
  ``load_vocab_mapping``, ``load_embedding`` from the target, ``freeze_embedding``, in
  ``training.param_dtype``; ``OnlineEagle3Model`` with ``training.ttt_length``;
- target: the historical HF backend's capture (forward hooks on the three capture layers, the
  full-vocabulary logits of one forward, both shifted one token with ``specforge.utils.padding``);
- step: ``Eagle3TrainStrategy`` (Σ 0.8^k per-step loss, its Triton loss kernel) through
  ``TrainerCore`` and an unwrapped ``FSDPTrainingBackend`` (a world of one has nothing to shard)
  with ``BF16Optimizer`` (fp32 masters, AdamW, clip, warm-up + cosine over a horizon in steps);
- save: its ``CheckpointManager`` writes ``training_state.pt`` and ``export_to_sglang`` the draft
  directory (``config.json`` + ``model.safetensors``), which our evaluator loads as it is.

The clock. SpecForge's schedule needs its horizon in steps, so ``--probe-steps`` + 1 steps first
run at learning rate 0 (they change no weight, and compile what the step compiles); the median
time of all but the first is one micro-step's, and the horizon is the budget over the time of
one optimizer step (``training.accumulation_steps`` micro-steps). Training then
stops at the first whole step past ``--minutes`` or at the horizon, whichever comes first;
``train_seconds`` counts the steps from the first capture to the last update, not the probe, data
preparation or saving.

The attention backend at its best: ``flex_attention`` on CUDA, ``sdpa`` on the CPU (torch's flex
attention has no backward there). Its loss is a Triton kernel with no CPU path: on the CPU it runs
under Triton's interpreter, slow but exact, so start the script there with ``TRITON_INTERPRET=1``
(Triton reads it when first imported; the script refuses to start on the CPU without it).

Writes into ``output.dir``: ``realcheck.yaml`` (the resolved run config), ``peer.json`` (the
settings and figures: samples, tokens, steps, minutes, samples/s, tokens/s), ``checkpoints/``,
``draft/`` (the export), ``eval-heldout.json`` (our evaluator's τ at k = 3 on the held-out
prompts, the real check's evaluate stage) and ``results.json`` (what ``bench/gpu_quality.py``
reads), and prints a ``RESULT {json}`` line. A folder that already holds ``peer.json`` is refused.
``--phase train`` stops after ``peer.json`` and the export; ``--phase evaluate`` then decodes that
export (``bench/gpu_quality.py`` measures every row once the GPU's training is done).
"""

import argparse
import itertools
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.sharegpt_realcheck import NUM_STEPS, RealCheck, _summary  # noqa: E402
from scripts.sharegpt_realcheck import parse_args as realcheck_args  # noqa: E402
from specforge_core.config import load_config  # noqa: E402
from specforge_core.errors import ConfigError, DataError, SpecForgeError  # noqa: E402
from specforge_core.io import atomic_write_json  # noqa: E402

PEER = "specforge==0.2.0"
TEMPLATE = "peer-target"  # the chat template this script registers with SpecForge


def import_specforge():
    """SpecForge's modules this script drives; ConfigError naming the install when absent."""
    try:
        import specforge  # noqa: F401
        from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: F401  (imports triton)
    except ImportError as e:
        raise ConfigError(f"{PEER} is not importable ({e})", where="PYTHONPATH",
                          fix="pip install --no-deps --target /tmp/site specforge-0.2.0-py3-none-any.whl "
                              "and add /tmp/site to PYTHONPATH (torch's CUDA wheels bring Triton; on the "
                              "CPU pip install triton)") from None


def check_peer_config(cfg) -> None:
    """The run config must be the EAGLE3 family's: the peer trains SpecForge's EAGLE3 draft."""
    if cfg.draft.family != "eagle3" or cfg.draft.fc_norm or cfg.draft.norm_output:
        raise ConfigError(f"the peer trains SpecForge's EAGLE3 draft, the config's draft is {cfg.draft.family}"
                          + (" with EAGLE-3.1's options" if cfg.draft.family == "eagle3" else ""),
                          where="draft.family / draft.fc_norm / draft.norm_output",
                          fix="give the real check's config without the other families' overrides")
    if cfg.data.chat_template_kwargs:
        raise ConfigError("SpecForge's data pipeline renders with no chat template variables",
                          where="data.chat_template_kwargs", fix="remove data.chat_template_kwargs for the peer")
    if len(cfg.data.train_files) != 1:
        raise ConfigError(f"the peer trains on one train file, the config names {len(cfg.data.train_files)}",
                          where="data.train_files", fix="give the real check's flags, which name its train file")


def init_single_process() -> None:
    """SpecForge's ``init_distributed`` for a world of one (the rendezvous ``torchrun`` would set)."""
    from specforge.distributed import init_distributed

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    init_distributed(timeout=10)


def build_dataset(cfg, tokenizer, num_proc: int):
    """SpecForge's tokenized train set of the run's train file, rendered as our run renders it."""
    from datasets import Dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate
    from specforge.utils import safe_conversations_generator

    from specforge_core.data.tokenize import ChatRenderer

    renderer = ChatRenderer(tokenizer, cfg.model.chat_template)
    tokenizer.chat_template = renderer.template  # SpecForge renders with tokenizer.apply_chat_template
    TEMPLATE_REGISTRY.register(TEMPLATE, ChatTemplate(assistant_header=renderer.header,
                                                      end_of_turn_token=renderer.end_of_turn), override=True)
    path = cfg.data.train_files[0]
    rows = Dataset.from_generator(safe_conversations_generator, gen_kwargs={"file_path": path})
    dataset = build_eagle3_dataset(rows, tokenizer, chat_template=TEMPLATE, max_length=cfg.data.max_length,
                                   shuffle_seed=cfg.training.seed, num_proc=num_proc, minimum_valid_tokens=1)
    if len(dataset) == 0:
        raise DataError("no row of the train file has a supervised assistant token", where=path,
                        fix="give the real check's train file of the target's answers (conversations rows)")
    return dataset


class HFTargetCapture:
    """SpecForge's historical HF target backend: hooks on the three capture layers, full logits."""

    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self._states: dict[int, object] = {}
        layers = model.get_decoder().layers
        self._hooks = [layers[i].register_forward_hook(self._keep(i)) for i in self.layer_ids]

    def _keep(self, index: int):
        def hook(_module, _inputs, output):
            self._states[index] = output[0] if isinstance(output, tuple) else output
        return hook

    def __call__(self, batch: dict, device):
        """A SpecForge ``TrainBatch`` of the collated ``batch``: aux states, shifted ids and logits."""
        import torch
        from specforge.runtime.contracts import TrainBatch
        from specforge.utils import padding

        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        aux = torch.cat([self._states.pop(i) for i in self.layer_ids], dim=-1)
        tensors = {"input_ids": padding(ids, left=False), "attention_mask": mask, "hidden_state": aux,
                   "target": padding(logits, left=False), "loss_mask": batch["loss_mask"].to(device)[..., None]}
        return TrainBatch(sample_ids=[], strategy="eagle3", tensors=tensors)


def build_trainer(draft, model, optimizer_factory, cfg):
    """SpecForge's step: ``Eagle3TrainStrategy`` in ``TrainerCore`` over an unwrapped backend."""
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy

    backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(model, wrap=False, optimizer_target=draft)
    strategy = Eagle3TrainStrategy(wrapped, ploss_decay=cfg.training.ploss_decay)
    return TrainerCore(strategy, backend, accumulation_steps=cfg.training.accumulation_steps)


def optimizer_factory(cfg, *, lr: float, total_steps: int):
    """SpecForge's ``BF16Optimizer`` at the run's recipe, over ``total_steps`` (its schedule's horizon)."""
    from specforge.optimizer import BF16Optimizer

    t = cfg.training
    return lambda module: BF16Optimizer(module, lr=lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                                        total_steps=total_steps, warmup_ratio=t.warmup_ratio,
                                        lr_scheduler=t.lr_scheduler)


def horizon_steps(budget_s: float, step_s: float) -> int:
    """Steps that fill the budget at the probed step time (at least one)."""
    if step_s <= 0:
        raise ValueError(f"a probed step time must be positive, got {step_s}")
    return max(1, math.ceil(budget_s / step_s))


def batches(loader):
    """The loader's batches, epoch after epoch (``set_epoch`` reshuffles, as SpecForge's loop does)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch + 1)
        yield from loader
        epoch += 1


def train(cfg, out: Path, device, *, minutes: float, attention_backend: str | None, probe_steps: int) -> dict:
    """Train SpecForge's draft on ``device`` for ``minutes``; save and export it; return the figures."""
    import torch
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.preprocessing import generate_vocab_mapping_file
    from specforge.data.utils import prepare_dp_dataloaders
    from specforge.distributed import destroy_distributed, get_dp_group
    from specforge.modeling.auto import AutoDraftModel
    from transformers import set_seed

    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.decoding.verifier import load_target
    from specforge_core.drafts.eagle3.draft_config import capture_layer_ids_of, draft_config_from_target

    os.environ["SPECFORGE_DEVICE"] = device.type  # SpecForge's device choice: the run's
    backend = attention_backend or ("flex_attention" if device.type == "cuda" else "sdpa")
    param_dtype = getattr(torch, cfg.training.param_dtype)
    t = cfg.training
    set_seed(t.seed)
    init_single_process()
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(cfg)
        dataset = build_dataset(cfg, tokenizer, num_proc=min(8, os.cpu_count() or 1) if device.type == "cuda" else 1)
        target, _ = load_target(cfg)
        dcfg = draft_config_from_target(target.config, cfg.draft.draft_vocab_size, cfg.model.capture_layer_ids)
        vocab_map = generate_vocab_mapping_file(dataset, target_vocab_size=dcfg.vocab_size,
                                                draft_vocab_size=dcfg.draft_vocab_size,
                                                cache_dir=str(out / "vocab_mapping"), cache_key="vocab_mapping")
        draft = AutoDraftModel.from_config(dcfg, attention_backend=backend, torch_dtype=param_dtype)
        draft.load_vocab_mapping(vocab_map)
        draft.load_embedding(cfg.model.target, embedding_key="model.embed_tokens.weight")
        draft.freeze_embedding()
        draft = draft.to(device=device, dtype=param_dtype)
        model = OnlineEagle3Model(draft, length=t.ttt_length, attention_backend=backend).to(device, param_dtype)
        capture = HFTargetCapture(target, capture_layer_ids_of(dcfg))
        loader = prepare_dp_dataloaders(dataset, t.batch_size, num_workers=4 if device.type == "cuda" else 0,
                                        shuffle=True, process_group=get_dp_group())
        prepare_seconds = time.perf_counter() - started

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        # the probe: the same steps at learning rate 0 on the first batches, timed after the first
        stream = batches(loader)
        probe = build_trainer(draft, model, optimizer_factory(cfg, lr=0.0, total_steps=1), cfg)
        times = []
        for _ in range(probe_steps + 1):
            sync()
            t0 = time.perf_counter()
            probe.train_step(capture(next(stream), device))
            sync()
            times.append(time.perf_counter() - t0)
        del probe, stream
        for p in draft.parameters():  # a probe that ended inside an accumulation window left gradients
            p.grad = None
        micro_s = statistics.median(times[1:])  # the first compiles; a new shape's recompile is an outlier
        budget_s = minutes * 60
        horizon = horizon_steps(budget_s, micro_s * t.accumulation_steps)  # optimizer steps, as its schedule counts
        core = build_trainer(draft, model, optimizer_factory(cfg, lr=t.learning_rate, total_steps=horizon), cfg)

        steps = samples = tokens = 0
        last = None
        stream = batches(loader)
        first = next(stream)  # the loader's workers start before the clock, as they had for the probe
        sync()
        clock = time.perf_counter()
        for batch in itertools.chain([first], stream):
            last = core.train_step(capture(batch, device))
            samples += batch["input_ids"].shape[0]
            tokens += int(batch["attention_mask"].sum())
            steps += last.optimizer_stepped
            if last.optimizer_stepped and (steps >= horizon or time.perf_counter() - clock >= budget_s):
                break
        sync()
        train_seconds = time.perf_counter() - clock
        draft_dir = save_and_export(core, dcfg, out, steps)
        return {"peer": PEER, "device": str(device), "attention_backend": backend,
                "param_dtype": t.param_dtype, "batch_size": t.batch_size,
                "accumulation_steps": t.accumulation_steps, "ttt_length": t.ttt_length,
                "learning_rate": t.learning_rate, "lr_scheduler": t.lr_scheduler, "warmup_ratio": t.warmup_ratio,
                "max_grad_norm": t.max_grad_norm, "ploss_decay": t.ploss_decay,
                "draft_vocab_size": dcfg.draft_vocab_size, "max_length": cfg.data.max_length,
                "train_rows": len(dataset), "minutes_budget": minutes, "probe_steps": probe_steps,
                "probe_micro_step_seconds": round(micro_s, 4), "horizon_steps": horizon, "steps": steps,
                "samples": samples, "tokens": tokens, "train_seconds": round(train_seconds, 2),
                "minutes": round(train_seconds / 60, 3), "samples_per_second": round(samples / train_seconds, 3),
                "tokens_per_second": round(tokens / train_seconds, 1), "prepare_seconds": round(prepare_seconds, 1),
                "final_loss": last.loss if last else None, "final_acc": (last.metrics.get("acc") if last else None),
                "draft": str(draft_dir)}
    finally:
        destroy_distributed()


def save_and_export(core, dcfg, out: Path, step: int) -> Path:
    """SpecForge's checkpoint of the draft (``training_state.pt``), then its SGLang export."""
    from specforge.export.to_sglang import export_to_sglang
    from specforge.training.checkpoint import CheckpointManager

    state = core.backend.state_dict()
    shared = {"draft_state_dict": core.strategy.checkpoint_state_filter(state["model"]), "global_step": step,
              "strategy": core.strategy.name, "run_id": "peer", "world_size": 1}
    checkpoint = CheckpointManager(str(out / "checkpoints"), "peer").save(shared, step)
    config = out / "draft_config.json"
    dcfg.to_json_file(str(config))
    return Path(export_to_sglang(checkpoint, str(config), str(out / "draft")))


def parse_args(argv=None):
    """``(peer flags, the real check's args)``: the peer's own flags, the rest as the real check reads them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--minutes", type=float, required=True, help="training minutes (the probe not counted)")
    ap.add_argument("--attention-backend", choices=["flex_attention", "sdpa"],
                    help="the draft's attention (default: flex_attention on CUDA, sdpa on the CPU)")
    ap.add_argument("--probe-steps", type=int, default=5, help="timed steps at learning rate 0 that set the horizon")
    ap.add_argument("--phase", choices=["all", "train", "evaluate"], default="all",
                    help="train (to peer.json and the export), evaluate (our held-out decode of that export), or both")
    args, rest = ap.parse_known_args(argv)
    if args.minutes <= 0 or args.probe_steps < 1:
        ap.error("--minutes must be positive and --probe-steps at least 1")
    return args, realcheck_args([*rest, "--eval-splits", "heldout"])


def train_phase(args, cfg, check, out: Path) -> dict:
    """Train the peer into ``out`` (refused where a peer run is) and write ``peer.json``: its figures."""
    from specforge_core.system.device import resolve_device

    if (out / "peer.json").is_file():
        raise ConfigError("this folder already holds a peer run", where=str(out / "peer.json"),
                          fix="give a new output.dir, or delete the old one")
    device = resolve_device(cfg.capture.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("SpecForge's loss is a Triton kernel with no CPU path; on the CPU only Triton's "
                          "interpreter runs it", where="TRITON_INTERPRET",
                          fix="start this script with TRITON_INTERPRET=1 in its environment (Triton reads "
                              "it when it is first imported), or give it a GPU (capture.device)")
    import_specforge()
    check.write_config()
    figures = train(cfg, out, device, minutes=args.minutes, attention_backend=args.attention_backend,
                    probe_steps=args.probe_steps)
    atomic_write_json(out / "peer.json", figures)
    return figures


def main(argv=None) -> int:
    from specforge_core.system.host import prefer_passive_omp_wait

    prefer_passive_omp_wait()
    from specforge_core.drafts import check_config

    args, check_args = parse_args(argv)
    try:
        cfg = check_config(load_config(check_args.config, check_args.overrides))
        check = RealCheck(check_args, cfg)
        cfg = check.resolved_config()
        check_peer_config(cfg)
        out = Path(cfg.output.dir)
        if args.phase == "evaluate":
            if not (out / "peer.json").is_file():
                raise ConfigError("no peer run to evaluate in this folder", where=str(out / "peer.json"),
                                  fix="run --phase train first with the same output.dir")
            figures = json.loads((out / "peer.json").read_text())
        else:
            figures = train_phase(args, cfg, check, out)
            if args.phase == "train":
                print("RESULT " + json.dumps({"training": figures}), flush=True)
                return 0
        heldout = check.evaluate_stage(draft=Path(figures["draft"]))["heldout"]
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {"training": figures, "heldout": _summary(heldout), "num_steps": NUM_STEPS, "curve": []}
    atomic_write_json(out / "results.json", results)
    print("RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
