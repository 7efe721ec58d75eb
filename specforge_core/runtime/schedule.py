"""Schedule arithmetic: the horizon in optimizer steps and the learning-rate curve. Pure functions.

The horizon counts optimizer steps (one step = ``accumulation_steps`` micro-batches on every
rank). A finite prompt plan trains only whole optimizer steps: micro-batches left over after the
last whole step are not trained, so no step ever runs on a partial accumulation window.

The learning rate rises linearly from 0 over ``int(warmup_ratio · horizon)`` steps, then follows
a half cosine down to 0 at the horizon (``cosine``) or stays at the peak (``constant``). The
multiplier for step s is the one applied by the (s+1)-th optimizer step, as ``LambdaLR`` counts.
"""

import math
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

from specforge_core.errors import ConfigError


def horizon(micro_batches_per_rank: int, accumulation_steps: int, max_steps: int | None = None) -> int:
    """Optimizer steps the run trains: whole accumulation windows of the plan, capped by ``max_steps``.

    ``micro_batches_per_rank`` is what the prompt plan gives every rank (equal on all ranks).
    Raises ConfigError when the plan does not fill a single optimizer step.
    """
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    whole = micro_batches_per_rank // accumulation_steps
    if whole == 0:
        raise ConfigError(
            f"the prompt plan gives each rank {micro_batches_per_rank} micro-batches, fewer than "
            f"training.accumulation_steps={accumulation_steps}: not one whole optimizer step",
            where="training.accumulation_steps",
            fix="lower training.batch_size or training.accumulation_steps, use fewer ranks, "
            "or add data / training.num_epochs",
        )
    return whole if max_steps is None else min(whole, max_steps)


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """``int(warmup_ratio · total_steps)``, the SpecForge convention (truncation, not rounding)."""
    return int(warmup_ratio * total_steps)


def lr_multiplier(step: int, *, total_steps: int, warmup: int, kind: Literal["cosine", "constant"]) -> float:
    """Factor on the peak learning rate for the optimizer step that follows ``step`` completed ones."""
    if step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_ratio: float,
    kind: Literal["cosine", "constant"],
) -> LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_multiplier`; step it once per optimizer step."""
    if kind not in ("cosine", "constant"):
        raise ConfigError(
            f"unknown learning-rate schedule {kind!r}", where="training.lr_scheduler", fix="use cosine or constant"
        )
    fn = partial(lr_multiplier, total_steps=total_steps, warmup=warmup_steps(total_steps, warmup_ratio), kind=kind)
    return LambdaLR(optimizer, fn)
