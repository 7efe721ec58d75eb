"""The block families' RMSNorm (``F.rms_norm``, fused on CUDA) against transformers' ``Qwen3RMSNorm``,
the module the served draft's layers use: the same values and gradients."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from specforge_core.drafts.dflash.model import RMSNorm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fused kernels)")


@pytest.mark.parametrize("dtype,device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"),
                                          pytest.param(torch.float32, "cuda", marks=CUDA),
                                          pytest.param(torch.bfloat16, "cuda", marks=CUDA)])
def test_the_norm_gives_qwen3_s_values_and_gradients(dtype, device):
    g = torch.Generator().manual_seed(0)
    weight = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    ours, theirs = RMSNorm(64, eps=1e-6).to(device, dtype), Qwen3RMSNorm(64, eps=1e-6).to(device, dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = (3 * torch.randn(7, 5, 64, generator=g)).to(device, dtype)
    upstream = torch.randn(7, 5, 64, generator=g).to(device, dtype)
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = ours(mine), theirs(ref)
    out.backward(upstream)
    want.backward(upstream)
    assert out.dtype == want.dtype == dtype
    if device == "cpu":  # the same operations: bit for bit
        assert torch.equal(out, want) and torch.equal(mine.grad, ref.grad)
        assert torch.equal(ours.weight.grad, theirs.weight.grad)
    else:  # one fused kernel: the same math, another summation order
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(out, want, **tol)
        torch.testing.assert_close(mine.grad, ref.grad, **tol)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **tol)


def test_state_dict_keys_and_eps_are_qwen3_s():
    ours, theirs = RMSNorm(8, eps=1e-5), Qwen3RMSNorm(8, eps=1e-5)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert ours.variance_epsilon == theirs.variance_epsilon
