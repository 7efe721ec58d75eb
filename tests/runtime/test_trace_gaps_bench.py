"""bench/trace_gaps.py: the device's idle time between kernels is charged to the host code that
ran while it waited, on a timeline whose gaps are known."""

import json

from tests.bench_scripts import load_bench


def _trace(path, events):
    path.write_text(json.dumps({"traceEvents": [dict(ph="X", **e) for e in events]}))
    return str(path)


def test_idle_time_is_charged_to_the_functions_running_in_the_gaps(tmp_path, capsys):
    gaps = load_bench("trace_gaps")
    trace = _trace(tmp_path / "t.json", [
        dict(cat="kernel", name="k1", ts=0, dur=10),
        dict(cat="gpu_memcpy", name="copy", ts=30, dur=10),
        dict(cat="kernel", name="k3", ts=100, dur=1000),  # idle 10-30 and 40-100: 80 µs
        dict(cat="python_function", name="objective.py(9): step", ts=0, dur=1100),
        dict(cat="python_function", name="objective.py(50): layout", ts=45, dur=50),  # 50 µs of the 2nd gap
        dict(cat="python_function", name="torch/x.py(1): inner", ts=50, dur=10),
        dict(cat="python_function", name="objective.py(70): under_kernels", ts=200, dur=500),  # none
        dict(cat="cpu_op", name="aten::nonzero", ts=15, dur=10),  # 10 µs of the 1st gap
    ])
    assert gaps.main([trace, "--steps", "2", "--match", "objective.py"]) == 0
    out = capsys.readouterr().out
    assert "busy 0.510, idle ≥ 5 µs 0.040 in 1 gaps/step" in out  # per step of 2
    rows = {line.split()[-1]: [float(x) for x in line.split()[:2]] for line in out.splitlines()
            if line.startswith(" ")}
    assert rows["step"] == [0.04, 0.55] and rows["layout"] == [0.025, 0.025] and rows["aten::nonzero"][0] == 0.005
    assert "under_kernels" not in rows and "inner" not in rows  # no idle inside; not matched


def test_gaps_shorter_than_the_floor_are_not_counted(tmp_path, capsys):
    gaps = load_bench("trace_gaps")
    trace = _trace(tmp_path / "t.json", [dict(cat="kernel", name="a", ts=0, dur=10),
                                         dict(cat="kernel", name="b", ts=13, dur=10)])
    assert gaps.main([trace, "--min-gap-us", "5"]) == 0
    assert "idle ≥ 5 µs 0.000 in 0 gaps/step" in capsys.readouterr().out


def test_a_trace_without_device_events_is_refused(tmp_path, capsys):
    gaps = load_bench("trace_gaps")
    trace = _trace(tmp_path / "t.json", [dict(cat="cpu_op", name="aten::mm", ts=0, dur=10)])
    assert gaps.main([trace]) == 1
    assert "no device events" in capsys.readouterr().err
