"""The draft a GPU-minute buys: every family trained for the same minutes on the same answers, one GPU each, at once.

    python bench/gpu_quality.py --config examples/sharegpt-realcheck-gpu.yaml --data .cache/sharegpt \
        --answers 20000 --prompt-turns all --regen-engine sglang --minutes 8 --gpus 0,1,2,3,4 \
        --out DIR                             # SGLang answers the prompts first; then one GPU per family
    PYTHONPATH=/tmp/site python bench/gpu_quality.py --config examples/sharegpt-realcheck-gpu.yaml \
        --data .cache/sharegpt --answers 20000 --prompt-turns all --minutes 8 --gpus 0,1,2,3,4,5 \
        --peer specforge --out DIR                                  # and the peer, SpecForge 0.2.0, on GPU 5
    python bench/gpu_quality.py --config examples/sharegpt-realcheck.yaml --data .cache/sharegpt-smoke \
        --answers 8 --minutes 0.5 --gpus cpu,cpu --families eagle3,dflash --benchmark-limit 2 --out DIR   # CPU smoke

``DATA`` holds what ``scripts/sharegpt_realcheck.py --stages data`` made with the same
``--answers``, ``--prompt-turns`` and prompt counts (the prompts of each split; ``--prompt-turns
all`` for more than ≈ 7,000), and the target's answers: made beforehand by its ``regenerate``
stage, or first by this script with ``--regen-engine`` (``sglang`` on the GPU, ``--regen-batch-size
512``), which runs that stage before any row starts and adds its figures (answers written, tokens/s)
to ``quality.json`` under ``regenerate``; answers already in the pool are not made again. Per family (``--families``; the
setting each family trains with is the real check's ``--family``), one process on one device of ``--gpus``
(``CUDA_VISIBLE_DEVICES``; ``cpu`` for a CPU), all at once. Each row trains, then measures:

1. train: ``scripts/sharegpt_realcheck.py --stages train`` with ``training.time_budget`` =
   ``--minutes``: the run and its held-out decodes while training (the curve of τ against
   training minutes);
2. measure: ``--stages evaluate,report`` (τ at k = 3 on the held-out ShareGPT prompts), then
   ``python -m specforge_core.evaluate --benchmarks mt-bench,humaneval`` on the trained draft
   (``--benchmark-limit`` prompts each, k = 3).

Rows that name the same GPU train one after the other, each with the GPU to itself (``--gpus
0,0,0,0,0`` on a one-GPU machine); their measurements wait until that GPU's last row has trained
and then run all at once (decoding needs no timing; a small target's decoders, SmolLM2's, share
an idle GPU easily), so one GPU takes the rows' training minutes plus about one measurement, not
one per row.

``--peer specforge`` adds one row on the last device of ``--gpus``: ``bench/peer_specforge.py
--phase train`` trains SpecForge 0.2.0's EAGLE3 draft with its own training loop on the same answers
for the same ``--minutes`` (the ``specforge`` wheel must be importable: install it with ``pip install --no-deps
--target /tmp/site specforge-0.2.0-py3-none-any.whl`` and put ``/tmp/site`` on ``PYTHONPATH``,
which every row inherits after the project), then (``--phase evaluate``, with the measurements) our
evaluator decodes its exported draft on the same held-out prompts and benchmarks. The peer's row has no curve: it decodes nothing while it
trains, so the plot shows its held-out τ once, at its training minutes.

Then ``DIR/quality.json`` (per family: samples trained, samples/s, τ held-out and per benchmark,
the curve, the run's directory; with ``--peer``, the peer's row under ``peer`` with its trainer's
figures, and ``ours_over_peer``: our EAGLE3 row's τ and samples/s over the peer's, per benchmark
too, and whether they meet the targets of 1.0 and 1.2) and ``DIR/quality.png`` (τ against training
minutes, one line per family), and a ``RESULT {json}`` line; exit status 1 when a row's run failed
(its log, ``DIR/<family>.log`` or ``DIR/peer.log``, is named).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ("eagle3", "eagle31", "dflash", "dflash2", "dspark")  # the real check's --family settings
PEERS = {"specforge": "SpecForge 0.2.0 EAGLE3"}  # --peer: the trainer bench/peer_specforge.py runs
PEER_ROW = "peer"  # the peer's folder and log under --out
PEER_TARGETS = {"heldout_acceptance_length": 1.0, "samples_per_second": 1.2}  # ours over the peer's, at least


def check_flags(args) -> list[str]:
    """The real check's flags every row passes: the same config, train file and prompts."""
    return ["--config", args.config, "--data", args.data, "--answers", str(args.answers), "--prompt-turns",
            args.prompt_turns, "--answer-tokens", str(args.answer_tokens), "--validation-prompts",
            str(args.validation_prompts), "--heldout-prompts", str(args.heldout_prompts), "--eval-new-tokens",
            str(args.new_tokens)]


