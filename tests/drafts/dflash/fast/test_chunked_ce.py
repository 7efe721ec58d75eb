"""fast/chunked_ce.py: the target head's weighted cross-entropy in row chunks, its gradient taken
in the forward, equals the plain one over the full logits: loss, per-row CE, argmax and the
gradient to the draft's outputs, and the top-k ids of the same logits."""

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

    loss, ce, argmax, _ = target_cross_entropy(chunked_h, head, labels, weights, chunk_rows=chunk_rows)
    (3.0 * loss).backward()  # the upstream gradient scales the one kept from the forward
    want_loss, want_ce, want_argmax, _ = target_cross_entropy_plain(plain_h, head, labels, weights)
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
        loss, ce, argmax, _ = target_cross_entropy(hidden, head, labels, weights, chunk_rows=2)
    want = target_cross_entropy_plain(hidden, head, labels, weights)
    torch.testing.assert_close(loss, want[0])
    assert not loss.requires_grad and torch.equal(argmax, want[2])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the Triton passes)")


@pytest.mark.parametrize("head_dtype,device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"),
                                               pytest.param(torch.bfloat16, "cuda", marks=CUDA)])
def test_the_top_k_ids_are_those_of_the_head_s_logits_and_leave_the_gradient_alone(head_dtype, device):
    """Each row's k largest logits in the head's dtype (largest first), chunk by chunk, taken before
    the gradient is written over them (on CUDA the Triton pass writes it over the logits):
    loss, CE and gradient as without them."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(13, 16, generator=g).to(device)
    head = torch.randn(50, 16, generator=g).to(head_dtype).to(device)
    labels, weights = torch.randint(50, (13,), generator=g).to(device), torch.rand(13, generator=g).to(device)
    with_top, without = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()

    loss, ce, _, top = target_cross_entropy(with_top, head, labels, weights, chunk_rows=4, top_k=6)
    loss.backward()
    plain_loss, plain_ce, _, none = target_cross_entropy(without, head, labels, weights, chunk_rows=4)
    plain_loss.backward()

    logits = hidden.to(head_dtype) @ head.T
    assert top.shape == (13, 6) and none.shape == (13, 0) and not top.requires_grad
    torch.testing.assert_close(logits.gather(1, top), logits.topk(6, dim=-1).values)  # the k largest, in order
    assert torch.equal(top, target_cross_entropy_plain(hidden, head, labels, weights, top_k=6)[3])
    torch.testing.assert_close(loss, plain_loss)
    assert torch.equal(ce, plain_ce) and torch.equal(with_top.grad, without.grad)
