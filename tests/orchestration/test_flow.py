"""The colocated-train flow in-process on the test API, tiny profile: stages, caching, report, promotion."""

import json
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter

from flows.colocated_train import colocated_train
from specforge_core.config import RunConfig
from tests.orchestration.conftest import recorded_task_runs, states_by_stage, tiny_config

STAGES = ["prepare_prompt_cache", "build_vocab_map", "record_plan", "train", "validate"]


def _run(config: dict):
    state = colocated_train(RunConfig.model_validate(config), return_state=True)
    assert state.is_completed(), state.message
    return state.state_details.flow_run_id, state.result()


def _task_states(flow_run_id, runs: int = len(STAGES)) -> dict[str, list[str]]:
    return states_by_stage(recorded_task_runs(flow_run_id, runs))


def _artifact(key: str, flow_run_id):
    with get_client(sync_client=True) as c:
        [found] = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                   flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return found


@pytest.fixture(scope="module")
def profile(tmp_path_factory, tiny_target_dir) -> dict:
    return tiny_config(tmp_path_factory.mktemp("flow-tiny"), tiny_target_dir)


@pytest.fixture(scope="module")
def first(prefect_api, profile):
    """The first run of the profile: every stage executes."""
    return _run(profile)


def test_the_five_stages_run_in_order_and_complete(first):
    flow_run_id, _ = first
    states = _task_states(flow_run_id)
    assert list(states) == STAGES
    assert all(s == ["Completed"] for s in states.values()), states


def test_the_report_links_the_plot_saved_beside_it(first):
    _, result = first
    report, plot = Path(result["report"]), Path(result["plot"])
    assert plot.parent == report.parent and plot.suffix == ".png" and plot.stat().st_size > 10_000
    assert f"]({plot.name})" in report.read_text()


def test_the_report_is_a_markdown_artifact_with_the_acceptance_lengths(first):
    flow_run_id, result = first
    markdown = _artifact("validation-report", flow_run_id).data
    # both measured figures (before and after training) are in the artifact, and they are the
    # evaluator's own numbers (its per-position acceptance is in the same table row)
    for key in ("acceptance_length", "acceptance_length_before"):
        assert f"**{result[key]:.3f}**" in markdown, key
    assert result["acceptance_length"] == result["measured"]["acceptance_length"]
    per_position = ", ".join(f"{p:.2f}" for p in result["measured"]["per_position_acceptance"] if p is not None)
    assert per_position in markdown


def test_the_draft_is_exported_for_serving(first):
    _, result = first
    assert (Path(result["draft_dir"]) / "config.json").is_file()


def test_training_keeps_progress_and_metrics_artifacts(first):
    flow_run_id, _ = first
    assert float(_artifact("training-progress", flow_run_id).data) == 100.0
    rows = json.loads(_artifact("training-metrics", flow_run_id).data)
    assert rows and "loss" in rows[0]


def test_later_runs_reuse_the_data_stages_and_promote_only_a_better_draft(first, profile, tmp_path):
    """Scheduled retraining of the same data: stages Cached, a new run directory, warm start from the
    promoted draft, promotion gated by the margin on a benchmark's acceptance length (promote_on)."""
    promoted = tmp_path / "promoted"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "turns": ["hello, what is the capital of France?", "and why?"]}) + "\n")
    config = json.loads(json.dumps(profile))
    config["draft"]["init_from"] = str(promoted)
    config["validation"].update(promoted_dir=str(promoted), promote_margin=100.0, benchmarks=[str(prompts)],
                                settings=[{"steps": 2, "topk": 1, "draft_tokens": 3}], promote_on=str(prompts))

    first_id, first_result = _run(config)
    states = _task_states(first_id)
    assert [states[s] for s in STAGES[:3]] == [["Cached"]] * 3
    assert first_result["run_dir"] != first[1]["run_dir"]
    assert first_result["promotion"]["promote"]  # nothing promoted yet: cold start, promoted
    assert (promoted / "promotion.json").is_file()

    assert first_result["benchmarks_promoted"] is None  # nothing to compare with yet

    second_id, second_result = _run(config)
    assert not second_result["promotion"]["promote"]  # warm start, but not 100 tokens better
    decision = _artifact("promotion-decision", second_id).data
    assert "kept the promoted draft" in decision and f"| | measured acceptance length on {prompts} at 2,1,3 |" in decision
    row = second_result["benchmarks"][str(prompts)]["settings"][0]
    assert second_result["promotion"]["new"] == row["acceptance_length"]
    assert second_result["promotion"]["promoted"] == \
        second_result["benchmarks_promoted"][str(prompts)]["settings"][0]["acceptance_length"]
    assert f"| {prompts} | 2, 1, 3 | **{row['acceptance_length']:.3f}** |" in _artifact("validation-report", second_id).data
    assert json.loads((promoted / "promotion.json").read_text())["run_dir"] == first_result["run_dir"]
