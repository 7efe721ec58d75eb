"""The demo's ending: its summary, and `make ui` (flows.demo --ui) finding the run in a real Prefect database."""

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prefect import flow

from flows.local_stack import free_port
from flows.demo import flow_run_url, latest_run_url, summary
from tests.orchestration.conftest import alive, wait_for

REPO = Path(__file__).resolve().parents[2]


@flow(name="colocated-train")
def fake_colocated_train(tag: str) -> str:
    return tag


@flow(name="another-flow")
def another_flow() -> None:
    pass


def test_flow_run_url_is_the_ui_page_of_the_run():
    assert flow_run_url("http://127.0.0.1:4200/api", "abc") == "http://127.0.0.1:4200/runs/flow-run/abc"
    assert flow_run_url("http://127.0.0.1:4300/api/", "abc") == "http://127.0.0.1:4300/runs/flow-run/abc"


def test_latest_run_url_names_the_newest_colocated_train_run(prefect_api):
    fake_colocated_train("older")
    newest = fake_colocated_train("newer", return_state=True).state_details.flow_run_id
    another_flow()  # a later run of another flow is not the demo's
    assert latest_run_url(prefect_api) == flow_run_url(prefect_api, newest)


def test_latest_run_url_is_none_when_the_flow_never_ran(prefect_api):
    assert latest_run_url(prefect_api, flow_name="never-ran") is None


def test_summary_gives_the_measured_acceptance_length_what_it_means_and_how_to_open_the_run():
    result = {"acceptance_length_before": 1.0, "acceptance_length": 1.4481, "draft_dir": "runs/x/draft",
              "report": "runs/x/report/report.md", "plot": "runs/x/report/curves.png",
              "measured": {"prompts": 16, "num_steps": 3}, "simulated_acceptance_length": 1.511}
    url = "http://127.0.0.1:4200/runs/flow-run/abc"
    text = summary(result, 212.4, flow_run="taupe-nautilus", run_url=url)
    assert "finished in 212 s (flow run 'taupe-nautilus')" in text
    assert "measured acceptance length: 1.00 before training -> 1.45 after, on 16 held-out prompts" in text
    assert "tokens per target forward" in text and "3 draft tokens" in text
    assert "simulated" not in text and "1.51" not in text  # the summary shows the measured figure alone
    assert "make ui" in text and text.rstrip().endswith(url)


@pytest.mark.slow
def test_make_ui_serves_the_demo_database_and_prints_its_runs_page(prefect_api, tmp_path):
    """`flows.demo --ui` started over the test API's database, in which the demo's flow has run."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    run_id = fake_colocated_train("demo", return_state=True).state_details.flow_run_id
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": PREFECT_SERVER_DATABASE_CONNECTION_URL.value()}
    env.pop("PREFECT_API_URL", None)
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "flows.demo", "--ui", "--port", str(port)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        wait_for(lambda: lines.append(ui.stdout.readline()) or "latest colocated-train run" in lines[-1]
                 or ui.poll() is not None, timeout=180, what="the run's URL")
        expected = f"http://127.0.0.1:{port}/runs/flow-run/{run_id}"
        assert lines[-1].strip() == f"the latest colocated-train run: {expected}", "".join(lines)
        # the UI's page for the run, as a browser asks for it (the API answers 404 to other clients)
        with urllib.request.urlopen(urllib.request.Request(expected, headers={"Accept": "text/html"}),
                                    timeout=30) as page:
            assert page.status == 200 and b"<!DOCTYPE html>" in page.read()
    finally:
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=60)
    with pytest.raises(OSError):  # the server stopped with it
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5)
    assert not alive(ui.pid)


def test_make_ui_refuses_a_taken_port_and_names_the_fix(capsys):
    from flows.demo import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["--ui", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "is taken" in err and "make ui UI_PORT=" in err
