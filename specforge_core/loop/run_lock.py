"""One run per output directory.

A run takes ``<output.dir>/RUN.lock`` before it writes anything there and holds it until it ends.
The file names its holder (run id, host, pid, start time). A second run on the same directory
fails naming that holder, or waits for it when ``output.on_busy: wait``. A lock of this host is
stale, and taken over (atomically, so two newcomers cannot both take it), when its process is gone:
no process has its pid, the machine rebooted since (another boot id), or the process that has the
pid now started at another time (the pid was reused: recorded as ticks since boot from
``/proc/<pid>/stat``; a lock without that record is judged by its ``started`` time, which its
holder cannot predate). A lock held from another host is never judged stale from here; the error
names the holder, how to check it, and the command that takes the directory over.

The lock is an ``O_CREAT | O_EXCL`` file, which is atomic on local and NFS v3+ filesystems, and
is taken by rank 0 (or the orchestrator) only. With several ranks, :func:`hold_for_ranks` has the
others wait on the lock file while rank 0 waits for the directory, not in a collective, so a wait
may last longer than the process group's collective timeout.
"""

import json
import os
import shlex
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specforge_core.errors import ConfigError, SpecForgeError

LOCK_NAME = "RUN.lock"


class RunBusyError(SpecForgeError):
    """Another live run holds the output directory."""


