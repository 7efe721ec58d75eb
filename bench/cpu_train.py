"""CPU training-step benchmark on SmolLM2-135M-Instruct: where one step's time goes.

    SPECFORGE_MODEL_CACHE=.cache/models OMP_NUM_THREADS=2 python bench/cpu_train.py         # ≈ 2-4 min
    python bench/cpu_train.py --steps 2 --variants fsdp,plain --batch 4 --max-length 384     # compare
    python bench/cpu_train.py --profile                                  # + torch.profiler op table

One process, one rank (a world of one), the real pieces: the ``hf`` capture backend on SmolLM2
(capture ids [1, 14, 26]), the EAGLE3 draft (Vd 8192, random vocab map), ``eagle3_loss`` (TTT 7),
the trainer's ``shard`` + ``DraftOptimizer`` (AdamW, clip 0.5, cosine). Rows are synthetic but
shaped like the reference run's data (bench/README: 480 regenerated chat answers, max_length 384,
206 tokens per sample on average): random token ids, lengths uniform in ``--lengths LO:HI``, loss
mask over the last 75% of each row (``--supervised``). Every variant trains the same batches, back to back, in the
same process, so a shared machine's load hits them alike; ``uptime`` is printed with each figure.

Per step it times: ``capture`` (target forward), ``teacher`` (compute_teacher), ``draft[k]``
(the draft layer of TTT step k, without its logits), ``loss`` (the head's logits of every step's
scored rows at once, soft CE, argmax, overlap; also the tokens' embedding half of q/k/v,
projected once before the steps), ``fsdp`` (root forward minus the objective: FSDP's
pre/post-forward), ``backward``, ``optim`` (clip + AdamW + schedule) and ``other``. Tokens/s counts real tokens, capture included.

``--variants fsdp,specforge`` trains the peer beside ours on the same captured batches:
SpecForge 0.2.0's ``LlamaForCausalLMEagle3`` (sdpa) inside its ``OnlineEagle3Model`` (TTT 7, its
compact teacher from the last hidden state, the same vocab map and frozen embedding), AdamW with
clip 0.5, imported from the wheel ``make install`` fetches (``python -m fixtures.wheels``). Its
loss is a Triton kernel, which a CPU cannot run: the bench puts the same formula in torch in its
place (``PeerKLLoss``: ``-Σ_v mask·p·log_softmax(z)``, averaged over B·T), nothing else of the
peer is changed. The last line then prints ``vs_specforge`` (ours over the peer in trained
tokens/s, capture included on both sides) and the same for the draft step alone.
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specforge_core.system.host import keep_freed_memory, prefer_passive_omp_wait  # noqa: E402

prefer_passive_omp_wait()  # before torch is imported, as python -m specforge_core.train does

import torch  # noqa: E402

import specforge_core.drafts.eagle3.objective as ttt  # noqa: E402
from specforge_core.capture.base import TargetRequest  # noqa: E402
from specforge_core.capture.hf import HFCaptureBackend  # noqa: E402
from fixtures.smollm2 import ensure_smollm2  # noqa: E402
from specforge_core.config import load_config  # noqa: E402
from specforge_core.data.vocab import VocabMap  # noqa: E402
from specforge_core.drafts import get_family  # noqa: E402
from specforge_core.launch.builder import build_draft, build_objective  # noqa: E402
from specforge_core.system.distributed import init_distributed  # noqa: E402
from specforge_core.loop.optim import DraftOptimizer  # noqa: E402
from specforge_core.loop.trainer import TrainStep, build_step  # noqa: E402

CAPTURE_IDS = (1, 14, 26)


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds. CPU time leaves out the time other jobs held the cores."""
    return time.perf_counter(), time.process_time()


class Clock:
    """Named accumulators of wall and CPU time; ``with clock("name"):`` adds the block's time."""

    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)

    def add(self, name: str, start: tuple[float, float]) -> None:
        wall, cpu = now()
        self.wall[name] += wall - start[0]
        self.cpu[name] += cpu - start[1]

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()

    def __call__(self, name: str):
        clock = self

        class _Block:
            def __enter__(self):
                self.start = now()

            def __exit__(self, *exc):
                clock.add(name, self.start)

        return _Block()


