"""Orchestration fixtures: one Prefect test API for the session, process-tree helpers."""

import json
import os
from pathlib import Path

import pytest

from flows.local_stack import wait_for  # noqa: F401  (the tests import it from here)


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API server (subprocess, temporary SQLite) for the whole session; its URL.

    Result storage lives under the suite's temporary PREFECT_HOME (tests/conftest.py), so no dev
    cache leaks in. Started once: a per-test harness costs ~10 s each.
    """
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield PREFECT_API_URL.value()


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
