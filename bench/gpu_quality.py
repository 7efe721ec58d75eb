"""The draft a GPU-minute buys: every family trained for the same minutes on the same answers, one GPU each, at once.

    python bench/gpu_quality.py --config examples/sharegpt-realcheck-gpu.yaml --data .cache/sharegpt \
        --answers 20000 --prompt-turns all --minutes 8 --gpus 0,1,2,3,4 --out DIR     # one GPU per family
    python bench/gpu_quality.py --config examples/sharegpt-realcheck.yaml --data .cache/sharegpt-smoke \
        --answers 8 --minutes 0.5 --gpus cpu,cpu --families eagle3,dflash --benchmark-limit 2 --out DIR   # CPU smoke

``DATA`` holds what ``scripts/sharegpt_realcheck.py --stages data,regenerate`` made with the same
``--answers``, ``--prompt-turns``, ``--answer-tokens`` and prompt counts (the prompts of each split
and the pool of the target's answers; ``--prompt-turns all`` for more than ≈ 7,000),
made beforehand on the GPU (``--regen-engine sglang``) or carried. Per family (``--families``; the
setting each family trains with is the real check's ``--family``), one process on one device of ``--gpus``
(``CUDA_VISIBLE_DEVICES``; ``cpu`` for a CPU), all at once:

1. ``scripts/sharegpt_realcheck.py --stages train,evaluate,report`` with ``training.time_budget``
   = ``--minutes``: the run, its held-out decodes while training (the curve of τ against training
   minutes), τ at k = 3 on the held-out ShareGPT prompts;
2. ``python -m specforge_core.evaluate --benchmarks mt-bench,humaneval`` on the trained draft
   (``--benchmark-limit`` prompts each, k = 3).

Then ``DIR/quality.json`` (per family: samples trained, τ held-out and per benchmark, the curve,
the run's directory) and ``DIR/quality.png`` (τ against training minutes, one line per family), and
a ``RESULT {json}`` line; exit status 1 when a family's run failed (its log is named).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ("eagle3", "eagle31", "dflash", "dflash2", "dspark")  # the real check's --family settings


def family_commands(args, family: str, out: Path) -> list[list[str]]:
    """The family's two commands: the real check's train/evaluate/report, then the benchmarks."""
    check = [sys.executable, str(ROOT / "scripts" / "sharegpt_realcheck.py"), "--config", args.config,
             "--data", args.data, "--answers", str(args.answers), "--prompt-turns", args.prompt_turns,
             "--answer-tokens", str(args.answer_tokens), "--validation-prompts", str(args.validation_prompts),
             "--heldout-prompts", str(args.heldout_prompts), "--eval-splits", "heldout",
             "--eval-new-tokens", str(args.new_tokens), "--stages", "train,evaluate,report",
             "--family", family, f"output.dir={out}", f"training.time_budget={args.minutes * 60:g}s", *args.overrides]
    bench = [sys.executable, "-m", "specforge_core.evaluate", "--config", str(out / "realcheck.yaml"),
             "--draft", str(out), "--benchmarks", args.benchmarks, "--limit", str(args.benchmark_limit),
             "--max-new-tokens", str(args.new_tokens), "--settings", "3,1,4", "--report",
             str(out / "report" / "benchmarks.md")]
    return [check, bench]


def run_family(args, family: str, device: str, out: Path) -> subprocess.Popen:
    """Start the family's commands one after the other on ``device``, in the background."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = device
    check, bench = family_commands(args, family, out)
    script = f"{shlex.join(check)} && {shlex.join(bench)} > {shlex.quote(str(out / 'benchmarks.json'))}"
    with open(out.parent / f"{family}.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def summarize(family: str, out: Path) -> dict:
    """One family's figures from its run's ``results.json`` and ``benchmarks.json``."""
    results = json.loads((out / "results.json").read_text())
    bench = json.loads((out / "benchmarks.json").read_text().strip().splitlines()[-1])
    per_bench = {name: b["settings"][0]["acceptance_length"] for name, b in bench["benchmarks"].items()}
    return {"family": family, "run": str(out), "samples": results["training"]["samples"],
            "train_seconds": results["training"]["train_seconds"],
            "heldout_acceptance_length": results["heldout"]["acceptance_length"],
            "benchmarks": per_bench,
            "curve": [{"minutes": round((p["train_seconds"] or 0) / 60, 3), "acceptance_length": p["validation_acceptance_length"]}
                      for p in results.get("curve", [])]}


def plot(rows: list[dict], path: Path) -> None:
    """τ of the in-training decodes against training minutes, one line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot([p["minutes"] for p in r["curve"]], [p["acceptance_length"] for p in r["curve"]], marker="o",
                label=f"{r['family']} (held-out τ {r['heldout_acceptance_length'] or float('nan'):.3f})")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("acceptance length, in-training decodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the real check's base config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every family's run")
    ap.add_argument("--data", required=True, help="the real check's --data folder (prompts and answers made)")
    ap.add_argument("--answers", type=int, required=True)
    ap.add_argument("--prompt-turns", choices=["first", "all"], default="first")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--gpus", required=True, help="one device per family, in order: CUDA indices or cpu")
    ap.add_argument("--minutes", type=float, default=8.0, help="training minutes per family")
    ap.add_argument("--answer-tokens", type=int, default=128, help="as the data was made (the real check's flags)")
    ap.add_argument("--validation-prompts", type=int, default=32, help="as the data was made")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="as the data was made")
    ap.add_argument("--benchmarks", default="mt-bench,humaneval")
    ap.add_argument("--benchmark-limit", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    families, devices = args.families.split(","), args.gpus.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or len(devices) != len(families):
        ap.error(f"--families: {unknown} unknown" if unknown else
                 f"--gpus gives {len(devices)} devices for {len(families)} families: one each")
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    procs = {f: run_family(args, f, d, out / f) for f, d in zip(families, devices)}
    codes = {f: p.wait() for f, p in procs.items()}
    rows, failed = [], {f: str(out / f"{f}.log") for f, c in codes.items() if c != 0}
    for f in families:
        if f not in failed:
            try:
                rows.append(summarize(f, out / f))
            except (OSError, KeyError, ValueError, IndexError) as e:  # the run ended but left no figures
                failed[f] = f"{out / f}: {type(e).__name__}: {e}"
    result = {"config": args.config, "overrides": args.overrides, "answers": args.answers, "minutes": args.minutes,
              "devices": dict(zip(families, devices)), "seconds": round(time.monotonic() - t0, 1),
              "families": rows, "failed": failed}
    (out / "quality.json").write_text(json.dumps(result, indent=1))
    if rows:
        plot(rows, out / "quality.png")
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
