"""``python -m specforge_core.train`` under real torchrun: topologies, a killed run resumed, SmolLM2.

Every run here is the product's own entry point on real pieces: tiny (or SmolLM2) target with the
hf capture backend, the content-keyed prompt cache, the vocab map, the EAGLE3 draft and objective
(the killed run: DFlash2's), FSDP2 over gloo.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from specforge_core.config import load_config
from fixtures.chitchat import write_chitchat_jsonl
from specforge_core.errors import ConfigError
from specforge_core.run.plan import PromptPlan
from specforge_core.loop.checkpoint import checkpoints_dir, latest_checkpoint
from specforge_core.loop.metrics import METRICS_FILE
from specforge_core.run.topology import Topology
from specforge_core.launch.builder import check_plan_against_config
from specforge_core.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-cli")
    write_chitchat_jsonl(root / "chat.jsonl", 48)
    return root


def write_config(workdir: Path, name: str, target: Path, **sections) -> Path:
    """A run config on ``target`` (tiny unless told), one shared prompt cache, run dir ``workdir/name``."""
    cfg = {
        "model": {"target": str(target), "dtype": "float32"},
        "data": {"train_files": [str(workdir / "chat.jsonl")], "max_length": 160, "cache_dir": str(workdir / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 1, "accumulation_steps": 2, "ttt_length": 3, "log_interval": 1,
                     "learning_rate": 1e-3, "max_steps": 2},
        "capture": {"device": "cpu"},
        "output": {"dir": str(workdir / name)},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(config: Path, nproc: int, *overrides: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "specforge_core.train", "--config", str(config), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def run_to_end(config: Path, nproc: int, *overrides: str, timeout: float = 240) -> str:
    proc = torchrun(config, nproc, *overrides)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def finite_losses(run_dir: Path, steps: int) -> list[float]:
    """The run's logged losses, one per step, each a finite number (a NaN loss still prints a step line)."""
    losses = [r["loss"] for r in records(run_dir)]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    return losses


# --- topologies -----------------------------------------------------------------------------------


# 2 ranks, tp 1: straight_run below and tests/reliability's runs; (4, 2) is two islands of two, so one
# island of two (2, 2) adds nothing
@pytest.mark.parametrize("world,tp", [(1, 1), (4, 2)])
def test_torchrun_trains_and_checkpoints_on_each_topology(workdir, tiny_target_dir, world, tp):
    name = f"w{world}-tp{tp}"
    config = write_config(workdir, name, tiny_target_dir,
                          capture={"tp_size": tp}, deployment={"nproc_per_node": world})
    run_to_end(config, world)
    run_dir = workdir / name
    # the reference: as many ranks, each capturing with the whole target (tp 1); every rank trains
    reference = workdir / f"w{world}-tp1"
    if not reference.exists():
        run_to_end(write_config(workdir, reference.name, tiny_target_dir, deployment={"nproc_per_node": world}),
                   world)
    assert finite_losses(run_dir, 2) == pytest.approx(finite_losses(reference, 2), rel=1e-4)
    assert [p.name for p in checkpoints_dir(run_dir).iterdir() if p.name.startswith("step-")] == ["step-00000002"]
    last = records(run_dir)[-1]
    assert last["captures"] == 2 * world and last["samples_per_s"] > 0 and "acc_0" in last
    weights = load_file(str(latest_checkpoint(run_dir) / "draft.safetensors"))
    assert "embed_tokens.weight" not in weights and "d2t" in weights


# --- a killed run, resumed ----------------------------------------------------------------------


