"""Process settings that make CPU training fast on a shared machine; the trainer applies both.

    prefer_passive_omp_wait()    # first thing in the entry point, before torch is imported
    keep_freed_memory()          # once, before the first step (glibc only; a no-op elsewhere)

Both leave a user's explicit choice alone and change no numbers, only where time goes:

- **OpenMP wait policy.** By default an OpenMP thread that finishes its share of an op spins,
  waiting for its peers. On cores shared with other jobs the peer is often descheduled, so the
  spinning thread burns the core the peer needs, once per op; sleeping waits
  (``OMP_WAIT_POLICY=PASSIVE``) give it back (docs/performance.md, "CPU"). The OpenMP runtime
  reads the variable when it is loaded, so this must run before ``import torch``.
- **Freed memory stays in the process.** Every step allocates and frees the same large
  activations (``[rows, Vd]`` logits, vocab blocks, target activations: 1-30 MB each). glibc
  serves blocks over its mmap threshold with fresh mappings and returns freed heap tops to the
  kernel, so each step page-faults its working set in again. Raising the mmap threshold to its maximum
  (32 MiB) and the trim threshold keeps freed blocks for reuse; the process keeps its peak heap
  mapped instead of returning it between steps.
"""

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def prefer_passive_omp_wait() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy (see the module docstring)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_freed_memory() -> bool:
    """Tune glibc's allocator to reuse freed large blocks instead of unmapping them.

    Returns True if applied; False where the C library is not glibc (or the user tuned malloc
    through ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, which then stand).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
