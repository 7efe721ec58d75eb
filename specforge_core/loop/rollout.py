"""The rollout stream: capture one target batch when the trainer asks for one, and nothing else.

    stream = RolloutStream.from_plan(plan, rank, cache.train, backend, start_sample=cursor)
    for batch in stream:                 # each next() = exactly one TP-wide capture
        loss = ...(batch); loss.backward()
        del batch, loss                  # the trainer's half of the memory contract
    print(stream.stats.as_dict())

Contract:

- **Pull-through, lazy.** ``next()`` takes the rank's next TP-wide batch from the plan's lazy
  iterator, reads exactly those prompt rows, runs one capture and returns this rank's slice.
  Nothing is captured before the first request, no epoch is expanded ahead of time, and no thread
  is started: target work never runs in the background.
- **At most one local batch staged.** The stream holds the captured batch only inside ``next()``
  and keeps no reference once it returns. The trainer must ``del`` the batch (and anything
  holding its tensors) after ``backward`` and before asking for the next one — in a
  ``for batch in stream`` loop the loop variable still holds the previous batch while ``next()``
  runs. ``stats.peak_live_batches`` counts the stream's batches still alive at each capture
  (1 when the trainer keeps the contract).
- **TP islands.** The TP peers of an island run the same capture over the same TP-wide batch
  (``tp_size × batch_size`` rows) and each keeps a fresh copy of its rows ``[r·B, (r+1)·B)``.
  Rows are not re-sorted by length across peers: a synchronous step waits for the slowest rank,
  whose padded length is the TP-wide maximum either way.
- **No waiting on the device.** Nothing in ``next()`` reads a device tensor back: the capture's
  inputs go to the device without blocking, its checks read the host's copy of the masks
  (``CapturedBatch.host_masks``) and its time is kept as device events, read when the stats are
  (``stats``, ``last_capture``). So the host can build the next request and launch its capture
  while the device still runs the previous step; the device runs them in order all the same.
- **Loud failures.** A TP-wide batch shorter than ``tp_size × batch_size`` (a short tail) or a
  capture that returns other rows or lengths than requested (a partial capture) raises
  CaptureError; the stream never trains a partial batch.
- **Resume.** ``start_sample`` (samples this rank already trained) jumps the plan's cursor; the
  skipped prompts are never read from ``rows`` nor captured.
- **Packing.** With ``token_budget`` (``training.token_budget``) each capture lays this rank's
  ``batch_size`` samples out in packed rows of at most ``token_budget`` tokens, with
  ``position_ids``/``seq_ids`` (``capture/packing.py``); the samples trained are the plan's either
  way. ``stats.padding_fraction`` is the share of the handed-out ``rows × width`` slots that hold
  no token.
- **Rows.** Any indexable sequence of mappings with ``input_ids`` and ``loss_mask`` lists: a
  ``datasets.Dataset`` (the prompt cache), or a list of dicts. This module does not import
  ``datasets``.
"""

import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from specforge_core.capture.base import CaptureBackend, CapturedBatch, TargetRequest
from specforge_core.errors import CaptureError, DataError
from specforge_core.run.plan import IslandBatch, PromptPlan


@dataclass
class RolloutStats:
    """Counters since the stream started (take differences for a log window)."""

    captures: int = 0
    capture_seconds: float = 0.0
    island_tokens: int = 0  # real tokens of the TP-wide batches the target computed
    local_tokens: int = 0  # real tokens of the slices this rank kept
    local_slots: int = 0  # rows × width of the batches handed out (tokens + padding)
    rows_read: int = 0  # prompt rows read from the dataset
    peak_staged_bytes: int = 0  # largest captured batch the stream handed over
    peak_live_batches: int = 0  # most of this stream's batches alive at once (at capture time)

    @property
    def capture_tokens_per_s(self) -> float:
        return self.island_tokens / self.capture_seconds if self.capture_seconds else 0.0

    @property
    def padding_fraction(self) -> float:
        return 1 - self.local_tokens / self.local_slots if self.local_slots else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "capture_tokens_per_s": self.capture_tokens_per_s,
                "padding_fraction": self.padding_fraction}


