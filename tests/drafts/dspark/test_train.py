"""``python -m specforge_core.train`` trains a DSpark draft on the tiny target: the loss falls, a
checkpoint holds the heads, a run stopped at its checkpoint resumes to the losses and weights of
an uninterrupted one, and two FSDP2 ranks train it (gloo, the CPU)."""

import pytest
import torch
from safetensors.torch import load_file

from specforge_core.loop.checkpoint import latest_checkpoint
from tests.runtime.test_train_cli import _kill_before_checkpoint, records, run_to_end, write_config

pytestmark = pytest.mark.slow  # three torchrun launches, about two minutes on two cores

DRAFT = {"family": "dspark", "dspark": {"block_size": 4, "num_anchors": 16, "num_layers": 1, "markov_rank": 16}}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from fixtures.chitchat import write_chitchat_jsonl

    root = tmp_path_factory.mktemp("dspark-train")
    write_chitchat_jsonl(root / "chat.jsonl", 48)
    return root


def _config(workdir, name, target, steps, nproc=1, **training):
    return write_config(workdir, name, target, draft=DRAFT, deployment={"nproc_per_node": nproc},
                        training={"max_steps": steps, "accumulation_steps": 1, "learning_rate": 3e-3, **training})


def test_one_rank_trains_checkpoints_and_resumes(workdir, tiny_target_dir):
    straight = _config(workdir, "straight", tiny_target_dir, 6, save_interval=3)
    run_to_end(straight, 1)
    losses = [r["loss"] for r in records(workdir / "straight")]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    last = records(workdir / "straight")[-1]
    assert {"accept_length", "simulated_accept_length", "confidence_loss"} <= set(last)
    weights = load_file(str(latest_checkpoint(workdir / "straight") / "draft.safetensors"))
    assert "markov_head.markov_w1.weight" in weights and "confidence_head.proj.weight" in weights

    killed = _config(workdir, "killed", tiny_target_dir, 6, save_interval=3)
    _kill_before_checkpoint(killed, 1, step=6)
    assert latest_checkpoint(workdir / "killed").name == "step-00000003"
    out = run_to_end(killed, 1)
    assert "resumed from" in out
    assert [r["loss"] for r in records(workdir / "killed")] == losses
    again = load_file(str(latest_checkpoint(workdir / "killed") / "draft.safetensors"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_two_fsdp_ranks_train(workdir, tiny_target_dir):
    config = _config(workdir, "fsdp", tiny_target_dir, 2, nproc=2)
    out = run_to_end(config, 2)
    assert "step=2/2 loss=" in out
    assert records(workdir / "fsdp")[-1]["captures"] == 2  # one prompt per rank per step
