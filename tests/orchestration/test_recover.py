"""flows/recover.py: a flow run whose process was SIGKILLed is stuck in Running until recovered."""

import os
import signal
import socket
import subprocess
import sys

from prefect.client.orchestration import get_client

from flows.recover import main as recover
from tests.orchestration.conftest import REPO, read_pids, wait_for


def _start_flow(api_url: str, workdir) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "tests.orchestration.fixtures.launcher_flow", str(workdir)],
                            cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _flow_run(workdir):
    with get_client(sync_client=True) as c:
        [run] = [r for r in c.read_flow_runs() if r.parameters.get("workdir") == str(workdir)]
        return run


def _stop(proc: subprocess.Popen, workdir) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    for pid in read_pids(workdir / "pids.json") or []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_sigkilled_run_stays_running_until_recover_marks_it_crashed(prefect_api, tmp_path, capsys):
    proc = _start_flow(prefect_api, tmp_path)
    wait_for(lambda: read_pids(tmp_path / "pids.json"), 60, "the flow's task to start its launcher")
    _stop(proc, tmp_path)  # returns once the flow process and its launcher are dead: no one is left to report
    run = _flow_run(tmp_path)
    assert run.state.name == "Running"
    assert recover([str(run.id)]) == 0
    assert _flow_run(tmp_path).state.name == "Crashed"
    assert f"prefect flow-run retry {run.id}" in capsys.readouterr().out


def test_recover_refuses_while_the_flow_run_process_is_alive(prefect_api, tmp_path, capsys):
    proc = _start_flow(prefect_api, tmp_path)
    try:
        wait_for(lambda: read_pids(tmp_path / "pids.json"), 60, "the flow's task to start its launcher")
        run = _flow_run(tmp_path)
        with get_client(sync_client=True) as c:  # what a process worker records for its flow runs
            c.update_flow_run(run.id, infrastructure_pid=f"{socket.gethostname()}:{proc.pid}")
        assert recover([str(run.id)]) == 2
        assert "still alive" in capsys.readouterr().err
        assert _flow_run(tmp_path).state.name == "Running"
    finally:
        _stop(proc, tmp_path)


def test_recover_leaves_a_finished_run_alone(prefect_api, tmp_path, capsys):
    from tests.orchestration.fixtures.launcher_flow import launcher_flow

    launcher_flow(str(tmp_path), steps=1)
    run = _flow_run(tmp_path)
    assert recover([str(run.id)]) == 0
    assert "not stuck" in capsys.readouterr().out
    assert _flow_run(tmp_path).state.name == "Completed"
