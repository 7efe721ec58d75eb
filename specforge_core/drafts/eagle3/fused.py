"""``torch.compile`` for the unroll's memory-bound passes on CUDA; plain eager elsewhere.

    loss = fused(fn, logits.device)(logits, ...)

The passes over ``[N, Vd]`` logits and the merge of the same-position keys are a few fp32
element-wise operations each: eager, every one is a round trip through device memory (and the
gathers of teacher rows or keys are copies); compiled, they become a few kernels that read each
input once and gather as they read. Shapes change every batch, so graphs are dynamic.
"""

import torch

_COMPILED: dict = {}


def fused(fn, device: torch.device):
    """``fn`` compiled (``dynamic=True``, once per function) when ``device`` is CUDA, else ``fn``."""
    if torch.device(device).type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]
