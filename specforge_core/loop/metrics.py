"""Training metrics: per-window sums on every rank, reduced and derived on log steps, then shown.

The trainer reports each micro-batch (:meth:`MetricsLogger.add_micro_batch`) and each optimizer
step (:meth:`MetricsLogger.add_step`); on a log step :meth:`MetricsLogger.flush` (collective)
reduces the window over all ranks and rank 0

- appends one JSON object to ``<output.dir>/metrics.jsonl``,
- prints ``step=i/N loss=... acc_0=... samples/s=...`` on stdout (the Prefect task parses
  ``step=i/N``),
- calls every subscriber with the same dict.

What the numbers mean:

- objective metrics (``loss``, ``acc_k``, ``acceptance_rate_k``, simulated acceptance length):
  the objective's summable numerators/denominators are summed over micro-batches and ranks, then
  turned into ratios by the ``derive`` function the objective supplies;
- ``samples_per_s``: global, samples one rank trained in the window × (world // sp_size) / the
  slowest rank's window time (every rank of a target-TP island trains its own slice);
- ``capture_share``: time inside target capture / window time, averaged over ranks;
  ``captures``: target captures in the window, all ranks together (one per micro-batch per rank:
  a resumed run that re-captured skipped prompts would show more); ``capture_tokens_per_s``:
  tokens the target computed per second of capture, per rank;
- ``bubble``: host time the trainer spent in ``next()`` for its next batch (building the request,
  launching the capture, staging, peers) / window time, averaged over ranks. On a CPU that is the
  capture itself; on CUDA the host does not wait for the device there, so the capture's own device
  time is in ``capture_share`` and ``bubble`` is what the host adds;
- ``peak_mem_allocated_bytes`` / ``peak_mem_reserved_bytes`` (CUDA, since start) or
  ``peak_rss_bytes`` (CPU, since start); ``peak_staged_bytes``: the rollout stream's staged
  features; all maxima over ranks;
- what the trainer adds (``extra``): ``train_seconds`` (the training clock at the step's update:
  saves and held-out decodes left out, ``loop/budget.py``), ``budget_fraction`` (with
  ``training.time_budget``: train_seconds / budget) and, on held-out steps, the held-out decode's
  figures (``launch/heldout.py``: ``heldout_acceptance_length``, ``heldout_accept_rate_i``, ...).

Window times leave out what the trainer marks with :meth:`MetricsLogger.exclude_time` (the
held-out decodes), so ``samples_per_s`` and ``step_time_s`` are the training's own.
"""

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specforge_core.run.metrics_file import METRICS_FILE, MetricsFile
from specforge_core.system.distributed import Dist, all_reduce

if TYPE_CHECKING:
    from specforge_core.loop.rollout import CaptureTime

MetricsRecord = dict[str, float | int]
Subscriber = Callable[[MetricsRecord], None]


def _peak_memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "peak_mem_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    # ru_maxrss is the true peak resident set of this process, in KiB on Linux.
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def format_line(record: MetricsRecord) -> str:
    """The human line: ``step=i/N loss=... acc_0=... samples/s=...`` then the rest that exists."""
    parts = [f"step={record['step']}/{record['total_steps']}"]
    for key, label, fmt in (
        ("loss", "loss", ".4f"),
        ("acc_0", "acc_0", ".3f"),
        ("samples_per_s", "samples/s", ".2f"),
        ("simulated_accept_length_with_bonus", "simulated_len", ".3f"),
        ("lr", "lr", ".2e"),
        ("grad_norm", "grad_norm", ".3f"),
        ("capture_share", "capture", ".0%"),
        ("bubble", "bubble", ".0%"),
        ("budget_fraction", "budget", ".0%"),
        ("heldout_acceptance_length", "measured_len", ".3f"),
    ):
        if record.get(key) is not None:
            parts.append(f"{label}={record[key]:{fmt}}")
    for key in ("peak_mem_allocated_bytes", "peak_rss_bytes"):
        if key in record:
            parts.append(f"mem={record[key] / 2**30:.2f}GiB")
    return " ".join(parts)


