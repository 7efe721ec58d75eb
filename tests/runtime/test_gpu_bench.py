"""bench/gpu_train.py on a CPU: its reading of a profiler timeline, its documented smoke run, and
the long-context curve built on it (bench/gpu_long_context.py)."""

import gzip
import json
import subprocess
import sys

import pytest

from tests.bench_scripts import BENCH, load_bench


def test_idle_gaps_count_to_the_innermost_span_around_them(tmp_path):
    def kernel(ts, dur, cat="kernel"):
        return {"cat": cat, "name": "k", "ts": ts, "dur": dur}

    def span(name, ts, dur):
        return {"cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}

    # µs; two overlapping kernels (no gap between them), then gaps of 1 (in attention, inside the
    # layer, inside the forward), 3 (in the layer outside attention), 5 (between forward and
    # backward: in no phase), 4 (backward); the host's own events do not count
    events = [kernel(0, 10), kernel(5, 6), kernel(12, 4, "gpu_memcpy"), kernel(19, 1), kernel(25, 5), kernel(34, 6),
              span("bench.forward", 0, 20), span("eagle3.layer", 10, 10), span("eagle3.attention", 10, 6),
              span("bench.backward", 25, 15), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40}]
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    bench = load_bench("gpu_train")
    idle = bench.device_idle(bench.trace_events(trace), steps=1)
    ms = {k: round(v * 1e3, 6) for k, v in idle.items()}  # back to µs
    assert ms == {"all": 13, "forward": 4, "attention": 1, "layer": 3, "backward": 4}


def test_kernels_count_to_the_host_op_that_launched_them_and_its_named_ranges(tmp_path):
    def x(cat, name, tid, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}

    mm_dims = [[2, 3], [3, 4]]
    events = [
        # thread 1: an autograd node whose two matmuls launch 7 µs, and 5 + 1 µs (a kernel and a memset)
        x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 1, 0, 100),
        x("cpu_op", "aten::mm", 1, 10, 20, **{"Input Dims": mm_dims}),
        x("cuda_runtime", "cudaLaunchKernel", 1, 15, 2, correlation=1),
        x("cpu_op", "aten::mm", 1, 40, 20, **{"Input Dims": mm_dims}),
        x("cuda_driver", "cuLaunchKernel", 1, 45, 2, correlation=2),
        # thread 2: a forward stage inside a phase, one op of another shape
        x("user_annotation", "bench.forward", 2, 0, 60),
        x("user_annotation", "eagle3.teacher", 2, 1, 50),
        x("cpu_op", "aten::exp_", 2, 5, 10, **{"Input Dims": [[4]]}),
        x("cuda_runtime", "cudaLaunchKernel", 2, 6, 1, correlation=3),
        # after the stage closed: a launch in the phase only
        x("cpu_op", "aten::add_", 2, 55, 3, **{"Input Dims": [[4]]}),
        x("cuda_runtime", "cudaLaunchKernel", 2, 56, 1, correlation=4),
        # device side: work per correlation, and one kernel whose launch the trace lacks
        x("kernel", "k1", 7, 200, 7, correlation=1), x("kernel", "k2", 7, 210, 5, correlation=2),
        x("gpu_memset", "m", 7, 216, 1, correlation=2), x("kernel", "k3", 7, 220, 4, correlation=3),
        x("kernel", "k4", 7, 230, 2, correlation=4), x("kernel", "k5", 7, 240, 3, correlation=99),
    ]
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    bench = load_bench("gpu_train")
    rows = bench.kernels_by_origin(bench.trace_events(trace), steps=1)
    got = [(round(ms * 1e3, 6), n, where, op, dims) for ms, n, where, op, dims in rows]  # back to µs
    assert got == [
        (13, 3, "MmBackward0", "aten::mm", str(mm_dims)),
        (4, 1, "bench.forward > eagle3.teacher", "aten::exp_", "[[4]]"),
        (3, 1, "-", "-", ""),
        (2, 1, "bench.forward", "aten::add_", "[[4]]"),
    ]
    assert "MmBackward0 > aten::mm" in bench.kernels_table(rows).splitlines()[1]