def load_avg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def synthetic_rows(
    n: int, lo: int, hi: int, vocab: int, seed: int, supervised: float
) -> list[tuple[list[int], list[int]]]:
    """Rows of random ids (lengths uniform in [lo, hi]) supervised over their last ``supervised``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(vocab, (length,), generator=g).tolist()
        start = int(length * (1 - supervised))
        rows.append((ids, [0] * start + [1] * (length - start)))
    return rows


def smollm2_or_random_target(which: str):
    """SmolLM2-135M-Instruct, or a random model of its shape (same FLOPs, no download)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if which == "smollm2":
        return AutoModelForCausalLM.from_pretrained(ensure_smollm2(), dtype=torch.float32)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def random_vocab_map(vocab: int, vd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:vd]] = True
    return torch.nonzero(t2d).flatten() - torch.arange(vd), t2d


_ACTIVE: dict = {"clock": None}  # the clock of the variant now training (the teacher timer reads it)


def time_teacher() -> None:
    """Wrap the objective's ``compute_teacher`` in a timer of the active variant's clock."""
    teacher = ttt.compute_teacher

    def timed_teacher(*args, **kwargs):
        with _ACTIVE["clock"]("teacher"):
            return teacher(*args, **kwargs)

    ttt.compute_teacher = timed_teacher


def time_draft_steps(draft: torch.nn.Module, clock: Clock) -> None:
    """Time each draft step: TTT step k is the k-th ``next_hidden`` call within one objective."""
    state = {"k": 0}
    step = draft.next_hidden

    def timed_step(*args, **kwargs):
        start = now()
        hidden = step(*args, **kwargs)
        clock.add(f"draft[{state['k']}]", start)
        state["k"] += 1
        return hidden

    draft.next_hidden = timed_step
    clock.reset_step = lambda: state.update(k=0)


class PeerKLLoss(torch.autograd.Function):
    """SpecForge 0.2.0's ``LogSoftmaxLoss`` (a Triton kernel) in torch: the row-mean of
    ``-Σ_v position_mask·target·log_softmax(logits)`` over ``B·T`` (its reference ``_compute_loss``)."""

    @staticmethod
    def forward(ctx, logits, target, position_mask):
        log_q = torch.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(log_q, target, position_mask)
        return -(position_mask * target * log_q).sum(-1).mean()

    @staticmethod
    def backward(ctx, grad):
        log_q, target, position_mask = ctx.saved_tensors
        n = log_q.shape[0] * log_q.shape[1]
        masked = position_mask * target
        grad_logits = (log_q.exp() * masked.sum(-1, keepdim=True) - masked) * (grad / n)
        return grad_logits, None, None


def import_peer():
    """SpecForge 0.2.0's EAGLE3 modules from its wheel, with ``PeerKLLoss`` as its loss."""
    import types

    from fixtures.wheels import wheel_path

    sys.path.insert(0, str(wheel_path("specforge", "0.2.0")))
    import specforge.core  # noqa: F401  (the package, before its loss module is replaced)

    loss = types.ModuleType("specforge.core.loss")
    loss.LogSoftmaxLoss = PeerKLLoss
    sys.modules["specforge.core.loss"] = loss
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    return OnlineEagle3Model, LlamaForCausalLMEagle3


