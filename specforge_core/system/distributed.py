"""The process group of one training run: torchrun's environment in, gloo (CPU) or NCCL (GPU) out.

    torchrun --nproc_per_node 2 -m specforge_core.train --config C.yaml   # RANK, WORLD_SIZE, ... set
    python -m specforge_core.train --config C.yaml                        # no torchrun: a world of one

``init_distributed`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (what torchrun exports), picks the device (``cuda:LOCAL_RANK`` or ``cpu``) and the
backend that goes with it (NCCL or gloo), and builds the 1-D device mesh the draft is sharded over.
Without those variables it makes a world of one in-process, so the same code path runs by hand.

The helpers below (barrier, reductions, object broadcast/gather) are the only collectives the
trainer, checkpoints and metrics use outside FSDP; every rank must call them in the same order.

``exit_after_success()`` ends a rank that finished its run (``python -m specforge_core.train``
calls it after ``main`` returned 0): it flushes stdio and logging and leaves with ``os._exit(0)``
instead of through the interpreter's teardown, where a gloo worker thread can still be releasing
its last collective and abort the process (the function says how).
"""

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from specforge_core.system.device import resolve_device
from specforge_core.errors import ConfigError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the run: its rank, the world, its device and the mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def enable_expandable_segments() -> None:
    """Ask the CUDA caching allocator for expandable segments unless the user configured it.

    Varying batch shapes fragment the allocator into late OOMs; expandable segments avoid that.
    The setting is read when CUDA initialises, so this must run before the first CUDA call.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def init_distributed(device: Literal["auto", "cpu", "cuda"] = "auto", *, timeout_s: float = 1800.0) -> Dist:
    """Join (or, without torchrun, create) the run's process group and return where we sit.

    ``timeout_s`` bounds every collective: a rank that dies makes the others fail after it
    instead of hanging forever.
    """
    enable_expandable_segments()
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if present and len(present) != len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise ConfigError(
            f"partial torchrun environment: {', '.join(missing)} unset",
            where="environment",
            fix="launch with torchrun (which sets all of them) or unset them all for a single process",
        )
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local_rank)  # the same rule the capture backend uses
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if present:
            kwargs = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend, mesh=mesh)


def close_distributed() -> None:
    """Leave the process group (idempotent); call once at the end of the run, on every rank."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_after_success() -> NoReturn:
    """End this process with exit code 0, skipping the interpreter's teardown (success path only).

    Upstream problem (torch, believed pytorch#190489): a gloo worker thread
    (``ProcessGroupGloo::runLoop``) drops its reference to a finished collective's work *after*
    the waiting rank has moved on; when the work holds tensors that Python also saw (FSDP2's
    all-gathers, ``DTensor.full_tensor``), its destructor decrefs their PyObjects and so takes
    the GIL. If the main thread has reached ``Py_FinalizeEx`` by then, CPython (3.11 here) ends
    the taking thread with ``pthread_exit``, whose unwind crosses the noexcept destructor:
    ``std::terminate`` ("terminate called without an active exception"), SIGABRT, exit code
    -6/134, though the run finished. ``destroy_process_group`` does not join those threads and a
    barrier before it does not close the window, so a rank whose work is done (files written and
    fsynced, process group destroyed) leaves here; a failure keeps the normal exit and its code.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced stream: nothing to flush
            pass
    logging.shutdown()  # flush and close every logging handler (atexit would, but it is skipped)
    os._exit(0)


def barrier(d: Dist) -> None:
    if d.world_size == 1:
        return
    if d.device.type == "cuda":
        dist.barrier(device_ids=[d.device.index])
    else:
        dist.barrier()


def all_reduce(d: Dist, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
    """Element-wise sum (or max) of ``values`` over all ranks, in float64, same list on every rank."""
    if d.world_size == 1 or not values:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_sum_(d: Dist, t: torch.Tensor) -> torch.Tensor:
    """``t`` (on ``d.device``) summed over all ranks in place, without the host reading it."""
    if d.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(d: Dist, obj: Any = None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects only, small: config, paths, dicts)."""
    if d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=d.device)
    return box[0]


def all_gather_object(d: Dist, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if d.world_size == 1:
        return [obj]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out
