"""Metrics: cross-rank reduction, derived numbers, metrics.jsonl, the stdout line, subscribers."""

import contextlib
import io
import json

import pytest
import torch

from specforge_core.system.distributed import Dist, close_distributed, init_distributed
from specforge_core.loop.metrics import METRICS_FILE, MetricsLogger, format_line
from tests.runtime.harness import run_ranks


def derive(sums):
    return {"loss": float(sums["loss_sum"] / sums["count"]), "acc_0": float(sums["acc_0_num"] / sums["acc_0_den"])}


def _metrics_worker(rank, run_dir):
    d = init_distributed("cpu", timeout_s=30)
    loggers = {
        sp: MetricsLogger(f"{run_dir}/sp{sp}" if sp > 1 else run_dir, d, total_steps=10, derive=derive, sp_size=sp)
        for sp in (1, 2)
    }
    seen = []
    loggers[1].subscribe(seen.append)
    out = io.StringIO()
    records = {}
    with contextlib.redirect_stdout(out):
        for sp, logger in loggers.items():
            for _ in range(2):  # two optimizer steps of one micro-batch each
                logger.add_micro_batch(
                    {"loss_sum": 1.0 + 2 * rank, "count": 1, "acc_0_num": 0.5 + rank, "acc_0_den": 2},
                    samples=4,
                    wait_s=0.1 * (rank + 1),
                    capture_s=0.05 * (rank + 1),
                    captures=1,
                    captured_tokens=100,
                    staged_bytes=1000 * (rank + 1),
                )
                logger.add_step(grad_norm=1.0, lr=1e-4)
            records[sp] = logger.flush(step=2)
        sums = {"loss_sum": 9.0, "count": 1, "acc_0_num": 1, "acc_0_den": 1}
        loggers[1].add_micro_batch(sums, samples=4, wait_s=0, capture_s=0)
        loggers[1].add_step(grad_norm=torch.tensor(2.0), lr=5e-5)  # as DraftOptimizer.step returns it
        records["second"] = loggers[1].flush(step=3)
    close_distributed()
    return {"records": records, "seen": seen, "stdout": out.getvalue()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, run_ranks(_metrics_worker, 2, str(run_dir))


def _window_s(record, steps=2):
    return record["step_time_s"] * steps


def test_objective_sums_are_reduced_over_ranks_before_deriving(two_ranks):
    record = two_ranks[1][0]["records"][1]
    assert record["loss"] == pytest.approx((1 + 1 + 3 + 3) / 4)
    assert record["acc_0"] == pytest.approx((0.5 + 0.5 + 1.5 + 1.5) / 8)


def test_global_samples_per_second_counts_world_over_sp_ranks(two_ranks):
    records = two_ranks[1][0]["records"]
    assert records[1]["samples_per_s"] * _window_s(records[1]) == pytest.approx(8 * 2)
    assert records[2]["samples_per_s"] * _window_s(records[2]) == pytest.approx(8 * 1)


def test_capture_share_and_bubble_are_rank_means_over_the_window(two_ranks):
    record = two_ranks[1][0]["records"][1]
    window = _window_s(record)
    assert record["capture_share"] * window == pytest.approx((0.1 + 0.2) / 2)
    assert record["bubble"] * window == pytest.approx((0.2 + 0.4) / 2)


def test_captures_are_counted_over_ranks_and_throughput_is_per_rank(two_ranks):
    record = two_ranks[1][0]["records"][1]
    assert record["captures"] == 4
    assert record["capture_tokens_per_s"] == pytest.approx(400 / (0.1 + 0.2))


def test_peaks_are_maxima_over_ranks_and_cpu_reports_rss(two_ranks):
    record = two_ranks[1][0]["records"][1]
    assert record["peak_staged_bytes"] == 2000
    assert record["peak_rss_bytes"] > 10 * 2**20
    assert "peak_mem_allocated_bytes" not in record


def test_each_flush_starts_a_new_window_and_reads_a_device_grad_norm_as_a_float(two_ranks):
    second = two_ranks[1][0]["records"]["second"]
    assert second["loss"] == pytest.approx(9.0)
    assert second["grad_norm"] == 2.0 and type(second["grad_norm"]) is float
    assert second["lr"] == 5e-5 and second["step"] == 3


def test_only_rank_zero_publishes(two_ranks):
    rank1 = two_ranks[1][1]
    assert rank1["records"] == {1: None, 2: None, "second": None}
    assert rank1["seen"] == [] and rank1["stdout"] == ""


def test_jsonl_subscriber_and_return_value_carry_the_same_records(two_ranks):
    run_dir, results = two_ranks
    lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    assert lines == results[0]["seen"] == [results[0]["records"][1], results[0]["records"]["second"]]


def test_stdout_line_leads_with_step_loss_acc_and_throughput(two_ranks):
    first = two_ranks[1][0]["stdout"].splitlines()[0]
    assert first.startswith("step=2/10 loss=2.0000 acc_0=0.500 samples/s=")


def test_format_line_shows_memory_in_gib():
    line = format_line({"step": 1, "total_steps": 2, "loss": 1.0, "peak_rss_bytes": 3 * 2**30})
    assert line == "step=1/2 loss=1.0000 mem=3.00GiB"


def _one_rank():
    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", mesh=None)


def test_tensor_sums_from_the_objective_are_accumulated(tmp_path):
    logger = MetricsLogger(tmp_path, _one_rank(), total_steps=1, derive=derive, echo=False)
    for value in (1.0, 3.0):
        sums = {"loss_sum": torch.tensor(value), "count": torch.tensor(1), "acc_0_num": 1, "acc_0_den": 4}
        logger.add_micro_batch(sums, samples=1, wait_s=0.0, capture_s=0.0)
    logger.add_step(grad_norm=0.1, lr=1.0)
    record = logger.flush(step=1)
    assert record["loss"] == 2.0 and record["acc_0"] == 0.25


def test_vector_sums_keep_their_shape_through_the_reduction(tmp_path):
    seen = {}

    def per_step(sums):
        seen.update(sums)
        return {"acc_1": float(sums["correct"][1] / sums["total"][1])}

    logger = MetricsLogger(tmp_path, _one_rank(), total_steps=1, derive=per_step, echo=False)
    for _ in range(2):
        sums = {"correct": torch.tensor([3.0, 1.0]), "total": torch.tensor([4.0, 4.0]), "positions": 8}
        logger.add_micro_batch(sums, samples=1, wait_s=0.0, capture_s=0.0)
    logger.add_step(grad_norm=0.1, lr=1.0)
    assert logger.flush(step=1)["acc_1"] == 0.25
    assert seen["correct"].tolist() == [6.0, 2.0] and seen["positions"].shape == ()


def test_records_after_the_resumed_step_are_discarded(tmp_path):
    d = _one_rank()
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    MetricsLogger(tmp_path, d, total_steps=5, derive=derive).discard_after(3)
    assert [json.loads(x)["step"] for x in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1, 2, 3]


def test_format_line_names_the_simulated_and_the_measured_acceptance_length():
    line = format_line({"step": 3, "total_steps": 9, "simulated_accept_length_with_bonus": 1.625,
                        "heldout_acceptance_length": 1.25})
    assert "simulated_len=1.625" in line and "measured_len=1.250" in line
    assert " accept_len=" not in line and "heldout_len=" not in line


def test_capture_times_are_read_at_the_flush_not_when_added(tmp_path):
    class Timing:  # the stream's CaptureTime: device events, read when asked
        def __init__(self, seconds):
            self.value, self.reads = seconds, 0

        def seconds(self):
            self.reads += 1
            return self.value

    logger = MetricsLogger(tmp_path, _one_rank(), total_steps=1, derive=derive, echo=False)
    timings = [Timing(0.25), Timing(0.5)]
    for timing in timings:
        logger.add_micro_batch({"loss_sum": 1.0, "count": 1, "acc_0_num": 1, "acc_0_den": 1}, samples=1, wait_s=0.0, capture_s=timing, captures=1,
                               captured_tokens=300)
    assert [t.reads for t in timings] == [0, 0]
    logger.add_step(grad_norm=0.1, lr=1.0)
    record = logger.flush(step=1)
    assert [t.reads for t in timings] == [1, 1]
    assert record["capture_tokens_per_s"] == pytest.approx(600 / 0.75)
    assert record["capture_share"] * record["step_time_s"] == pytest.approx(0.75)
