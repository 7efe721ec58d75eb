"""One run per output directory: refuse naming the holder, wait, take over stale locks safely."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_core.errors import ConfigError
from specforge_core.loop.run_lock import LOCK_NAME, RunBusyError, RunLock, process_start, read_holder


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def plant(out, **holder):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"run_id": "old", "host": socket.gethostname(), "started": 0.0, **holder}))


def test_second_run_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path, run_id="first"):
        with pytest.raises(RunBusyError) as e:
            RunLock(tmp_path, run_id="second").acquire()
    msg = str(e.value)
    assert "run first" in msg and socket.gethostname() in msg
    assert "pid" in msg and "output.dir" in msg


def test_lock_is_released_on_exit(tmp_path):
    with RunLock(tmp_path, run_id="a"):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path, run_id="b") as lock:
        assert read_holder(tmp_path / LOCK_NAME) == lock.holder


class Waits:
    """The waiting run's clock and sleep: each sleep moves the clock; ``then`` runs at sleep ``at``."""

    def __init__(self, at: int | None = None, then=None):
        self.now, self.sleeps, self.at, self.then = 0.0, 0, at, then

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps += 1
        if self.sleeps == self.at:
            self.then()


def test_waiting_run_starts_when_the_holder_ends(tmp_path):
    first = RunLock(tmp_path, run_id="first").acquire()
    waits = Waits(at=3, then=first.release)
    with RunLock(tmp_path, run_id="second", wait_s=10, clock=waits.clock, sleep=waits.sleep) as second:
        assert read_holder(tmp_path / LOCK_NAME).run_id == "second"
    assert waits.sleeps == 3  # it waited while the holder held the lock, and no longer
    assert second.took_over is None


def test_waiting_run_gives_up_after_its_deadline(tmp_path):
    waits = Waits()
    with RunLock(tmp_path, run_id="first"):
        with pytest.raises(RunBusyError, match="run first"):
            RunLock(tmp_path, run_id="second", wait_s=2.0, clock=waits.clock, sleep=waits.sleep).acquire()
    assert waits.now == 2.0  # four polls half a second apart, then the deadline


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    pid = dead_pid()
    plant(tmp_path, pid=pid)
    with RunLock(tmp_path, run_id="new") as lock:
        assert lock.took_over is not None and lock.took_over.pid == pid
        assert read_holder(tmp_path / LOCK_NAME).run_id == "new"


def test_lock_from_another_host_is_never_judged_stale(tmp_path):
    plant(tmp_path, host="some-other-node", pid=1)
    with pytest.raises(RunBusyError) as e:
        RunLock(tmp_path).acquire()
    assert "some-other-node" in str(e.value) and f"rm {tmp_path / LOCK_NAME}" in str(e.value)


def test_a_lock_naming_a_pid_that_another_process_now_has_is_taken_over(tmp_path):
    """pid 1 is alive, but it is not the process that wrote the lock: that one started at another time."""
    plant(tmp_path, pid=1, proc_start=process_start(1) + 1)
    with RunLock(tmp_path, run_id="new") as lock:
        assert lock.took_over is not None and lock.took_over.pid == 1


def test_an_older_lock_naming_pid_1_is_taken_over(tmp_path):
    """The trial that blocked a directory for good: a lock without the start-time record, naming pid 1."""
    plant(tmp_path, pid=1, started=time.time() - 10 * 365 * 86400)
    with RunLock(tmp_path, run_id="new") as lock:
        assert lock.took_over is not None and lock.took_over.pid == 1


