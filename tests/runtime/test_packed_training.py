"""``python -m specforge_core.train`` with ``training.token_budget``: packed rows, the plan's samples.

A packed step trains the same samples as the unpacked step, and each sample's numbers equal its
unpacked numbers. The loss does not: the EAGLE3 objective divides by the batch's ``B·T`` positions,
padding included (``drafts/eagle3/objective.py``, as SpecForge does), and packing changes ``B·T``.
So at step 1 (same weights) the packed and unpacked losses differ by one layout factor, the same for
every unrolled step ``k``, while the acceptance rates, which count only real positions, agree.
"""

import math
import subprocess
import sys

import pytest
import yaml

from fixtures.chitchat import write_chitchat_jsonl
from specforge_core.loop.checkpoint import latest_checkpoint, read_train_state

from .test_time_budget import records
from .test_train_cli import ROOT, finite_losses

TTT = 3


def train(tmp_path, tiny_target_dir, name: str, **training) -> list[dict]:
    cfg = {
        "model": {"target": str(tiny_target_dir), "dtype": "float32"},
        "data": {"train_files": [str(tmp_path / "chat.jsonl")], "max_length": 160, "cache_dir": str(tmp_path / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 3, "accumulation_steps": 1, "ttt_length": TTT, "max_steps": 2, "log_interval": 1,
                     **training},
        "capture": {"device": "cpu"},
        "output": {"dir": str(tmp_path / name)},
    }
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "specforge_core.train", "--config", str(tmp_path / f"{name}.yaml")],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finite_losses(tmp_path / name, 2)
    return records(tmp_path / name)


def test_a_packed_run_trains_the_unpacked_runs_samples_and_counts_them(tmp_path, tiny_target_dir):
    write_chitchat_jsonl(tmp_path / "chat.jsonl", 24)
    packed = train(tmp_path, tiny_target_dir, "packed", token_budget=512)[0]
    plain = train(tmp_path, tiny_target_dir, "plain")[0]
    for k in range(TTT):
        assert packed[f"acceptance_rate_{k}"] == pytest.approx(plain[f"acceptance_rate_{k}"], rel=1e-5)
    layout = plain["loss"] / packed["loss"]  # packed B·T / unpacked B·T: fewer padded positions
    assert 0 < layout < 1 and not math.isclose(layout, 1.0, rel_tol=1e-3)
    for k in range(TTT):
        assert plain[f"ploss_{k}"] / packed[f"ploss_{k}"] == pytest.approx(layout, rel=1e-4)
    state = read_train_state(latest_checkpoint(tmp_path / "packed"))
    assert state["consumed_samples_per_rank"] == 2 * 3  # samples, not packed rows
