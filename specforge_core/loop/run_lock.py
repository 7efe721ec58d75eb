"""One run per output directory.

A run takes ``<output.dir>/RUN.lock`` before it writes anything there and holds it until it ends.
The file names its holder (run id, host, pid, start time). A second run on the same directory
fails naming that holder, or waits for it when ``output.on_busy: wait``. A lock left by a process
that no longer exists on this host is stale: it is taken over (atomically, so two newcomers cannot
both take it). A lock held from another host is never judged stale from here; its owner or an
operator removes it (the error says how).

The lock is an ``O_CREAT | O_EXCL`` file, which is atomic on local and NFS v3+ filesystems, and
is taken by rank 0 (or the orchestrator) only.
"""

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from specforge_core.errors import SpecForgeError

LOCK_NAME = "RUN.lock"


class RunBusyError(SpecForgeError):
    """Another live run holds the output directory."""


@dataclass(frozen=True)
class LockHolder:
    run_id: str
    host: str
    pid: int
    started: float

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


def read_holder(lock_path: Path) -> LockHolder | None:
    """The holder recorded in ``lock_path``; None if absent or unreadable (a torn write)."""
    try:
        return LockHolder(**json.loads(lock_path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _is_stale(holder: LockHolder | None) -> bool:
    if holder is None:
        return True
    return holder.host == socket.gethostname() and not _pid_alive(holder.pid)


class RunLock:
    """Context manager holding ``<out_dir>/RUN.lock`` for one run.

    ``wait_s``: None fails at once when the directory is busy; a number waits up to that many
    seconds (polling) before failing.
    """

    def __init__(self, out_dir: str | Path, run_id: str | None = None, wait_s: float | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.holder = LockHolder(
            run_id=run_id or uuid.uuid4().hex[:12], host=socket.gethostname(), pid=os.getpid(), started=time.time()
        )
        self.wait_s = wait_s
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
        self.out_dir.mkdir(parents=True, exist_ok=True)
        deadline = None if self.wait_s is None else time.monotonic() + self.wait_s
        while True:
            if self._try_create():
                return self
            holder = read_holder(self.path)
            if _is_stale(holder):
                self._take_over_stale(holder)
                continue
            if deadline is None or time.monotonic() >= deadline:
                who = holder.describe() if holder else "another run"
                raise RunBusyError(
                    f"output directory is in use by {who}",
                    where=str(self.out_dir),
                    fix=(
                        "wait for that run to finish (output.on_busy: wait), or choose another output.dir; "
                        f"if that run is gone for good on another host, delete {self.path}"
                    ),
                )
            time.sleep(0.5)

    def release(self) -> None:
        if read_holder(self.path) == self.holder:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
