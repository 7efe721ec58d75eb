"""Activation checkpointing by region: keep a region's inputs for backward, recompute the rest.

    recompute_regions(draft)   # every module whose class names ``recomputed_regions``

A module class lists, in ``recomputed_regions``, methods that are pure functions of their tensor
arguments (no side effects, no randomness): each such method of every module under the root is
replaced by one that runs it under ``torch.utils.checkpoint`` (non-reentrant), so its forward
saves only its inputs and the backward runs it once more to get what it needs. Applied after
``compile_pointwise``, the recomputation runs the compiled region again. Gradients are the same
as without it (``tests/drafts/eagle3/test_recompute.py``); the cost is one more forward of each
region.
"""

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def recompute_regions(root: nn.Module) -> int:
    """Wrap each method named in a module's ``recomputed_regions`` (for every module under
    ``root``) in activation checkpointing; returns how many were wrapped."""
    count = 0
    for module in root.modules():
        for name in getattr(type(module), "recomputed_regions", ()):
            method = getattr(module, name)
            if not getattr(method, "recomputed", False):  # wrapped once, however often asked
                setattr(module, name, _recomputed(method))
            count += 1
    return count


def _recomputed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        # the regions draw no random numbers (the contract above): no RNG state to stash and restore
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    run.recomputed = True
    return run
