"""Orchestration fixtures: one Prefect test API for the session, process-tree helpers."""

import json
import os
import time
from pathlib import Path

import pytest

from flows.local_stack import wait_for  # noqa: F401  (the tests import it from here)


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API server (subprocess, temporary SQLite) for the whole session; its URL.

    Result storage lives under the suite's temporary PREFECT_HOME (tests/conftest.py), so no dev
    cache leaks in. Started once: a per-test harness costs ~10 s each.

    Flow-run heartbeats are off for the flows the tests run in this process: at its end a flow run
    joins its heartbeat thread, which sleeps in whole seconds, so each run waited up to 1 s for it
    (most of a cached run's time), and no test reads a heartbeat. That wait also hid that the API
    records task runs after their flow run has ended: read them with ``recorded_task_runs``.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield PREFECT_API_URL.value()


def recorded_task_runs(flow_run_id, runs: int, timeout: float = 30) -> list:
    """The flow run's task runs, oldest first, once the API holds ``runs`` of them, each in a final state.

    The API records a task run from the events its flow run sent, a moment after the run has ended:
    what this process still holds of them is sent first, then the API is polled. Once ``runs`` are
    there the API is read once more after a pause, and that reading is returned: a task run the
    API records late (one too many, or any where ``runs`` is 0) is then in the list the caller
    checks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()

    def read() -> list:
        with get_client(sync_client=True) as c:
            found = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        return sorted(found, key=lambda r: r.expected_start_time)

    def recorded() -> bool:
        found = read()
        return len(found) >= runs and all(r.state is not None and r.state.is_final() for r in found)

    wait_for(recorded, timeout, f"{runs} task runs of flow run {flow_run_id}, each in a final state")
    time.sleep(0.5)
    return read()


def states_by_stage(runs) -> dict[str, list[str]]:
    """Stage name → the states of its task runs, in the order of ``runs`` (a rebuilt stage, or a
    retried flow run, has two): a task run is named ``<stage>-<suffix>``."""
    out: dict[str, list[str]] = {}
    for r in runs:
        out.setdefault(r.name.rsplit("-", 1)[0], []).append(r.state.name)
    return out


def alive(pid: int) -> bool:
    """True if ``pid`` runs. A zombie counts as dead: on this machine PID 1 does not reap orphans,
    so a killed, re-parented rank stays in the table as ``Z`` although it is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def read_pids(path: Path) -> list[int] | None:
    """All pids the fake launcher recorded (launcher first), or None before it wrote them."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return [record["launcher"], *record["ranks"]]


REPO = Path(__file__).resolve().parents[2]


def tiny_config(root: Path, target: Path, *, conversations: int = 400, **sections: dict) -> dict:
    """examples/tiny-cpu.yaml as the flow parameter's JSON, with data, caches and runs under ``root``.

    ``sections`` update single fields, e.g. ``training={"max_steps": 40}``."""
    import yaml

    from fixtures.chitchat import write_chitchat_jsonl

    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    data = root / "chitchat.jsonl"
    if not data.exists():
        write_chitchat_jsonl(data, conversations)
    cfg["model"]["target"] = str(target)
    cfg["data"].update(train_files=[str(data)], cache_dir=str(root / "cache"))
    cfg["output"]["dir"] = str(root / "runs")
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg
