"""GPU benchmark of the colocated training step on one rank, with its references in the same run.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/gpu_train.py --shape qwen3-8b --out DIR
    python bench/gpu_train.py --shape llama3-8b --phases refs,capture      # a subset of phases
    python bench/gpu_train.py --shape tiny --device cpu --steps 2          # smoke test on a CPU

Needs torch + transformers only (no Prefect, datasets or network); the peer needs the
``specforge==0.2.0`` wheel installed with ``--no-deps`` (skipped when not importable). The target
is built from a config with random bf16 weights; sample lengths follow a ShareGPT-like
log-normal (median 800 tokens, σ 0.9, 64 ≤ ℓ ≤ 4096; the first quarter of each sample is prompt).

Phases (``--phases``, default all):

- ``refs``: bf16 matmul rate, plain target forward tokens/s (dense ``4×4096``, no hooks), FLOP bound;
- ``capture``: the real capture path (``HFCaptureBackend`` + ``RolloutStream`` over a
  ``PromptPlan``), unpacked and packed: tokens/s, overhead over a plain forward of the same
  samples, padding waste; and packed == unpacked per sample on this device;
- ``draft``: our isolated draft step (objective forward + backward + AdamW) on dense shapes, timed
  step by step (synchronised after each, median) and back to back (as a training loop runs them);
  and the same step handed its teacher
  (``CapturedBatch.teacher``, made before the timing as the peer's logits are):
  ``draft_vs_peer_same_inputs_<shape>``;
- ``train``: the end-to-end loop (stream → objective → backward → optimizer), steady-state
  tokens/s and samples/s, capture share, padding, peak memory, peak staged features, seconds from
  launch to the first optimizer step;
- ``peer``: SpecForge 0.2.0's draft step of the same family on the same dense shapes as ``draft``,
  timed both ways too; its figure is the better of the two (``--peer-teachers full,compact``: also
  with its compact teacher, built from the last hidden state as ours is, ``draft_vs_peer_compact_*``).

On CUDA the draft and train phases also count the host-device synchronisations of one step
(``..._syncs_per_step``, ``set_sync_debug_mode``; where they came from in ``DIR/syncs_<key>.txt``).

``--profile`` (CUDA) in the train phase records 2 steps of the loop launched back to back (the
capture named ``bench.capture``, then the step) with the same tables (``..._train_<variant>``);
in the draft phase, per shape, forward / backward / optimizer by CUDA events (and the host's
time to launch each from an idle device), then 2 steps launched back to back after 2 more: the
forward's stages and the backward's autograd nodes by device time, the device's idle time by
phase and stage (``..._idle_<phase|stage>_ms``) and by the launch that ended each gap
(``DIR/idle_<key>.txt``: what the host was still doing while the device waited, and the host's
CUDA runtime calls by name), a profiler table, the kernels by the op that launched them, and the
timeline.

``--family dflash`` times the DFlash family instead (``--dflash-layers`` captured layers and draft
layers, block ``--dflash-block``): capture without the final hidden, the DFlash objective, the
same builder; its peer is SpecForge 0.2.0's ``DFlashDraftModel`` + ``OnlineDFlashModel``
(``dflash_family_model.py``) with the same layers, block, anchors, mask id and loss decay.

Every figure is printed as one ``key=value`` line and written to ``DIR/results.json``; the last
lines are ``vs_peer_best_capture=<x>`` (our end-to-end tokens/s over the serial combination of OUR
best packed capture and the peer's best draft step: a peer that compiled its capture too),
``vs_peer_best_capture_logits=<x>`` (the same capture also making the target head's full-vocab
logits that the peer's step is handed: ``capture_*_with_logits_tokens_per_s``),
``vs_peer_compact_best_capture=<x>`` (with ``--peer-teachers full,compact``: the peer making its
teacher from the last hidden state) and ``vs_peer=<x>``: ours over the serial combination of a
plain target forward and the peer's draft step, ``1 / (1/plain + 1/peer)``.
"""

import time

LAUNCH = time.perf_counter()  # before torch's import: the cold start counts it

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from bench import gpu_reference as ref  # noqa: E402

RESULTS: dict = {}


def report(key: str, value) -> None:
    RESULTS[key] = value
    shown = f"{value:.4g}" if isinstance(value, float) else value
    print(f"{key}={shown}", flush=True)


def sharegpt_like_rows(n: int, vocab: int, seed: int, max_length: int = 4096) -> list[dict]:
    """``n`` prompt rows with ShareGPT-like lengths (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(800) + 0.9 * torch.randn(n, generator=g)).round().clamp(64, max_length).long()
    rows = []
    for n_tok in lengths.tolist():
        prompt = n_tok // 4
        rows.append({
            "input_ids": torch.randint(3, vocab, (n_tok,), generator=g).tolist(),
            "loss_mask": [0] * prompt + [1] * (n_tok - prompt),
        })
    return rows


def fixed_length_rows(n: int, vocab: int, seed: int, length: int) -> list[dict]:
    """``n`` prompt rows of exactly ``length`` tokens each, the first quarter prompt
    (``--sample-length``: the long-context curve)."""
    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * prompt + [1] * (length - prompt)} for _ in range(n)]


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- phases -----------------------------------------------------------------------------------


def phase_refs(args, model) -> None:
    if args.device.type == "cuda":
        report("matmul_tflops", ref.matmul_tflops())
        report("flop_bound_tokens_per_s", ref.flop_bound_tokens_per_s(args.shape, RESULTS["matmul_tflops"]))
    b, t = args.plain_shape
    report("plain_forward_shape", f"{b}x{t}")
    report("plain_forward_tokens_per_s", ref.target_forward_tokens_per_s(model, b, t))


def make_stream(args, backend, rows, *, batch_size, token_budget, steps):
    from specforge_core.run.plan import PromptPlan
    from specforge_core.run.topology import Topology
    from specforge_core.loop.rollout import RolloutStream

    plan = PromptPlan.build(len(rows), seed=args.seed, epochs=1, topology=Topology(1, 1, batch_size),
                            accumulation_steps=1, max_steps=steps)
    return RolloutStream.from_plan(plan, 0, rows, backend, token_budget=token_budget)


def plain_varlen_forward_seconds(backend, request) -> float:
    """A plain flat forward of the request's samples (no hooks' copies, no layout): the floor."""
    from specforge_core.capture import varlen

    lengths = [len(r) for r in request.input_ids]
    ids = torch.as_tensor([t for r in request.input_ids for t in r], device=backend.device)[None]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(backend.device)[None]

    @torch.inference_mode()
    def run():
        with varlen.packed_call(lengths, backend.device) as kwargs:
            backend._decoder(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
        backend._grabbed.clear()

    return ref.median_seconds(run, warmup=1, iters=3) if backend.device.type == "cuda" else _cpu_time(run)


def _cpu_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_stream(args, backend, rows, name, *, batch_size, token_budget, logits: bool = False) -> None:
    """Steady-state capture figures of the real path (plan → stream → backend), 2 warm-up captures.

    ``logits`` (CUDA): also time the target head's full-vocab bf16 logits of every captured token,
    what a capture that feeds SpecForge's step makes (its step is handed them): ``*_with_logits``."""
    stream = make_stream(args, backend, rows, batch_size=batch_size, token_budget=token_budget, steps=args.steps + 2)
    for _ in range(2):
        batch = next(stream)
        del batch
    start = stream.stats.as_dict()
    heads = []
    for batch in stream:
        if logits and batch.last_hidden is not None and args.device.type == "cuda":
            heads.append([torch.cuda.Event(enable_timing=True) for _ in range(2)])
            heads[-1][0].record()
            z = batch.last_hidden[batch.attention_mask.bool()] @ backend.lm_head_weight.t()  # [tokens, V] bf16
            heads[-1][1].record()
            del z
        del batch
    end = stream.stats.as_dict()
    tokens = end["island_tokens"] - start["island_tokens"]
    slots = end["local_slots"] - start["local_slots"]
    seconds = end["capture_seconds"] - start["capture_seconds"]
    report(f"capture_{name}_tokens_per_s", tokens / seconds)
    if heads:
        heads[-1][1].synchronize()
        head = sum(a.elapsed_time(b) for a, b in heads) / 1e3
        report(f"capture_{name}_head_logits_seconds_per_step", head / args.steps)
        report(f"capture_{name}_with_logits_tokens_per_s", tokens / (seconds + head))
    report(f"capture_{name}_padding", 1 - tokens / slots)
    report(f"capture_{name}_tokens_per_step", tokens / args.steps)


