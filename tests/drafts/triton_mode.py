"""Where the Triton kernels run in this test process: on CUDA, or on the CPU under Triton's
interpreter (tests/conftest.py turns it on where there is no CUDA device).

    @needs_triton
    def test_kernel(): ...   # tensors on TRITON_DEVICE
"""

import pytest
import torch

from specforge_core.drafts.vocab import kernels as vocab_kernels

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _why_not() -> str | None:
    if vocab_kernels.triton is None:
        return "Triton is not installed (the dev extra installs it)"
    if torch.cuda.is_available():
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(vocab_kernels._soft_ce_forward_kernel, InterpretedFunction):
        return ("no CUDA device, and Triton was imported before TRITON_INTERPRET=1 was set: "
                "set it in the environment that starts pytest")
    return None


needs_triton = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
