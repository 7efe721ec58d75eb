"""tasks/train_stage.py: where a flow run trains, what it records there, and the per-node torchrun command."""

import sys
import uuid
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow

from specforge_core.config import RunConfig, config_from_dict
import json

from specforge_core.run.directory import RunDir
from specforge_core.run.manifest import RunManifest
from tasks.caching import StageOutput
from specforge_core.system.compile import CACHE_ENV
from tasks.train_stage import (launch_prefix, record_run, run_dir_for, run_job_variable_env, torchrun_command,
                               torchrun_env)


def _cmd(monkeypatch, prefix: list[str] | None = None, **deployment) -> list[str]:
    cfg = RunConfig.model_validate({"deployment": deployment})
    return torchrun_command(cfg, Path("run/run.json"), rdzv_id="abc", prefix=prefix)


def test_the_run_directory_is_stable_for_a_flow_run_and_new_for_another():
    one = run_dir_for("runs/x", "brave-otter", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    assert one == run_dir_for("runs/x", "brave-otter", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    assert one == Path("runs/x/brave-otter-0a1b2c3d")
    assert one != run_dir_for("runs/x", "brave-otter", "ffffffff-4e5f-6789-abcd-ef0123456789")


RUN_ID = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"


@pytest.mark.parametrize("name, slug", [
    ("../../etc", "etc"),
    ("../..", "run"),
    ("/tmp/evil", "tmp-evil"),
    ("", "run"),
    ("..", "run"),
    ("Crème brûlée 名前", "Creme-brulee"),
    ("名前", "run"),
    ("a/../../b", "a-b"),
    ("x" * 300, "x" * 48),
])
def test_a_flow_run_name_becomes_a_slug_directly_under_the_output_dir(tmp_path, name, slug):
    out = tmp_path / "runs"
    run = run_dir_for(str(out), name, RUN_ID)
    assert run == out / f"{slug}-0a1b2c3d"
    assert run.resolve().parent == out.resolve()


def test_names_that_slug_alike_stay_apart_by_the_flow_run_id(tmp_path):
    one = run_dir_for(str(tmp_path), "../x", RUN_ID)
    other = run_dir_for(str(tmp_path), "/x", "ffffffff-4e5f-6789-abcd-ef0123456789")
    assert one != other and one.name.startswith("x-") and other.name.startswith("x-")


def test_one_node_runs_torchrun_standalone(monkeypatch):
    assert _cmd(monkeypatch, nproc_per_node=2) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
        "-m", "specforge_core.train", "--manifest", "run/run.json"]


@pytest.mark.parametrize("output_dir", ["runs", "absolute"])
def test_every_flow_run_under_an_output_dir_trains_with_one_compile_cache(tmp_path, monkeypatch, output_dir):
    monkeypatch.chdir(tmp_path)  # a relative output.dir is the flow process's: the ranks get it absolute
    out = "runs" if output_dir == "runs" else str(tmp_path / "elsewhere")
    cfg = RunConfig.model_validate({"output": {"dir": out}, "deployment": {"nproc_per_node": 2}})
    env = torchrun_env(cfg, {"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"].isdigit()
    shared = Path(env[CACHE_ENV])
    assert shared.is_absolute() and shared == (tmp_path / out / "compile-cache").resolve()
    runs = [RunDir(run_dir_for(out, "nightly", run_id)) for run_id in (RUN_ID, "ffffffff-4e5f-6789-abcd-ef0123456789")]
    assert all(run.root.resolve().parent == shared.parent for run in runs)  # beside every run directory


def test_the_workers_own_thread_count_and_compile_cache_stand(tmp_path):
    cfg = RunConfig.model_validate({"output": {"dir": str(tmp_path / "runs")}})
    env = torchrun_env(cfg, {"OMP_NUM_THREADS": "3", CACHE_ENV: "/fast/disk/inductor"})
    assert env["OMP_NUM_THREADS"] == "3" and env[CACHE_ENV] == "/fast/disk/inductor"


def test_several_nodes_rendezvous_through_c10d(monkeypatch):
    cmd = _cmd(monkeypatch, nproc_per_node=8, nnodes=4, rdzv_endpoint="node0:29500")
    assert "--standalone" not in cmd
    assert cmd[3:8] == ["--nproc-per-node=8", "--nnodes=4", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=node0:29500", "--rdzv-id=abc"]


def test_several_nodes_without_an_endpoint_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="deployment.rdzv_endpoint"):
        _cmd(monkeypatch, nnodes=2)


def test_the_launch_prefix_starts_the_command_once_per_node(monkeypatch):
    prefix = launch_prefix("srun-4node", {"SPECFORGE_LAUNCHER_SRUN_4NODE": "srun --nodes=4 --ntasks-per-node=1"}, {})
    cmd = _cmd(monkeypatch, prefix=prefix, nproc_per_node=8, nnodes=4, rdzv_endpoint="node0:29500")
    assert cmd[:3] == ["srun", "--nodes=4", "--ntasks-per-node=1"]
    assert cmd[3:6] == [sys.executable, "-m", "torch.distributed.run"]


def test_without_a_launcher_there_is_no_prefix():
    assert launch_prefix(None, {"SPECFORGE_LAUNCHER_SRUN": "srun"}, {}) == []


def test_a_launcher_the_run_sets_through_job_variables_is_refused():
    """A process worker merges job variables into the worker's environment: a launcher there would
    let whoever may set job variables choose the command the worker runs."""
    environ = {"SPECFORGE_LAUNCHER_SRUN": "touch /tmp/pwned;"}
    with pytest.raises(ValueError, match="job variables set SPECFORGE_LAUNCHER_SRUN.*worker's own environment"):
        launch_prefix("srun", environ, run_env={"SPECFORGE_LAUNCHER_SRUN": "touch /tmp/pwned;"})


def test_the_retired_free_form_prefix_is_refused_from_the_run_and_from_the_worker():
    with pytest.raises(ValueError, match="job variables set SPECFORGE_LAUNCH_PREFIX"):
        launch_prefix(None, {"SPECFORGE_LAUNCH_PREFIX": "sh -c id"}, {"SPECFORGE_LAUNCH_PREFIX": "sh -c id"})
    with pytest.raises(ValueError, match="no longer read.*SPECFORGE_LAUNCHER_<NAME>"):
        launch_prefix(None, {"SPECFORGE_LAUNCH_PREFIX": "srun"}, {})


def test_a_launcher_the_worker_does_not_define_is_refused_naming_the_variable_to_export():
    with pytest.raises(ValueError, match=r"defined: \['srun-2node'\].*export SPECFORGE_LAUNCHER_SLURM_8"):
        launch_prefix("slurm-8", {"SPECFORGE_LAUNCHER_SRUN_2NODE": "srun"}, {})


@flow
def _read_run_env() -> dict:
    return run_job_variable_env()


def test_the_run_environment_holds_the_deployments_and_the_runs_job_variables(prefect_api):
    """What ``launch_prefix`` refuses to take a launcher from is read back from the API: the
    deployment's job variables and the flow run's own overrides."""
    with get_client(sync_client=True) as client:
        deployment_id = client.create_deployment(
            flow_id=client.create_flow(_read_run_env), name=f"env-{uuid.uuid4().hex[:8]}",
            job_variables={"env": {"SPECFORGE_LAUNCHER_FROM_DEPLOYMENT": "sh -c id", "OTHER": "1"}})
        flow_run = client.create_flow_run_from_deployment(
            deployment_id, job_variables={"env": {"SPECFORGE_LAUNCHER_FROM_RUN": "sh -c id"}})
    env = run_flow(_read_run_env, flow_run=flow_run)
    assert env == {"SPECFORGE_LAUNCHER_FROM_DEPLOYMENT": "sh -c id", "OTHER": "1",
                   "SPECFORGE_LAUNCHER_FROM_RUN": "sh -c id"}
    with pytest.raises(ValueError, match="FROM_DEPLOYMENT, SPECFORGE_LAUNCHER_FROM_RUN"):
        launch_prefix(None, {}, env)


@pytest.mark.parametrize("name", ["srun;id", "../x", "SRUN", "-x", ""])
def test_a_launcher_name_is_a_plain_name_not_a_command(name):
    with pytest.raises(ValueError, match="deployment.launcher"):
        RunConfig.model_validate({"deployment": {"launcher": name}})


def _record(tmp_path, cfg: RunConfig) -> RunDir:
    run = RunDir(tmp_path / "run")
    record_run(cfg, run, StageOutput(key="c" * 64, path="/cache/prompts/ccc"),
               StageOutput(key="v" * 64, path="/cache/vocab/vvv.pt", facts={"vocab_key": "w" * 64}),
               StageOutput(key="p" * 64, path="/cache/plans/ppp.json", facts={"plan_key": "q" * 64}))
    return run


def test_the_manifest_records_each_resolved_input_and_the_run_directory(tmp_path):
    run = _record(tmp_path, RunConfig())
    manifest = RunManifest.load(run.manifest)
    assert (manifest.prompt_cache.key, manifest.prompt_cache.path) == ("c" * 64, "/cache/prompts/ccc")
    assert (manifest.vocab_map.key, manifest.vocab_map.path) == ("w" * 64, "/cache/vocab/vvv.pt")
    assert (manifest.plan.key, manifest.plan.path) == ("q" * 64, str(run.plan))
    cfg = config_from_dict(manifest.config)
    assert cfg.output.dir == str(run.root) and cfg.draft.vocab_map_path == "/cache/vocab/vvv.pt"


def test_neither_the_manifest_nor_config_yaml_holds_storage_credentials(tmp_path):
    run = _record(tmp_path, RunConfig.model_validate({"data": {"storage_options": {"token": "s3cr3t"}}}))
    for path in (run.manifest, run.config):
        assert "s3cr3t" not in path.read_text()
    assert json.loads(run.manifest.read_text())["config"]["data"]["storage_options"] == {"token": "***"}