def test_an_older_lock_naming_a_pid_that_started_after_it_was_written_is_taken_over(tmp_path):
    """A lock without the start-time record: a process younger than the lock cannot have written it."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as young:
        try:
            plant(tmp_path, pid=young.pid, started=time.time() - 3600)
            with RunLock(tmp_path, run_id="new") as lock:
                assert lock.took_over is not None and lock.took_over.pid == young.pid
        finally:
            young.kill()


def test_a_lock_from_an_earlier_boot_of_this_host_is_taken_over(tmp_path):
    plant(tmp_path, pid=1, boot_id="an-earlier-boot", proc_start=process_start(1))
    with RunLock(tmp_path, run_id="new") as lock:
        assert lock.took_over is not None


def test_a_live_holder_keeps_its_lock_and_the_error_says_how_to_check_and_take_over(tmp_path):
    with RunLock(tmp_path, run_id="first") as first:
        assert first.holder.proc_start == process_start(os.getpid())
        with pytest.raises(RunBusyError) as e:
            RunLock(tmp_path, run_id="second").acquire()
    msg = str(e.value)
    assert f"ps -o pid,lstart,args -p {os.getpid()}" in msg and f"rm {tmp_path / LOCK_NAME}" in msg


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
def test_an_output_dir_that_is_a_file_is_refused_naming_the_field(tmp_path, under):
    (tmp_path / "taken").write_text("not a directory")
    out = tmp_path / "taken" / "run" if under else tmp_path / "taken"
    with pytest.raises(ConfigError, match=r"output.dir=.*taken.*: output.dir is an existing file") as e:
        RunLock(out).acquire()
    assert "set output.dir to a directory" in str(e.value)


def test_unreadable_lock_file_is_treated_as_stale(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{not json")
    with RunLock(tmp_path, run_id="new"):
        assert read_holder(tmp_path / LOCK_NAME).run_id == "new"


def _contend(out, barrier, results, release):
    barrier.wait()
    try:
        lock = RunLock(out, run_id=f"p{mp.current_process().pid}").acquire()
        results.put("won")
        release.wait(60)  # hold it until every contender has tried (the test says when)
        lock.release()
    except RunBusyError:
        results.put("refused")


def test_racing_takeovers_of_a_stale_lock_have_one_winner(tmp_path):
    from tests.runtime.harness import rank_context

    plant(tmp_path, pid=dead_pid())
    ctx = rank_context()
    barrier, results, release = ctx.Barrier(4), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_contend, args=(tmp_path, barrier, results, release)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    release.set()
    for p in procs:
        p.join(30)
    assert outcomes == ["refused", "refused", "refused", "won"]


# --- several ranks ---------------------------------------------------------------------------------

COLLECTIVE_TIMEOUT_S = 2.0


def _ranks_wait_for_a_busy_directory(rank, out):
    from specforge_core.system.distributed import barrier, close_distributed, init_distributed
    from specforge_core.loop.run_lock import hold_for_ranks

    d = init_distributed("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    polls = []

    def sleep(s):  # rank 1's polls: the holder ends once rank 1 has waited twice the collective timeout
        polls.append(s)
        time.sleep(s)
        if sum(polls) - s < 2 * COLLECTIVE_TIMEOUT_S <= sum(polls):  # once: the lock is the holder's still
            (Path(out) / LOCK_NAME).unlink()

    lock = hold_for_ranks(out, d, on_busy="wait", sleep=sleep)
    holder = read_holder(Path(out) / LOCK_NAME)
    barrier(d)  # the process group outlived the wait
    if lock is not None:
        lock.release()
    close_distributed()
    return {"waited_s": sum(polls), "holder": holder.run_id, "mine": None if lock is None else lock.holder.run_id}


def test_ranks_wait_for_a_busy_directory_longer_than_the_collective_timeout(tmp_path):
    from tests.runtime.harness import run_ranks

    with RunLock(tmp_path, run_id="holder"):
        results = run_ranks(_ranks_wait_for_a_busy_directory, 2, str(tmp_path), timeout_s=120)
    assert results[1]["waited_s"] >= 2 * COLLECTIVE_TIMEOUT_S
    assert results[0]["holder"] == results[1]["holder"] == results[0]["mine"] != "holder"
    assert not (tmp_path / LOCK_NAME).exists()


def _ranks_refused(rank, out):
    from specforge_core.system.distributed import close_distributed, init_distributed
    from specforge_core.loop.run_lock import hold_for_ranks

    d = init_distributed("cpu", timeout_s=30)
    try:
        hold_for_ranks(out, d, on_busy="fail")
    except RunBusyError as e:
        return str(e)
    finally:
        close_distributed()


def test_every_rank_is_refused_a_busy_directory_with_the_holders_name(tmp_path):
    from tests.runtime.harness import run_ranks

    with RunLock(tmp_path, run_id="holder"):
        results = run_ranks(_ranks_refused, 2, str(tmp_path), timeout_s=120)
    assert all("run holder" in r for r in results)


def test_a_run_that_wrote_nothing_leaves_no_output_directory(tmp_path):
    with RunLock(tmp_path / "new" / "run"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_wrote_keeps_its_output_directory(tmp_path):
    with RunLock(tmp_path / "run"):
        (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]
