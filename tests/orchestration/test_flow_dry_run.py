"""colocated-train with ``dry_run=True``: the data stages, then the dry run of what they recorded; no training."""

from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter

from flows.colocated_train import colocated_train
from specforge_core.config import RunConfig
from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.data.tokenize import load_tokenizer
from specforge_core.errors import ConfigError
from specforge_core.run.plan import PromptPlan
from specforge_core.run.topology import Topology
from tests.orchestration.conftest import tiny_config
from tests.orchestration.test_flow import _task_states


@pytest.fixture(scope="module")
def profile(tmp_path_factory, tiny_target_dir) -> dict:
    return tiny_config(tmp_path_factory.mktemp("flow-dry-run"), tiny_target_dir)


@pytest.fixture(scope="module")
def dry(prefect_api, profile):
    state = colocated_train(RunConfig.model_validate(profile), dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    return state.state_details.flow_run_id, state.result()


def test_the_data_stages_run_and_the_dry_run_replaces_train_and_validate(dry, profile):
    flow_run_id, _ = dry
    assert list(_task_states(flow_run_id, runs=4)) == ["prepare_prompt_cache", "build_vocab_map", "record_plan",
                                                       "dry_run"]
    assert not Path(profile["output"]["dir"]).exists()  # no run directory: nothing was launched


def test_the_report_is_the_recorded_plan_over_the_prompt_caches_rows(dry, profile):
    _, report = dry
    cfg = RunConfig.model_validate(profile)
    rows = len(ensure_prompt_cache(cfg, load_tokenizer(cfg)).rows("train"))  # the cache the flow built
    assert report["dataset"]["rows"] == rows
    assert report["plan"]["key"] == PromptPlan.from_config(cfg, rows, topology=Topology.from_config(cfg)).key
    assert report["tokens_per_micro_step_per_rank"]["basis"] == "plan and row lengths"
    assert report["topology"]["world_size"] == cfg.deployment.world_size


def test_the_layout_is_published_as_an_artifact(dry):
    flow_run_id, _ = dry
    with get_client(sync_client=True) as c:
        [found] = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["dry-run"])),
                                   flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    assert "islands" in found.data and "memory per GPU" in found.data


def test_a_broken_layout_fails_the_flow_run_naming_the_field(prefect_api, profile):
    broken = {**profile, "data": {**profile["data"], "max_length": 2000}}  # + ttt_length past the tiny context
    state = colocated_train(RunConfig.model_validate(broken), dry_run=True, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert "data.max_length" in str(error) and "max_position_embeddings" in str(error)


def test_a_family_rule_fails_the_flow_run_before_any_task(prefect_api, profile):
    """Prefect's parameter validation (what a deployment's run gets from the form) runs RunConfig's
    own rules only; the flow's first statement runs the family's (drafts.check_config)."""
    broken = {**profile, "draft": {**profile.get("draft", {}), "family": "dspark", "dspark": {"markov_rank": 0}}}
    state = colocated_train(broken, dry_run=True, return_state=True)  # the JSON a deployment's run carries
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigError) and error.where == "draft.dspark.confidence_head_with_markov"
    assert _task_states(state.state_details.flow_run_id, runs=0) == {}
