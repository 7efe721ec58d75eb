"""A private Prefect stack on this machine: `prefect server start` on 127.0.0.1 (SQLite) + a process worker.

    with LocalPrefect(home=Path("/tmp/ph")) as stack:        # server up, telemetry off
        stack.prefect("work-pool", "create", "colocated-pool", "--type", "process")
        stack.deploy()                                        # deployments/prefect.yaml
        stack.start_worker("colocated-pool")
        stack.prefect("deployment", "run", "colocated-train/default", "--watch")
    # everything it started is stopped here

Used by the deployment end-to-end tests and by scripts/ui_screenshot.py; docs/deploy.md gives the
same steps as shell commands. Every process starts in its own session and is stopped with a
process-group SIGTERM (then SIGKILL): a worker started in the background of a non-interactive
shell ignores SIGINT, and forwards SIGTERM to itself as SIGINT (Prefect 3.9's worker), so only
its own session makes it stoppable. The home directory holds the DB, the result storage and the
UI build; nothing is written to ~/.prefect.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tasks.process_group import kill_process_group

PROJECT_DIR = Path(__file__).resolve().parents[1]
PREFECT_YAML = PROJECT_DIR / "deployments" / "prefect.yaml"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """``predicate()``'s first truthy value, polled every ``interval`` s; TimeoutError naming
    ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrefect:
    """Server + workers under ``home``; ``env`` is what every child (and a CLI call) gets."""

    def __init__(self, home: Path, port: int | None = None, worker_poll_s: float = 2.0):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PREFECT_UI_STATIC_DIRECTORY": str(self.home / "ui"),
            "PREFECT_WORKER_QUERY_SECONDS": str(worker_poll_s),
            "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
            "PYTHONUNBUFFERED": "1",
            "PWD": str(PROJECT_DIR),
            # This project's code, even where another checkout is pip-installed in editable mode.
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_DIR), os.environ.get("PYTHONPATH")) if p),
        }
        self.procs: list[tuple[str, subprocess.Popen]] = []

    # ---- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "prefect", *args], cwd=PROJECT_DIR, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((name, proc))
        return proc

    def start_server(self, timeout_s: float = 120.0) -> None:
        proc = self._spawn("server", ["server", "start", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--analytics-off"])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}; see {self.home / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"prefect server not healthy after {timeout_s:.0f} s; see {self.home / 'server.log'}")

    def wait(self) -> None:
        """Block until every process started here has exited (the server runs until stopped)."""
        for _, proc in self.procs:
            proc.wait()

    def start_worker(self, pool: str, name: str = "worker") -> subprocess.Popen:
        return self._spawn(name, ["worker", "start", "--pool", pool, "--name", f"{name}-{self.port}"])

    def prefect(self, *args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run one `prefect` CLI command against this server, from the project root."""
        done = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=PROJECT_DIR,
                              env={**self.env, "COLUMNS": "200"}, capture_output=True, text=True,
                              timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def deploy(self) -> None:
        """`prefect deploy --all` of deployments/prefect.yaml (its work pools, colocated-pool and
        gpu-pool, must exist)."""
        self.prefect("deploy", "--all", "--prefect-file", str(PREFECT_YAML.relative_to(PROJECT_DIR)),
                     "--no-prompt")

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop workers first (so they do not report a vanished server), then the server."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                kill_process_group(proc.pid, grace_s=grace_s, leader=proc)
        self.procs.clear()

    def __enter__(self) -> "LocalPrefect":
        try:
            self.start_server()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

