"""take_rows: index_select whose gradient is copied back (distinct rows) rather than added."""

import pytest
import torch

from specforge_core.drafts.eagle3.rows import take_rows


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_take_rows_equals_index_select_forward_and_backward(dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(5, 7, 6, dtype=torch.float64, generator=gen)
    index = torch.randperm(x.shape[dim], generator=gen)[: x.shape[dim] - 2]  # distinct, unordered
    grad = torch.randn(x.index_select(dim, index).shape, dtype=torch.float64, generator=gen)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = take_rows(got_x, dim, index), want_x.index_select(dim, index)
    assert torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(got_x.grad, want_x.grad)
    assert got_x.grad.abs().sum() > 0 and (got_x.grad.index_select(dim, index) == grad).all()


def test_take_rows_without_a_gradient_is_index_select_and_keeps_no_graph():
    x = torch.randn(3, 4)
    index = torch.tensor([2, 0])
    out = take_rows(x, 0, index)
    assert torch.equal(out, x.index_select(0, index)) and out.grad_fn is None
    with torch.no_grad():
        assert take_rows(x.requires_grad_(), 0, index).grad_fn is None
