"""The training loop: capture one batch, train on it, release it; whole optimizer steps; log; save.

    trainer = Trainer(cfg, d, plan, draft=draft, objective=objective, derive=derive,
                      open_stream=lambda start: RolloutStream.from_plan(plan, d.rank, rows, backend,
                                                                        start_sample=start),
                      contract=contract, write_draft_files=write_draft_files)
    trainer.fit()       # resume (per training.resume) → train to the horizon or the budget → final save

``python -m specforge_core.train`` builds these pieces from a run config (``launch/builder.py``);
this module knows no draft family: the ``objective(draft, batch) -> (loss, sums)`` computes the loss and the
summable metric sums, ``derive(sums)`` turns reduced sums into named metrics.

One optimizer step, on every rank: ``accumulation_steps`` times { pull one batch from the rollout
stream (exactly one capture) → objective → backward → ``del`` the batch }, then clip + AdamW + LR
schedule. Logs every ``log_interval`` steps and at the end; saves every ``save_interval`` steps,
after each ``save_every_minutes`` of wall time since the last save (the ranks agree: one scalar
all-reduce per step), and at the end. No ``torch.cuda.empty_cache()``: the captured batch is
released by dropping the last reference before the next capture, and the allocator reuses it.

When it stops: at the plan's horizon, or with ``training.time_budget`` at the first whole
optimizer step whose update finds the budget spent, whichever comes first; the learning rate then
follows the run's progress (``loop/budget.py``: the larger of the budget's fraction spent and
the horizon's fraction trained) instead of the step count. The training clock
(``train_seconds`` in the metrics and the checkpoint) leaves out checkpoint saves and held-out
decodes. With ``training.heldout.interval`` = N, every N steps and at the last one the ranks
gather the draft's weights and rank 0 decodes a few held-out prompts (``launch/heldout.py``);
the figures join that step's metrics record.

What resume guarantees: the run continues from the newest complete checkpoint with the same
weights, optimizer, schedule, RNG and data position (the stream skips the consumed prompts without
capturing them) after :func:`~specforge_core.loop.checkpoint.check_resume` has found the
recorded contract equal to this run's — so the resumed run trains exactly what the uninterrupted
one would have. A budgeted run resumes its clock from the checkpoint's ``train_seconds`` and
its schedule from the checkpoint's scheduler state, and stops when the same total is spent; it is
not bit-reproducible (wall time never is), and neither is the number of steps it trains. Without a
budget nothing here reads the clock except to report it: the same config trains the same weights.
Held-out decodes run on their own copies of the weights and the target under a forked RNG, so they
change nothing the ranks train.
"""

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specforge_core.capture.base import CapturedBatch
from specforge_core.config import RunConfig, dump_config
from specforge_core.errors import ResumeError
from specforge_core.run.plan import PromptPlan
from specforge_core.loop.budget import TrainClock, budget_progress
from specforge_core.loop.checkpoint import (
    TRAIN_STATE,
    check_resume,
    latest_checkpoint,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
)
from specforge_core.system.distributed import Dist, all_reduce, all_reduce_sum_, broadcast_object
from specforge_core.loop.metrics import MetricsLogger
from specforge_core.loop.optim import DraftOptimizer, shard
from specforge_core.loop.rollout import RolloutStream

Objective = Callable[[nn.Module, CapturedBatch], tuple[torch.Tensor, dict]]
# rank 0's held-out decode: the draft's full weights (no frozen parameters) → figures for the metrics
HeldOutDecode = Callable[[dict[str, torch.Tensor]], dict[str, float]]

# Training options that change what a step computes: resuming with other values is refused.
_OPTIMIZATION_FIELDS = (
    "learning_rate",
    "lr_scheduler",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "param_dtype",
    "ttt_length",
    "ploss_decay",
    "token_budget",
)