def _kill_before_checkpoint(config: Path, nproc: int, step: int) -> None:
    """Run to the end, but SIGKILL rank 0 just before it publishes checkpoint ``step`` (the rename that
    commits it): every earlier checkpoint is whole, this one torn, whatever the machine's speed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "CRASH_ON": f"rename:/checkpoints/step-{step:08d}", "CRASH_RANK": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "reliability" / "crashpoint.py"), "specforge_core.train", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, "the run ended before it could be killed"


N = 2  # the killed run is checkpointed at step N and killed; both runs train 2N steps


# DFlash with the DFlash2 option: everything DFlash saves and restores, plus the convolution and
# selector weights and the DFlash2 fields of the resume contract. EAGLE3's killed and resumed runs
# are tests/reliability's (a kill at every point, torn checkpoints, stale locks); DSpark's:
# tests/drafts/dspark/test_train.py.
FAMILIES = {"dflash2": {"family": "dflash", "dflash": {"block_size": 4, "num_anchors": 16, "dflash2": True,
                                                        "selector_rank": 8, "selector_top_k": 4}}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def straight_run(request, workdir, tiny_target_dir):
    family = request.param
    config = write_config(workdir, f"straight-{family}", tiny_target_dir, draft=FAMILIES[family],
                          training={"max_steps": 2 * N, "save_interval": N}, deployment={"nproc_per_node": 2})
    run_to_end(config, 2)
    return family, workdir / f"straight-{family}"


def test_killed_run_resumes_to_identical_losses_and_bit_identical_weights(workdir, tiny_target_dir, straight_run):
    family, straight_run = straight_run
    name = f"killed-{family}"
    killed = write_config(workdir, name, tiny_target_dir, draft=FAMILIES[family],
                          training={"max_steps": 2 * N, "save_interval": N}, deployment={"nproc_per_node": 2})
    _kill_before_checkpoint(killed, 2, step=2 * N)
    assert latest_checkpoint(workdir / name).name == f"step-{N:08d}"
    out = run_to_end(killed, 2)
    assert f"resumed from {checkpoints_dir(workdir / name) / f'step-{N:08d}'}" in out

    a, b = records(straight_run), records(workdir / name)
    assert [r["step"] for r in b] == list(range(1, 2 * N + 1))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]
    assert [r["captures"] for r in b] == [2 * 2] * (2 * N)  # the resumed half captured only its own prompts
    wa = load_file(str(latest_checkpoint(straight_run) / "draft.safetensors"))
    wb = load_file(str(latest_checkpoint(workdir / name) / "draft.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


# --- the entry point itself (in process) ------------------------------------------------------------


def test_entry_point_asks_for_expandable_segments_before_anything_else(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_world_size_other_than_the_config_is_refused_naming_the_field(workdir, tiny_target_dir, capsys):
    config = write_config(workdir, "mismatch", tiny_target_dir, deployment={"nproc_per_node": 2})
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "deployment.nproc_per_node" in err and "1 ranks are launched" in err


def test_an_output_dir_that_is_a_file_is_refused_naming_the_field(workdir, tiny_target_dir, capsys):
    (workdir / "a-file").write_text("not a directory")
    config = write_config(workdir, "file-as-output", tiny_target_dir, output={"dir": str(workdir / "a-file")})
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "output.dir" in err and "is an existing file" in err and "fix:" in err and "Traceback" not in err


def test_recorded_plan_of_another_config_is_refused(workdir, tiny_target_dir, tmp_path):
    cfg = load_config(write_config(workdir, "plan", tiny_target_dir))
    PromptPlan.from_config(cfg, 40, topology=Topology.from_config(cfg)).save(tmp_path / "plan.json")
    other = load_config(write_config(workdir, "plan", tiny_target_dir, training={"seed": 7}))
    recorded = PromptPlan.load(tmp_path / "plan.json")
    with pytest.raises(ConfigError, match="seed: 42 → 7"):
        check_plan_against_config(other, recorded, Topology.from_config(other), 40, str(tmp_path / "plan.json"))
    check_plan_against_config(cfg, recorded, Topology.from_config(cfg), 40, str(tmp_path / "plan.json"))


# --- the real model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_rank_trains_a_draft_for_smollm2(workdir, smollm2_dir):
    # one conversation, seen at every step: a draft that trains must fit it better step after step
    one = json.loads((workdir / "chat.jsonl").read_text().splitlines()[0])
    (workdir / "one-chat.jsonl").write_text("".join(json.dumps(one) + "\n" for _ in range(8)))
    config = write_config(workdir, "smollm2", smollm2_dir, data={"max_length": 96, "train_files": [str(workdir / "one-chat.jsonl")],
                          "cache_dir": str(workdir / "cache-one")}, draft={"draft_vocab_size": 2048},
                          training={"accumulation_steps": 1, "ttt_length": 7, "max_steps": 4, "warmup_ratio": 0.0})
    run_to_end(config, 1, timeout=600)
    losses = finite_losses(workdir / "smollm2", 4)
    assert losses[-1] < 0.8 * losses[0], losses
    assert (latest_checkpoint(workdir / "smollm2") / "draft_config.json").is_file()