class MetricsLogger:
    """Accumulates one log window per rank and publishes the reduced record from rank 0.

    ``derive`` maps the summed objective sums (CPU float64 tensors, shapes as given) to named
    float metrics (loss, acc_k, ...); it runs on rank 0 after the cross-rank sum. ``sp_size`` is
    the sequence-parallel width (ranks that share one sample), 1 in colocated mode.
    """

    def __init__(
        self,
        run_dir: str | Path,
        d: Dist,
        *,
        total_steps: int,
        derive: Callable[[dict[str, torch.Tensor]], dict[str, float]],
        sp_size: int = 1,
        echo: bool = True,
    ):
        self.file = MetricsFile(Path(run_dir) / METRICS_FILE)
        self.path = self.file.path
        self.d = d
        self.total_steps = total_steps
        self.derive = derive
        self.sp_size = sp_size
        self.echo = echo
        self.subscribers: list[Subscriber] = []
        self._reset()

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(record)`` on rank 0 after every published record."""
        self.subscribers.append(callback)

    def _reset(self) -> None:
        self.window_start = time.perf_counter()
        self.excluded_s = 0.0
        self.sums: dict[str, torch.Tensor] = {}
        self.samples = 0
        self.wait_s = 0.0
        self.capture_s = 0.0
        self.capture_timings = []  # CaptureTime objects, read at the flush
        self.captures = 0
        self.captured_tokens = 0
        self.steps = 0
        self.grad_norm_sum = 0.0
        self.lr = 0.0
        self.peak_staged_bytes = 0

    def add_micro_batch(
        self,
        sums: dict[str, float | torch.Tensor],
        *,
        samples: int,
        wait_s: float,
        capture_s: "float | CaptureTime",
        captures: int = 0,
        captured_tokens: int = 0,
        staged_bytes: int = 0,
    ) -> None:
        """One micro-batch on this rank: objective sums, samples trained, seconds waited/captured,
        captures and the tokens they computed, the stream's peak staged bytes. ``capture_s`` is a
        number or the stream's :class:`~specforge_core.loop.rollout.CaptureTime` (device events,
        read at the flush: reading them now would make the host wait for the capture).

        ``sums`` values are numbers or tensors of any shape (e.g. one entry per unrolled step),
        the same keys and shapes on every rank. Device tensors are added on the device and read
        once per flush, so logging does not synchronise the device every micro-batch.
        """
        for key, value in sums.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
            value = torch.as_tensor(value, dtype=torch.float64)
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.samples += samples
        self.wait_s += wait_s
        if hasattr(capture_s, "seconds"):
            self.capture_timings.append(capture_s)
        else:
            self.capture_s += capture_s
        self.captures += captures
        self.captured_tokens += captured_tokens
        self.peak_staged_bytes = max(self.peak_staged_bytes, staged_bytes)

    def add_step(self, *, grad_norm, lr: float) -> None:
        """One optimizer step on this rank (grad_norm is already global, equal on all ranks; a
        float or a 0-dim tensor, summed where it lives and read at the flush)."""
        self.steps += 1
        self.grad_norm_sum = self.grad_norm_sum + grad_norm
        self.lr = lr

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` spent on this rank in the current window out of its window time."""
        self.excluded_s += seconds

    def discard_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a crashed run's tail, before resuming at ``step``)."""
        if self.d.is_main:
            self.file.truncate_after(step)

    def flush(self, step: int, extra: MetricsRecord | None = None) -> MetricsRecord | None:
        """Reduce the window over ranks (collective) and publish it on rank 0 with ``extra`` (rank 0's
        figures, added as given); returns the record there."""
        elapsed = time.perf_counter() - self.window_start - self.excluded_s
        self.capture_s += sum(t.seconds() for t in self.capture_timings)
        keys = sorted(self.sums)
        values = torch.cat([self.sums[k].reshape(-1).cpu() for k in keys]).tolist() if keys else []
        summed = all_reduce(self.d, values + [self.captures, self.captured_tokens, self.wait_s, self.capture_s])
        shapes = {k: self.sums[k].shape for k in keys}
        memory = _peak_memory(self.d.device)
        peaks = all_reduce(self.d, [elapsed, self.peak_staged_bytes, *memory.values()], op="max")
        samples, steps, grad_norm_sum, lr = self.samples, self.steps, self.grad_norm_sum, self.lr
        self._reset()
        if not self.d.is_main:
            return None

        world = self.d.world_size
        window_s = max(peaks[0], 1e-9)
        captures, captured_tokens, wait_s, capture_s = summed[-4], summed[-3], summed[-2] / world, summed[-1] / world
        record: MetricsRecord = {"step": step, "total_steps": self.total_steps}
        reduced, offset = {}, 0
        for key in keys:
            n = shapes[key].numel()
            reduced[key] = torch.tensor(summed[offset : offset + n], dtype=torch.float64).reshape(shapes[key])
            offset += n
        record.update(self.derive(reduced))
        record.update(
            lr=lr,
            grad_norm=float(grad_norm_sum) / max(steps, 1),
            samples_per_s=samples * (world // self.sp_size) / window_s,
            step_time_s=window_s / max(steps, 1),
            capture_share=capture_s / window_s,
            captures=int(captures),
            capture_tokens_per_s=captured_tokens / (capture_s * world) if capture_s > 0 else 0.0,
            bubble=wait_s / window_s,
            peak_staged_bytes=int(peaks[1]),
            time=time.time(),
        )
        record.update({k: int(v) for k, v in zip(memory, peaks[2:])})
        record.update(extra or {})
        self.file.append(record)
        if self.echo:
            print(format_line(record), flush=True)
        for callback in self.subscribers:
            callback(record)
        return record
