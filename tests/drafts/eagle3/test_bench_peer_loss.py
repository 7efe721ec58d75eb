"""bench/cpu_train.py's torch stand-in for SpecForge 0.2.0's Triton loss computes its formula."""

import torch

from tests.bench_scripts import load_bench


def test_peer_loss_and_its_gradient_equal_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(2, 5, 11, generator=g, dtype=torch.float64), -1)
    mask = (torch.rand(2, 5, 1, generator=g) > 0.3).double()
    loss = load_bench("cpu_train").PeerKLLoss.apply(logits, target, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    # SpecForge 0.2.0's reference (specforge/core/loss.py, _compute_loss): -Σ_v mask·p·log_softmax(z), mean over B·T
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = -torch.sum(mask * target * torch.log_softmax(ref_logits, dim=2), 2).mean()
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert grad[mask[..., 0] == 0].abs().max() == 0  # masked rows get no gradient
