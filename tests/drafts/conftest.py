"""Triton's interpreter where there is no CUDA device, so that the Triton kernels' equality tests
run on the CPU: it must be on before Triton is first imported (tests/drafts/triton_mode.py)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