def phase_capture(args, backend, rows) -> None:
    from dataclasses import replace

    from specforge_core.capture.base import TargetRequest

    measure_stream(args, backend, rows, "unpacked", batch_size=args.unpacked_batch, token_budget=None)
    measure_stream(args, backend, rows, "packed", batch_size=args.batch_size, token_budget=args.token_budget,
                   logits=args.family == "eagle3")
    # The floor for the packed capture: a plain flat forward of one batch's samples.
    sample = rows[: args.batch_size]
    request = TargetRequest.from_rows([r["input_ids"] for r in sample], [r["loss_mask"] for r in sample],
                                      slice(0, len(sample)))
    floor = plain_varlen_forward_seconds(backend, request)
    packed = replace(request, token_budget=args.token_budget)
    capture = ref.median_seconds(lambda: backend.capture(packed), warmup=1, iters=3) \
        if backend.device.type == "cuda" else _cpu_time(lambda: backend.capture(packed))
    report("plain_varlen_forward_tokens_per_s", request.num_tokens / floor)
    report("capture_overhead_vs_plain_varlen", capture / floor - 1)
    if "plain_forward_tokens_per_s" in RESULTS:
        report("capture_overhead_vs_plain_dense",
               RESULTS["plain_forward_tokens_per_s"] / RESULTS["capture_packed_tokens_per_s"] - 1)
    check_packed_equals_unpacked(backend, request, args.token_budget)


def phase_capture_compiled(args, backend, rows) -> None:
    """The packed capture with the target's decoder layers compiled (``training.compile``); kept
    for training only if faster. ``capture_compiled_vs_eager_rel_err``: one batch's capture,
    compiled against eager (the worst of aux and last hidden; bf16 rounding of fused kernels)."""
    from specforge_core.capture.base import TargetRequest
    from specforge_core.system.compile import compile_target

    sample = rows[: args.batch_size]
    request = TargetRequest.from_rows([r["input_ids"] for r in sample], [r["loss_mask"] for r in sample],
                                      slice(0, len(sample)), token_budget=args.token_budget)
    eager = backend.capture(request)
    report("capture_compiled_modules", compile_target(backend._decoder))
    compiled = backend.capture(request)
    report("capture_compiled_vs_eager_rel_err", max(
        _rel_err(compiled.aux_hidden, eager.aux_hidden),
        0.0 if eager.last_hidden is None else _rel_err(compiled.last_hidden, eager.last_hidden)))
    del eager, compiled
    measure_stream(args, backend, rows, "packed_compiled", batch_size=args.batch_size, token_budget=args.token_budget,
                   logits=args.family == "eagle3")
    faster = RESULTS["capture_packed_compiled_tokens_per_s"] > RESULTS.get("capture_packed_tokens_per_s", 0)
    report("capture_compiled_used", faster)
    if not faster:
        for module in backend._decoder.modules():
            module._compiled_call_impl = None
            vars(module).pop("forward", None)  # a compiled layer's region


def _rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check_packed_equals_unpacked(backend, request, token_budget) -> None:
    """Per sample, the packed capture vs the sample captured alone (one row, no padding, the dense
    causal kernel) on this device: the worst relative error over aux and last hidden."""
    from dataclasses import replace

    n = min(4, len(request.input_ids))
    packed = backend.capture(replace(request, token_budget=token_budget))
    padded = backend.capture(replace(request, input_ids=request.input_ids[:n], loss_mask=request.loss_mask[:n],
                                     local=slice(0, n)))
    worst = noise = 0.0
    for i in range(n):
        alone = backend.capture(replace(request, input_ids=request.input_ids[i : i + 1],
                                        loss_mask=request.loss_mask[i : i + 1], local=slice(0, 1)))
        where, length = packed.seq_ids == i, len(request.input_ids[i])
        worst = max(worst, _rel_err(packed.aux_hidden[where], alone.aux_hidden[0]))
        noise = max(noise, _rel_err(padded.aux_hidden[i, :length], alone.aux_hidden[0]))
        if alone.last_hidden is not None:  # DFlash captures no final hidden
            worst = max(worst, _rel_err(packed.last_hidden[where], alone.last_hidden[0]))
            noise = max(noise, _rel_err(padded.last_hidden[i, :length], alone.last_hidden[0]))
    report("packed_vs_alone_rel_err", worst)
    report("padded_vs_alone_rel_err", noise)  # the same samples through the padded, masked kernel: bf16 noise


