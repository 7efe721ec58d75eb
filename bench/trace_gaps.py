"""Where the GPU waits for the host, from a profiler timeline (Chrome trace with Python stacks).

    BENCH_PROFILE=ours.json python bench/gpu_families.py --side ours --family dspark --work W ...
    python bench/trace_gaps.py ours.json [--steps 10] [--min-gap-us 5] [--top 40] [--match specforge_core]

The device is idle wherever no kernel, copy or memset runs. Each Python function and each
operator of the host's timeline is charged the idle time inside its own interval (inclusive, as
a cumulative profile charges time): a function that runs while the device is starved shows a
large share, one that runs under long kernels none. Printed per step (``--steps``: how many
steps the trace holds), with the device's busy and idle time first. ``--match`` keeps only
Python functions whose name holds the text (their file and line), so the table reads as a call
tree of the step's own code.
"""

import argparse
import bisect
import collections
import json
import sys

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def merged(intervals):
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def idle_gaps(busy, min_gap):
    """The idle intervals between busy ones, each at least ``min_gap`` long."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap]


def overlap(gaps, starts, prefix, lo, hi):
    """Idle time of ``gaps`` (sorted, disjoint; ``starts`` their starts, ``prefix`` running sums
    of their lengths) inside ``[lo, hi]``."""
    if hi <= lo or not gaps:
        return 0.0
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    j = bisect.bisect_left(starts, hi)
    if j <= i:
        return 0.0
    total = prefix[j] - prefix[i]
    first, last = gaps[i], gaps[j - 1]
    total -= max(0.0, min(lo, first[1]) - first[0])  # the part of the first gap before lo
    total -= max(0.0, last[1] - max(hi, last[0]))  # the part of the last gap after hi
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (figures are per step)")
    ap.add_argument("--min-gap-us", type=float, default=5.0, help="shorter idle intervals are not counted")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--match", default=None, help="keep Python functions whose name holds this text")
    args = ap.parse_args(argv)
    events = [e for e in json.load(open(args.trace))["traceEvents"] if e.get("ph") == "X"]
    device = merged((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS)
    if not device:
        print(f"{args.trace}: no device events (a CPU run has no kernels to wait for)", file=sys.stderr)
        return 1
    gaps = idle_gaps(device, args.min_gap_us)
    starts = [g[0] for g in gaps]
    prefix = [0.0]
    for a, b in gaps:
        prefix.append(prefix[-1] + b - a)
    span = device[-1][1] - device[0][0]
    busy = sum(b - a for a, b in device)
    per = 1e3 * args.steps  # µs per step → ms per step
    print(f"device span {span / per:.3f} ms/step, busy {busy / per:.3f}, idle ≥ {args.min_gap_us:g} µs "
          f"{prefix[-1] / per:.3f} in {len(gaps) / args.steps:.0f} gaps/step")
    charged = collections.defaultdict(lambda: [0.0, 0.0, 0])  # name -> idle, wall, count
    for e in events:
        cat = e.get("cat")
        if cat not in ("python_function", "cpu_op", "user_annotation"):
            continue
        if cat == "python_function" and args.match and args.match not in e["name"]:
            continue
        row = charged[(cat, e["name"])]
        row[0] += overlap(gaps, starts, prefix, e["ts"], e["ts"] + e["dur"])
        row[1] += e["dur"]
        row[2] += 1
    for cat in ("python_function", "cpu_op"):
        rows = sorted(((v, k[1]) for k, v in charged.items() if k[0] == cat), reverse=True)[: args.top]
        print(f"\n{cat}: idle inside (ms/step), wall (ms/step), calls/step, name")
        for (idle, wall, count), name in rows:
            if idle <= 0:
                break
            print(f"{idle / per:8.3f} {wall / per:8.3f} {count / args.steps:7.1f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
