"""The learning-rate curve, over optimizer steps or over the fraction of a time budget. Pure functions.

By steps (no ``training.time_budget``): the horizon is the prompt plan's ``total_optimizer_steps``
(``specforge_core/run/plan.py``: whole optimizer steps only, capped by ``training.max_steps``). The
learning rate rises linearly from 0 over ``int(warmup_ratio · horizon)`` steps, then follows a half
cosine down to 0 at the horizon (``cosine``) or stays at the peak (``constant``). The multiplier for
step s is the one applied by the (s+1)-th optimizer step, as ``LambdaLR`` counts.

By progress (a budgeted run, ``loop/budget.py``): the same curve over a progress p ∈ [0, 1]
instead of steps: linear warm-up over p < ``warmup_ratio`` (no truncation: the ratio is a fraction
of the budget, not a step count), then the half cosine from ``warmup_ratio`` to 1 (or the peak,
``constant``). The trainer sets p before each update (:class:`ProgressMultiplier`); p = 1 gives 0
(cosine), and p stays at 1 past the end.
"""

import math
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

from specforge_core.errors import ConfigError

Kind = Literal["cosine", "constant"]


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """``int(warmup_ratio · total_steps)``, the SpecForge convention (truncation, not rounding)."""
    return int(warmup_ratio * total_steps)


def lr_multiplier(step: int, *, total_steps: int, warmup: int, kind: Kind) -> float:
    """Factor on the peak learning rate for the optimizer step that follows ``step`` completed ones."""
    if step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def progress_multiplier(progress: float, *, warmup_ratio: float, kind: Kind) -> float:
    """Factor on the peak learning rate at ``progress`` ∈ [0, 1] of the run (clamped to it)."""
    p = min(1.0, max(0.0, progress))
    if p < warmup_ratio:
        return p / warmup_ratio
    if kind == "constant":
        return 1.0
    decay = (p - warmup_ratio) / (1.0 - warmup_ratio)  # warmup_ratio < 1 (the config's bound)
    return 0.5 * (1.0 + math.cos(math.pi * decay))


class ProgressMultiplier:
    """``LambdaLR``'s factor for a budgeted run: :func:`progress_multiplier` at ``self.progress``.

    The step count ``LambdaLR`` passes is ignored; the trainer sets ``progress`` before the
    scheduler computes the next update's rate. A callable object (not a function), so ``LambdaLR``
    saves and restores its ``progress`` with the scheduler's state in every checkpoint.
    """

    def __init__(self, *, warmup_ratio: float, kind: Kind):
        self.warmup_ratio = warmup_ratio
        self.kind = kind
        self.progress = 0.0

    def __call__(self, _step: int) -> float:
        return progress_multiplier(self.progress, warmup_ratio=self.warmup_ratio, kind=self.kind)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_ratio: float,
    kind: Kind,
    by_progress: bool = False,
) -> LambdaLR:
    """A ``LambdaLR`` over ``optimizer``; step it once per optimizer step.

    It follows :func:`lr_multiplier` over ``total_steps``, or with ``by_progress`` a
    :class:`ProgressMultiplier` (``scheduler.lr_lambdas[0]``) whose ``progress`` the caller sets.
    """
    if kind not in ("cosine", "constant"):
        raise ConfigError(
            f"unknown learning-rate schedule {kind!r}", where="training.lr_scheduler", fix="use cosine or constant"
        )
    if by_progress:
        return LambdaLR(optimizer, ProgressMultiplier(warmup_ratio=warmup_ratio, kind=kind))
    fn = partial(lr_multiplier, total_steps=total_steps, warmup=warmup_steps(total_steps, warmup_ratio), kind=kind)
    return LambdaLR(optimizer, fn)
