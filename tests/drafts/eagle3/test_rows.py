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


@pytest.mark.parametrize("empty", [None, "first", "second"])
def test_split_rows_equals_two_index_selects_forward_and_backward(empty):
    """Two parts that together cover the rows (some in both): the same outputs and the same
    gradient as two index_selects whose gradients autograd adds; an empty part is allowed."""
    from specforge_core.drafts.eagle3.rows import split_rows

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 9, 4, dtype=torch.float64, generator=gen)
    first, second = torch.tensor([0, 2, 3, 5, 8]), torch.tensor([1, 2, 4, 6, 7, 8])  # rows 2 and 8 in both
    if empty == "first":
        first, second = first[:0], torch.arange(9)
    elif empty == "second":
        first, second = torch.arange(9), second[:0]

    def slots(index):
        slot = torch.full((9,), -1, dtype=torch.long)
        slot[index] = torch.arange(index.numel())
        return slot

    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = split_rows(got_x, 1, first, second, slots(first), slots(second))
    want = (want_x.index_select(1, first), want_x.index_select(1, second))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    grads = [torch.randn(w.shape, dtype=torch.float64, generator=gen) for w in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    assert torch.equal(got_x.grad, want_x.grad)
    if empty is None:
        assert torch.equal(got_x.grad[0, 2], grads[0][0, 1] + grads[1][0, 1])  # both parts' gradients add up