class PeerStep:
    """The peer's draft step (see the module docstring), called like ``root(batch)``: forward,
    then ``backward`` / ``step`` like our ``DraftOptimizer``."""

    def __init__(self, backend, args):
        from transformers import LlamaConfig

        online_model, eagle3 = import_peer()
        t = backend.target_config
        config = LlamaConfig(
            hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads, head_dim=getattr(t, "head_dim", None), vocab_size=t.vocab_size,
            num_hidden_layers=1, max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_parameters["rope_theta"], tie_word_embeddings=False, pad_token_id=0,
        )
        config.draft_vocab_size = args.vd
        torch.manual_seed(0)
        draft = eagle3(config, attention_backend="sdpa")
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(backend.embed_weight)
            d2t, t2d = random_vocab_map(t.vocab_size, args.vd, seed=1)
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.requires_grad_(False)
        self.model = online_model(draft, length=args.ttt, attention_backend="sdpa")
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-4)
        self.head = backend.lm_head_weight
        self.vocab_chunk = args.vocab_chunk

    def __call__(self, batch):
        out = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, loss_mask=batch.loss_mask[..., None].float(),
            hidden_states=batch.aux_hidden, target=None, target_hidden_for_compact=batch.last_hidden,
            target_head_weight=self.head, compact_teacher_chunk_size=self.vocab_chunk,
        )
        return sum(0.8**i * p for i, p in enumerate(out[0])), None

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run_config(args, attention: str = "sdpa"):
    """The run config these steps train under (the fields the builder reads)."""
    return load_config(None, [
        f"training.seed=0", f"training.ttt_length={args.ttt}", f"capture.teacher_chunk_size={args.vocab_chunk}",
        f"draft.draft_vocab_size={args.vd}", f"draft.attention_backend={attention}", "training.learning_rate=3e-4",
        "training.warmup_ratio=0.02", "training.max_grad_norm=0.5",
    ])


def build_variant(name: str, target_config, backend, d, args, clock: Clock):
    """A fresh draft (same seed every variant), built by the same builder ``python -m
    specforge_core.train`` uses, behind the trainer's root and optimizer (``fsdp``) or unsharded;
    or the peer's (``specforge``). ``fsdp-flash``, ``plain-flex``, ...: with that attention
    backend (sdpa, the CPU's default, otherwise)."""
    if name == "specforge":
        peer = PeerStep(backend, args)
        clock.reset_step = lambda: None
        return peer, peer
    name, _, attention = name.partition("-")
    cfg = run_config(args, attention or "sdpa")
    family = get_family("eagle3")
    d2t, t2d = random_vocab_map(target_config.vocab_size, args.vd, seed=1)
    draft = build_draft(cfg, family, backend, VocabMap(key="random", path=Path("random"), d2t=d2t, t2d=t2d,
                                                       coverage=None))
    time_draft_steps(draft, clock)
    loss_fn, _ = build_objective(cfg, family, backend)

    def objective(model, batch):
        with clock("objective"):
            return loss_fn(model, batch)

    if name == "fsdp":
        return build_step(cfg, d, draft, objective, total_steps=500, accumulation_steps=1)
    if name != "plain":
        raise SystemExit(f"unknown variant {name!r}: use fsdp, plain or specforge")
    root = TrainStep(draft, objective)
    root.set_requires_gradient_sync = lambda flag: None  # what DraftOptimizer calls on FSDP roots
    optimizer = DraftOptimizer(
        root, learning_rate=3e-4, weight_decay=0.0, max_grad_norm=0.5, accumulation_steps=1,
        total_steps=500, warmup_ratio=0.02, lr_scheduler="cosine",
    )
    return root, optimizer


def train_step(root, optimizer, backend, request, clock: Clock) -> int:
    _ACTIVE["clock"] = clock
    with clock("capture"):
        batch = backend.capture(request)
    with clock("forward"):
        loss, sums = root(batch)
    with clock("backward"):
        optimizer.backward(loss)
    with clock("optim"):
        optimizer.step()
    tokens = batch.num_tokens
    del batch, loss, sums
    return tokens


