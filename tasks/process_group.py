"""Run a multi-process launcher (torchrun) inside a Prefect task, and never leave its ranks behind.

    from tasks.process_group import run_process_group
    outcome = run_process_group(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "specforge_core.train", ...],
        metrics_path=run.metrics, log_path=run.train_log, tree_path=run.process_tree)

What it guarantees, in order of importance:

* **No orphaned ranks.** The command starts in its own session (so a process worker's ``killpg``
  of the flow-run group does not race with us), tagged with an environment variable every
  descendant inherits. On ANY exception while it runs (Prefect's ``TerminationSignal`` on cancel
  or SIGTERM, ``KeyboardInterrupt``, an error of ours), the launcher's group gets SIGTERM, every
  tagged process still alive after ``kill_grace_s`` gets SIGKILL, and the exception is re-raised.
  The tag matters: torchrun starts each rank in a session of its own, so no process group holds
  them all.
* **Every line is kept, the API is not flooded.** Merged stdout/stderr go line by line to
  ``log_path`` (full) and to the Prefect run logger through a token bucket; suppressed lines are
  counted in the next logged line. Progress-bar frames (model loading on each rank) go to
  ``log_path`` only. On failure the last lines are in the exception message.
* **Progress and metrics stay current.** ``step=i/N`` lines update one progress artifact
  (optimizer steps done / total); ``metrics.jsonl`` is mirrored into one table artifact, updated
  at most every ``metrics_refresh_s`` and once at the end.

``tree_path`` records the tag, so ``python -m flows.recover`` can stop a tree whose flow-run
process was SIGKILLed (the one case no ``except`` can see).
"""

import json
import logging
import os
import re
import signal
import subprocess
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from specforge_core.io import atomic_write_json
from specforge_core.run.metrics_file import metrics_rows

STEP_LINE = re.compile(r"\bstep=(\d+)/(\d+)\b")
# A progress bar's frame as tqdm draws it ("Loading weights:  40%|████      | 30/75 [00:01<…]", or
# "12it [00:01, …]" without a total); each \r-redraw arrives as a line of its own.
PROGRESS_BAR = re.compile(r"\d+%\|[^|]*\|\s*\d+/\d+|\b\d+it \[\d+:\d+")
# Every process of a launched tree inherits this variable with the tree's own value.
TREE_TOKEN_ENV = "SPECFORGE_PROCESS_TREE"


@dataclass
class ProcessOutcome:
    """What the caller needs after a successful run (small: it may become a persisted task result)."""

    returncode: int
    first_step: int | None = None
    last_step: int | None = None
    total_steps: int | None = None
    lines: int = 0
    tail: list[str] = field(default_factory=list)


class ProcessGroupFailed(RuntimeError):
    def __init__(self, returncode: int, tail: list[str], log_path: Path | None):
        self.returncode = returncode
        self.tail = tail
        where = f" (full output: {log_path})" if log_path else ""
        shown = "\n".join(tail[-20:])
        super().__init__(f"command exited with code {returncode}{where}; last lines:\n{shown}")


