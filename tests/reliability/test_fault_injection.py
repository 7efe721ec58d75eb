"""kill -9 of one rank at seeded points of a 2-rank run, once at each kind of point on each rank
that reaches it, then a re-run: the final draft weights and every step's loss are bit-identical to
an uninterrupted run, and no crash costs more than the steps since the last checkpoint.

    PYTHONPATH=. python -m pytest tests/reliability/test_fault_injection.py -q -s   # prints the table

The run trains 20 optimizer steps with a checkpoint after each. The kills are the five
(point, rank) pairs: before a micro-batch's forward (in a step's compute) on rank 0 and on rank 1,
before a file of a checkpoint is synced (in a save) on rank 0 and on rank 1, and before rank 0
publishes a checkpoint (only rank 0 publishes). Attempt ``i`` lets 1 to 3 earlier such points
through, drawn from ``random.Random(i)``. The points are calls in the code, so a kill lands at the
same place on any machine. Each attempt resumes what the previous one left, so resume is also
tested from resumed runs and after stale run locks (a SIGKILLed or torn-down rank 0 never releases
its lock).
"""

import os
import random
import re
import signal

import pytest

from specforge_core.loop.checkpoint import (
    COMPLETE,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    verify_files,
)

from .runs import STEP, Run, final_weights, losses, run_config, run_to_end, same_weights, session_pids

STEPS = 20
ACCUMULATION = 2  # run_config's micro-batches per optimizer step
KILL_POINTS = {  # name: (crashpoint spec, calls per optimizer step or save on the killed rank)
    "compute": ("call:specforge_core.loop.trainer:TrainStep.forward", ACCUMULATION),
    "save": ("call:specforge_core.loop.checkpoint:fsync_file", 1),
    "publish": ("rename:/checkpoints/step-", 1),
}
KILLS = [("compute", 0), ("save", 1), ("publish", 0), ("compute", 1), ("save", 0)]  # every point on every rank


def verify_every_complete_checkpoint(run_dir) -> None:
    """Each checkpoint that carries COMPLETE has every file it lists, with the listed sha256."""
    import json

    for ckpt in complete_checkpoints(run_dir):
        names = list(json.loads((ckpt / COMPLETE).read_text())["files"])
        verify_files(ckpt, names)


@pytest.mark.slow
def test_a_kill_at_every_point_on_every_rank_then_a_rerun_end_bit_identical_to_an_uninterrupted_run(
        train_workdir, tiny_target_dir):
    straight = run_config(train_workdir, "straight", tiny_target_dir, world=2, max_steps=STEPS)
    run_to_end(straight, world=2)
    faulted = run_config(train_workdir, "faulted", tiny_target_dir, world=2, max_steps=STEPS)
    run_dir = train_workdir / "faulted"

    rows = []
    for seed, (point, rank) in enumerate(KILLS):
        rng = random.Random(seed)
        spec, per_step = KILL_POINTS[point]
        skip = rng.randrange(1, 4) * per_step
        run = Run.start(faulted, world=2, crash_on=spec, crash_skip=skip, crash_rank=rank)
        assert run.wait(300) != 0, "the launcher reported success after a rank was killed"
        assert "SIGKILL" in run.output, f"the run did not end by the planned kill:\n{run.output[-3000:]}"
        assert session_pids(run.proc.pid) == [], "a rank outlived the killed one"
        started = int(resumed.group(1)) if (resumed := re.search(r"at step (\d+)/", run.output)) else 0
        seen = max((int(m.group(1)) for line in run.lines if (m := STEP.search(line))), default=started)
        ckpt = latest_checkpoint(run_dir)
        kept = int(ckpt.name.split("-")[1]) if ckpt else 0
        verify_every_complete_checkpoint(run_dir)
        torn = sorted(p.name for p in checkpoints_dir(run_dir).glob(".step-*.tmp"))
        rows.append((seed, rank, point, skip, started, seen, kept, seen - kept, torn))
        assert seen - kept <= 1, f"a crash cost {seen - kept} checkpointed steps (save_interval is 1)"
        assert kept < STEPS, "the run finished before every kill landed; raise STEPS"

    out = run_to_end(faulted, world=2)
    assert f"resumed from {checkpoints_dir(run_dir)}" in out
    print("\n| attempt | killed rank | kill point | calls let through | attempt started at step | last step line "
          "| newest complete checkpoint | steps to redo | torn save left |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) if x != [] else "—" for x in row) + " |")
    assert losses(run_dir) == losses(train_workdir / "straight")
    assert same_weights(final_weights(run_dir), final_weights(train_workdir / "straight"))
