"""bench/cpu_train.py's torch stand-in for SpecForge 0.2.0's Triton loss computes its formula."""

import importlib.util
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("cpu_train", ROOT / "bench" / "cpu_train.py")
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)  # its import sets process-wide OpenMP settings
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def test_peer_loss_and_its_gradient_equal_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(2, 5, 11, generator=g, dtype=torch.float64), -1)
    mask = (torch.rand(2, 5, 1, generator=g) > 0.3).double()
    loss = _bench().PeerKLLoss.apply(logits, target, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    # SpecForge 0.2.0's reference (specforge/core/loss.py, _compute_loss): -Σ_v mask·p·log_softmax(z), mean over B·T
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = -torch.sum(mask * target * torch.log_softmax(ref_logits, dim=2), 2).mean()
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert grad[mask[..., 0] == 0].abs().max() == 0  # masked rows get no gradient