def config_identity(config: dict) -> str:
    """sha256 of a JSON-able config, independent of key order."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def target_memo_dir(cfg: RunConfig) -> Path:
    """Where the target files' digests are remembered: beside the data sources' (``cache_dir``)."""
    return Path(cfg.data.cache_dir) / "sources"


def directory_identity(path: str | Path, *, memo_dir: str | Path | None = None) -> str:
    """sha256 naming a model directory by content: each file's relative path and the sha256 of all
    its bytes (weights, config, tokenizer), so replaced weights of the same size are another target.

    Each file is hashed whole, once: its digest is remembered in ``memo_dir`` under its path, size,
    modification and change times and inode (``data.formats.source_digest``), so a re-check is a
    ``stat`` per file. A sample of blocks would be cheaper the first time but is no identity: a
    fine-tune that changes a few tensors can miss every sampled block. Hashing reads every byte
    once, paid at prepare time or by rank 0 at the first start.
    A copy or re-download of the same model keeps its identity.
    """
    from specforge_core.data.formats import source_digest

    root = Path(path)
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(f"{file.relative_to(root).as_posix()}\0{source_digest(str(file), None, memo_dir)}\0".encode())
    return h.hexdigest()


def training_contract(
    cfg: RunConfig, plan: PromptPlan, *, prompt_cache: str, vocab_map: str | None, target: str,
    draft_config: dict, family_fields: dict | None = None,
) -> dict:
    """What a checkpoint must share with a run that resumes it (compared field by field).

    The plan record (dataset size, seed, epochs, world size, tp size and island count, batch,
    accumulation, max_steps, permutation checksum, horizon), the identities of the prompt cache,
    vocab map (None for a family without one), target and draft config, and the optimisation
    options, with the draft family's own (``family_fields``, e.g. DFlash's block size), and the
    time budget in seconds when one is set (a run without one records no such field, as before).
    """
    optimization = {name: getattr(cfg.training, name) for name in _OPTIMIZATION_FIELDS}
    if cfg.training.time_budget_s is not None:
        optimization["time_budget_s"] = cfg.training.time_budget_s
    optimization.update(family_fields or {})
    return {
        "plan": plan.to_json(),
        "identities": {
            "prompt_cache": prompt_cache,
            "vocab_map": vocab_map,
            "target": target,
            "draft_config": config_identity(draft_config),
        },
        "optimization": optimization,
    }


class TrainStep(nn.Module):
    """The FSDP root: ``forward(batch)`` runs the objective over the draft (its only child)."""

    def __init__(self, draft: nn.Module, objective: Objective):
        super().__init__()
        self.draft = draft
        self.objective = objective

    def forward(self, batch: CapturedBatch) -> tuple[torch.Tensor, dict]:
        return self.objective(self.draft, batch)


def sum_loss_grad_scale(d: Dist, local_weight: torch.Tensor | float, accumulation_steps: int) -> torch.Tensor:
    """For an objective whose loss is a sum Σ w·ℓ (DFlash): the factor that turns a window's
    gradients into those of Σ w·ℓ / Σ w over every micro-batch of every rank (the global weighted
    mean), so that how the batch is split over ranks and micro-steps changes nothing.

    ``DraftOptimizer.backward`` divided each micro-batch by ``accumulation_steps`` and FSDP's
    reduce averaged over the world, so the gradients hold Σ ∇(w·ℓ) / (A·W); one scalar all-reduce
    of this rank's Σ w gives the global weight. 0 (no update) when no position had weight. A
    float32 scalar on ``d.device``, made there: the host does not wait for the window's backward.
    """
    total = all_reduce_sum_(d, torch.as_tensor(local_weight, dtype=torch.float64).to(d.device, copy=True))
    scale = accumulation_steps * d.world_size / total
    return torch.where(total > 0, scale, torch.zeros_like(scale)).float()


def build_step(cfg: RunConfig, d: Dist, draft: nn.Module, objective: Objective, *, total_steps: int,
               accumulation_steps: int) -> tuple[nn.Module, DraftOptimizer]:
    """The sharded training step and its optimizer, from ``training.*``: what :class:`Trainer` uses
    and what the benchmarks time."""
    t = cfg.training
    root = shard(TrainStep(draft, objective), d, param_dtype=t.param_dtype)
    optimizer = DraftOptimizer(
        root,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        accumulation_steps=accumulation_steps,
        total_steps=total_steps,
        warmup_ratio=t.warmup_ratio,
        lr_scheduler=t.lr_scheduler,
        lr_by_progress=t.time_budget_s is not None,
    )
    return root, optimizer


class Trainer:
    """Setup → :meth:`fit` (resume, train, save). See the module docstring for the loop."""

    def __init__(
        self,
        cfg: RunConfig,
        d: Dist,
        plan: PromptPlan,
        *,
        draft: nn.Module,
        objective: Objective,
        derive: Callable[[dict[str, torch.Tensor]], dict[str, float]],
        open_stream: Callable[[int], RolloutStream],
        contract: dict,
        write_draft_files: Callable[[Path, dict[str, torch.Tensor]], None],
        loss_is_sum: bool = False,
        heldout: HeldOutDecode | None = None,
        echo: bool = True,
        wall_clock: Callable[[], float] = time.monotonic,
    ):
        t = cfg.training
        self.cfg, self.d, self.plan = cfg, d, plan
        self.run_dir = Path(cfg.output.dir)
        self.total_steps = plan.total_optimizer_steps
        self.accumulation_steps = plan.accumulation_steps
        self.draft = draft
        self.root, self.optimizer = build_step(cfg, d, draft, objective, total_steps=self.total_steps,
                                               accumulation_steps=plan.accumulation_steps)
        self.metrics = MetricsLogger(
            self.run_dir, d, total_steps=self.total_steps, derive=derive, sp_size=t.sp_size, echo=echo,
            clock=wall_clock,
        )
        self.open_stream = open_stream
        self.contract = contract
        self.write_draft_files = write_draft_files
        self.loss_is_sum = loss_is_sum
        self.time_budget_s = t.time_budget_s
        self.heldout_interval = t.heldout.interval
        if self.heldout_interval and heldout is None and d.is_main:
            raise ValueError("training.heldout.interval is set but rank 0 was given no held-out decode")
        self.heldout = heldout  # rank 0's; the other ranks only take part in the weight gather
        self.echo = echo
        self.step = 0  # optimizer steps done
        self.consumed_samples = 0  # samples this rank has trained (the plan's resume cursor)
        self.clock = TrainClock(now=wall_clock)
        self.train_seconds = 0.0  # the clock at the last update (agreed over ranks with a budget)
        self.resumed_from: Path | None = None
        self.wall_clock = wall_clock  # seconds; what time-based saves and the budget measure (tests pass their own)
        self.save_every_s = t.save_every_minutes * 60 or None
        self.last_save_at = 0.0

    # ---- resume --------------------------------------------------------------------------------

    def resume(self) -> Path | None:
        """Restore the newest complete checkpoint as ``training.resume`` says; returns it or None.

        Raises ResumeError when the recorded contract differs from this run's (naming every
        field), when ``resume=must`` finds no checkpoint, or when ``resume=never`` finds one.
        """
        mode = self.cfg.training.resume
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            if mode == "must":
                raise ResumeError(
                    "training.resume=must but the run has no complete checkpoint",
                    where=str(self.run_dir / "checkpoints"),
                    fix="set training.resume=auto to start fresh, or point output.dir at the run to resume",
                )
            self.metrics.discard_after(0)  # lines of an earlier attempt that never checkpointed
            return None
        if mode == "never":
            raise ResumeError(
                f"training.resume=never but the run directory already holds checkpoints ({ckpt.name})",
                where=str(self.run_dir),
                fix="choose a new output.dir for a fresh run, or set training.resume=auto to continue this one",
            )
        state = read_train_state(ckpt)
        check_resume(state["contract"], self.contract, where=str(ckpt / TRAIN_STATE))
        load_checkpoint(
            ckpt, self.d, draft=self.draft, optimizer=self.optimizer.optimizer, scheduler=self.optimizer.scheduler
        )
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples_per_rank"]
        self.train_seconds = state.get("train_seconds", 0.0)  # absent in checkpoints older than the budget
        self.clock = TrainClock(self.train_seconds, now=self.wall_clock)
        self.metrics.discard_after(self.step)
        self.resumed_from = ckpt
        if self.d.is_main and self.echo:
            print(f"resumed from {ckpt} at step {self.step}/{self.total_steps}", flush=True)
        return ckpt

    # ---- loop ----------------------------------------------------------------------------------

    def budget_spent(self) -> bool:
        return self.time_budget_s is not None and self.train_seconds >= self.time_budget_s

    def fit(self) -> None:
        """Resume if there is something to resume, train to the horizon or until the time budget is
        spent, save the final checkpoint."""
        self.resume()
        if self.step >= self.total_steps or self.budget_spent():
            return
        stream = self.open_stream(self.consumed_samples)
        t = self.cfg.training
        warming = self.step == 0  # a fresh run's first step compiles and warms the kernels: start-up
        if not warming:
            self.clock.start()
        self.last_save_at = self.wall_clock()
        try:
            while True:
                self._optimizer_step(stream)
                if warming:
                    self.clock.start()
                    warming = False
                self.step += 1
                last = self.step == self.total_steps or self.budget_spent()
                decode = bool(self.heldout_interval) and (last or self.step % self.heldout_interval == 0)
                extra = self._heldout_figures() if decode else {}
                if last or decode or self.step % t.log_interval == 0:
                    self.metrics.flush(self.step, extra={**self._clock_figures(), **extra})
                if last or (t.save_interval and self.step % t.save_interval == 0) or self.save_due():
                    with self.clock.paused():
                        self.save()
                    self.last_save_at = self.wall_clock()
                if last:
                    break
        finally:
            stream.close()
        if self.time_budget_s is not None and self.d.is_main and self.echo:
            why = "time budget spent" if self.budget_spent() else "the plan's horizon ended the run"
            print(f"{why}: {self.step}/{self.total_steps} steps, {self.train_seconds:.1f} s of training "
                  f"({self.train_seconds / self.time_budget_s:.0%} of training.time_budget={t.time_budget})",
                  flush=True)

    def save_due(self) -> bool:
        """Collective while ``save_every_minutes`` is set: True on every rank if any rank's wall clock
        has run that long since its last save (a save is collective, so the ranks must agree)."""
        if self.save_every_s is None:
            return False
        due = self.wall_clock() - self.last_save_at >= self.save_every_s
        return all_reduce(self.d, [float(due)], op="max")[0] > 0

    def _clock_figures(self) -> dict[str, float]:
        figures = {"train_seconds": self.train_seconds}
        if self.time_budget_s is not None:
            figures["budget_fraction"] = self.train_seconds / self.time_budget_s
        return figures

    def _heldout_figures(self) -> dict[str, float]:
        """Collective: gather the draft's full weights, decode on rank 0, share its outcome.

        Paused on the training clock and left out of the metrics window, on every rank (the
        others wait for rank 0). A failure on rank 0 is raised on every rank.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        start = self.wall_clock()
        figures, error = {}, None
        with self.clock.paused():
            state = get_model_state_dict(self.draft, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))  # whole on rank 0 only
            if self.d.is_main:
                try:
                    figures = self.heldout(state)
                except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                    error = e
            del state
            error = broadcast_object(self.d, error)
        if error is not None:
            raise error
        self.metrics.exclude_time(self.wall_clock() - start)
        return figures

    def _optimizer_step(self, stream: RolloutStream) -> None:
        weight = torch.zeros((), dtype=torch.float64, device=self.d.device)
        for _ in range(self.accumulation_steps):
            # No synchronisation here: the host launches the next capture while the device still
            # runs this step's tail; the capture's own time is measured on the device (last_capture).
            start = time.perf_counter()
            batch = next(stream, None)
            if batch is None:
                raise RuntimeError(
                    f"the rollout stream ended at step {self.step} of {self.total_steps}: "
                    "the stream and the plan disagree about the horizon"
                )
            wait_s = time.perf_counter() - start
            loss, sums = self.root(batch)
            self.optimizer.backward(loss)
            if self.loss_is_sum:
                weight = weight + sums["weight_sum"].detach().to(weight.device, torch.float64)
            samples = batch.num_samples  # packed rows hold several samples each
            # Release the captured features before the next capture (the stream stages one batch).
            del batch, loss
            self.consumed_samples += samples
            self.metrics.add_micro_batch(
                sums,
                samples=samples,
                wait_s=wait_s,
                capture_s=stream.last_capture,
                captures=1,  # one next(), one capture (the stream's contract)
                captured_tokens=stream.last_capture.tokens,
                staged_bytes=stream.peak_staged_bytes,
            )
        scale = sum_loss_grad_scale(self.d, weight, self.accumulation_steps) if self.loss_is_sum else None
        if self.time_budget_s is None:
            self.train_seconds = self.clock.read()
        else:
            self.train_seconds = self.clock.agree(self.d)
            # this update applies the rate set at the last one; the next one's follows from here
            self.optimizer.set_progress(budget_progress(
                self.train_seconds, self.time_budget_s, steps_done=self.step + 1, total_steps=self.total_steps))
        self.metrics.add_step(**self.optimizer.step(scale))

    # ---- save ----------------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the current optimizer step (collective)."""
        state = {
            "consumed_samples_per_rank": self.consumed_samples,
            "consumed_samples": self.consumed_samples * self.d.world_size,
            "total_steps": self.total_steps,
            "train_seconds": self.train_seconds,
            "contract": self.contract,
            "config": dump_config(self.cfg),
        }
        path = save_checkpoint(
            self.run_dir,
            self.d,
            step=self.step,
            draft=self.draft,
            optimizer=self.optimizer.optimizer,
            scheduler=self.optimizer.scheduler,
            write_draft_files=self.write_draft_files,
            train_state=state,
            keep=self.cfg.training.keep_checkpoints,
        )
        if self.d.is_main and self.echo:
            print(f"checkpoint {path.name} saved", flush=True)
        return path
