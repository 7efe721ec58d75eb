"""tasks/torchrun.py under the real Prefect engine, with a real launcher → 2-rank process tree."""

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, LogFilter
from prefect.logging.handlers import APILogWorker
from tqdm import tqdm

from tasks.process_group import (TREE_TOKEN_ENV, LineBudget, ProcessGroupFailed, kill_recorded_tree, shown_in_run_log,
                                 stop_process_tree)
from tests.orchestration.conftest import alive, read_pids, wait_for
from tests.orchestration.fixtures.launcher_flow import FAKE_LAUNCHER, launcher_flow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_stray_children():
    """Every test here must leave no child process of pytest behind."""
    import psutil

    # The Prefect server, its uvicorn, multiprocessing's resource tracker and fork server (one each per
    # pytest process, started by whichever earlier test first used a semaphore or started gloo ranks:
    # tests/runtime/harness.py) live as long as the session.
    session_helpers = ("prefect", "uvicorn", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
                 and not any(h in " ".join(p.cmdline()) for h in session_helpers)]
    assert not leftovers, f"processes left behind: {[p.cmdline() for p in leftovers]}"


def _logs(flow_run_id) -> list[str]:
    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as c:
        return [log.message for log in c.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]}))]


def _artifacts(key: str, flow_run_id) -> list:
    with get_client(sync_client=True) as c:
        return c.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}),
        )


def _flow_run_state(workdir: Path):
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs()
    [run] = [r for r in runs if r.parameters.get("workdir") == str(workdir)]
    return run.state


def _start_flow_process(api_url: str, workdir: Path, *extra: str) -> subprocess.Popen:
    """The flow as its own process group, as a process worker starts a flow run."""
    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.orchestration.fixtures.launcher_flow", str(workdir), *extra],
        cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def test_step_lines_stream_into_the_flow_run_logs(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=4, return_state=True)
    messages = _logs(state.state_details.flow_run_id)
    assert [m for m in messages if m.startswith("step=")] == [
        f"step={i}/4 loss={5.0 / i:.4f} acc_0={1 - 1 / i:.3f}" for i in range(1, 5)
    ]


def test_progress_artifact_counts_optimizer_steps(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=5, return_state=True)
    [progress] = _artifacts("training-progress", state.state_details.flow_run_id)
    assert progress.type == "progress"
    assert float(progress.data) == 100.0
    assert progress.description == "5/5 optimizer steps"


def test_one_metrics_table_is_kept_current_with_metrics_jsonl(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=3, return_state=True)
    [table] = _artifacts("training-metrics", state.state_details.flow_run_id)
    assert table.type == "table"
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert set(rows[0]) == {"step", "loss", "acc_0"}


def test_nonzero_exit_fails_the_task_with_the_last_lines(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=2, exit_code=3, return_state=True)
    assert state.is_failed()
    err = state.result(raise_on_failure=False)
    assert isinstance(err, ProcessGroupFailed) and err.returncode == 3
    assert "rank 1 failed (injected)" in str(err)
    assert str(tmp_path / "launcher.log") in str(err)


def test_rate_limit_holds_lines_back_but_the_log_file_keeps_all(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=5, noise=9, burst=12, return_state=True)
    shown = [m for m in _logs(state.state_details.flow_run_id) if m.startswith(("step=", "noise"))]
    assert len(shown) == 12
    assert any(m.startswith("(38 lines not shown here") for m in _logs(state.state_details.flow_run_id))
    assert len((tmp_path / "launcher.log").read_text().splitlines()) == 50


def test_run_logs_get_each_rank_start_step_and_checkpoint_line_but_no_progress_bar(prefect_api, tmp_path):
    state = launcher_flow(str(tmp_path), steps=2, loading_bars=True, return_state=True)
    messages = _logs(state.state_details.flow_run_id)
    assert [m for m in messages if m.startswith(("rank ", "step=", "checkpoint "))] == [
        "rank 0/2 started", "rank 1/2 started", "step=1/2 loss=5.0000 acc_0=0.000",
        "step=2/2 loss=2.5000 acc_0=0.500", "checkpoint step-00000002 saved"]
    assert not [m for m in messages if "Loading weights" in m]
    assert (tmp_path / "launcher.log").read_text().count("Loading weights:   0%") == 2  # each bar is kept


