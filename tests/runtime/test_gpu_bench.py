"""bench/gpu_train.py on a CPU: its reading of a profiler timeline, and its documented smoke run."""

import gzip
import json
import subprocess
import sys

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
    idle = load_bench("gpu_train").device_idle(trace, steps=1)
    ms = {k: round(v * 1e3, 6) for k, v in idle.items()}  # back to µs
    assert ms == {"all": 13, "forward": 4, "attention": 1, "layer": 3, "backward": 4}


def test_the_documented_cpu_smoke_run_of_the_gpu_bench_trains_a_tiny_draft(tmp_path):
    cmd = [sys.executable, str(BENCH / "gpu_train.py"), "--shape", "tiny", "--device", "cpu", "--steps", "1",
           "--phases", "draft", "--draft-variants", "eager", "--draft-shapes", "1x256", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "draft_eager_error" not in results, results["draft_eager_error"]
    assert results["draft_eager_1x256_tokens_per_s"] > 0