def benchmark_command(args, out: Path, draft: Path) -> list[str]:
    """Our evaluator on MT-Bench/HumanEval for ``draft``, with the row's resolved config."""
    return [sys.executable, "-m", "specforge_core.evaluate", "--config", str(out / "realcheck.yaml"),
            "--draft", str(draft), "--benchmarks", args.benchmarks, "--limit", str(args.benchmark_limit),
            "--max-new-tokens", str(args.new_tokens), "--settings", "3,1,4", "--report",
            str(out / "report" / "benchmarks.md")]


def family_commands(args, family: str, out: Path) -> list[list[str]]:
    """The family's commands: the real check's training, then its held-out decode and the benchmarks."""
    check = [sys.executable, str(ROOT / "scripts" / "sharegpt_realcheck.py"), *check_flags(args),
             "--eval-splits", "heldout", "--family", family, f"output.dir={out}",
             f"training.time_budget={args.minutes * 60:g}s", *args.overrides]
    return [[*check, "--stages", "train"], [*check, "--stages", "evaluate,report"], benchmark_command(args, out, out)]


def peer_commands(args, out: Path) -> list[list[str]]:
    """The peer's commands: SpecForge's trainer, then our held-out decode of its export and the benchmarks."""
    peer = [sys.executable, str(ROOT / "bench" / "peer_specforge.py"), *check_flags(args),
            "--minutes", f"{args.minutes:g}", f"output.dir={out}", *args.overrides]
    return [[*peer, "--phase", "train"], [*peer, "--phase", "evaluate"], benchmark_command(args, out, out / "draft")]


def child_env(extra: dict | None = None) -> dict:
    """A child's environment: ours, ``extra``, and on ``PYTHONPATH`` the project first, then
    whatever the caller's PYTHONPATH adds (the peer's wheel, say)."""
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def regenerate(args, out: Path) -> dict:
    """The real check's ``regenerate`` stage over ``DATA`` with ``--regen-engine``: the target answers
    the train prompts that have no answer yet. Returns the stage's JSON line; raises RuntimeError,
    naming its log, when it fails."""
    cmd = [sys.executable, str(ROOT / "scripts" / "sharegpt_realcheck.py"), *check_flags(args), "--stages",
           "regenerate", "--regen-engine", args.regen_engine, "--regen-batch-size", str(args.regen_batch_size),
           f"output.dir={out / 'regenerate'}", *args.overrides]
    out.mkdir(parents=True, exist_ok=True)
    log = out / "regenerate.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=f, text=True)
    stage_lines = [line for line in done.stdout.splitlines() if line.startswith('{"stage": "regenerate"')]
    with open(log, "a") as f:
        f.write(done.stdout)
    if done.returncode != 0 or not stage_lines:
        raise RuntimeError(f"the regenerate stage failed (exit {done.returncode}): see {log}")
    return json.loads(stage_lines[-1])


