"""One run per output directory, end to end: two ``python -m specforge_core.train`` on one output
dir. The second is refused naming the holder (run id, host, pid), or waits for it with
``output.on_busy: wait``; the lock of a killed run is stale, and the next run takes it over and
resumes bit-identically.
"""

import os
import signal
import socket

import pytest

from specforge_core.loop.checkpoint import checkpoints_dir
from specforge_core.loop.run_lock import LOCK_NAME, read_holder

from .runs import Run, alive, final_weights, losses, run_config, run_to_end, same_weights


def test_a_second_train_on_the_same_output_dir_is_refused_naming_the_holder(train_workdir, tiny_target_dir):
    config = run_config(train_workdir, "busy", tiny_target_dir, world=1, max_steps=60)
    first = Run.start(config, world=1)
    try:
        first.wait_step()  # it holds the lock and trains
        # frozen while the second one asks: it cannot finish (and release the lock) first, however
        # slow the second launch is; a stopped process is alive and its lock is not stale
        os.kill(first.proc.pid, signal.SIGSTOP)
        holder = read_holder(train_workdir / "busy" / LOCK_NAME)
        second = Run.start(config, world=1)
        assert second.wait(120) == 2
    finally:
        os.kill(first.proc.pid, signal.SIGKILL)
    assert holder.pid == first.proc.pid and holder.host == socket.gethostname()
    assert (f"output directory is in use by run {holder.run_id} (host {holder.host}, pid {holder.pid}"
            in second.output)
    assert "fix: wait for that run to finish (output.on_busy: wait), or choose another output.dir" in second.output
    assert "step=" not in second.output


def test_a_waiting_train_starts_when_the_holder_ends(train_workdir, tiny_target_dir):
    steps = 60
    config = run_config(train_workdir, "queued", tiny_target_dir, world=1, max_steps=steps, save_interval=0,
                        output={"on_busy": "wait"})
    first = Run.start(config, world=1)
    try:
        first.wait_step()
        os.kill(first.proc.pid, signal.SIGSTOP)  # it cannot end before the second one has seen it busy
        waiting = Run.start(config, world=1)
        waiting.wait_line(r"output directory is in use by run .*; waiting for it to end")
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert first.wait() == 0
    assert waiting.wait(120) == 0
    assert "step=" not in waiting.output  # it found the run finished: nothing trained twice
    assert f"resumed from {checkpoints_dir(train_workdir / 'queued') / f'step-{steps:08d}'}" in waiting.output


@pytest.fixture(scope="module")
def one_rank_reference(train_workdir, tiny_target_dir):
    run_to_end(run_config(train_workdir, "one-rank-reference", tiny_target_dir, world=1, max_steps=16,
                          save_interval=4), world=1)
    return train_workdir / "one-rank-reference"


def test_the_lock_of_a_killed_train_is_taken_over_and_the_run_resumes_bit_identically(
        train_workdir, tiny_target_dir, one_rank_reference):
    config = run_config(train_workdir, "stale", tiny_target_dir, world=1, max_steps=16, save_interval=4)
    first = Run.start(config, world=1)
    first.wait_line("checkpoint step-00000004 saved")
    first.wait_step()
    os.kill(first.proc.pid, signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    stale = read_holder(train_workdir / "stale" / LOCK_NAME)
    assert stale.pid == first.proc.pid and not alive(stale.pid)

    out = run_to_end(config, world=1)
    assert f"resumed from {checkpoints_dir(train_workdir / 'stale') / 'step-00000004'}" in out
    assert not (train_workdir / "stale" / LOCK_NAME).exists()  # taken over, then released
    assert losses(train_workdir / "stale") == losses(one_rank_reference)
    assert same_weights(final_weights(train_workdir / "stale"), final_weights(one_rank_reference))
