"""The deployment path for real: `prefect server start` (127.0.0.1, SQLite, private home, no telemetry),
`prefect deploy` of deployments/prefect.yaml, a process worker, and the tiny profile through
`prefect deployment run colocated-train/default`. Crash, retry, cancel and recovery are driven the
way a user drives them: signals to the worker's flow-run process and the `prefect` CLI.

Before a test signals a run it SIGSTOPs torchrun and its ranks, so the run is still training when
the signal lands however fast the machine: a paused rank cannot finish. The shutdown sends SIGTERM
and then SIGCONT, so the paused processes stop at once rather than after the grace period.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, LogFilter

from flows.local_stack import PROJECT_DIR, LocalPrefect
from specforge_core.loop.checkpoint import latest_checkpoint
from tasks.process_group import tree_members
from specforge_core.run.directory import RunDir
from tasks.train_stage import run_dir_for
from tests.orchestration.conftest import alive, states_by_stage, tiny_config, wait_for

pytestmark = pytest.mark.slow

STAGES = {"prepare_prompt_cache", "build_vocab_map", "record_plan", "train", "validate"}
DATA_STAGES = {"prepare_prompt_cache", "build_vocab_map", "record_plan"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Server + pools + every deployment + one CPU worker; all stopped when the module is done."""
    with LocalPrefect(tmp_path_factory.mktemp("prefect-e2e-home")) as s:
        s.prefect("work-pool", "create", "colocated-pool", "--type", "process")
        s.prefect("work-pool", "create", "gpu-pool", "--type", "process")  # the GPU recipes' (no worker here)
        s.deploy()
        s.start_worker("colocated-pool")
        yield s


@pytest.fixture
def client(stack):
    with SyncPrefectClient(stack.api_url) as c:
        yield c


def _start(stack, config: dict, *, watch: bool = False) -> tuple[str, subprocess.CompletedProcess]:
    args = ["deployment", "run", "colocated-train/default", "--params", json.dumps({"config": config})]
    done = stack.prefect(*args, *(["--watch"] if watch else []), timeout_s=600, check=False)
    ids = [line.split("UUID:")[1].strip() for line in done.stdout.splitlines() if "UUID:" in line]
    assert ids, f"no flow run created:\n{done.stdout}\n{done.stderr}"
    return ids[0], done


def _state(client, flow_run_id):
    return client.read_flow_run(flow_run_id).state


def _wait_state(client, flow_run_id, names: set[str], timeout: float = 300):
    return wait_for(lambda: (s := _state(client, flow_run_id)).name in names and s, timeout,
                    f"flow run {flow_run_id} to reach {names}", interval=1.0)


def _task_states(client, flow_run_id) -> dict[str, list[str]]:
    """Stage name → the states of its task runs, oldest first (a retried flow run has two each)."""
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return states_by_stage(sorted(runs, key=lambda r: r.expected_start_time))


def _logs(client, flow_run_id) -> list[str]:
    return [log.message for log in client.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]}))]


def _logs_with(client, flow_run_id, needle: str) -> list[str]:
    """The flow run's log lines once one contains ``needle``: the run's state can be final before its
    process has shipped its last lines to the API (they go in batches)."""
    return wait_for(lambda: (logs := _logs(client, flow_run_id)) and any(needle in m for m in logs) and logs, 30,
                    f"a line with {needle!r} in the flow run's logs", interval=1.0)


def _run_dir(client, flow_run_id, config) -> Path:
    run = client.read_flow_run(flow_run_id)
    return run_dir_for(config["output"]["dir"], run.name, str(run.id))


def _flow_process(client, flow_run_id) -> int:
    pid = wait_for(lambda: client.read_flow_run(flow_run_id).infrastructure_pid, 120,
                   "the worker to record the flow-run process")
    return int(pid.rpartition(":")[2])


def _pause(pids: list[int], sig: int = signal.SIGSTOP) -> None:
    for pid in pids:
        os.kill(pid, sig)


def _pause_after_a_checkpoint(client, flow_run_id, config, ranks: list[int]) -> Path:
    """Pause torchrun and its ranks at a moment when a checkpoint is on disk and training is not done.

    Each poll pauses first and looks second, so what it sees cannot change behind it; a poll that
    finds no checkpoint lets the run go on. The run returns paused."""
    run_dir = _run_dir(client, flow_run_id, config)

    def paused_with_checkpoint():
        _pause(ranks)
        if checkpoint := latest_checkpoint(run_dir):
            return checkpoint
        _pause(ranks, signal.SIGCONT)
        return None

    checkpoint = wait_for(paused_with_checkpoint, 300, f"a checkpoint under {run_dir}", interval=0.2)
    step = int(checkpoint.name.rpartition("-")[2])
    assert step < config["training"]["max_steps"], f"the run finished before it could be interrupted: {checkpoint}"
    return checkpoint


def _ranks(run_dir: Path) -> list[int]:
    """The pids of torchrun's agent and its 2 ranks, once they all run."""
    record = json.loads(wait_for(lambda: RunDir(run_dir).process_tree.is_file() and RunDir(run_dir).process_tree.read_text(),
                                 300, "the train task to record torchrun's process tree"))
    members = wait_for(lambda: len(m := tree_members(record["token"])) >= 3 and m, 120, "torchrun's 2 ranks")
    return [p.pid for p in members]