def start_phase(name: str, commands: list[list[str]], device: str, out: Path, env: dict | None = None,
                *, last_stdout_to: str | None = None) -> subprocess.Popen:
    """Start ``commands`` one after the other on ``device``, in the background, appending to the row's
    log (``env``: more variables); ``last_stdout_to``: a file in ``out`` for the last one's output."""
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(env)
    if device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = device
    parts = [shlex.join(c) for c in commands]
    if last_stdout_to:
        parts[-1] += f" > {shlex.quote(str(out / last_stdout_to))}"
    with open(out.parent / f"{name}.log", "a") as log:  # the child keeps its own descriptor
        return subprocess.Popen(["bash", "-c", " && ".join(parts)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def run_rows(rows: list[tuple], out: Path) -> dict[str, int]:
    """Run every ``(name, commands, device, env)`` row (``commands``: the training command, then
    the measurement's) and return its exit code by name. Rows on different devices run at once;
    rows that name the same CUDA device train one after the other, in order, each with the GPU to
    itself, and their measurements start together once the last of them has trained (``cpu``
    rows: each its own device)."""
    queues: dict[str, list[tuple]] = {}
    for row in rows:
        name, _, device, _ = row
        queues.setdefault(device if device != "cpu" else f"cpu-{name}", []).append(row)

    def start(name: str, *args, **kwargs) -> subprocess.Popen | None:
        try:
            return start_phase(name, *args, **kwargs)
        except OSError as e:  # the phase could not start: a failed row, the others go on
            with open(out / f"{name}.log", "a") as log:
                log.write(f"could not start: {type(e).__name__}: {e}\n")
            return None

    def run_queue(queue: list[tuple]) -> dict[str, int]:
        codes, measuring = {}, {}
        for name, commands, device, env in queue:
            (out / f"{name}.log").unlink(missing_ok=True)
            proc = start(name, commands[:1], device, out / name, env=env)
            codes[name] = proc.wait() if proc else -1
        for name, commands, device, env in queue:  # a row whose training failed measures nothing
            if codes[name] == 0:
                measuring[name] = start(name, commands[1:], device, out / name, env=env,
                                        last_stdout_to="benchmarks.json")
        return {**codes, **{name: proc.wait() if proc else -1 for name, proc in measuring.items()}}

    with ThreadPoolExecutor(max_workers=len(queues)) as pool:
        done = list(pool.map(run_queue, queues.values()))
    return {name: code for part in done for name, code in part.items()}


def summarize(family: str, out: Path) -> dict:
    """One row's figures from its run's ``results.json`` and ``benchmarks.json``."""
    results = json.loads((out / "results.json").read_text())
    bench = json.loads((out / "benchmarks.json").read_text().strip().splitlines()[-1])
    per_bench = {name: b["settings"][0]["acceptance_length"] for name, b in bench["benchmarks"].items()}
    samples, seconds = results["training"]["samples"], results["training"]["train_seconds"]
    return {"family": family, "run": str(out), "samples": samples, "train_seconds": seconds,
            "samples_per_second": samples / seconds if seconds else None,
            "heldout_acceptance_length": results["heldout"]["acceptance_length"],
            "benchmarks": per_bench,
            "curve": [{"minutes": round((p["train_seconds"] or 0) / 60, 3), "acceptance_length": p["validation_acceptance_length"]}
                      for p in results.get("curve", [])]}


def ours_over_peer(ours: dict, peer: dict) -> dict:
    """Our EAGLE3 row's τ and samples/s over the peer's, and whether both meet their targets."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    tau = ratio(ours["heldout_acceptance_length"], peer["heldout_acceptance_length"])
    speed = ratio(ours["samples_per_second"], peer["samples_per_second"])
    meets = None if tau is None or speed is None else \
        tau >= PEER_TARGETS["heldout_acceptance_length"] and speed >= PEER_TARGETS["samples_per_second"]
    shown = (lambda x: None if x is None else round(x, 3))
    return {"heldout_acceptance_length": shown(tau), "samples_per_second": shown(speed),
            "benchmarks": {name: shown(ratio(tau_ours, peer["benchmarks"].get(name)))
                           for name, tau_ours in ours["benchmarks"].items()},
            "targets": PEER_TARGETS, "meets_targets": meets}


def plot(rows: list[dict], path: Path, peer: dict | None = None, ratios: dict | None = None) -> None:
    """τ of the in-training decodes against training minutes, one line per family; the peer's
    held-out τ after its training, one marker at its minutes (it decodes nothing while training),
    and our EAGLE3 row over it in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot([p["minutes"] for p in r["curve"]], [p["acceptance_length"] for p in r["curve"]], marker="o",
                label=f"{r['family']} (held-out τ {r['heldout_acceptance_length'] or float('nan'):.3f})")
    if peer is not None:
        ax.plot([peer["train_seconds"] / 60], [peer["heldout_acceptance_length"] or float("nan")], marker="*",
                markersize=14, linestyle="none", color="black",
                label=f"peer: {peer['family']} (held-out τ {peer['heldout_acceptance_length'] or float('nan'):.3f} "
                      "after training)")
    if ratios is not None:
        def times(value) -> str:
            return "–" if value is None else f"×{value}"

        ax.set_title(f"eagle3 over the peer: held-out τ {times(ratios.get('heldout_acceptance_length'))}, "
                     f"samples/s {times(ratios.get('samples_per_second'))}")
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
    ap.add_argument("--peer", choices=sorted(PEERS), help="also train this peer's EAGLE3 for the same minutes, "
                    "on the device after the families' (needs eagle3 among --families)")
    ap.add_argument("--gpus", required=True, help="one device per family, then the peer's: CUDA indices or cpu")
    ap.add_argument("--minutes", type=float, default=8.0, help="training minutes per family")
    ap.add_argument("--answer-tokens", type=int, default=128, help="as the data was made (the real check's flags)")
    ap.add_argument("--regen-engine", choices=["hf", "sglang"],
                    help="make the answers first with this engine (the real check's regenerate stage)")
    ap.add_argument("--regen-batch-size", type=int, default=512, help="prompts per call of --regen-engine")
    ap.add_argument("--validation-prompts", type=int, default=32, help="as the data was made")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="as the data was made")
    ap.add_argument("--benchmarks", default="mt-bench,humaneval")
    ap.add_argument("--benchmark-limit", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    families, devices = args.families.split(","), args.gpus.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    rows_wanted = len(families) + bool(args.peer)
    if unknown:
        ap.error(f"--families: {unknown} unknown")
    if len(devices) != rows_wanted:
        ap.error(f"--gpus gives {len(devices)} devices for {len(families)} families"
                 + (" and the peer" if args.peer else "") + ": one each")
    if args.peer and "eagle3" not in families:
        ap.error("--peer compares against our EAGLE3 row: add eagle3 to --families")
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    made = None
    if args.regen_engine:
        try:
            made = regenerate(args, out)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    names = {f: f for f in families}
    rows_to_run = [(f, family_commands(args, f, out / f), d, None) for f, d in zip(families, devices)]
    if args.peer:
        names[PEER_ROW] = PEERS[args.peer]
        # on a CPU the peer's Triton loss runs under Triton's interpreter (bench/peer_specforge.py)
        rows_to_run.append((PEER_ROW, peer_commands(args, out / PEER_ROW), devices[-1],
                            {"TRITON_INTERPRET": "1"} if devices[-1] == "cpu" else None))
    codes = run_rows(rows_to_run, out)
    row_names = [name for name, *_ in rows_to_run]
    figures, failed = {}, {f: str(out / f"{f}.log") for f, c in codes.items() if c != 0}
    for f in row_names:
        if f not in failed:
            try:
                figures[f] = summarize(names[f], out / f)
            except (OSError, KeyError, ValueError, IndexError) as e:  # the run ended but left no figures
                failed[f] = f"{out / f}: {type(e).__name__}: {e}"
    rows = [figures[f] for f in families if f in figures]
    peer = figures.get(PEER_ROW)
    result = {"config": args.config, "overrides": args.overrides, "answers": args.answers, "minutes": args.minutes,
              "devices": dict(zip(row_names, devices)), "seconds": round(time.monotonic() - t0, 1),
              "families": rows, "failed": failed}
    if made is not None:
        result["regenerate"] = made
    if args.peer:
        result["peer"] = peer and {**peer, "trainer": json.loads((out / PEER_ROW / "peer.json").read_text())}
        result["ours_over_peer"] = ours_over_peer(figures["eagle3"], peer) if peer and "eagle3" in figures else None
    (out / "quality.json").write_text(json.dumps(result, indent=1))
    if rows or peer:
        plot(rows, out / "quality.png", peer, result.get("ours_over_peer"))
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