def test_the_run_log_filter_drops_tqdm_frames_and_keeps_the_trainers_lines():
    frames = io.StringIO()
    for _ in tqdm(range(75), desc="Loading weights", file=frames, mininterval=0):
        pass
    for _ in tqdm(iter(range(12)), desc="Writing model shards", file=frames, mininterval=0):  # no total
        pass
    frames = [f for f in re.split(r"[\r\n]", frames.getvalue()) if f.strip()]
    assert len(frames) > 4 and not [f for f in frames if shown_in_run_log(f)]
    assert all(map(shown_in_run_log, [
        "rank 1/2 started on cpu: target and draft built in 9.9 s",
        "step=40/80 loss=5.7496 acc_0=0.317 samples/s=1.78 simulated_len=1.398 lr=2.81e-04 capture=60%",
        "checkpoint step-00000040 saved", "resumed from runs/x/checkpoints/step-00000010 at step 10/80",
        "RuntimeError: rank 1 failed: 100% of the 16/16 GiB in use",
    ]))
    assert not shown_in_run_log("   ")


def test_sigterm_of_the_flow_run_process_leaves_no_rank_alive(prefect_api, tmp_path):
    """What a process worker does on `prefect flow-run cancel`: SIGTERM to the flow-run's group."""
    proc = _start_flow_process(prefect_api, tmp_path)
    pids = wait_for(lambda: read_pids(tmp_path / "pids.json"), 60, "the launcher and its 2 ranks")
    assert all(alive(p) for p in pids)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    wait_for(lambda: not any(alive(p) for p in pids), 20, "every launcher/rank pid to be gone")
    assert _flow_run_state(tmp_path).is_crashed()


def test_sigkilled_flow_leaves_ranks_that_the_recorded_tree_kill_removes(prefect_api, tmp_path):
    proc = _start_flow_process(prefect_api, tmp_path)
    pids = wait_for(lambda: read_pids(tmp_path / "pids.json"), 60, "the launcher and its 2 ranks")
    os.kill(proc.pid, signal.SIGKILL)  # no except clause runs: the ranks are orphaned
    proc.wait(10)
    ranks = pids[1:]  # (the launcher itself may die of the broken pipe to its dead reader)
    assert all(alive(p) for p in ranks)
    assert kill_recorded_tree(tmp_path / "launcher.tree", grace_s=5) >= len(ranks)
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the orphaned ranks to be gone")


def test_ranks_that_ignore_sigterm_are_sigkilled_after_the_grace(tmp_path):
    pids_file = tmp_path / "pids.json"
    leader = subprocess.Popen(
        [sys.executable, str(FAKE_LAUNCHER), "--steps", "0", "--step-seconds", "0.1", "--stubborn",
         "--pids", str(pids_file)], start_new_session=True, stdout=subprocess.DEVNULL,
        env={**os.environ, TREE_TOKEN_ENV: "stubborn-test"},
    )
    pids = wait_for(lambda: read_pids(pids_file), 30, "the launcher and its 2 ranks")
    assert stop_process_tree("stubborn-test", grace_s=1.0, leader=leader) == 3
    wait_for(lambda: not any(alive(p) for p in pids), 5, "the stubborn ranks to be gone")


def test_a_paused_tree_handles_its_sigterm_instead_of_waiting_out_the_grace(tmp_path):
    pids_file = tmp_path / "pids.json"
    leader = subprocess.Popen(
        [sys.executable, str(FAKE_LAUNCHER), "--steps", "0", "--pids", str(pids_file)],
        start_new_session=True, stdout=subprocess.DEVNULL, env={**os.environ, TREE_TOKEN_ENV: "paused-test"},
    )
    pids = wait_for(lambda: read_pids(pids_file), 30, "the launcher and its 2 ranks")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    assert stop_process_tree("paused-test", grace_s=600.0, leader=leader) == 3
    # 143: the launcher's own SIGTERM handler ran; a SIGKILL after the grace would read -9
    assert leader.wait(30) == 128 + signal.SIGTERM
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the paused ranks to be gone")


def test_line_budget_allows_a_burst_then_counts_what_it_holds_back():
    budget = LineBudget(burst=3, per_second=0.0)
    assert [budget.take() for _ in range(5)] == [True, True, True, False, False]
    assert budget.suppressed == 2
