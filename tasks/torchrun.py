"""Run a multi-process launcher (torchrun) inside a Prefect task, and never leave its ranks behind.

    from tasks.torchrun import run_process_group
    outcome = run_process_group(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "specforge_core.train", ...],
        metrics_path=run_dir / "metrics.jsonl", log_path=run_dir / "train.log",
        pgid_path=run_dir / "train.pgid")

What it guarantees, in order of importance:

* **No orphaned ranks.** The command starts in its own session (so its process group is ours to
  kill, and a process worker's ``killpg`` of the flow-run group does not race with it). On ANY
  exception while it runs (Prefect's ``TerminationSignal`` on cancel or SIGTERM, ``KeyboardInterrupt``,
  an error of ours), the whole group gets SIGTERM, then SIGKILL after ``kill_grace_s`` for members
  that are still there, and the exception is re-raised.
* **Every line is kept, the API is not flooded.** Merged stdout/stderr go line by line to
  ``log_path`` (full) and to the Prefect run logger through a token bucket; suppressed lines are
  counted in the next logged line. On failure the last lines are in the exception message.
* **Progress and metrics stay current.** ``step=i/N`` lines update one progress artifact
  (optimizer steps done / total); ``metrics.jsonl`` is re-read into a table artifact at most every
  ``metrics_refresh_s`` and once at the end.

``pgid_path`` records the group id and the leader's start time, so a later
``python -m flows.recover`` can kill a group whose flow-run process was SIGKILLed (the one case no
``except`` can see).
"""

import json
import logging
import math
import os
import re
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

STEP_LINE = re.compile(r"\bstep=(\d+)/(\d+)\b")


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
# Killing a process group


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

    SIGTERM first because torchrun forwards it to its ranks and they may flush a log line; the
    SIGKILL sweep covers ranks stuck in a collective. ``leader`` (our Popen) is reaped as we go so
    it does not linger as a zombie of this process.
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


def write_pgid_record(path: Path, pid: int) -> None:
    """Record ``pid``'s group and start time, so a recovery tool kills only this very group."""
    record = {"pgid": os.getpgid(pid), "pid": pid, "create_time": psutil.Process(pid).create_time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def kill_recorded_group(path: Path, *, grace_s: float = 15.0) -> int:
    """Kill the group recorded by ``write_pgid_record`` if its leader is still the same process.

    Returns the number of processes that were alive in the group (0: nothing to do). A leader
    whose start time differs is a reused pid: left alone.
    """
    if not path.is_file():
        return 0
    record = json.loads(path.read_text())
    members = group_members(record["pgid"])
    if not members:
        return 0
    try:
        same = abs(psutil.Process(record["pid"]).create_time() - record["create_time"]) < 1e-3
    except psutil.NoSuchProcess:
        # The leader is gone but ranks of its group survive: they are ours (a session id is not
        # reused while any member of it lives).
        same = True
    if not same:
        return 0
    kill_process_group(record["pgid"], grace_s=grace_s)
    return len(members)


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


def _cell(v):
    if isinstance(v, float):
        return float(f"{v:.5g}") if math.isfinite(v) else None
    return v if isinstance(v, (int, str, bool)) or v is None else json.dumps(v)


def metrics_rows(path: Path, max_rows: int = 200) -> list[dict]:
    """The newest ``max_rows`` lines of a metrics.jsonl as rows with one column set (a torn last
    line, written while we read, is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    rows = rows[-max_rows:]
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return [{c: _cell(row.get(c)) for c in columns} for row in rows]


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


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tasks.torchrun")


# ---------------------------------------------------------------------------------------------
# The runner


def run_process_group(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    log_path: Path | None = None,
    pgid_path: Path | None = None,
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

    logger.info("running: %s", " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        cwd=cwd,
        env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        if pgid_path is not None:
            write_pgid_record(Path(pgid_path), proc.pid)
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            outcome.lines += 1
            tail.append(line)
            if log_file:
                log_file.write(line + "\n")
            if line.strip() and budget.take():
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
        logger.warning("stopping process group %d (SIGTERM, SIGKILL after %.0f s)", proc.pid, kill_grace_s)
        kill_process_group(proc.pid, grace_s=kill_grace_s, leader=proc)
        raise
    finally:
        if log_file:
            log_file.close()
        proc.stdout.close()

    # The leader exited; a rank that detached from it must not outlive the run either.
    if group_members(proc.pid):
        kill_process_group(proc.pid, grace_s=kill_grace_s)
    if pgid_path is not None:
        Path(pgid_path).unlink(missing_ok=True)
    if progress and outcome.total_steps:
        progress.update(outcome.last_step, outcome.total_steps, force=True)
    if table:
        table.refresh(force=True)
    outcome.tail = list(tail)[-10:]
    if outcome.returncode != 0:
        raise ProcessGroupFailed(outcome.returncode, list(tail), log_path)
    return outcome
