"""Soak: train the tiny target on one CPU rank for a fixed time and record memory and step time.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/reliability/soak.py --minutes 30 --workdir /tmp/soak
    PYTHONPATH=. python tests/reliability/soak.py --report /tmp/soak/soak.json     # the summary again

The run is ``python -m specforge_core.train`` (one process, OMP_NUM_THREADS=1) on the tiny Llama
target with 2,000 real conversations (chitchat), max_length 256, batch 1 × accumulation 2, a
checkpoint every 200 steps (keep 2), a metrics line every 20 steps, epochs enough to outlast the
soak. Every 10 s the script reads the process's RSS from /proc (``VmRSS``, split into anonymous
memory ``RssAnon`` and file pages ``RssFile``: the memory-mapped prompt cache counts there) and
the newest metrics line (``step``, ``step_time_s``). At the end it kills the run (SIGKILL: the soak
is also one more crash) and writes ``soak.json`` with every sample and a summary: RSS per
5-minute window, the RSS slope over the run after warm-up, step time per window.
A leak shows as a slope that does not go to zero; flat means no leak.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WARMUP_S = 120  # the first epoch touches the memory-mapped cache and the allocator settles


def setup(workdir: Path) -> Path:
    from fixtures.chitchat import write_chitchat_jsonl
    from fixtures.tiny import build_tiny_target

    target = workdir / "tiny-target"
    if not (target / "config.json").exists():
        build_tiny_target(target)
    data = workdir / "chat.jsonl"
    if not data.exists():
        write_chitchat_jsonl(data, 2000)
    config = workdir / "soak.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"target": str(target), "dtype": "float32"},
        "data": {"train_files": [str(data)], "max_length": 256, "cache_dir": str(workdir / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 1, "accumulation_steps": 2, "ttt_length": 3, "num_epochs": 100,
                     "log_interval": 20, "save_interval": 200, "keep_checkpoints": 2, "learning_rate": 1e-4},
        "capture": {"device": "cpu"},
        "output": {"dir": str(workdir / "run")},
    }))
    return config


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields


def last_metrics(run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else None


def soak(workdir: Path, minutes: float, every_s: float = 10.0) -> dict:
    config = setup(workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    log = open(workdir / "train.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "specforge_core.train", "--config", str(config)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    t0, samples = time.monotonic(), []
    try:
        while time.monotonic() - t0 < minutes * 60:
            time.sleep(every_s)
            if proc.poll() is not None:
                raise SystemExit(f"the run ended early (exit {proc.returncode}); see {workdir / 'train.log'}")
            m = last_metrics(workdir / "run")
            samples.append({"t_s": round(time.monotonic() - t0, 1), **rss_kib(proc.pid),
                            "step": m and m["step"], "step_time_s": m and m["step_time_s"]})
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
    result = {"minutes": minutes, "samples": samples, "summary": summarize(samples),
              "checkpoints": sorted(p.name for p in (workdir / "run" / "checkpoints").glob("step-*"))}
    (workdir / "soak.json").write_text(json.dumps(result, indent=1))
    return result


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, KiB) points, in MiB per hour."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 3600 / 1024 if den else 0.0


def summarize(samples: list[dict]) -> dict:
    windows = []
    for start in range(0, int(samples[-1]["t_s"]) + 1, 300):
        win = [s for s in samples if start <= s["t_s"] < start + 300]
        if not win:
            continue
        times = [s["step_time_s"] for s in win if s["step_time_s"]]
        windows.append({
            "minutes": f"{start // 60}-{start // 60 + 5}",
            "rss_mib": round(statistics.fmean(s["VmRSS"] for s in win) / 1024, 1),
            "anon_mib": round(statistics.fmean(s["RssAnon"] for s in win) / 1024, 1),
            "file_mib": round(statistics.fmean(s["RssFile"] for s in win) / 1024, 1),
            "step_time_ms": round(1000 * statistics.median(times), 1) if times else None,
            "steps_to": max((s["step"] or 0) for s in win),
        })
    steady = [s for s in samples if s["t_s"] >= WARMUP_S] or samples  # a short smoke run has no steady part
    return {
        "windows": windows,
        "rss_slope_mib_per_h": round(slope_mib_per_hour([(s["t_s"], s["VmRSS"]) for s in steady]), 2),
        "anon_slope_mib_per_h": round(slope_mib_per_hour([(s["t_s"], s["RssAnon"]) for s in steady]), 2),
        "rss_mib_min_max_after_warmup": [round(min(s["VmRSS"] for s in steady) / 1024, 1),
                                         round(max(s["VmRSS"] for s in steady) / 1024, 1)],
        "steps": samples[-1]["step"],
    }


def print_report(result: dict) -> None:
    s = result["summary"]
    print("| minutes | RSS MiB (anon + file) | median step time ms | steps done |\n|---|---|---|---|")
    for w in s["windows"]:
        print(f"| {w['minutes']} | {w['rss_mib']} ({w['anon_mib']} + {w['file_mib']}) "
              f"| {w['step_time_ms']} | {w['steps_to']} |")
    print(json.dumps({k: v for k, v in s.items() if k != "windows"} | {"checkpoints": result["checkpoints"]}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--workdir", default="/tmp/specforge-soak")
    ap.add_argument("--report", help="print the summary of an earlier soak.json and exit")
    args = ap.parse_args(argv)
    if args.report:
        print_report(json.loads(Path(args.report).read_text()))
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print_report(soak(workdir, args.minutes))


if __name__ == "__main__":
    main()