def run_config(args, *, compile_pointwise: bool = False, attention: str = "auto"):
    """The run config of the timed steps: the fields the product's builder reads."""
    from specforge_core.config import load_config

    blocks = [f"draft.dflash.num_layers={args.dflash_layers}", f"draft.dflash.block_size={args.dflash_block}",
              f"draft.dflash.mask_token_id={args.dflash_mask}"]
    if args.family == "dspark":  # its own section: DSpark's defaults, DFlash's layer count and mask token
        blocks = [f"draft.dspark.num_layers={args.dflash_layers}", f"draft.dspark.mask_token_id={args.dflash_mask}"]
    vocab = [] if args.vocab_d is None else [f"draft.draft_vocab_size={args.vocab_d}"]  # set once the target is built
    return load_config(None, [
        f"training.seed={args.seed}", f"training.ttt_length={args.ttt_length}", "training.ploss_decay=0.8",
        *vocab, "training.param_dtype=bfloat16", "training.learning_rate=1e-4",
        "training.warmup_ratio=0.015", "training.max_grad_norm=0.5", f"training.compile={compile_pointwise}",
        f"capture.device={'cuda' if args.device.type == 'cuda' else 'cpu'}", f"draft.family={args.family}",
        *blocks, f"draft.attention_backend={attention}",
        f"training.activation_checkpointing={str(args.activation_checkpointing).lower()}",
    ])


def random_vocab(args, vocab_size: int):
    from pathlib import Path as _Path

    from specforge_core.data.vocab import VocabMap

    g = torch.Generator().manual_seed(args.seed)
    used = torch.randperm(vocab_size, generator=g)[: args.vocab_d].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return VocabMap(key="random", path=_Path("random"), d2t=used - torch.arange(args.vocab_d), t2d=t2d, coverage=None)


