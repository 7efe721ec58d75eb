"""The long-context curve: memory and speed of the training loop as samples grow, beside the peer's step.

    python bench/gpu_long_context.py --out DIR                                   # EAGLE3, 4k..64k, one GPU
    python bench/gpu_long_context.py --families eagle3,dflash --lengths 4096,32768 --no-peer --out DIR
    python bench/gpu_long_context.py --setting eager --setting eager+ckpt:single --out DIR    # + the 32k recipe's step
    python bench/gpu_long_context.py --shape tiny --device cpu --lengths 256,512 --steps 1 --no-peer  # smoke test

Needs torch + transformers (the peer: the ``specforge==0.2.0`` wheel, ``--no-deps``). Per family
(``--families``), setting (``--setting``, repeatable: ``eager`` or ``compiled`` draft step, ``+ckpt`` for
``training.activation_checkpointing``, ``:single/packed`` for its modes; a ``+ckpt`` setting skips the
families without the switch) and length L (``--lengths``), points of the product's loop at ``--shape``
with random weights (``bench/gpu_train.py --phases train``: capture, objective, backward, AdamW):

- ``single``: one sample of L tokens per step;
- ``packed``: samples of ``--packed-sample`` tokens (4,096), L / 4,096 of them packed in one step:
  the same tokens per step, each attending only to itself.

Each point runs in a process of its own (an out-of-memory ends that point, not the curve, and
every point starts from an empty allocator): tokens/s, peak allocated and reserved GiB, and where
the memory goes in one more step (``memory``: allocated at the step's start, which holds the
target, the draft and its optimizer state; the capture's peak over it; the peak of the forward,
the backward and the optimizer). A point that runs out of memory is recorded as ``"oom"`` and
the family's longer lengths are not tried. Then the peer: SpecForge 0.2.0's EAGLE3 draft step
(``bench/gpu_peer_standalone.py``, at its best: its flex attention, Triton loss and default
allocator) on one row of L tokens, length by length until it runs out of memory.

Writes ``DIR/long_context.json`` after every point and prints one ``POINT {json}`` line per point.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OOM = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


CHECKPOINTED_FAMILIES = ("eagle3",)  # DFlash-family configs refuse training.activation_checkpointing


def parse_setting(text: str, default_modes: str) -> dict:
    """``VARIANT[+ckpt][:MODE/MODE]`` -> ``{"name", "variant", "ckpt", "modes"}``."""
    name, colon, modes = text.partition(":")
    variant, *extra = name.split("+")
    if variant not in ("eager", "compiled") or extra not in ([], ["ckpt"]):
        raise SystemExit(f"--setting {text!r}: expected eager or compiled, optionally +ckpt and :single/packed")
    modes = modes.split("/") if colon else default_modes.split(",")
    if not modes or set(modes) - {"single", "packed"} or len(set(modes)) != len(modes):
        raise SystemExit(f"--setting {text!r}: the modes are single and packed, each at most once")
    return {"name": name, "variant": variant, "ckpt": extra == ["ckpt"], "modes": modes}


def gpu_train_command(args, setting: dict, family: str, length: int, mode: str, out: Path) -> list[str]:
    packed = mode == "packed"
    sample = args.packed_sample if packed else length
    batch = max(1, length // args.packed_sample) if packed else 1
    steps = args.warmup + args.steps + 1  # + the step that splits the memory by phase
    return [sys.executable, str(HERE / "gpu_train.py"), "--shape", args.shape, "--device", args.device,
            "--family", family, "--phases", "train", "--draft-variants", setting["variant"], "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--sample-length", str(sample), "--batch-size", str(batch),
            "--token-budget", str(sample * batch), "--samples", str(steps * batch), "--out", str(out),
            *(["--activation-checkpointing"] if setting["ckpt"] else [])]


def run_point(args, setting: dict, family: str, length: int, mode: str) -> dict:
    """One point of the curve in its own process: its figures, or ``{"oom": True}``, or an error."""
    with tempfile.TemporaryDirectory(prefix=f"long-{family}-{length}-{mode}-") as tmp:
        t = time.perf_counter()
        try:
            done = subprocess.run(gpu_train_command(args, setting, family, length, mode, Path(tmp)), capture_output=True,
                                  text=True, timeout=args.point_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within --point-timeout {args.point_timeout} s"}
        results = Path(tmp) / "results.json"
        found = json.loads(results.read_text()) if results.is_file() else {}
    key = f"train_{setting['variant']}_"
    error = found.get(f"{key}error", "") or (done.stderr[-2000:] if done.returncode else "")
    if any(sign in error for sign in OOM):
        return {"oom": True}
    if error or f"{key}tokens_per_s" not in found:
        return {"error": (error or done.stdout[-2000:])[-2000:]}
    point = {name: found.get(f"{key}{name}") for name in (
        "tokens_per_s", "samples_per_s", "tokens_per_step", "peak_allocated_gib", "peak_reserved_gib")}
    point["memory_gib"] = {name.removeprefix(f"{key}memory_").removesuffix("_gib"): value
                           for name, value in found.items() if name.startswith(f"{key}memory_")}
    point["process_s"] = round(time.perf_counter() - t, 1)
    point["device"] = found.get("device")
    point["max_position_embeddings"] = found.get("max_position_embeddings")
    return point


def run_peer(args, length: int) -> dict:
    """SpecForge 0.2.0's EAGLE3 step on one row of ``length`` tokens (its own process)."""
    cmd = [sys.executable, str(HERE / "gpu_peer_standalone.py"), "--shape", args.shape, "--shapes", f"1x{length}",
           "--family", "eagle3", "--iters", str(args.steps), "--warmup", str(args.warmup)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within --peer-timeout {args.peer_timeout} s"}
    found = [json.loads(x[7:]) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not found:
        tail = (done.stdout + done.stderr)[-2000:]
        return {"oom": True} if any(sign in tail for sign in OOM) else {"error": tail}
    key = f"standalone_1x{length}"
    best = max(found[0][f"{key}_tokens_per_s_median"], found[0].get(f"{key}_tokens_per_s_back_to_back", 0.0))
    return {"tokens_per_s": best, "peak_allocated_gib": found[0][f"{key}_peak_gib"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="eagle3", help="comma-separated: eagle3, dflash, dspark")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--modes", default="single,packed")
    ap.add_argument("--packed-sample", type=int, default=4096, help="tokens per sample of a packed point")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--point-timeout", type=float, default=600)
    ap.add_argument("--peer-timeout", type=float, default=300, help="seconds for one of the peer's points")
    ap.add_argument("--setting", action="append", default=None,
                    help="VARIANT[+ckpt][:MODE/MODE], repeatable (default: eager with --modes): the draft step "
                         "without or with training.compile, +ckpt for training.activation_checkpointing")
    ap.add_argument("--no-peer", action="store_true", help="leave SpecForge's step out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    settings = [parse_setting(text, args.modes) for text in (args.setting or ["eager"])]
    families = args.families.split(",")
    for setting in settings:
        if setting["ckpt"] and not set(families) & set(CHECKPOINTED_FAMILIES):
            raise SystemExit(f"--setting {setting['name']}: none of --families {args.families} has activation "
                             f"checkpointing (only {', '.join(CHECKPOINTED_FAMILIES)})")
    curve: dict = {"shape": args.shape, "date": time.strftime("%Y-%m-%d"), "lengths": lengths,
                   "settings": [s["name"] for s in settings], "points": []}

    def record(point: dict) -> None:
        curve["points"].append(point)
        print("POINT " + json.dumps(point), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "long_context.json").write_text(json.dumps(curve, indent=1))

    for setting in settings:
        for family in families:
            if setting["ckpt"] and family not in CHECKPOINTED_FAMILIES:
                continue
            for mode in setting["modes"]:
                for length in lengths:
                    point = run_point(args, setting, family, length, mode)
                    record({"side": "ours", "setting": setting["name"], "family": family, "mode": mode,
                            "length": length, **point})
                    if point.get("oom"):
                        break
    if not args.no_peer:
        for length in lengths:
            point = run_peer(args, length)
            record({"side": "specforge-0.2.0", "setting": "its best", "family": "eagle3", "mode": "single",
                    "length": length, **point})
            if point.get("oom"):
                break
    return 0 if all("error" not in p for p in curve["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
