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


@pytest.mark.parametrize("case", ["two", "first_empty", "second_empty", "three_with_a_gap", "one_unused"])
def test_take_parts_equals_index_selects_forward_and_backward(case):
    """Parts that share some rows: the same outputs and the same gradient as one index_select
    per part whose gradients autograd adds; an empty part, a row in no part and a part whose
    output reaches nothing are allowed."""
    from specforge_core.drafts.eagle3.rows import take_parts

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 9, 4, dtype=torch.float64, generator=gen)
    parts = [torch.tensor([0, 2, 3, 5, 8]), torch.tensor([1, 2, 4, 6, 7, 8])]  # rows 2 and 8 in both
    if case == "first_empty":
        parts = [parts[0][:0], torch.arange(9)]
    elif case == "second_empty":
        parts = [torch.arange(9), parts[1][:0]]
    elif case == "three_with_a_gap":
        parts = [torch.tensor([0, 2, 8]), torch.tensor([2, 4, 8]), torch.tensor([8, 1, 2])]  # rows 3, 5-7 in none

    def slots(index):
        slot = torch.full((9,), -1, dtype=torch.long)
        slot[index] = torch.arange(index.numel())
        return slot

    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = take_parts(got_x, 1, parts, [slots(p) for p in parts])
    want = tuple(want_x.index_select(1, p) for p in parts)
    assert len(got) == len(parts) and all(torch.equal(g, w) for g, w in zip(got, want))
    # whole numbers: sums in any order are exact
    grads = [torch.randint(-9, 10, w.shape, generator=gen).double() for w in want]
    reached = slice(0, 1) if case == "one_unused" else slice(None)
    torch.autograd.backward(got[reached], grads[reached])
    torch.autograd.backward(want[reached], grads[reached])
    assert torch.equal(got_x.grad, want_x.grad)
    if case == "two":
        assert torch.equal(got_x.grad[0, 2], grads[0][0, 1] + grads[1][0, 1])  # both parts' gradients add up
    if case == "three_with_a_gap":
        assert torch.equal(got_x.grad[0, 8], grads[0][0, 2] + grads[1][0, 2] + grads[2][0, 0])
        assert not got_x.grad[0, 3].any()
