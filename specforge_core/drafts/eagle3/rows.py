"""Taking a subset of rows with a gradient that is a plain copy back.

    from specforge_core.drafts.eagle3.rows import take_rows
    hidden_k = take_rows(hidden, 1, plan.carry[k])      # == hidden.index_select(1, carry[k])
    carried, scored = split_rows(hidden, 1, carry, here, carry_slot, here_slot)   # two at once

The unroll narrows its tensors to the rows each step computes with indices that are distinct (the
plan's rows are ascending). ``index_select``'s backward must allow repeated indices, so it adds the
gradient into zeros with ``index_add``, whose atomic adds on bf16 cost ≈ 0.2 ms per call on an
H200 at Qwen3-8B shape (3.8 ms a step over ≈ 20 calls, round 7's profile). With distinct indices
the same gradient is a scatter, ``index_copy`` into zeros: no atomics, and deterministic.

:func:`split_rows` takes two such subsets that together cover every row (the unroll's rows
carried to the next step and its scored rows) and gets each row's gradient by a gather instead:
the sum of its gradients in the two parts, read through each part's slot map, in one pass that
writes every row once (no zero fill, no scatter, no add of two full-size gradients; compiled with
``training.compile``). Their scatters into zeros and the add ran at ≈ 0.3 TB/s on an H200
(round 16's profile: 6.1 ms a loop step at Qwen3-8B shape for every ``take_rows``).
"""

import torch

from specforge_core.runtime.compile import fused


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, x.shape
        ctx.save_for_backward(index)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_copy_(ctx.dim, index, grad), None, None


def take_rows(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, index)`` for an ``index`` without repeats (not checked: a repeated
    index would keep only one of its gradients). Without a gradient it is ``index_select`` itself."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x.index_select(dim, index)
    return _TakeRows.apply(x, dim, index)


def _spread(grad: torch.Tensor, slot: torch.Tensor, dim: int) -> torch.Tensor:
    """``grad``'s rows at every row of the whole: row i gets ``grad``'s row ``slot[i]``, or zeros
    where ``slot[i] < 0``."""
    picked = grad.index_select(dim, slot.clamp(min=0))
    keep = (slot >= 0).view([-1 if d == dim else 1 for d in range(grad.dim())])
    return torch.where(keep, picked, torch.zeros((), dtype=grad.dtype, device=grad.device))


def _merge(first: torch.Tensor, second: torch.Tensor, first_slot: torch.Tensor, second_slot: torch.Tensor,
           dim: int) -> torch.Tensor:
    return _spread(first, first_slot, dim) + _spread(second, second_slot, dim)


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, first, second, first_slot, second_slot):
        ctx.dim = dim
        ctx.save_for_backward(first_slot, second_slot)
        return x.index_select(dim, first), x.index_select(dim, second)

    @staticmethod
    def backward(ctx, first, second):
        first_slot, second_slot = ctx.saved_tensors
        if not second.shape[ctx.dim]:  # an empty part has nothing to read
            grad = fused(_spread, first.device)(first, first_slot, ctx.dim)
        elif not first.shape[ctx.dim]:
            grad = fused(_spread, second.device)(second, second_slot, ctx.dim)
        else:
            grad = fused(_merge, first.device)(first, second, first_slot, second_slot, ctx.dim)
        return grad, None, None, None, None, None


def split_rows(x: torch.Tensor, dim: int, first: torch.Tensor, second: torch.Tensor, first_slot: torch.Tensor,
               second_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.index_select(dim, first), x.index_select(dim, second))`` for two ``index`` tensors
    without repeats that together hold every index of ``dim`` (they may share some), given
    their slot maps: ``first_slot[i]`` is i's position in ``first`` or -1 (likewise ``second``).
    Neither is checked: a row in neither part gets a zero gradient anyway, a repeated index keeps
    one gradient. Without a gradient it is two ``index_select``."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x.index_select(dim, first), x.index_select(dim, second)
    return _SplitRows.apply(x, dim, first, second, first_slot, second_slot)