def breakdown(totals: dict, steps: int, wall: float) -> dict:
    """Per-step seconds by part (``wall``: the whole steps' time in the same clock); ``fsdp`` =
    root forward outside the objective."""
    per = {k: v / steps for k, v in totals.items()}
    draft = sum(v for k, v in per.items() if k.startswith("draft["))
    out = {"capture": per["capture"], "teacher": per.get("teacher", 0.0)}
    out.update({k: per[k] for k in sorted(per) if k.startswith("draft[")})
    if "objective" in per:  # ours: the objective's parts are timed
        out["loss"] = per["objective"] - out["teacher"] - draft
        out["fsdp"] = per["forward"] - per["objective"]
    else:  # the peer: its forward as a whole (teacher, draft steps, loss)
        out["forward"] = per["forward"]
    out["backward"] = per["backward"]
    out["optim"] = per["optim"]
    out["other"] = wall / steps - sum(per[k] for k in ("capture", "forward", "backward", "optim"))
    out["step"] = wall / steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant (after 1 warm-up)")
    ap.add_argument("--variants", default="fsdp",
                    help="comma list of fsdp, plain, specforge (the peer); fsdp-flash, ...: another attention backend")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--lengths", default="110:300", help="LO:HI real row lengths (reference mean 206)")
    ap.add_argument("--supervised", type=float, default=0.75, help="loss-masked share of each row (its end)")
    ap.add_argument("--vd", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocab-chunk", type=int, default=32768)
    ap.add_argument("--target", default="smollm2", help="smollm2 (ensure_smollm2) or random (its shape, no files)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--malloc", choices=["tuned", "default"], default="tuned", help="system.host.keep_freed_memory or not")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.malloc == "tuned":
        keep_freed_memory()  # as python -m specforge_core.train does on CPU
    lo, hi = (min(int(x), args.max_length) for x in args.lengths.split(":"))

    t0 = time.perf_counter()
    d = init_distributed("cpu")
    model = smollm2_or_random_target(args.target)
    backend = HFCaptureBackend(model, CAPTURE_IDS)
    print(f"setup {time.perf_counter() - t0:.1f}s threads={args.threads} load={load_avg()}", flush=True)

    rows = synthetic_rows(args.batch * (args.steps + 1), lo, hi, backend.vocab_size, seed=0, supervised=args.supervised)
    requests = [
        TargetRequest.from_rows([r[0] for r in chunk], [r[1] for r in chunk], slice(0, args.batch))
        for chunk in (rows[i : i + args.batch] for i in range(0, len(rows), args.batch))
    ]
    time_teacher()
    names = args.variants.split(",")
    variants = {}
    for name in names:
        clock = Clock()
        root, optimizer = build_variant(name, backend.target_config, backend, d, args, clock)
        train_step(root, optimizer, backend, requests[0], clock)  # warm-up
        clock.clear()
        variants[name] = (root, optimizer, clock, [], [0])
    load_before = load_avg()
    # Interleaved step by step: a change of machine load hits every variant alike.
    for request in requests[1:]:
        for name in names:
            root, optimizer, clock, walls, tokens = variants[name]
            clock.reset_step()
            with clock("step"):
                tokens[0] += train_step(root, optimizer, backend, request, clock)
            walls.append(clock.wall["step"] - sum(walls))
    results = {}
    for name in names:
        root, optimizer, clock, walls, tokens = variants[name]
        for kind, totals in (("wall", clock.wall), ("cpu", clock.cpu)):
            parts = breakdown(totals, args.steps, totals["step"])
            parts["tokens_per_s"] = tokens[0] / totals["step"]
            results[f"{name} {kind}"] = parts
        results[f"{name} wall"]["median_step"] = sorted(walls)[len(walls) // 2]
        results[f"{name} wall"]["tokens_per_step"] = tokens[0] / args.steps
        print(f"[{name}] steps (wall): " + " ".join(f"{w:.2f}" for w in walls), flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                clock.reset_step()
                train_step(root, optimizer, backend, requests[1], clock)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    load = f"{load_before} → {load_avg()}"
    if "specforge" in names and len(names) > 1:
        peer = results["specforge wall"]
        for name in names:
            if name == "specforge":
                continue
            ours = results[f"{name} wall"]
            results[f"{name} wall"]["vs_specforge"] = ours["tokens_per_s"] / peer["tokens_per_s"]
            step = lambda r: r["step"] - r["capture"]  # noqa: E731  (the draft step: capture excluded)
            results[f"{name} wall"]["draft_step_vs_specforge"] = step(peer) / step(ours)

    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    print(f"\nthreads={args.threads} batch={args.batch} lengths={lo}:{hi} load (1/5/15 min) {load}")
    print("| part (s/step) | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r[k]:.3f}" if k in r else "" for r in results.values()) + " |")
    print(json.dumps({"args": vars(args), "load": load, "results": results}))
    backend.close()
    return 0


if __name__ == "__main__":
    code = main()
    if not code:  # finished: leave without the interpreter's teardown (system/distributed.py says why)
        from specforge_core.system.distributed import exit_after_success

        exit_after_success()
    sys.exit(code)
