"""The cached data stages (tasks/prepare.py) under the real engine, keyed by the data stage's content keys."""

import json
import shutil
from pathlib import Path

import pytest
from prefect import flow

from specforge_core.config import RunConfig
from specforge_core.run.plan import PromptPlan
from tasks.caching import run_cached
from tasks.data_stages import build_vocab_map, plan_key, prepare_prompt_cache, record_plan, stage_keys
from tests.orchestration.conftest import recorded_task_runs, states_by_stage, tiny_config


@flow
def data_stages(config: RunConfig) -> dict:
    """The first three stages of colocated-train, composed exactly as the flow composes them."""
    keys = stage_keys(config)
    cache = run_cached(prepare_prompt_cache, config, key=keys.prompt_cache)
    vocab = run_cached(build_vocab_map, config, cache, keys.target_vocab_size, key=keys.vocab_map)
    plan = run_cached(record_plan, config, cache, key=plan_key(config, cache))
    return {"cache": cache, "vocab": vocab, "plan": plan}


def _run(config: dict, runs: int = 3) -> tuple[dict, dict[str, list[str]]]:
    """The flow's result and its ``runs`` task runs' states by stage (a rebuilt stage runs twice)."""
    state = data_stages(RunConfig.model_validate(config), return_state=True)
    assert state.is_completed(), state.message
    return state.result(), states_by_stage(recorded_task_runs(state.state_details.flow_run_id, runs))


@pytest.fixture
def config(tmp_path, tiny_target_dir) -> dict:
    return tiny_config(tmp_path, tiny_target_dir, conversations=120)


def test_a_first_run_builds_every_stage(prefect_api, config):
    out, states = _run(config)
    assert states == {"prepare_prompt_cache": ["Completed"], "build_vocab_map": ["Completed"],
                      "record_plan": ["Completed"]}
    assert Path(out["cache"].path).is_dir() and Path(out["vocab"].path).is_file()
    assert PromptPlan.load(out["plan"].path).dataset_size == out["cache"].facts["train_rows"]


def test_the_stage_keys_are_the_data_stage_content_keys(prefect_api, config):
    out, _ = _run(config)
    assert Path(out["cache"].path).name == out["cache"].key
    assert Path(out["vocab"].path).stem == out["vocab"].key


def test_an_unchanged_second_run_is_cached_throughout(prefect_api, config):
    first, _ = _run(config)
    second, states = _run(config)
    assert states == {name: ["Cached"] for name in states} and len(states) == 3
    assert second == first


def test_changed_conversations_rebuild_only_the_stages_whose_keys_changed(prefect_api, config):
    _run(config)
    data = Path(config["data"]["train_files"][0])
    rows = data.read_text().splitlines()
    row = json.loads(rows[0])
    row["conversations"][1]["content"] = "A different answer entirely."
    rows[0] = json.dumps(row)  # same number of rows: same plan
    data.write_text("\n".join(rows) + "\n")
    _, states = _run(config)
    assert states == {"prepare_prompt_cache": ["Completed"], "build_vocab_map": ["Completed"],
                      "record_plan": ["Cached"]}


def test_a_new_layout_changes_only_the_plan(prefect_api, config):
    _run(config)
    config["training"]["batch_size"] = 1
    _, states = _run(config)
    assert states == {"prepare_prompt_cache": ["Cached"], "build_vocab_map": ["Cached"],
                      "record_plan": ["Completed"]}


def test_a_deleted_prompt_cache_is_rebuilt_under_the_same_key(prefect_api, config):
    first, _ = _run(config)
    shutil.rmtree(first["cache"].path)
    second, states = _run(config, runs=4)
    assert states["prepare_prompt_cache"] == ["Cached", "Completed"]
    assert second["cache"].path == first["cache"].path and Path(first["cache"].path).is_dir()