class CaptureTime:
    """Seconds one capture took, read when asked (:meth:`seconds`). On CUDA, device events on the
    current stream: the host clock would count the previous step's kernels still queued when the
    capture starts, and reading the events right after the capture would make the host wait for
    it. Read later (a log step, the stream's ``stats``), they have long been reached. Elsewhere,
    ``clock`` (seconds; tests pass their own)."""

    def __init__(self, device, tokens: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.cuda = torch.device(device).type == "cuda"
        self.tokens = tokens  # real tokens of the TP-wide batch the target computed
        self._seconds = None
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.clock = clock
            self.t0 = clock()

    def stop(self) -> "CaptureTime":
        if self.cuda:
            self.end.record()
        else:
            self._seconds = self.clock() - self.t0
        return self

    def seconds(self) -> float:
        if self._seconds is None:
            self.end.synchronize()
            self._seconds = self.start.elapsed_time(self.end) / 1000
        return self._seconds


class RolloutStream(Iterator[CapturedBatch]):
    """Iterator of this rank's captured batches; see the module docstring for the contract."""

    def __init__(
        self,
        batches: Iterator[IslandBatch],
        rows: Sequence[Mapping],
        backend: CaptureBackend,
        *,
        batch_size: int,
        island_batch_size: int,
        token_budget: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._batches = batches
        self.clock = clock  # what a capture's time is read on off CUDA (tests pass their own)
        self._rows = rows
        self.backend = backend
        self.batch_size = batch_size
        self.island_batch_size = island_batch_size
        self.token_budget = token_budget
        self._stats = RolloutStats()
        self._timings: list[CaptureTime] = []  # captures whose seconds are not in _stats yet
        self.last_capture: CaptureTime | None = None  # the latest next()'s capture time
        self._handed_out: list[weakref.ref] = []

    @classmethod
    def from_plan(
        cls, plan: PromptPlan, rank: int, rows: Sequence[Mapping], backend: CaptureBackend, *, start_sample: int = 0,
        token_budget: int | None = None, clock: Callable[[], float] = time.perf_counter,
    ) -> "RolloutStream":
        """The stream of ``rank`` under ``plan``, resuming after ``start_sample`` trained samples;
        ``token_budget`` packs each batch's samples into rows of at most that many tokens."""
        if len(rows) != plan.dataset_size:
            raise DataError(
                f"the prompt rows number {len(rows)}, but the plan was made for {plan.dataset_size}",
                where="prompt cache (train split)",
                fix="use the prompt cache the plan was recorded for, or record a new plan",
            )
        return cls(
            plan.island_batches(rank, start_sample=start_sample),
            rows,
            backend,
            batch_size=plan.batch_size,
            island_batch_size=plan.island_batch_size,
            token_budget=token_budget,
            clock=clock,
        )

    def __next__(self) -> CapturedBatch:
        island_batch = next(self._batches)
        request = self._request(island_batch)
        timer = CaptureTime(self.backend.device, request.num_tokens, clock=self.clock)
        batch = self.backend.capture(request)
        self.last_capture = timer.stop()
        self._check(batch, request, island_batch)
        self._account(batch, request, timer)
        return batch

    @property
    def peak_staged_bytes(self) -> int:
        """The largest captured batch handed over so far (``stats.peak_staged_bytes``, read without
        settling the capture timings)."""
        return self._stats.peak_staged_bytes

    @property
    def stats(self) -> RolloutStats:
        """The counters so far (reading them settles the captures' device timings)."""
        for timing in self._timings:
            self._stats.capture_seconds += timing.seconds()
        self._timings.clear()
        return self._stats

    def close(self) -> None:
        """Stop: no further captures. The backend is the caller's to close."""
        self._batches = iter(())

    # ---- steps of next() -------------------------------------------------------------------

    def _request(self, island_batch: IslandBatch) -> TargetRequest:
        tasks = island_batch.tasks
        if len(tasks) != self.island_batch_size or len(island_batch.local_tasks) != self.batch_size:
            raise CaptureError(
                f"short TP-wide batch at micro-step {island_batch.micro_step}: {len(tasks)} prompts "
                f"(this rank's slice {len(island_batch.local_tasks)}), expected {self.island_batch_size} "
                f"({self.batch_size} per rank); refusing to train a partial batch",
                where=tasks[0].task_id if tasks else f"micro-step {island_batch.micro_step}",
                fix="build the batches with PromptPlan, which drops each epoch's tail",
            )
        input_ids, loss_mask = [], []
        for task in tasks:
            row = self._rows[task.prompt_index]
            ids, mask = list(row["input_ids"]), list(row["loss_mask"])
            if not ids or len(ids) != len(mask):
                raise DataError(
                    f"row {task.prompt_index} has {len(ids)} input_ids and {len(mask)} loss_mask entries",
                    where=f"prompt cache row {task.prompt_index} ({task.task_id})",
                    fix="rebuild the prompt cache (python -m specforge_core.prepare)",
                )
            input_ids.append(ids)
            loss_mask.append(mask)
        self._stats.rows_read += len(tasks)
        return TargetRequest.from_rows(
            input_ids, loss_mask, island_batch.local, [t.task_id for t in tasks], token_budget=self.token_budget
        )

    def _check(self, batch: CapturedBatch, request: TargetRequest, island_batch: IslandBatch) -> None:
        want = request.local_lengths
        # the host's copy of the masks where the capture kept one: reading the device's would wait for it
        masks = batch if batch.host_masks is None else batch.host_masks
        if batch.seq_ids is None:
            got = masks.attention_mask.sum(dim=1).tolist()
        else:  # packed rows: tokens of each sample, wherever they sit
            seq = batch.seq_ids if masks.seq_ids is None else masks.seq_ids
            real = seq[seq >= 0]
            got = torch.bincount(real, minlength=len(want)).tolist() if real.numel() else []
        shapes = _row_shapes(batch)
        if got != want or len(set(shapes.values())) > 1:
            raise CaptureError(
                f"partial capture at micro-step {island_batch.micro_step}: got rows of lengths {got}, "
                f"requested {want}; [B,T] of each field: {shapes}",
                where=f"capture backend {self.backend.name!r}",
                fix="check the target engine for dropped or truncated requests; the step is not trained",
            )

    def _account(self, batch: CapturedBatch, request: TargetRequest, timing: CaptureTime) -> None:
        s = self._stats
        s.captures += 1
        self._timings.append(timing)
        s.island_tokens += request.num_tokens
        s.local_tokens += sum(request.local_lengths)
        s.local_slots += batch.input_ids.numel()
        s.peak_staged_bytes = max(s.peak_staged_bytes, batch.feature_bytes())
        self._handed_out = [r for r in self._handed_out if r() is not None]
        self._handed_out.append(weakref.ref(batch.aux_hidden))
        s.peak_live_batches = max(s.peak_live_batches, len(self._handed_out))


def _row_shapes(batch: CapturedBatch) -> dict[str, tuple[int, ...]]:
    """``[B,T]`` of every field a capture returns, the host masks' included (shapes: no device read)."""
    shapes = {}
    for name in ("input_ids", "attention_mask", "loss_mask", "position_ids", "seq_ids", "aux_hidden", "last_hidden"):
        value = getattr(batch, name)
        if value is not None:
            shapes[name] = tuple(value.shape[:2])
    if batch.host_masks is not None:
        for name in ("attention_mask", "loss_mask", "seq_ids"):
            value = getattr(batch.host_masks, name)
            if value is not None:
                shapes[f"host_masks.{name}"] = tuple(value.shape)
    return shapes