@pytest.fixture
def slow_tiny(tmp_path, tiny_target_dir) -> dict:
    """The tiny profile with enough steps to be interrupted mid-training, checkpointing often."""
    return tiny_config(tmp_path, tiny_target_dir, training={"max_steps": 20, "save_interval": 2})


def test_deployment_run_completes_with_all_five_stages(stack, client, tmp_path, tiny_target_dir):
    flow_run_id, done = _start(stack, tiny_config(tmp_path, tiny_target_dir), watch=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _state(client, flow_run_id).name == "Completed"
    assert set(_task_states(client, flow_run_id)) >= STAGES


def test_after_a_crash_a_retry_with_a_changed_plan_is_refused_and_a_plain_retry_resumes(stack, client, slow_tiny):
    """Two retries of one crashed run (a training run is the expensive part of this suite)."""
    flow_run_id, _ = _start(stack, slow_tiny)
    ranks = _ranks(_run_dir(client, flow_run_id, slow_tiny))
    _pause_after_a_checkpoint(client, flow_run_id, slow_tiny, ranks)
    os.kill(_flow_process(client, flow_run_id), signal.SIGTERM)
    _wait_state(client, flow_run_id, {"Crashed"})
    wait_for(lambda: not any(alive(p) for p in ranks), 30, "every torchrun process to be gone")

    # 1. Parameters that change the plan: the retry fails before training, naming the change.
    changed = json.loads(json.dumps(slow_tiny))
    changed["training"]["batch_size"] = 1
    client.update_flow_run(flow_run_id, parameters={"config": changed})
    stack.prefect("flow-run", "retry", flow_run_id)
    state = _wait_state(client, flow_run_id, {"Completed", "Failed", "Crashed"}, timeout=600)
    assert state.name == "Failed"
    refusals = [m for m in _logs_with(client, flow_run_id, "different prompt plan") if "different prompt plan" in m]
    assert "batch_size: checkpoint=2 run=1" in refusals[0]

    # 2. The run's own parameters: data stages Cached, training resumes after the checkpoint.
    client.update_flow_run(flow_run_id, parameters={"config": slow_tiny})
    stack.prefect("flow-run", "retry", flow_run_id)
    state = _wait_state(client, flow_run_id, {"Completed", "Failed", "Crashed"}, timeout=600)
    assert state.name == "Completed", state.message
    states = _task_states(client, flow_run_id)
    assert all(states[name][-1] == "Cached" for name in DATA_STAGES), states
    logs = _logs_with(client, flow_run_id, "resuming from")
    resumed = [m for m in logs if m.startswith("resuming from")][-1]
    resumed_step = int(resumed.split("optimizer step ")[1].split()[0])
    assert resumed_step > 0
    steps_after = [int(m.split("step=")[1].split("/")[0]) for m in logs[logs.index(resumed):] if m.startswith("step=")]
    assert steps_after and steps_after[0] > resumed_step


def test_cancel_stops_every_torchrun_process(stack, client, slow_tiny):
    flow_run_id, _ = _start(stack, slow_tiny)
    ranks = _ranks(_run_dir(client, flow_run_id, slow_tiny))
    _pause(ranks)
    stack.prefect("flow-run", "cancel", flow_run_id)
    _wait_state(client, flow_run_id, {"Cancelled"}, timeout=120)
    wait_for(lambda: not any(alive(p) for p in ranks), 30, "every torchrun process to be gone")


def test_a_run_stuck_in_running_is_recovered_by_one_command_then_retried(stack, client, slow_tiny):
    """The flow-run process and its worker both SIGKILLed: nobody tells the API."""
    flow_run_id, _ = _start(stack, slow_tiny)
    ranks = _ranks(_run_dir(client, flow_run_id, slow_tiny))
    _pause_after_a_checkpoint(client, flow_run_id, slow_tiny, ranks)
    [(_, worker)] = [(n, p) for n, p in stack.procs if n == "worker"]
    flow_pid = _flow_process(client, flow_run_id)
    os.kill(worker.pid, signal.SIGKILL)
    os.kill(flow_pid, signal.SIGKILL)
    worker.wait(10)
    stack.procs.remove(("worker", worker))
    wait_for(lambda: not alive(flow_pid), 30, "the flow-run process to be gone")
    # nobody is left to report: the API still says Running
    assert _state(client, flow_run_id).name == "Running"

    done = subprocess.run([sys.executable, "-m", "flows.recover", flow_run_id], cwd=PROJECT_DIR,
                          env=stack.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _state(client, flow_run_id).name == "Crashed"
    wait_for(lambda: not any(alive(p) for p in ranks), 30, "the orphaned torchrun processes to be gone")

    stack.start_worker("colocated-pool")
    stack.prefect("flow-run", "retry", flow_run_id)
    state = _wait_state(client, flow_run_id, {"Completed", "Failed", "Crashed"}, timeout=600)
    assert state.name == "Completed", state.message
