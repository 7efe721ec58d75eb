"""tasks/train.py: where a flow run trains and the per-node torchrun command."""

import sys
from pathlib import Path

import pytest

from specforge_core.config import RunConfig
from tasks.training import config_file, run_dir_for, torchrun_command


def _cmd(monkeypatch, prefix: str = "", **deployment) -> list[str]:
    monkeypatch.setenv("SPECFORGE_LAUNCH_PREFIX", prefix)
    cfg = RunConfig.model_validate({"deployment": deployment})
    return torchrun_command(cfg, Path("run/config.yaml"), Path("run/plan.json"), rdzv_id="abc")


def test_the_run_directory_is_stable_for_a_flow_run_and_new_for_another():
    one = run_dir_for("runs/x", "brave-otter", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    assert one == run_dir_for("runs/x", "brave-otter", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    assert one == Path("runs/x/brave-otter-0a1b2c3d")
    assert one != run_dir_for("runs/x", "brave-otter", "ffffffff-4e5f-6789-abcd-ef0123456789")


def test_one_node_runs_torchrun_standalone(monkeypatch):
    assert _cmd(monkeypatch, nproc_per_node=2) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
        "-m", "specforge_core.train", "--config", "run/config.yaml", "--plan", "run/plan.json"]


def test_several_nodes_rendezvous_through_c10d(monkeypatch):
    cmd = _cmd(monkeypatch, nproc_per_node=8, nnodes=4, rdzv_endpoint="node0:29500")
    assert "--standalone" not in cmd
    assert cmd[3:8] == ["--nproc-per-node=8", "--nnodes=4", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=node0:29500", "--rdzv-id=abc"]


def test_several_nodes_without_an_endpoint_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="deployment.rdzv_endpoint"):
        _cmd(monkeypatch, nnodes=2)


def test_the_launch_prefix_starts_the_command_once_per_node(monkeypatch):
    cmd = _cmd(monkeypatch, prefix="srun --nodes=4 --ntasks-per-node=1", nproc_per_node=8, nnodes=4,
               rdzv_endpoint="node0:29500")
    assert cmd[:3] == ["srun", "--nodes=4", "--ntasks-per-node=1"]
    assert cmd[3:6] == [sys.executable, "-m", "torch.distributed.run"]


def test_the_recorded_config_masks_storage_options_and_the_private_copy_is_removed(tmp_path):
    cfg = RunConfig.model_validate({"data": {"storage_options": {"token": "s3cr3t"}}})
    with config_file(cfg, tmp_path / "config.yaml") as path:
        assert path != tmp_path / "config.yaml" and "s3cr3t" in path.read_text()
        assert path.stat().st_mode & 0o077 == 0
    assert not path.exists()
    assert "s3cr3t" not in (tmp_path / "config.yaml").read_text()


def test_without_storage_options_torchrun_reads_the_recorded_config(tmp_path):
    with config_file(RunConfig(), tmp_path / "config.yaml") as path:
        assert path == tmp_path / "config.yaml"
