"""fast/chunked_ce.py: the target head's cross-entropy in row chunks equals the plain one over the
full logits, values, argmax and the gradient to the draft's outputs."""

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
    upstream = torch.rand(rows, generator=g)
    chunked_h, plain_h = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()

    ce, argmax = target_cross_entropy(chunked_h, head, labels, chunk_rows=chunk_rows)
    (ce * upstream).sum().backward()
    want_ce, want_argmax = target_cross_entropy_plain(plain_h, head, labels)
    (want_ce * upstream).sum().backward()

    assert ce.dtype == torch.float32 and torch.equal(argmax, want_argmax)
    torch.testing.assert_close(ce, want_ce)
    tol = {} if head_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # rounded through the bf16 head
    torch.testing.assert_close(chunked_h.grad, plain_h.grad, **tol)
