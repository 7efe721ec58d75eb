"""Files that are either whole or absent: atomic writes, fsync, staged directories, sha256.

    atomic_write_text(run / "plan.json", text)                 # temp file beside it, then rename
    atomic_write_json(path, record, durable=True)              # + fsync of the file and its directory
    with staged_directory(final) as tmp: write(tmp / "a")      # tmp renamed to final on success
    sha256_file(path)

Every writer in the library goes through these, so a crash at any instant leaves the old file or
the new one, never a torn one: the bytes go to a dot-named temporary file in the same directory
(the same filesystem, so the rename is atomic), and ``os.replace`` puts it in place. ``durable``
also fsyncs the file before the rename and the directory after it, so the new file survives a
power cut, not just a process crash (checkpoints, caches, manifests).
"""

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 1 << 22


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; caches and runs are shared by ranks and users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, *, durable: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: str | Path, obj: Any, *, durable: bool = False, indent: int | None = 2,
                      sort_keys: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n", durable=durable)


def write_durably(path: str | Path, text: str) -> None:
    """Write ``text`` in place and fsync it (inside a directory that is renamed into place later)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def staged_directory(final: str | Path, *, replace: bool = False, durable: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``final``; on success rename it to ``final``.

    ``replace``: an existing ``final`` is swapped out (renamed aside, then deleted) instead of
    being an error. On an exception the temporary directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    stage.chmod(0o755)  # mkdtemp makes it private; the directory is shared by ranks and users
    try:
        yield stage
        if durable:
            for p in stage.rglob("*"):
                if p.is_file():
                    fsync_file(p)
            fsync_dir(stage)
        if final.exists():
            if not replace:
                raise FileExistsError(f"{final} exists")
            aside = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, aside)
            os.rename(stage, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(stage, final)
        if durable:
            fsync_dir(final.parent)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
