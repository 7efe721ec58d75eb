"""Taking a subset of rows with a gradient that is a plain copy back.

    from specforge_core.drafts.eagle3.rows import take_rows
    hidden_k = take_rows(hidden, 1, plan.carry[k])      # == hidden.index_select(1, carry[k])

The unroll narrows its tensors to the rows each step computes with indices that are distinct (the
plan's rows are ascending). ``index_select``'s backward must allow repeated indices, so it adds the
gradient into zeros with ``index_add``, whose atomic adds on bf16 cost ≈ 0.2 ms per call on an
H200 at Qwen3-8B shape (3.8 ms a step over ≈ 20 calls, round 7's profile). With distinct indices
the same gradient is a scatter, ``index_copy`` into zeros: no atomics, and deterministic.
"""

import torch


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