# ---------------------------------------------------------------------------------------------
# Killing a process group, and a whole process tree


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def kill_process_group(pgid: int, *, grace_s: float = 15.0, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM every process in group ``pgid``; SIGKILL whatever is still alive after ``grace_s``.

    ``leader`` (our Popen) is reaped as we go so it does not linger as a zombie of this process.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not group_members(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if leader is not None:
        try:
            leader.wait(5)
        except subprocess.TimeoutExpired:
            pass


def tree_members(token: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``TREE_TOKEN_ENV=token``: the launched command and
    everything it started, whatever their session, process group or parent is now."""
    members = []
    for p in psutil.process_iter(["status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
            continue
        try:
            if p.environ().get(TREE_TOKEN_ENV) == token:
                members.append(p)
        except (psutil.Error, OSError):
            continue
    return members


def _signal_all(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def stop_process_tree(token: str, *, grace_s: float = 15.0, leader: subprocess.Popen | None = None) -> int:
    """Stop every process of the tree tagged ``token``; returns how many were alive.

    SIGTERM goes to the leader's process group if the leader lives (torchrun then stops its ranks
    itself and they may flush a line), else to every member; whatever is left after ``grace_s``
    (a rank stuck in a collective, a rank whose launcher is gone) gets SIGKILL. torchrun starts
    each rank in a session of its own, so neither the flow-run's nor torchrun's process group
    holds the ranks: the environment tag does. Every member then gets SIGCONT, so one that is
    stopped (SIGSTOP, a paused job) handles its SIGTERM at once instead of waiting out the grace.
    """
    members = tree_members(token)
    if not members:
        return 0
    if leader is not None and leader.poll() is None:
        try:
            os.killpg(leader.pid, signal.SIGTERM)
        except ProcessLookupError:
            _signal_all(members, signal.SIGTERM)
    else:
        _signal_all(members, signal.SIGTERM)
    _signal_all(members, signal.SIGCONT)  # a stopped member (a paused job) handles its SIGTERM now
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not tree_members(token):
            return len(members)
        time.sleep(0.2)
    _signal_all(tree_members(token), signal.SIGKILL)
    if leader is not None:
        try:
            leader.wait(5)
        except subprocess.TimeoutExpired:
            pass
    return len(members)


def write_tree_record(path: Path, pid: int, token: str) -> None:
    """Record the launched tree (leader pid, start time, tag) for ``kill_recorded_tree``."""
    atomic_write_json(path, {"pid": pid, "create_time": psutil.Process(pid).create_time(), "token": token})


def kill_recorded_tree(path: Path, *, grace_s: float = 15.0) -> int:
    """Stop the tree recorded by ``write_tree_record`` (for a flow-run process that was SIGKILLed);
    returns how many of its processes were alive (0: nothing to do)."""
    if not path.is_file():
        return 0
    return stop_process_tree(json.loads(path.read_text())["token"], grace_s=grace_s)


# ---------------------------------------------------------------------------------------------
# Logs, progress, metrics


class LineBudget:
    """Token bucket: ``burst`` lines at once, then ``per_second``; counts what it holds back."""

    def __init__(self, burst: int = 200, per_second: float = 10.0):
        self.burst, self.per_second = burst, per_second
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.suppressed = 0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.per_second)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False


class ProgressArtifact:
    """One progress artifact per task attempt: optimizer steps done / total, updated in place."""

    def __init__(self, key: str, min_interval_s: float = 1.0):
        self.key, self.min_interval_s = key, min_interval_s
        self.artifact_id = None
        self.shown: float | None = None
        self.stamp = 0.0

    def update(self, step: int, total: int, *, force: bool = False) -> None:
        pct = 100.0 * min(step, total) / max(total, 1)
        now = time.monotonic()
        if not force and (pct == self.shown or now - self.stamp < self.min_interval_s):
            return
        text = f"{step}/{total} optimizer steps"
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(pct, key=self.key, description=text)
        else:
            update_progress_artifact(self.artifact_id, pct, description=text)
        self.shown, self.stamp = pct, now


class MetricsTable:
    """One table artifact mirroring metrics.jsonl, created at the first rows and then updated in
    place (a new artifact per refresh would add a badge to the run graph each time)."""

    def __init__(self, path: Path, key: str, min_interval_s: float = 10.0):
        self.path, self.key, self.min_interval_s = path, key, min_interval_s
        self.artifact_id = None
        self.size = -1
        self.stamp = 0.0

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.stamp < self.min_interval_s:
            return
        self.stamp = now
        size = self.path.stat().st_size if self.path.is_file() else 0
        if size == self.size:
            return
        rows = metrics_rows(self.path)
        if not rows:
            return
        description = f"training metrics ({self.path.name}, {len(rows)} rows)"
        if self.artifact_id is None:
            self.artifact_id = create_table_artifact(rows, key=self.key, description=description)
        else:
            with get_client(sync_client=True) as client:
                client.update_artifact(self.artifact_id, ArtifactUpdate(data=json.dumps(rows), description=description))
        self.size = size


def shown_in_run_log(line: str) -> bool:
    """Whether a launched process's line goes to the Prefect run log: not blank, not a progress-bar
    frame (one per redraw per rank; progress is the progress artifact's, and log_path keeps them)."""
    return bool(line.strip()) and not PROGRESS_BAR.search(line)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tasks.process_group")


# ---------------------------------------------------------------------------------------------
# The runner


def run_process_group(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    log_path: Path | None = None,
    tree_path: Path | None = None,
    metrics_path: Path | None = None,
    progress_key: str | None = "training-progress",
    metrics_key: str = "training-metrics",
    kill_grace_s: float = 15.0,
    budget: LineBudget | None = None,
    metrics_refresh_s: float = 10.0,
) -> ProcessOutcome:
    """Run ``cmd`` in a new session, stream its lines, keep artifacts current, and kill its whole
    process group on any exception. Raises ``ProcessGroupFailed`` on a non-zero exit."""
    logger = _logger()
    budget = budget or LineBudget()
    progress = ProgressArtifact(progress_key) if progress_key else None
    table = MetricsTable(Path(metrics_path), metrics_key, metrics_refresh_s) if metrics_path else None
    outcome = ProcessOutcome(returncode=-1)
    tail: deque[str] = deque(maxlen=50)
    log_file = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "a", encoding="utf-8", buffering=1)

    token = uuid.uuid4().hex
    logger.info("running: %s", " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        cwd=cwd,
        env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1", TREE_TOKEN_ENV: token},
        start_new_session=True,
    )
    try:
        if tree_path is not None:
            write_tree_record(Path(tree_path), proc.pid, token)
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            outcome.lines += 1
            tail.append(line)
            if log_file:
                log_file.write(line + "\n")
            if shown_in_run_log(line) and budget.take():
                if budget.suppressed:
                    logger.info("(%d lines not shown here: see %s)", budget.suppressed, log_path or "stdout")
                    budget.suppressed = 0
                logger.info(line)
            m = STEP_LINE.search(line)
            if m:
                step, total = int(m.group(1)), int(m.group(2))
                if outcome.first_step is None:
                    outcome.first_step = step
                outcome.last_step, outcome.total_steps = step, total
                if progress:
                    progress.update(step, total)
                if table:
                    table.refresh()
        outcome.returncode = proc.wait()
        if budget.suppressed:
            logger.info("(%d lines not shown here: see %s)", budget.suppressed, log_path or "stdout")
    except BaseException:
        logger.warning("stopping the process tree of %d (SIGTERM, SIGKILL after %.0f s)", proc.pid, kill_grace_s)
        stop_process_tree(token, grace_s=kill_grace_s, leader=proc)
        raise
    finally:
        if log_file:
            log_file.close()
        proc.stdout.close()

    # The leader exited; a rank that detached from it must not outlive the run either.
    stop_process_tree(token, grace_s=kill_grace_s)
    if tree_path is not None:
        Path(tree_path).unlink(missing_ok=True)
    if progress and outcome.total_steps:
        progress.update(outcome.last_step, outcome.total_steps, force=True)
    if table:
        table.refresh(force=True)
    outcome.tail = list(tail)[-10:]
    if outcome.returncode != 0:
        raise ProcessGroupFailed(outcome.returncode, list(tail), log_path)
    return outcome
