"""The rollout stream: one capture per trainer request, one staged batch, lazy, loud — by counting."""

import subprocess
import sys
import threading
import weakref

from dataclasses import replace

import pytest
import torch

from specforge_core.capture import build_capture_backend
from fixtures.fake_sglang import FakeSGLangEngine
from specforge_core.config import load_config
from specforge_core.errors import CaptureError, DataError
from specforge_core.run.topology import Topology
from specforge_core.run.plan import IslandBatch, PromptPlan
from specforge_core.loop.rollout import RolloutStream
from tests.runtime.test_time_budget import TickingClock


class CountingRows(list):
    """A list of prompt rows that records which indices were read."""

    def __init__(self, rows):
        super().__init__(rows)
        self.read: list[int] = []

    def __getitem__(self, i):
        self.read.append(i)
        return super().__getitem__(i)


def make_rows(n: int, seed: int = 0) -> CountingRows:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (n,), generator=g).tolist()
    return CountingRows(
        {"input_ids": torch.randint(3, 500, (k,), generator=g).tolist(), "loss_mask": [0, 0] + [1] * (k - 2)}
        for k in lengths
    )


@pytest.fixture(scope="module")
def backends(tiny_target_dir):
    """sglang backends on the fake engine for TP ranks 0 and 1 of a tp_size=2 island."""
    cfg = load_config(None, [
        f"model.target={tiny_target_dir}", "capture.backend=sglang", "data.max_length=256", "model.dtype=float32",
        "capture.tp_size=2", "deployment.nproc_per_node=2", "training.batch_size=2",
    ])
    return [build_capture_backend(cfg, rank=r, topology=Topology.from_config(cfg),
                                  engine_factory=FakeSGLangEngine.start) for r in range(2)]


def plan(**kw) -> PromptPlan:
    args = dict(dataset_size=40, seed=3, epochs=2, world_size=2, tp_size=2, batch_size=2, accumulation_steps=1)
    args.update(kw)
    topology = Topology(args.pop("world_size"), args.pop("tp_size"), args.pop("batch_size"))
    return PromptPlan.build(args.pop("dataset_size"), topology=topology, **args)


def stream_for(backends, rank=0, rows=None, p=None, **kw) -> RolloutStream:
    p = p or plan()
    return RolloutStream.from_plan(p, rank, rows if rows is not None else make_rows(p.dataset_size), backends[rank], **kw)


def test_nothing_is_read_or_captured_before_the_first_request(backends):
    calls = backends[0].engine.forward_calls
    rows = make_rows(40)
    stream_for(backends, rows=rows)
    assert rows.read == [] and backends[0].engine.forward_calls == calls


def test_each_request_captures_exactly_one_target_batch(backends):
    stream, engine = stream_for(backends), backends[0].engine
    start = engine.forward_calls
    for k in range(1, 4):
        batch = next(stream)
        assert engine.forward_calls - start == k and stream.stats.captures == k
        del batch


def test_each_capture_reads_exactly_one_tp_wide_batch_of_rows(backends):
    rows = make_rows(40)
    stream = stream_for(backends, rows=rows)
    batch = next(stream)
    assert len(rows.read) == stream.stats.rows_read == 4  # tp_size × batch_size
    del batch


def test_no_thread_is_started_to_prefetch_target_work(backends):
    before = threading.active_count()
    stream = stream_for(backends)
    for batch in stream:
        assert threading.active_count() == before
        del batch


class SyntheticRows:
    """A million prompt rows made on demand, counting reads."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": [3 + i % 400] * 6, "loss_mask": [1] * 6}


def test_a_thousand_epoch_plan_is_not_expanded_ahead(backends):
    rows = SyntheticRows(1_000_000)
    p = plan(dataset_size=rows.n, epochs=1000)
    batch = next(stream_for(backends, rows=rows, p=p))
    assert rows.reads == p.island_batch_size and batch.batch_size == 2


def test_tp_peers_capture_one_aligned_batch_and_keep_disjoint_slices(backends):
    peers = [stream_for(backends, rank=r) for r in range(2)]
    b0, b1 = next(peers[0]), next(peers[1])
    assert set(b0.task_ids).isdisjoint(b1.task_ids)
    island = next(plan().island_batches(0))
    assert b0.task_ids + b1.task_ids == tuple(t.task_id for t in island.tasks)
    assert peers[0].stats.island_tokens == peers[1].stats.island_tokens  # the same TP-wide capture


def test_the_kept_slice_owns_its_memory(backends):
    batch = next(stream_for(backends, rank=1))
    for t in (batch.aux_hidden, batch.last_hidden):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_the_stream_drops_its_reference_when_the_trainer_takes_the_batch(backends):
    stream = stream_for(backends)
    batch = next(stream)
    features = weakref.ref(batch.aux_hidden)
    del batch
    assert features() is None


def test_a_trainer_that_deletes_each_batch_keeps_one_batch_live(backends):
    stream = stream_for(backends)
    for batch in stream:
        del batch
    assert stream.stats.peak_live_batches == 1


def test_a_trainer_that_holds_batches_is_counted(backends):
    stream = stream_for(backends)
    held = [next(stream), next(stream)]
    assert stream.stats.peak_live_batches == 2 and len(held) == 2


def test_the_stream_ends_at_the_plan_horizon(backends):
    p = plan(max_steps=3)
    assert sum(1 for _ in stream_for(backends, p=p)) == p.total_micro_steps == 3


def test_resume_never_reads_or_captures_the_skipped_prompts(backends):
    p, rows = plan(), make_rows(40)
    remaining = [t.prompt_index for b in list(p.island_batches(0))[5:] for t in b.tasks]
    engine = backends[0].engine
    start_calls = engine.forward_calls
    stream = stream_for(backends, rows=rows, p=p, start_sample=5 * p.batch_size)
    for batch in stream:
        del batch
    assert rows.read == remaining  # the first 5 micro-steps' prompts were never read
    assert engine.forward_calls - start_calls == p.total_micro_steps - 5


def test_a_short_tp_wide_batch_raises(backends):
    full = next(plan().island_batches(0))
    short = IslandBatch(full.epoch, full.micro_step, full.tasks[:3], full.local)
    stream = RolloutStream(iter([short]), make_rows(40), backends[0], batch_size=2, island_batch_size=4)
    with pytest.raises(CaptureError, match="short TP-wide batch"):
        next(stream)


class DroppingBackend:
    """A backend whose capture loses this rank's last row."""

    def __init__(self, inner):
        self.inner, self.name, self.device = inner, "dropping", inner.device

    def capture(self, request):
        batch = self.inner.capture(request)
        for f in ("input_ids", "attention_mask", "loss_mask", "aux_hidden", "last_hidden"):
            setattr(batch, f, getattr(batch, f)[:-1])
        return batch


