"""The learning-rate curve over the run's horizon, in optimizer steps. Pure functions.

The horizon is the prompt plan's ``total_optimizer_steps`` (``specforge_core/run/plan.py``: whole
optimizer steps only, capped by ``training.max_steps``). The learning rate rises linearly from 0
over ``int(warmup_ratio · horizon)`` steps, then follows a half cosine down to 0 at the horizon
(``cosine``) or stays at the peak (``constant``). The multiplier for step s is the one applied by
the (s+1)-th optimizer step, as ``LambdaLR`` counts.
"""

import math
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

from specforge_core.errors import ConfigError


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
