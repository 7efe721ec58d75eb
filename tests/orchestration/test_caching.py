"""tasks/caching.py: stage results cached by content key across flow runs, rebuilt when their file is gone."""

import json
import uuid
from pathlib import Path

import cloudpickle
import pytest
from prefect import flow, task

from tasks.caching import StageOutput, run_cached, stage_cache
from tests.orchestration.conftest import recorded_task_runs


@task(**stage_cache("toy-stage"))
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


def _task_states(flow_run_id, runs: int) -> list[str]:
    return [r.state.name for r in recorded_task_runs(flow_run_id, runs)]


def _builds(out_dir: Path) -> int:
    return len((out_dir / "builds.log").read_text().splitlines())


@pytest.fixture
def key() -> str:
    return uuid.uuid4().hex


def test_second_flow_run_with_the_same_key_is_cached(prefect_api, tmp_path, key):
    toy_flow(str(tmp_path), key)
    state = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(state.state_details.flow_run_id, 1) == ["Cached"]
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
    assert _task_states(state.state_details.flow_run_id, 2) == ["Cached", "Completed"]
    assert Path(out.path).read_text() == "built"
    third = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(third.state_details.flow_run_id, 1) == ["Cached"]
    assert _builds(tmp_path) == 2



@task(**stage_cache("toy-located", location=lambda p: p["out_dir"]))
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


def _storage() -> Path:
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH

    return Path(PREFECT_RESULTS_LOCAL_STORAGE_PATH.value())


def test_a_cached_stage_result_is_stored_as_json(prefect_api, tmp_path, key):
    out = toy_flow(str(tmp_path), key)
    metadata = json.loads((_storage() / "stage-records" / f"toy-stage-{key}").read_text())
    assert metadata["serializer"]["type"] == "json"
    result = json.loads((_storage() / metadata["storage_key"]).read_text())
    assert result == {"__class__": "tasks.caching.StageOutput",
                      "data": {"key": key, "path": out.path, "marker": None, "facts": {}}}


def _plant(record: Path, serializer: dict, result: bytes) -> None:
    """A record as Prefect would find it under the cache key: its metadata, and the result it names."""
    record.parent.mkdir(parents=True, exist_ok=True)
    (record.parent / "planted-result").write_bytes(result)
    record.write_text(json.dumps({"storage_key": str(record.parent / "planted-result"), "expiration": None,
                                  "serializer": serializer, "prefect_version": "3.9.1", "storage_block_id": None}))


class _Payload:
    """Unpickling it touches ``path``."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("serializer", [
    {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None},
    {"type": "json", "jsonlib": "json", "object_encoder": "prefect.serializers.prefect_json_object_encoder",
     "object_decoder": "pickle.loads", "dumps_kwargs": {}, "loads_kwargs": {}},
], ids=["pickle", "json-with-another-decoder"])
def test_a_planted_record_under_the_cache_key_is_never_decoded(prefect_api, tmp_path, key, serializer):
    """A record that does not name Prefect's plain JSON serializer (an older version's pickle, or
    planted) is a cache miss: the stage runs again and replaces it with JSON; nothing is decoded."""
    import base64

    record = _storage() / "stage-records" / f"toy-stage-{key}"
    pickled = cloudpickle.dumps(_Payload(tmp_path / "UNPICKLED"))
    _plant(record, serializer, base64.b64encode(pickled) if serializer["type"] == "pickle" else pickled)
    state = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(state.state_details.flow_run_id, 1) == ["Completed"]
    assert not (tmp_path / "UNPICKLED").exists()
    assert json.loads(record.read_text())["serializer"]["type"] == "json"
    again = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(again.state_details.flow_run_id, 1) == ["Cached"]
    assert _builds(tmp_path) == 1


def test_a_record_whose_result_lies_outside_the_result_storage_is_not_read(prefect_api, tmp_path, key):
    """A record naming Prefect's JSON serializer and a well-formed result, but one kept elsewhere."""
    from prefect.serializers import JSONSerializer

    outside = tmp_path / "result.json"
    outside.write_text(json.dumps({"__class__": "tasks.caching.StageOutput",
                                   "data": {"key": key, "path": str(tmp_path / "elsewhere")}}))
    record = _storage() / "stage-records" / f"toy-stage-{key}"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"storage_key": str(outside), "expiration": None,
                                  "serializer": json.loads(JSONSerializer().model_dump_json()),
                                  "prefect_version": "3.9.1", "storage_block_id": None}))
    state = toy_flow(str(tmp_path), key, return_state=True)
    assert _task_states(state.state_details.flow_run_id, 1) == ["Completed"]
    assert state.result().path == str(tmp_path / f"{key}.txt")


@pytest.mark.parametrize("result", [
    {"__class__": "os.system", "data": "touch x"},
    {"__class__": "tasks.caching.StageOutput", "data": {"key": "k", "path": "p",
                                                        "facts": {"x": {"__exc_type__": "SystemExit", "message": "1"}}}},
    {"__class__": "tasks.caching.StageOutput", "data": {"key": "k", "path": "p", "extra": 1}},
])
def test_a_json_result_that_is_not_a_plain_stage_output_is_not_read(result):
    from tasks.caching import check_stage_result

    with pytest.raises(ValueError, match="not a plain StageOutput record"):
        check_stage_result(json.dumps(result).encode(), "storage/x")