@dataclass(frozen=True)
class LockHolder:
    run_id: str
    host: str
    pid: int
    started: float
    boot_id: str | None = None  # this boot of the host (absent in older locks)
    proc_start: int | None = None  # the process's start, clock ticks since boot (absent in older locks)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, since {when})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``, field 22);
    None when that cannot be read (no such process, no ``/proc``)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _process_started_at(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (boot time + its start ticks)."""
    ticks = process_start(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return None if ticks is None else boot + ticks / os.sysconf("SC_CLK_TCK")


def read_holder(lock_path: Path) -> LockHolder | None:
    """The holder recorded in ``lock_path``; None if absent or unreadable (a torn write)."""
    try:
        return LockHolder(**json.loads(lock_path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


_CLOCK_SLACK_S = 2.0  # /proc/stat's boot time is whole seconds; wall clocks drift a little


def _is_stale(holder: LockHolder | None) -> bool:
    if holder is None:
        return True
    if holder.host != socket.gethostname():
        return False
    if holder.boot_id and _boot_id() and holder.boot_id != _boot_id():
        return True
    if not _pid_alive(holder.pid):
        return True
    if holder.proc_start is not None:
        now = process_start(holder.pid)
        return now is not None and now != holder.proc_start
    started = _process_started_at(holder.pid)  # an older lock: its holder wrote it after it started
    return started is not None and started > holder.started + _CLOCK_SLACK_S


def make_output_dir(path: Path) -> list[Path]:
    """Create the run directory ``path`` (and its parents); the directories it created, deepest
    first. ConfigError naming ``output.dir`` and the fix when it, or a folder above it, is an
    existing file."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        return made
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(
            "output.dir is an existing file, not a directory (or lies under one)",
            where=f"output.dir={path}",
            fix="set output.dir to a directory (new or existing), or move that file away",
        ) from None


class RunLock:
    """Context manager holding ``<out_dir>/RUN.lock`` for one run.

    ``wait_s``: None fails at once when the directory is busy; a number waits up to that many
    seconds (polling) before failing. ``clock`` and ``sleep`` measure and spend that wait (tests
    pass their own).
    """

    def __init__(self, out_dir: str | Path, run_id: str | None = None, wait_s: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.holder = LockHolder(
            run_id=run_id or uuid.uuid4().hex[:12], host=socket.gethostname(), pid=os.getpid(), started=time.time(),
            boot_id=_boot_id(), proc_start=process_start(os.getpid()),
        )
        self.wait_s = wait_s
        self.clock, self.sleep = clock, sleep
        self.made_dirs: list[Path] = []  # what acquire created; release removes them if left empty
        self.took_over: LockHolder | None = None

    def _try_create(self) -> bool:
        tmp = self.out_dir / f".{LOCK_NAME}.{self.holder.pid}.{uuid.uuid4().hex[:6]}"
        tmp.write_text(json.dumps(asdict(self.holder)))
        try:
            os.link(tmp, self.path)  # atomic: fails if the lock exists; the content is complete
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _take_over_stale(self, seen: LockHolder | None) -> None:
        """Remove a stale lock, serialised by a short-lived takeover mutex.

        Only the contender holding the mutex re-reads the lock and removes it if it is still the
        stale one it saw; everyone then races on the atomic create again.
        """
        mutex = self.out_dir / f".{LOCK_NAME}.takeover"
        try:
            fd = os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:  # a contender that died mid-takeover leaves the mutex; it is only ever held briefly
                if time.time() - mutex.stat().st_mtime > 30:
                    mutex.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return
        try:
            if read_holder(self.path) == seen:
                self.path.unlink(missing_ok=True)
                self.took_over = seen
        finally:
            os.close(fd)
            mutex.unlink(missing_ok=True)

    def acquire(self) -> "RunLock":
        self.made_dirs = make_output_dir(self.out_dir)
        deadline = None if self.wait_s is None else self.clock() + self.wait_s
        while True:
            if self._try_create():
                return self
            holder = read_holder(self.path)
            if _is_stale(holder):
                self._take_over_stale(holder)
                continue
            if deadline is None or self.clock() >= deadline:
                raise RunBusyError(
                    f"output directory is in use by {holder.describe() if holder else 'another run'}",
                    where=str(self.out_dir),
                    fix=self._busy_fix(holder),
                )
            self.sleep(0.5)

    def _busy_fix(self, holder: LockHolder | None) -> str:
        check = "" if holder is None else (
            f" (check on {holder.host}: ps -o pid,lstart,args -p {holder.pid}; the lock says since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.started))})")
        return ("wait for that run to finish (output.on_busy: wait), or choose another output.dir; if that "
                f"run no longer runs{check}, take the directory over with: rm {shlex.quote(str(self.path))}")

    def release(self) -> None:
        """Remove the lock, and the directories acquire created if the run left them empty (a
        refused run leaves no empty output directory behind)."""
        if read_holder(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
        for d in self.made_dirs:
            try:
                d.rmdir()
            except OSError:  # not empty (the run wrote there) or gone: keep the rest
                break

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def hold_for_ranks(out_dir: str | Path, d, *, on_busy: str, poll_s: float = 0.5,
                   sleep: Callable[[float], None] = time.sleep) -> RunLock | None:
    """Collective: rank 0 takes ``<out_dir>/RUN.lock`` for the run, waiting for a busy directory when
    ``on_busy == "wait"``; returns rank 0's lock (None on the other ranks), or raises rank 0's
    SpecForgeError on every rank.

    Rank 0 tries once and tells the others the outcome. While it then waits for the holder to
    leave, the other ranks poll the lock file until it names rank 0's run: the only collectives
    are two quick broadcasts, so no rank sits in one for the length of the wait.
    """
    from specforge_core.system.distributed import broadcast_object

    lock, outcome = None, None
    if d.is_main:
        lock = RunLock(out_dir)
        try:
            lock.acquire()
            outcome = "held"
        except RunBusyError as e:
            outcome = "waiting" if on_busy == "wait" else e
            if outcome == "waiting":
                print(f"{e.where}: {e.problem}; waiting for it to end (output.on_busy: wait)", flush=True)
        except SpecForgeError as e:
            outcome = e
    outcome, run_id = broadcast_object(d, (outcome, lock.holder.run_id if lock else None))
    if isinstance(outcome, SpecForgeError):
        raise outcome
    if outcome == "waiting":
        if d.is_main:
            lock.wait_s = float("inf")
            lock.acquire()
        else:
            path = Path(out_dir) / LOCK_NAME
            while (holder := read_holder(path)) is None or holder.run_id != run_id:
                sleep(poll_s)
    if lock is not None and lock.took_over is not None:
        print(f"took over the stale lock of {lock.took_over.describe()}", flush=True)
    return lock
