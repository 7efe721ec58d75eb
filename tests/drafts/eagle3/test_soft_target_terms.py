"""The unroll's soft-target terms (fast.soft_target_ce.soft_target_terms) against autograd of their formula:
both ways the backward gets the draft's softmax (saved, or recomputed from the saved logits and
their logsumexp as on CUDA) give the soft cross-entropy's gradient."""

import pytest
import torch

from specforge_core.drafts.vocab import soft_target_ce
from specforge_core.drafts.vocab.soft_target_ce import soft_target_terms


def terms_inputs(dtype, seed=0, n=9, vd=37, nt=13):
    """Logits and teacher logits in ``dtype`` (the teacher keeps the head's dtype), fp32 lse."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vd, generator=g)).to(dtype).requires_grad_()
    teacher_logits = (3 * torch.randn(nt, vd, generator=g)).to(dtype)
    label = torch.randperm(nt, generator=g)[:n]
    weight = (torch.rand(n, generator=g) < 0.7).float()
    log_mass = -torch.rand(nt, generator=g)[label]
    return logits, teacher_logits, torch.logsumexp(teacher_logits.float(), -1), label, weight, log_mass


def by_formula(logits, teacher_logits, label, weight, log_mass):
    target = torch.softmax(teacher_logits[label].float(), -1)
    log_q = torch.log_softmax(logits.float(), -1)
    loss = -(target * log_q).sum(-1) * weight
    overlap = torch.minimum(log_q.exp(), target * log_mass.exp()[:, None]).sum(-1)
    return loss, overlap


@pytest.mark.parametrize("recompute, block", [(False, None), (False, 2 * 37), (True, None)],
                         ids=["saved_softmax", "saved_softmax_row_blocks", "recomputed_from_lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_target_terms_equal_their_formula_and_its_gradient(recompute, block, dtype, monkeypatch):
    """``block``: the eager path in blocks of 2 rows (a last one of 1), as it splits larger batches."""
    if block:
        monkeypatch.setattr(soft_target_ce, "EAGER_BLOCK", block)
    logits, tl, tlse, label, weight, log_mass = terms_inputs(dtype)
    upstream = torch.randn(logits.shape[0], generator=torch.Generator().manual_seed(5))
    loss, overlap, argmax = soft_target_terms(logits, tl, tlse, label, weight, log_mass, recompute=recompute)
    (grad,) = torch.autograd.grad((loss * upstream).sum(), logits)

    ref_logits = logits.detach().clone().requires_grad_()
    ref_loss, ref_overlap = by_formula(ref_logits, tl, label, weight, log_mass)
    (ref_grad,) = torch.autograd.grad((ref_loss * upstream).sum(), ref_logits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(overlap, ref_overlap, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, logits.detach().argmax(-1))
    assert grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient is rounded to the logits' dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=tol, atol=tol)
    assert not grad[weight == 0].any()  # rows without a target get no gradient