def test_each_idle_gap_counts_to_the_launch_that_ended_it(tmp_path):
    def x(cat, name, tid, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        # host: a forward stage launches a matmul, then outside any stage a rotary op launches
        # two kernels, then the layer stage launches one more
        x("user_annotation", "bench.forward", 1, 0, 100),
        x("user_annotation", "eagle3.teacher", 1, 0, 10),
        x("cpu_op", "aten::mm", 1, 1, 5, **{"Input Dims": [[2, 3], [3, 4]]}),
        x("cuda_runtime", "cudaLaunchKernel", 1, 2, 1, correlation=1),
        x("cpu_op", "aten::cos", 1, 30, 5, **{"Input Dims": [[4]]}),
        x("cuda_runtime", "cudaLaunchKernel", 1, 31, 1, correlation=2),
        x("cuda_runtime", "cudaLaunchKernel", 1, 33, 1, correlation=3),
        x("user_annotation", "eagle3.layer", 1, 50, 20),
        x("cpu_op", "aten::addmm", 1, 55, 5, **{"Input Dims": [[4], [2, 3], [3, 4]]}),
        x("cuda_runtime", "cudaLaunchKernel", 1, 56, 1, correlation=4),
        # device: 10..20, gap 20..32 (ended by cos's first kernel), 32..35, gap to 36, 36..40,
        # gap 40..60 (ended by the layer's addmm), 60..70, then a kernel without a launch after a gap
        x("kernel", "mm", 7, 10, 10, correlation=1), x("kernel", "cos", 7, 32, 3, correlation=2),
        x("kernel", "cos", 7, 36, 4, correlation=3), x("kernel", "addmm", 7, 60, 10, correlation=4),
        x("kernel", "orphan", 7, 75, 1, correlation=99),
    ]
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    bench = load_bench("gpu_train")
    rows = bench.idle_by_launch(bench.trace_events(trace), steps=1)
    got = [(round(ms * 1e3, 6), n, where, op) for ms, n, where, op, _ in rows]  # back to µs
    assert got == [(20, 1, "bench.forward > eagle3.layer", "aten::addmm"),
                   (13, 2, "bench.forward", "aten::cos"),
                   (5, 1, "-", "-")]
    assert bench.kernels_table(rows, "gaps").splitlines()[0].startswith("ms/step  gaps/step")
    # the host's runtime calls by name, largest first: four launches of 1 µs each
    assert bench.runtime_table(bench.trace_events(trace), steps=1).splitlines()[1].split() == [
        "0.004", "4.0", "cudaLaunchKernel"]


def test_the_documented_cpu_smoke_run_of_the_gpu_bench_trains_a_tiny_draft(tmp_path):
    cmd = [sys.executable, str(BENCH / "gpu_train.py"), "--shape", "tiny", "--device", "cpu", "--steps", "1",
           "--phases", "draft", "--draft-variants", "eager", "--draft-shapes", "1x256", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "draft_eager_error" not in results, results["draft_eager_error"]
    assert results["draft_eager_1x256_tokens_per_s"] > 0
    assert results["draft_eager_1x256_teacher_given_tokens_per_s"] > 0  # the same step handed its teacher


def long_context_curve(tmp_path, *options: str) -> dict:
    """The curve of the tiny shape on the CPU at 256 tokens (packed: two samples of 128), no peer."""
    cmd = [sys.executable, str(BENCH / "gpu_long_context.py"), "--shape", "tiny", "--device", "cpu", "--lengths", "256",
           "--packed-sample", "128", "--steps", "1", "--warmup", "1", "--no-peer", *options, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "long_context.json").read_text())


def test_the_long_context_curve_runs_each_point_in_its_own_process_with_the_same_tokens(tmp_path):
    curve = long_context_curve(tmp_path)
    assert curve["settings"] == ["eager"]
    points = curve["points"]
    assert [(p["family"], p["mode"], p["length"]) for p in points] == [("eagle3", "single", 256), ("eagle3", "packed", 256)]
    single, packed = points
    assert single["tokens_per_step"] == packed["tokens_per_step"] == 256  # one sample of 256, two of 128
    per_token = [p["samples_per_s"] / p["tokens_per_s"] for p in points]
    assert per_token[1] == pytest.approx(2 * per_token[0])


@pytest.mark.parametrize("options", [("--families", "dflash,dspark"),
                                     ("--families", "eagle3,dflash", "--setting", "eager+ckpt:single")],
                         ids=["block-families", "eagle3-checkpointed"])
def test_the_curve_runs_every_family_and_the_checkpointed_step(tmp_path, options):
    curve = long_context_curve(tmp_path, "--modes", "single", *options)
    checkpointed = "--setting" in options
    families = ["eagle3"] if checkpointed else ["dflash", "dspark"]  # DFlash has no checkpointed step: skipped
    assert curve["settings"] == (["eager+ckpt"] if checkpointed else ["eager"])
    assert [(p["setting"], p["family"], p["mode"]) for p in curve["points"]] == [
        (curve["settings"][0], f, "single") for f in families]
    assert all(p["tokens_per_step"] == 256 and p["tokens_per_s"] > 0 for p in curve["points"])


@pytest.mark.parametrize("options,says", [
    (("--setting", "eager+"), "expected eager or compiled"),
    (("--setting", "fast"), "expected eager or compiled"),
    (("--setting", "eager:"), "the modes are single and packed"),
    (("--setting", "eager:single/single"), "each at most once"),
    (("--families", "dflash", "--setting", "eager+ckpt"), "none of --families dflash has activation checkpointing"),
])
def test_a_setting_the_curve_cannot_run_is_refused_before_any_point(options, says):
    cmd = [sys.executable, str(BENCH / "gpu_long_context.py"), "--shape", "tiny", "--device", "cpu", "--no-peer", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and says in proc.stderr and "POINT" not in proc.stdout, proc.stderr[-1000:]
