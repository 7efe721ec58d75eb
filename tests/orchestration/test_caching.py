"""tasks/caching.py: stage results cached by content key across flow runs, rebuilt when their file is gone."""

import uuid
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter

from tasks.caching import StageOutput, content_key, run_cached


@task(cache_key_fn=content_key("toy-stage"), persist_result=True)
def toy_stage(out_dir: str, key: str) -> StageOutput:
    """Writes <out_dir>/<key>.txt and counts its own executions in builds.log."""
    with open(Path(out_dir) / "builds.log", "a") as f:
        f.write(key + "\n")
    path = Path(out_dir) / f"{key}.txt"
    path.write_text("built")
    return StageOutput(key=key, path=str(path))


@flow
def toy_flow(out_dir: str, key: str) -> StageOutput:
    return run_cached(toy_stage, out_dir, key=key)


def _task_states(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return [r.state.name for r in sorted(runs, key=lambda r: r.expected_start_time)]


def _builds(out_dir: Path) -> int:
    return len((out_dir / "builds.log").read_text().splitlines())


@pytest.fixture
def key() -> str:
    return uuid.uuid4().hex


def test_second_flow_run_with_the_same_key_is_cached(prefect_api, tmp_path, key):
    toy_flow(str(tmp_path), key)
    state = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(state.state_details.flow_run_id) == ["Cached"]
    assert _builds(tmp_path) == 1


def test_a_different_content_key_executes(prefect_api, tmp_path, key):
    toy_flow(str(tmp_path), key)
    toy_flow(str(tmp_path), key + "-changed")
    assert _builds(tmp_path) == 2


def test_the_key_is_the_content_key_not_the_path(prefect_api, tmp_path, key):
    """Another output directory (another path string) with the same content key is a cache hit."""
    first = toy_flow(str(tmp_path), key)
    (tmp_path / "other").mkdir()
    again = toy_flow(str(tmp_path / "other"), key)
    assert again == first
    assert not (tmp_path / "other" / "builds.log").exists()


def test_a_cached_result_whose_file_is_gone_is_rebuilt(prefect_api, tmp_path, key):
    out = toy_flow(str(tmp_path), key)
    Path(out.path).unlink()
    state = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(state.state_details.flow_run_id) == ["Cached", "Completed"]
    assert Path(out.path).read_text() == "built"
    third = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(third.state_details.flow_run_id) == ["Cached"]
    assert _builds(tmp_path) == 2



@task(cache_key_fn=content_key("toy-located", location=lambda p: p["out_dir"]), persist_result=True)
def located_stage(out_dir: str, key: str) -> StageOutput:
    return toy_stage.fn(out_dir, key)


@flow
def located_flow(out_dir: str, key: str) -> StageOutput:
    return run_cached(located_stage, out_dir, key=key)


def test_the_same_content_in_another_location_is_another_entry(prefect_api, tmp_path, key):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = located_flow(str(tmp_path / "a"), key)
    b = located_flow(str(tmp_path / "b"), key)
    assert Path(a.path).parent == tmp_path / "a" and Path(b.path).parent == tmp_path / "b"
    assert located_flow(str(tmp_path / "a"), key) == a
