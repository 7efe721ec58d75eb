"""Taking subsets of rows with a gradient that is a plain copy back, or a gather.

    from specforge_core.drafts.eagle3.rows import take_parts, take_rows
    hidden_k = take_rows(hidden, 1, plan.carry[k])      # == hidden.index_select(1, carry[k])
    carried, scored = take_parts(hidden, 1, [carry, here], [carry_slot, here_slot])   # several at once

The unroll narrows its tensors to the rows each step computes with indices that are distinct (the
plan's rows are ascending). ``index_select``'s backward must allow repeated indices, so it adds the
gradient into zeros with ``index_add``, whose atomic bf16 adds are slow and non-deterministic.
With distinct indices
the same gradient is a scatter, ``index_copy`` into zeros: no atomics, and deterministic.

:func:`take_parts` takes several such subsets of one tensor (the unroll's rows carried to the
next step and its scored rows; each step's tokens) and gets each row's gradient by a gather
instead: the sum of its gradients in the parts, read through each part's slot map, in one pass
that writes every row once (no zero fills, no scatters, no adds of full-size gradients;
compiled with ``training.compile``), where a ``take_rows`` per part would zero-fill and add a
full-size gradient per part.
"""

import torch

from specforge_core.system.compile import fused


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


def _gather_sum(grads: list, slots: list, dim: int) -> torch.Tensor:
    total = _spread(grads[0], slots[0], dim)
    for grad, slot in zip(grads[1:], slots[1:]):
        total = total + _spread(grad, slot, dim)
    return total


class _TakeParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, compile, parts, *indices_and_slots):
        ctx.dim, ctx.compile = dim, compile
        ctx.set_materialize_grads(False)  # a part whose output reaches nothing reads nothing
        ctx.save_for_backward(*indices_and_slots[parts:])
        return tuple(x.index_select(dim, index) for index in indices_and_slots[:parts])

    @staticmethod
    def backward(ctx, *grads):
        slots = ctx.saved_tensors
        used = [(g, s) for g, s in zip(grads, slots) if g is not None and g.shape[ctx.dim]]
        grad = fused(_gather_sum, used[0][0].device, ctx.compile)([g for g, _ in used], [s for _, s in used], ctx.dim) \
            if used else None
        return grad, None, None, None, *(None,) * (2 * len(slots))


def take_parts(x: torch.Tensor, dim: int, indices: list, slots: list, *, compile: bool = True) -> tuple:
    """``tuple(x.index_select(dim, i) for i in indices)`` for index tensors without repeats (parts
    may share rows, and need not cover them all), given their slot maps: ``slots[j][r]`` is row
    r's position in ``indices[j]`` or -1. The slot maps are not checked: a repeated index keeps
    one gradient. Without a gradient it is the index_selects. ``compile`` (``training.compile``): the
    backward's gather compiled on CUDA."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return tuple(x.index_select(dim, index) for index in indices)
    return _TakeParts.apply(x, dim, compile, len(indices), *indices, *slots)