class TrainLoop:
    """The training step of ``specforge_core.train`` on one rank, built by the same builder: the
    family's draft and objective (``launch/builder.py``) behind the trainer's FSDP2 root (bf16
    compute, fp32 masters) and its AdamW + clipping + schedule (``loop/trainer.build_step``);
    ``step(batch)`` is one micro-batch = one optimizer step (accumulation 1)."""

    def __init__(self, args, backend, *, compile_pointwise: bool = False, total_steps: int = 1000,
                 attention: str = "auto"):
        from specforge_core.drafts import get_family
        from specforge_core.launch.builder import build_draft, build_objective
        from specforge_core.system.distributed import init_distributed
        from specforge_core.loop.trainer import build_step

        t = [time.perf_counter()]
        d = init_distributed("cuda" if args.device.type == "cuda" else "cpu")
        t.append(time.perf_counter())
        cfg = run_config(args, compile_pointwise=compile_pointwise, attention=attention)
        family = get_family(cfg.draft.family)
        draft = build_draft(cfg, family, backend, random_vocab(args, backend.vocab_size))
        t.append(time.perf_counter())
        objective, _ = build_objective(cfg, family, backend)
        self.root, self.optimizer = build_step(cfg, d, draft, objective, total_steps=total_steps, accumulation_steps=1)
        sync(args.device)
        t.append(time.perf_counter())
        self.d, self.loss_is_sum, self.draft = d, family.loss_is_sum, draft
        self.build_split = {"distributed": t[1] - t[0], "draft": t[2] - t[1], "step": t[3] - t[2]}

    def step(self, batch, memory: dict | None = None) -> None:
        """One step; its phases are named ``bench.forward/backward/optimizer`` in a profile. With
        ``memory`` (a dict, CUDA) it records the GiB allocated when the step starts (target, draft,
        optimizer state and the captured batch) and the peak allocated during each phase."""
        from specforge_core.loop.trainer import sum_loss_grad_scale

        def mark(name):
            if memory is not None:
                memory[name] = gib(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()

        if memory is not None:
            memory["start"] = gib(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        with record_function("bench.forward"):
            loss, sums = self.root(batch)
        mark("forward_peak")
        with record_function("bench.backward"):
            self.optimizer.backward(loss)
        mark("backward_peak")
        # as the trainer does for a summed loss (DFlash): divide by the global weight
        scale = sum_loss_grad_scale(self.d, sums["weight_sum"], 1) if self.loss_is_sum else None
        del loss, sums
        with record_function("bench.optimizer"):
            self.optimizer.step(scale)
        mark("optimizer_peak")


def dense_batch(args, backend, b, t):
    from specforge_core.capture.base import CapturedBatch, HostMasks

    h, v = backend.hidden_size, backend.vocab_size
    d = args.device
    ones = torch.ones(b, t, dtype=torch.long, device=d)
    k = len(backend.layer_ids)
    return CapturedBatch(
        input_ids=torch.randint(3, v, (b, t), device=d), attention_mask=ones, loss_mask=ones.clone(),
        aux_hidden=torch.randn(b, t, k * h, device=d, dtype=torch.bfloat16),
        last_hidden=torch.randn(b, t, h, device=d, dtype=torch.bfloat16) if backend.keep_last_hidden else None,
        task_ids=tuple(f"dense-{i}" for i in range(b)),
        host_masks=HostMasks(torch.ones(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.long)),  # as a capture keeps them
    )


def count_syncs(args, key: str, fn) -> int:
    """Host-device synchronisations inside ``fn()`` (``torch.cuda.set_sync_debug_mode("warn")``:
    a copy to pageable memory or from it, ``.item()``, ``nonzero``, ...), reported as
    ``<key>_syncs_per_step``; where each came from (our frames of its Python stack) goes to
    ``DIR/syncs_<key>.txt``."""
    import traceback
    import warnings

    sites: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):  # not the one-off "prototype feature" notice
            frames = [f for f in traceback.extract_stack()[:-1] if "specforge_core" in f.filename or "/bench/" in f.filename]
            sites.append(f"  {str(message).splitlines()[0]}\n" + "".join(traceback.format_list(frames[-4:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    report(f"{key}_syncs_per_step", len(sites))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        text = "".join(f"--- sync {i}\n{site}" for i, site in enumerate(sites)) or "none\n"
        (Path(args.out) / f"syncs_{key}.txt").write_text(text)
    return len(sites)


def phase_draft(args, backend, variant: str) -> None:
    """Our isolated draft step on dense shapes (the peer's shapes), eager or with compiled norms/MLPs.

    Timed two ways: each step alone (``ref.median_seconds``: synchronised after every step, median) and
    steps back to back as a trainer runs them (``..._back_to_back_tokens_per_s``: one
    synchronisation after all); ``draft_<shape>_tokens_per_s`` is the better of the two. A variant
    ``compiled-<backend>`` is the compiled step with that attention backend (``auto`` otherwise);
    it is reported under its own keys and is not a candidate for the best figure."""
    compiled, _, attention = variant.partition("-")
    loop = TrainLoop(args, backend, compile_pointwise=compiled == "compiled", attention=attention or "auto")
    for b, t in args.draft_shapes:
        batch = dense_batch(args, backend, b, t)
        key = f"draft_{variant.replace('-', '_')}_{b}x{t}"
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        s, s_run = step_seconds(args, lambda: loop.step(batch))
        if args.device.type == "cuda":
            report(f"{key}_peak_gib", gib(torch.cuda.max_memory_allocated()))
            report(f"{key}_back_to_back_tokens_per_s", b * t / s_run)
            count_syncs(args, key, lambda: loop.step(batch))
        report(f"{key}_tokens_per_s", b * t / s)
        if not attention:
            best = RESULTS.get(f"draft_{b}x{t}_tokens_per_s", 0.0)
            RESULTS[f"draft_{b}x{t}_tokens_per_s"] = max(best, b * t / s, b * t / s_run)
        if args.family == "eagle3" and not attention:
            time_teacher_given(args, loop, backend, batch, key, b, t)
        if args.profile and args.device.type == "cuda":
            profile_step(args, loop, batch, key)
        del batch
    del loop


def step_seconds(args, step) -> tuple[float, float]:
    """Seconds per ``step()``: each step alone (synchronised after each, median) and steps launched
    back to back (one synchronisation after all); on a CPU one figure serves both."""
    if args.device.type != "cuda":
        s = _cpu_time(step)
        return s, s
    return (ref.median_seconds(step, warmup=2, iters=args.steps),
            ref.timed_back_to_back(step, warmup=1, iters=args.steps))


def time_teacher_given(args, loop, backend, batch, key: str, b: int, t: int) -> None:
    """The same step handed its teacher (``CapturedBatch.teacher``, made before the timing) as the
    peer's step is handed the target's full-vocab logits: the same inputs on both sides, the
    target head's matmul in neither step. ``draft_teacher_given_<b>x<t>_tokens_per_s`` (the
    better of per step and back to back; ``draft_vs_peer_same_inputs_*`` in ``main``)."""
    import dataclasses

    from specforge_core.drafts.vocab.teacher import compute_teacher

    made = compute_teacher(batch.last_hidden.flatten(0, 1), backend.lm_head_weight, loop.draft.t2d)
    given = dataclasses.replace(batch, teacher=made)
    s, s_run = step_seconds(args, lambda: loop.step(given))
    report(f"{key}_teacher_given_tokens_per_s", b * t / min(s, s_run))
    best = RESULTS.get(f"draft_teacher_given_{b}x{t}_tokens_per_s", 0.0)
    RESULTS[f"draft_teacher_given_{b}x{t}_tokens_per_s"] = max(best, b * t / min(s, s_run))


def _device_ms(event, steps: int = 2) -> float:
    """Device milliseconds per step of a profiler row (kernels launched inside it)."""
    total = getattr(event, "device_time_total", None)
    return (event.cuda_time_total if total is None else total) / 1e3 / steps


def profile_step(args, loop, batch, key: str) -> None:
    """Where one step's time goes: forward / backward / optimizer medians by CUDA events, then 2
    steps launched back to back under the profiler (:func:`record_steps`): the forward's stages,
    the backward's nodes and the device's idle time per step."""
    parts = {"forward": [], "backward": [], "optimizer": []}
    host = {"forward": [], "backward": []}  # the host's milliseconds to launch each, from an idle device
    for _ in range(args.steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        t0 = time.perf_counter()
        ev[0].record()
        loss, sums = loop.root(batch)
        ev[1].record()
        t1 = time.perf_counter()
        loop.optimizer.backward(loss)
        ev[2].record()
        host["forward"].append((t1 - t0) * 1e3)
        host["backward"].append((time.perf_counter() - t1) * 1e3)
        del loss, sums
        loop.optimizer.step()
        ev[3].record()
        ev[3].synchronize()
        for name, a, z in zip(parts, ev[:3], ev[1:]):
            parts[name].append(a.elapsed_time(z))
    for name, ms in [*parts.items(), *((f"{k}_host", v) for k, v in host.items())]:
        report(f"{key}_{name}_ms", sorted(ms)[len(ms) // 2])
    events, timeline = record_steps(args, key, lambda: loop.step(batch))
    # the forward's named stages (record_function ranges in drafts/eagle3) and the backward by
    # autograd node: device time of the kernels each one launched, per step. A range has two rows:
    # the host's (its kernels' sum, and its host time: launching, dispatch, Python; where the device
    # waits on the host, a stage's host time exceeds its kernels' time) and the device timeline's
    # annotation (first to last kernel: _span)
    for e in events:
        if e.key.startswith("eagle3."):
            stage = e.key.removeprefix("eagle3.")
            if e.device_type == torch.autograd.DeviceType.CPU:
                report(f"{key}_fwd_{stage}_ms", _device_ms(e))
                report(f"{key}_fwd_{stage}_host_ms", e.cpu_time_total / 1e3 / 2)
            else:
                report(f"{key}_fwd_{stage}_span_ms", _device_ms(e))
    backward = sorted((e for e in events if e.key.startswith(AUTOGRAD_NODE)),
                      key=lambda e: -_device_ms(e))
    for e in backward[:12]:
        name = e.key.removeprefix(AUTOGRAD_NODE)
        report(f"{key}_bwd_{name}_ms", _device_ms(e))
    for name, ms in device_idle(timeline, steps=2).items():
        report(f"{key}_idle_{name}_ms", ms)


def record_steps(args, key: str, step) -> tuple:
    """The last 2 of 4 ``step()`` calls launched back to back, as a trainer runs them (the first
    recorded one starts while the device still runs the one before: a step started on an idle
    device shows gaps the loop never has), under torch.profiler. Writes, with ``--out``, a table of
    the top kernels and ops by device time (DIR/profile_<key>.txt), the kernels by the op that
    launched them (DIR/kernels_<key>.txt, :func:`kernels_by_origin`), the device's idle time by the
    launch that ended each gap (DIR/idle_<key>.txt, :func:`idle_by_launch`) and the timeline
    (DIR/trace_<key>.json.gz). Returns the profiler's averages and the timeline's events."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    scratch = None if args.out else tempfile.TemporaryDirectory()  # the trace is read back, then dropped
    out = Path(args.out or scratch.name)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace_{key}.json.gz"
    recorded = {}

    def ready(prof):
        recorded["events"] = prof.key_averages()
        recorded["shapes"] = prof.key_averages(group_by_input_shape=True)
        prof.export_chrome_trace(str(trace))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, on_trace_ready=ready,
                 schedule=torch.profiler.schedule(wait=0, warmup=2, active=2, repeat=1)) as prof:
        for i in range(4):
            step()
            if i == 3:
                torch.cuda.synchronize()  # every kernel of the last step done before the trace ends
            prof.step()
    events = recorded["events"]
    table = events.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
    cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)
    shapes = recorded["shapes"].table(
        sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=40, max_shapes_column_width=110)
    timeline = trace_events(trace)  # the two steps' timeline (https://ui.perfetto.dev), kept with --out
    if args.out:
        (out / f"profile_{key}.txt").write_text(table + "\n\n" + cpu_table + "\n\n" + shapes)
        (out / f"kernels_{key}.txt").write_text(kernels_table(kernels_by_origin(timeline, steps=2)))
        (out / f"idle_{key}.txt").write_text(
            kernels_table(idle_by_launch(timeline, steps=2), "gaps") + "\n" + runtime_table(timeline, steps=2))
    if scratch is not None:
        scratch.cleanup()
    print("\n".join(line[:160] for line in table.splitlines()[:24]), flush=True)
    return events, timeline


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "  # the profiler's name prefix of a backward node
_ORIGINS = (AUTOGRAD_NODE, "bench.", "eagle3.", "FSDP::", "Optimizer.")


def trace_events(trace: Path) -> list[dict]:
    """The events of a profiler timeline written by ``export_chrome_trace`` (``.json.gz``)."""
    import gzip

    return json.loads(gzip.open(trace).read())["traceEvents"]


_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # a timeline's categories of device work


def device_idle(events: list[dict], steps: int) -> dict[str, float]:
    """Milliseconds per step the device sat idle (no kernel, copy or memset running) in a profiler
    timeline's ``events`` (:func:`trace_events`): in all (first to last kernel), inside each ``bench.*`` phase's device span, and
    inside each forward stage's span (``eagle3.*``; a gap counts to the innermost span around it).
    Idle inside a span is the host launching that stage's work while the device waits."""
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") in _DEVICE_WORK and "dur" in e)
    if not busy:
        return {}
    gaps, end = [], busy[0][1]
    for a, z in busy[1:]:
        if a > end:
            gaps.append((end, a))
        end = max(end, z)
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("cat") == "gpu_user_annotation" and e["name"].startswith(("bench.", "eagle3."))]
    idle = {"all": sum(z - a for a, z in gaps)}
    for a, z in gaps:
        mid = (a + z) / 2
        around = [s for s in spans if s[0] <= mid <= s[1]]
        for prefix in ("bench.", "eagle3."):
            inner = [s for s in around if s[2].startswith(prefix)]
            if inner:
                name = min(inner, key=lambda s: s[1] - s[0])[2].split(".", 1)[1]
                idle[name] = idle.get(name, 0.0) + z - a
    return {k: v / 1e3 / steps for k, v in idle.items()}


def launch_origins(events: list[dict]) -> dict:
    """What launched each piece of device work in a profiler timeline (``events``:
    :func:`trace_events`): per launch correlation id, ``(where, op, input dims)``, the two
    innermost named ranges around the host's launch call (forward stage, autograd node, FSDP,
    optimizer; ``-`` where none) and the innermost ``cpu_op`` around it with its input shapes."""
    events = [e for e in events if e.get("ph", "X") == "X" and "dur" in e]
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") in _DEVICE_WORK and "correlation" in e.get("args", {})}
    by_tid: dict = {}
    for e in events:
        cat = e.get("cat")
        if cat in ("cpu_op", "user_annotation"):
            by_tid.setdefault(e["tid"], []).append((e["ts"], 0, e))
        elif cat in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") in launched:
            by_tid.setdefault(e["tid"], []).append((e["ts"], 1, e))
    origins = {}
    for items in by_tid.values():
        # one sweep per thread: host ranges nest, so the open ones at a launch form a stack
        items.sort(key=lambda x: (x[0], x[1], -x[2]["dur"]))
        stack: list = []
        for ts, is_launch, e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            if not is_launch:
                stack.append(e)
                continue
            ops = [s for s in stack if s.get("cat") == "cpu_op"]
            named = [s["name"].removeprefix(AUTOGRAD_NODE) for s in stack if s["name"].startswith(_ORIGINS)]
            leaf = ops[-1] if ops else None
            origins[e["args"]["correlation"]] = (
                " > ".join(named[-2:]) or "-", leaf["name"] if leaf else "-",
                str(leaf.get("args", {}).get("Input Dims", "")) if leaf else "")
    return origins


def _rows(items, steps: int) -> list[tuple[float, float, str, str, str]]:
    """``(key, µs)`` items, ``key = (where, op, dims)``, summed per key as rows ``(ms, count,
    where, op, dims)`` per step, largest first."""
    groups: dict = {}
    for key, us in items:
        total, n = groups.get(key, (0.0, 0))
        groups[key] = (total + us, n + 1)
    rows = [(us / 1e3 / steps, n / steps, *key) for key, (us, n) in groups.items()]
    return sorted(rows, key=lambda r: -r[0])


_UNKNOWN = ("-", "-", "")  # the origin of device work whose launch the trace lacks


def kernels_by_origin(events: list[dict], steps: int) -> list[tuple[float, float, str, str, str]]:
    """Device time per step of a profiler timeline's kernels (copies and memsets too; ``events``:
    :func:`trace_events`), grouped by what launched them (:func:`launch_origins`; ``-`` for work
    whose launch the trace lacks). Rows ``(ms, kernels, where, op, input dims)`` per step, largest
    first: where a phase's kernel time goes by source line, e.g. the gradient adds of one weight
    or one ``index_add``."""
    origins = launch_origins(events)
    return _rows(((origins.get(e.get("args", {}).get("correlation"), _UNKNOWN), e["dur"])
                  for e in events if e.get("cat") in _DEVICE_WORK and "dur" in e), steps)


def idle_by_launch(events: list[dict], steps: int) -> list[tuple[float, float, str, str, str]]:
    """The device's idle time per step in a profiler timeline (``events``: :func:`trace_events`),
    each gap counted to the launch that ended it (:func:`launch_origins` of the work that ran
    next): what the host was still doing while the device waited. Rows ``(ms, gaps, where, op,
    input dims)`` per step, largest first; unlike :func:`device_idle`'s spans, a gap between two
    stages counts to the code that launched the next one."""
    origins = launch_origins(events)
    work = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
                  for e in events if e.get("cat") in _DEVICE_WORK and "dur" in e)
    gaps, end = [], None
    for ts, stop, corr in work:
        if end is not None and ts > end:
            gaps.append((origins.get(corr, _UNKNOWN), ts - end))
        end = stop if end is None else max(end, stop)
    return _rows(gaps, steps)


def runtime_table(events: list[dict], steps: int) -> str:
    """The host's CUDA runtime and driver calls in a profiler timeline (``events``:
    :func:`trace_events`) by name, host milliseconds per step, largest first: where the host
    waited on the device (a synchronisation, an allocator's ``cudaFree`` or ``cudaHostAlloc``, or a
    launch blocked on a full queue, which a host that runs ahead of the device shows as long
    ``cudaLaunchKernel`` calls)."""
    calls: dict = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            us, n = calls.get(e["name"], (0.0, 0))
            calls[e["name"]] = (us + e["dur"], n + 1)
    lines = ["host ms/step  calls/step  CUDA runtime / driver call"]
    lines += [f"{us / 1e3 / steps:12.3f}  {n / steps:10.1f}  {name}"
              for name, (us, n) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:25]]
    return "\n".join(lines) + "\n"


def kernels_table(rows, count: str = "kernels") -> str:
    """:func:`kernels_by_origin`'s rows (or :func:`idle_by_launch`'s, ``count="gaps"``) as text:
    summed over input shapes first, then each shape."""
    summed: dict = {}
    for ms, n, where, op, _ in rows:
        a, b = summed.get((where, op), (0.0, 0.0))
        summed[(where, op)] = (a + ms, b + n)
    top = sorted(((ms, n, where, op) for (where, op), (ms, n) in summed.items()), key=lambda r: -r[0])
    lines = [f"ms/step  {count}/step  where > op (all input shapes)"]
    lines += [f"{ms:8.3f}  {n:7.1f}  {where} > {op}" for ms, n, where, op in top[:80]]
    lines += ["", f"ms/step  {count}/step  where > op  input dims"]
    lines += [f"{ms:8.3f}  {n:7.1f}  {where} > {op}  {dims}" for ms, n, where, op, dims in rows[:200]]
    return "\n".join(lines) + "\n"


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo + inductor, forward and
    backward graphs: every frame's ``_compile.compile_inner`` plus each lazily compiled backward)."""
    from torch._dynamo.utils import compilation_time_metrics as m

    return sum(sum(v) for k, v in m.items() if k == "_compile.compile_inner" or "bw_compiler" in k)


def phase_train(args, backend, rows, variant: str) -> None:
    """The end-to-end loop: plan → rollout stream (packed capture) → draft step, per optimizer step.

    The first step is split for the cold start: draft build, first capture, first step, and the
    compile seconds inside each (``train_first_*``); run ``--phases train`` alone in a fresh
    process with an empty ``--compile-cache`` for a clean process's figure."""
    cold = "seconds_to_first_optimizer_step" not in RESULTS
    if variant == "compiled" and "capture_compiled_used" not in RESULTS and args.device.type == "cuda":
        from specforge_core.system.compile import compile_target  # what training.compile does to the target

        report("train_target_compiled_modules", compile_target(backend._decoder))
    t0, c0 = time.perf_counter(), compile_seconds()
    loop = TrainLoop(args, backend, compile_pointwise=variant == "compiled")
    warmup = max(args.warmup, 1)
    stream = make_stream(args, backend, rows, batch_size=args.batch_size, token_budget=args.token_budget,
                         steps=warmup + args.steps)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        report(f"train_{variant}_start_allocated_gib", gib(torch.cuda.memory_allocated()))  # target, draft, optimizer
    first: dict = {"build_loop": time.perf_counter() - t0, **{f"build_{k}": v for k, v in loop.build_split.items()}}
    for i in range(warmup):
        if i == warmup - 1 and i and args.device.type == "cuda":  # the last warm-up step: where the host waits
            count_syncs(args, f"train_{variant}", lambda: loop.step(next(stream)))
            continue
        t1, c1 = time.perf_counter(), compile_seconds()
        batch = next(stream)
        sync(args.device)
        t2, c2 = time.perf_counter(), compile_seconds()
        loop.step(batch)
        del batch
        sync(args.device)
        if i == 0:
            first.update(capture=t2 - t1, capture_compile=c2 - c1, step=time.perf_counter() - t2,
                         step_compile=compile_seconds() - c2, all_compile=compile_seconds() - c0)
            if cold:
                report("seconds_to_first_optimizer_step", time.perf_counter() - LAUNCH)
    for name, value in first.items():
        report(f"train_{variant}_first_{name}_seconds", value)
    if args.out and cold:
        from torch._dynamo.utils import compile_times

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"compile_times_{variant}.txt").write_text(compile_times(repr="str", aggregate=True))
    start_stats = stream.stats.as_dict()
    t0 = time.perf_counter()
    for batch in stream:
        loop.step(batch)
        del batch
    sync(args.device)
    seconds = time.perf_counter() - t0
    s = stream.stats.as_dict()
    tokens = s["local_tokens"] - start_stats["local_tokens"]
    key = f"train_{variant}"
    report(f"{key}_tokens_per_s", tokens / seconds)
    report(f"{key}_samples_per_s", args.steps * args.batch_size / seconds)
    report(f"{key}_tokens_per_step", tokens / args.steps)
    report(f"{key}_capture_share", (s["capture_seconds"] - start_stats["capture_seconds"]) / seconds)
    report(f"{key}_padding", 1 - tokens / (s["local_slots"] - start_stats["local_slots"]))
    report(f"{key}_peak_staged_gib", gib(s["peak_staged_bytes"]))
    if args.device.type == "cuda":
        report(f"{key}_peak_allocated_gib", gib(torch.cuda.max_memory_allocated()))
        report(f"{key}_peak_reserved_gib", gib(torch.cuda.max_memory_reserved()))
    RESULTS["train_tokens_per_s"] = max(RESULTS.get("train_tokens_per_s", 0.0), tokens / seconds)
    if args.device.type == "cuda":  # where the memory goes: one more step, phase by phase
        stream = make_stream(args, backend, rows, batch_size=args.batch_size, token_budget=args.token_budget, steps=1)
        torch.cuda.reset_peak_memory_stats()
        before = gib(torch.cuda.memory_allocated())
        batch = next(stream)
        memory = {"capture_peak": gib(torch.cuda.max_memory_allocated()) - before}
        loop.step(batch, memory)
        del batch
        for name, value in memory.items():
            report(f"{key}_memory_{name}_gib", value)
    if args.profile and args.device.type == "cuda":  # the same loop under the profiler: capture + step
        stream = make_stream(args, backend, rows, batch_size=args.batch_size, token_budget=args.token_budget,
                             steps=warmup + 4)
        for _ in range(warmup):
            loop.step(next(stream))

        def step():
            with record_function("bench.capture"):
                batch = next(stream)
            loop.step(batch)

        _, timeline = record_steps(args, key, step)
        for name, ms in device_idle(timeline, steps=2).items():
            report(f"{key}_idle_{name}_ms", ms)
    del loop


def phase_peer_draft_step(args, backend) -> None:
    """SpecForge 0.2.0's draft step of the same family on the same dense shapes, at its best: in a
    process of its own (``bench/gpu_peer_standalone.py``) with the CUDA allocator at its default
    (this process's expandable segments cost the peer 19-20 %, measured 2026-12-01).

    ``--peer-teachers full,compact`` also times the peer with its compact teacher (built from the
    last hidden state per vocab chunk, as ours is; ``peer_compact_*``): its default step is handed
    full-vocab target logits, so the target head's matmul is in neither its step nor, in
    ``vs_peer``, its capture, while ours computes it inside the draft step."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).with_name("gpu_peer_standalone.py")), "--shape", args.shape,
           "--shapes", ",".join(f"{b}x{t}" for b, t in args.draft_shapes), "--family", args.family,
           "--ttt-length", str(args.ttt_length), "--vocab-d", str(args.vocab_d), "--iters", str(max(args.steps, 5))]
    if args.family == "dflash":
        dflash = run_config(args).draft.dflash
        cmd += ["--dflash-layer-ids", ",".join(str(x) for x in backend.layer_ids), "--dflash-block", str(args.dflash_block),
                "--dflash-anchors", str(dflash.num_anchors), "--dflash-mask", str(args.dflash_mask)]
        if dflash.loss_decay_gamma is not None:
            cmd += ["--dflash-gamma", str(dflash.loss_decay_gamma)]
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    for teacher in args.peer_teachers:
        proc = subprocess.run([*cmd, "--teacher", teacher], env=env, capture_output=True, text=True, timeout=900)
        found = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not found:
            print(f"peer ({teacher} teacher): the standalone peer gave no result (exit {proc.returncode}): "
                  f"{(proc.stdout + proc.stderr)[-1500:]}")
            continue
        prefix = "peer" if teacher == "full" else f"peer_{teacher}"
        best = None
        for b, t in args.draft_shapes:
            median = found[0][f"standalone_{b}x{t}_tokens_per_s_median"]
            run = found[0].get(f"standalone_{b}x{t}_tokens_per_s_back_to_back", 0.0)
            report(f"{prefix}_{b}x{t}_median_tokens_per_s", median)
            report(f"{prefix}_{b}x{t}_back_to_back_tokens_per_s", run)
            tps = max(median, run)  # the peer at its best, either way of timing it
            report(f"{prefix}_{b}x{t}_tokens_per_s", tps)
            report(f"{prefix}_{b}x{t}_peak_gib", found[0][f"standalone_{b}x{t}_peak_gib"])
            best = tps if best is None else max(best, tps)
        report(f"{prefix}_best_tokens_per_s", best)


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=[*ref.SHAPES, "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--phases", default="refs,capture,draft,train,peer")
    p.add_argument("--batch-size", type=int, default=12, help="samples per micro-step (packed)")
    p.add_argument("--unpacked-batch", type=int, default=4, help="samples per micro-step without packing")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3,
                   help="train phase: untimed steps first (more where a cold compile cache still recompiles)")
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--vocab-d", type=int, default=None,
                   help="draft vocabulary (default 32000, or the whole vocabulary of a smaller target: --shape tiny)")
    p.add_argument("--draft-shapes", default="1x4096,4x2048")
    p.add_argument("--plain-shape", default="4x4096")
    p.add_argument("--draft-variants", default="eager,compiled",
                   help="compiled: the draft's norms/MLPs too; compiled-flex, compiled-flash, ...: with that attention backend")
    p.add_argument("--capture-variants", default="eager,compile", help="compile: also the target's norms/MLPs")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--sample-length", type=int, default=None,
                   help="every sample exactly this many tokens (default: ShareGPT-like lengths, 64..4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", default="eagle3", choices=["eagle3", "dflash", "dspark"], help="the draft family to time "
                   "(dspark: the train phase only; its peer's step is bench/gpu_families.py's)")
    p.add_argument("--dflash-layers", type=int, default=5, help="DFlash draft layers (= captured target layers)")
    p.add_argument("--dflash-block", type=int, default=16)
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="training.activation_checkpointing (EAGLE3: each unrolled step's MLP block recomputed in backward)")
    p.add_argument("--dflash-mask", type=int, default=None, help="DFlash mask token id (default: Qwen3's, 151669; "
                   "the tiny shape's last row, 4095)")
    p.add_argument("--peer-teachers", default="full",
                   help="full (the peer's best: handed target logits); full,compact: also from the last hidden state")
    p.add_argument("--profile", action="store_true", help="draft phase: split and profile each timed shape; train phase: "
                   "profile 2 steps of the loop, capture and step (DIR/profile_*.txt, kernels_*.txt, idle_*.txt, trace_*.json.gz)")
    p.add_argument("--compile-cache", default=None,
                   help="TORCHINDUCTOR_CACHE_DIR for this process (an empty one: a cold start; the product "
                        "keeps <output.dir>/compile-cache)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.compile_cache).resolve())
    args.device = torch.device(args.device)
    args.phases = args.phases.split(",")
    args.draft_variants = args.draft_variants.split(",")
    args.peer_teachers = args.peer_teachers.split(",")
    unknown = set(args.peer_teachers) - {"full", "compact"}
    if unknown:
        p.error(f"--peer-teachers: {sorted(unknown)} unknown; give full and/or compact")
    if args.family != "eagle3" and args.peer_teachers != ["full"]:
        p.error("--peer-teachers: the compact teacher is EAGLE3's; leave it out with --family dflash")
    if args.dflash_mask is None:
        args.dflash_mask = 4095 if args.shape == "tiny" else 151669
    if args.family == "dspark" and set(args.phases) - {"train"}:
        p.error(f"--family dspark times the train phase only (--phases train), not {','.join(args.phases)}")
    args.draft_shapes = [tuple(int(x) for x in s.split("x")) for s in args.draft_shapes.split(",")]
    args.plain_shape = tuple(int(x) for x in args.plain_shape.split("x"))
    return args


def build_backend(args):
    from specforge_core.capture.hf import HFCaptureBackend
    from specforge_core.capture.target_info import default_capture_layers

    if args.shape == "tiny":
        ref.SHAPES["tiny"] = dict(arch="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096,
                                  max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6)
    positions = (args.sample_length or 0) + args.ttt_length
    if positions > ref.SHAPES[args.shape]["max_position_embeddings"]:  # the sample and its TTT positions:
        ref.SHAPES[args.shape]["max_position_embeddings"] = positions  # a longer context, the same sizes and work
    report("max_position_embeddings", ref.SHAPES[args.shape]["max_position_embeddings"])
    model = ref.build_random_target(args.shape, device=str(args.device))
    if args.family != "eagle3":
        from specforge_core.drafts import get_family

        family = get_family(args.family)
        layer_ids = family.capture_layer_ids(run_config(args), model.config)
        return HFCaptureBackend(model, layer_ids, keep_last_hidden=family.captures_last_hidden)
    return HFCaptureBackend(model, default_capture_layers(model.config.num_hidden_layers))


def run_phase(name, fn, args) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # report and go on: one broken phase must not cost the others
        report(f"{name}_error", f"{type(e).__name__}: {e}"[:500])
    report(f"{name}_phase_seconds", time.perf_counter() - t0)
    if args.device.type == "cuda":
        torch.cuda.empty_cache()  # between phases only, never inside a step loop
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def report_vs_serial(name: str, ours, capture, step) -> bool:
    """``serial_<name>_tokens_per_s``: a pipeline of ``capture`` then ``step`` in series
    (``1 / (1/capture + 1/step)``), and ``vs_<name>``: ``ours`` over it. False (nothing reported)
    where a figure is missing."""
    if not (ours and capture and step):
        return False
    report(f"serial_{name}_tokens_per_s", 1 / (1 / capture + 1 / step))
    report(f"vs_{name}", ours / RESULTS[f"serial_{name}_tokens_per_s"])
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    report("shape", args.shape)
    report("device", torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu")
    report("torch", torch.__version__)
    import transformers

    report("transformers", transformers.__version__)
    report("date", time.strftime("%Y-%m-%d %H:%M"))
    t0 = time.perf_counter()
    backend = build_backend(args)
    report("build_target_seconds", time.perf_counter() - t0)
    if args.vocab_d is None:
        args.vocab_d = min(32000, backend.vocab_size)
    elif not 0 < args.vocab_d <= backend.vocab_size:
        sys.exit(f"--vocab-d {args.vocab_d}: the draft vocabulary must be 1..{backend.vocab_size} (the target's "
                 f"vocabulary at --shape {args.shape}); give a smaller --vocab-d or leave it out")
    report("config", f"batch_size={args.batch_size} token_budget={args.token_budget} ttt={args.ttt_length} "
                     f"Vd={args.vocab_d} steps={args.steps}")
    rows = (fixed_length_rows(args.samples, backend.vocab_size, args.seed, args.sample_length) if args.sample_length
            else sharegpt_like_rows(args.samples, backend.vocab_size, args.seed))
    report("mean_sample_tokens", sum(len(r["input_ids"]) for r in rows) / len(rows))
    # Eager first, then the peer, then the compiled variants: a slow compile cannot cost the baseline.
    steps = [("refs", lambda: phase_refs(args, backend.model)),
             ("capture", lambda: phase_capture(args, backend, rows))]
    for variant in args.draft_variants:
        if variant == "compiled":
            steps.append(("peer", lambda: phase_peer_draft_step(args, backend)))
            if "compile" in args.capture_variants:
                steps.append(("capture_compiled", lambda: phase_capture_compiled(args, backend, rows)))
        steps.append((f"draft_{variant}", lambda v=variant: phase_draft(args, backend, v)))
        if "-" not in variant:  # an attention variant times the draft step only
            steps.append((f"train_{variant}", lambda v=variant: phase_train(args, backend, rows, v)))
    if "compiled" not in args.draft_variants:
        steps.append(("peer", lambda: phase_peer_draft_step(args, backend)))
    for name, fn in steps:
        if name.split("_")[0] in args.phases:
            run_phase(name, fn, args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    for b, t in args.draft_shapes:
        for prefix in ("peer", "peer_compact"):
            ours, peer = RESULTS.get(f"draft_{b}x{t}_tokens_per_s"), RESULTS.get(f"{prefix}_{b}x{t}_tokens_per_s")
            if ours and peer:
                report(f"draft_vs_{prefix}_{b}x{t}", ours / peer)
        # both steps handed the target's output (the peer its logits, ours its teacher)
        given, peer = RESULTS.get(f"draft_teacher_given_{b}x{t}_tokens_per_s"), RESULTS.get(f"peer_{b}x{t}_tokens_per_s")
        if given and peer:
            report(f"draft_vs_peer_same_inputs_{b}x{t}", given / peer)
    if "train_tokens_per_s" in RESULTS:
        report("train_best_tokens_per_s", RESULTS["train_tokens_per_s"])
    plain, peer, ours = (RESULTS.get(k) for k in ("plain_forward_tokens_per_s", "peer_best_tokens_per_s", "train_tokens_per_s"))
    capture = max((RESULTS.get(k, 0.0) for k in ("capture_packed_tokens_per_s", "capture_packed_compiled_tokens_per_s")),
                  default=0.0)
    # the stricter line: a peer that captured as fast as our best capture
    report_vs_serial("peer_best_capture", ours, capture, peer)
    # the same line with the peer's step fed what it reads: our best capture also makes the
    # target head's full-vocab logits (ours makes its teacher inside its step, from the last hidden)
    with_logits = max(RESULTS.get(f"capture_{k}_with_logits_tokens_per_s", 0.0) for k in ("packed", "packed_compiled"))
    report_vs_serial("peer_best_capture_logits", ours, with_logits, peer)
    # or the peer's own teacher from the last hidden state, as ours
    report_vs_serial("peer_compact_best_capture", ours, capture, RESULTS.get("peer_compact_best_tokens_per_s"))
    if not report_vs_serial("peer", ours, plain, peer):
        print("vs_peer=nan", flush=True)
    if args.out:
        (Path(args.out) / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
    # finished: leave without the interpreter's teardown, where a gloo thread can abort the process
    # (system/distributed.py says why)
    from specforge_core.system.distributed import exit_after_success

    exit_after_success()
