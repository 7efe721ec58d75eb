"""fast/chunked_ce.py: the target head's weighted cross-entropy in row chunks, its gradient taken
in the forward, equals the plain one over the full logits: loss, per-row CE, argmax and the
gradient to the draft's outputs."""

import pytest
import torch

from specforge_core.drafts.dflash.fast.chunked_ce import target_cross_entropy, target_cross_entropy_plain


@pytest.mark.parametrize("rows", [0, 11])
@pytest.mark.parametrize("chunk_rows", [3, 11, 64])  # a partial last chunk, one exact chunk, one larger
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_cross_entropy_equals_the_plain_one_and_its_gradient(rows, chunk_rows, head_dtype):
    g = torch.Generator().manual_seed(chunk_rows)
    hidden = torch.randn(rows, 16, generator=g)
    head = torch.randn(40, 16, generator=g).to(head_dtype)
    labels = torch.randint(40, (rows,), generator=g)
    weights = torch.rand(rows, generator=g)
    weights[::4] = 0.0  # rows that do not count
    chunked_h, plain_h = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()

    loss, ce, argmax = target_cross_entropy(chunked_h, head, labels, weights, chunk_rows=chunk_rows)
    (3.0 * loss).backward()  # the upstream gradient scales the one kept from the forward
    want_loss, want_ce, want_argmax = target_cross_entropy_plain(plain_h, head, labels, weights)
    (3.0 * want_loss).backward()

    assert ce.dtype == torch.float32 and torch.equal(argmax, want_argmax)
    assert not ce.requires_grad and loss.requires_grad
    torch.testing.assert_close(ce, want_ce)
    torch.testing.assert_close(loss, want_loss)
    tol = {} if head_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # rounded through the bf16 head
    torch.testing.assert_close(chunked_h.grad, plain_h.grad, **tol)


def test_without_gradient_it_computes_the_values_and_keeps_no_gradient():
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g)
    labels, weights = torch.randint(12, (5,), generator=g), torch.rand(5, generator=g)
    with torch.no_grad():
        loss, ce, argmax = target_cross_entropy(hidden, head, labels, weights, chunk_rows=2)
    want = target_cross_entropy_plain(hidden, head, labels, weights)
    torch.testing.assert_close(loss, want[0])
    assert not loss.requires_grad and torch.equal(argmax, want[2])