def test_a_partial_capture_raises(backends):
    stream = RolloutStream.from_plan(plan(), 0, make_rows(40), DroppingBackend(backends[0]))
    with pytest.raises(CaptureError, match="partial capture"):
        next(stream)


def test_rows_that_do_not_match_the_plan_are_refused(backends):
    with pytest.raises(DataError, match="the prompt rows number 39, but the plan was made for 40"):
        stream_for(backends, rows=make_rows(39))


class TimedBackend:
    """The real backend, each ``capture`` taking CAPTURE_S seconds of the test's ``clock``."""

    def __init__(self, backend, clock):
        self.backend, self.clock, self.calls = backend, clock, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def capture(self, request):
        self.clock.at += CAPTURE_S
        self.calls += 1
        return self.backend.capture(request)


CAPTURE_S, BETWEEN_S = 2.0, 100.0


def test_stats_report_capture_time_throughput_and_peak_staged_bytes(backends):
    rows = make_rows(40)
    clock = TickingClock(tick=0.0)
    timed = TimedBackend(backends[0], clock)
    stream = stream_for([timed, backends[1]], rows=rows, clock=clock)
    sizes = []
    for batch in stream:
        sizes.append(batch.feature_bytes())
        clock.at += BETWEEN_S  # trainer work between captures: not capture time
        del batch
    tokens = sum(len(list.__getitem__(rows, i)["input_ids"]) for i in rows.read)
    s = stream.stats.as_dict()
    assert s["captures"] == timed.calls == plan().total_micro_steps
    assert s["peak_staged_bytes"] == max(sizes)
    assert s["island_tokens"] == tokens
    # the stream's capture clock covers the backend's capture calls and not the trainer's time between them
    assert s["capture_seconds"] == CAPTURE_S * s["captures"]
    assert s["capture_tokens_per_s"] * s["capture_seconds"] == pytest.approx(tokens)


def test_a_datasets_dataset_works_as_the_rows(backends):
    datasets = pytest.importorskip("datasets")
    rows = make_rows(40)
    from_list = [b.task_ids for b in stream_for(backends, rows=list(rows))]
    from_arrow = [b.task_ids for b in stream_for(backends, rows=datasets.Dataset.from_list(list(rows)))]
    assert from_list == from_arrow


def test_the_runtime_does_not_import_datasets():
    code = (
        "import sys, specforge_core.loop.rollout, specforge_core.capture.hf, specforge_core.capture.sglang_backend;"
        "assert 'datasets' not in sys.modules, 'datasets was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_token_budget_packs_the_same_samples_into_fewer_rows(backends):
    plain = next(stream_for(backends))
    stream = stream_for(backends, token_budget=64)
    packed = next(stream)
    assert packed.task_ids == plain.task_ids and packed.batch_size == 1
    assert packed.num_tokens == plain.num_tokens and packed.seq_ids is not None
    assert stream.stats.padding_fraction == 0.0


def test_stats_report_the_padding_of_the_handed_out_rows(backends):
    stream = stream_for(backends)
    batch = next(stream)
    slots = batch.input_ids.numel()
    assert stream.stats.local_slots == slots
    assert stream.stats.padding_fraction == pytest.approx(1 - batch.num_tokens / slots)


@pytest.mark.parametrize("host_masks", [True, False], ids=["with-host-masks", "device-only"])
def test_a_packed_capture_that_loses_a_sample_raises(backends, host_masks):
    class LosingBackend(DroppingBackend):
        def capture(self, request):
            batch = self.inner.capture(request)
            batch.seq_ids = batch.seq_ids.masked_fill(batch.seq_ids == 1, -1)
            host = batch.host_masks
            # a backend that keeps host masks lays them out from what it captured (the stream reads those)
            batch.host_masks = replace(host, seq_ids=host.seq_ids.masked_fill(host.seq_ids == 1, -1)) if host_masks else None
            return batch

    stream = RolloutStream.from_plan(plan(), 0, make_rows(40), LosingBackend(backends[0]), token_budget=64)
    with pytest.raises(CaptureError, match="partial capture"):
        next(stream)
