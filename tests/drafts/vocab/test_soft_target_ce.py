"""drafts/vocab/soft_target_ce.py: each implementation of the soft-target terms equals the plain function
(autograd of the formula), forward and gradient, run through the autograd Function the
objective uses; the Triton one on CUDA or under Triton's interpreter (tests/drafts/triton_mode.py)."""

import pytest
import torch

from specforge_core.drafts.vocab import soft_target_ce
from specforge_core.drafts.vocab.soft_target_ce import (
    RecomputeSoftCE,
    SavedSoftmaxSoftCE,
    SoftTargetTerms,
    TritonSoftCE,
    implementation_for,
    soft_target_terms_plain,
)
from tests.drafts.triton_mode import TRITON_DEVICE, needs_triton


def _inputs(dtype, device="cpu", n=11, vd=300, nt=7, seed=0):
    """Teacher rows shared by several draft rows (as the unroll's steps share them), a tie in a row."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vd, generator=g)).to(dtype)
    logits[2, 40] = logits[2, 9] = logits[2].max() + 1
    teacher_logits = (3 * torch.randn(nt, vd, generator=g)).to(dtype)
    label = torch.randint(nt, (n,), generator=g)
    weight = (torch.rand(n, generator=g) < 0.7).float()
    log_mass = -torch.rand(n, generator=g)
    teacher_lse = torch.logsumexp(teacher_logits.float(), -1)
    return [x.to(device) for x in (logits, teacher_logits, teacher_lse, label, weight, log_mass)]


def _assert_equals_plain(impl, dtype, device):
    logits, *rest = _inputs(dtype, device)
    weight = rest[3]
    upstream = torch.randn(logits.shape[0], generator=torch.Generator().manual_seed(1)).to(device)
    fast_logits, plain_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, overlap, argmax = SoftTargetTerms.apply(fast_logits, *rest, impl)
    (grad,) = torch.autograd.grad((loss * upstream).sum(), fast_logits)
    want_loss, want_overlap, want_argmax = soft_target_terms_plain(plain_logits, *rest)
    (want_grad,) = torch.autograd.grad((want_loss * upstream).sum(), plain_logits)

    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    counted = weight > 0  # the overlap's contract
    torch.testing.assert_close(overlap[counted], want_overlap[counted], rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, want_argmax) and argmax[2] == 9
    assert grad.dtype == dtype and not grad[~counted].any()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient is rounded to the logits' dtype
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=tol, atol=tol)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the recompute is compiled there)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [SavedSoftmaxSoftCE, RecomputeSoftCE()], ids=["saved_softmax", "recompute"])
def test_the_torch_implementations_equal_the_plain_terms_and_gradient(impl, dtype, device):
    _assert_equals_plain(impl, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_saved_softmax_in_row_blocks_equals_the_plain_terms_and_gradient(dtype, monkeypatch):
    monkeypatch.setattr(soft_target_ce, "EAGER_BLOCK", 2 * 300)  # blocks of 2 rows, a last one of 1
    assert len(soft_target_ce.row_blocks(torch.zeros(11, 300))) == 6
    _assert_equals_plain(SavedSoftmaxSoftCE, dtype, "cpu")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_implementation_equals_the_plain_terms_and_gradient(dtype):
    _assert_equals_plain(TritonSoftCE, dtype, TRITON_DEVICE)


def test_one_place_picks_the_implementation():
    x = torch.zeros(4, 8)
    assert implementation_for(x, x, recompute=False) is SavedSoftmaxSoftCE
    assert implementation_for(x, x, recompute=True) == RecomputeSoftCE()  # CPU tensors: no Triton
    if torch.cuda.is_available() and soft_target_ce.vocab_kernels.triton is not None:
        y = x.cuda()
        assert implementation_for(y, y, recompute=True) is TritonSoftCE
        assert implementation_for(y.t(), y, recompute=True) == RecomputeSoftCE()
