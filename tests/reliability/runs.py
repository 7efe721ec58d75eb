"""Real training runs for the fault tests: configs, launches, the ranks' pids, a run's results.

    config = run_config(workdir, "a", target, world=2, max_steps=6)
    run = Run.start(config, world=2)                 # torchrun (world > 1) or plain python -m
    step = run.wait_step()                           # blocks until rank 0 prints step=i/N
    os.kill(run.rank_pids()[1], signal.SIGKILL)      # one rank dies
    run.wait()                                       # the launcher's exit code

Every launch is the product's own entry point (``python -m specforge_core.train``), optionally
through ``crashpoint.py`` (``crash_on=...``) to die just before a chosen rename. Output lines are
read on a thread, so a test can wait for a line and act while the run goes on.
"""

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

from specforge_core.loop.checkpoint import latest_checkpoint
from specforge_core.loop.metrics import METRICS_FILE

ROOT = Path(__file__).resolve().parents[2]
CRASHPOINT = Path(__file__).with_name("crashpoint.py")
STEP = re.compile(r"^step=(\d+)/(\d+) ")


def run_config(workdir: Path, name: str, target: Path, *, world: int, max_steps: int, save_interval: int = 1,
               **sections) -> Path:
    """A tiny CPU run: 48 chitchat rows (``workdir/chat.jsonl``) for 4 epochs (11 steps each on 2 ranks,
    22 on one) cut at ``max_steps``, a shared cache, run dir ``workdir/name``."""
    cfg = {
        "model": {"target": str(target), "dtype": "float32"},
        "data": {"train_files": [str(workdir / "chat.jsonl")], "max_length": 160, "cache_dir": str(workdir / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 1, "accumulation_steps": 2, "ttt_length": 3, "log_interval": 1,
                     "learning_rate": 1e-3, "max_steps": max_steps, "save_interval": save_interval,
                     "num_epochs": 4},
        "capture": {"device": "cpu"},
        "deployment": {"nproc_per_node": world},
        "output": {"dir": str(workdir / name)},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Run:
    """One launch of the train entry point, its output lines collected on a thread."""

    def __init__(self, proc: subprocess.Popen, world: int):
        self.proc, self.world = proc, world
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, config: Path, *, world: int, crash_on: str | None = None, crash_skip: int = 0,
              crash_rank: int = 0, overrides: tuple[str, ...] = ()) -> "Run":
        """Launch: plain ``python`` for one rank, ``torchrun --standalone`` for more. ``crash_on``:
        through crashpoint.py, armed on rank ``crash_rank`` (see that module)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CRASH_ON"):
            env.pop(var, None)
        entry = ["-m", "specforge_core.train"]
        if crash_on:
            env.update(CRASH_ON=crash_on, CRASH_SKIP=str(crash_skip), CRASH_RANK=str(crash_rank))
            entry = [str(CRASHPOINT), "specforge_core.train"]
        launcher = [sys.executable]
        if world > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
        cmd = [*launcher, *entry, "--config", str(config), *overrides]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        return cls(proc, world)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, pattern: str | re.Pattern, timeout: float = 300) -> re.Match:
        """The first new line matching ``pattern``; AssertionError if the run ends or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{self.output[-3000:]}") from None
            if line is None:
                raise AssertionError(f"the run ended before a line matching {pattern!r}:\n{self.output[-3000:]}")
            if m := re.search(pattern, line):
                return m

    def wait_step(self, timeout: float = 300) -> int:
        return int(self.wait_line(STEP, timeout).group(1))

    def wait(self, timeout: float = 300) -> int:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)  # every line the run printed is in self.lines
        return self.proc.returncode

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the rank processes: the process itself, or torchrun's children."""
        if self.world == 1:
            return {0: self.proc.pid}
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != self.proc.pid:
                    continue
                env = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue  # a process that ended while we looked
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(stat.parent.name)
        return found


def run_to_end(config: Path, *, world: int, timeout: float = 600) -> str:
    run = Run.start(config, world=world)
    code = run.wait(timeout)
    assert code == 0, run.output[-4000:]
    return run.output


def final_weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "draft.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    import json

    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())]


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a run's launcher starts one): its ranks while any is left."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended while we looked
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False
