"""``python -m specforge_core.train`` with ``training.token_budget``: packed rows, the plan's samples."""

import subprocess
import sys

import yaml

from fixtures.chitchat import write_chitchat_jsonl
from specforge_core.loop.checkpoint import latest_checkpoint, read_train_state

from .test_train_cli import ROOT, finite_losses


def test_a_packed_run_trains_and_counts_the_plans_samples(tmp_path, tiny_target_dir):
    write_chitchat_jsonl(tmp_path / "chat.jsonl", 24)
    cfg = {
        "model": {"target": str(tiny_target_dir), "dtype": "float32"},
        "data": {"train_files": [str(tmp_path / "chat.jsonl")], "max_length": 160, "cache_dir": str(tmp_path / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 3, "accumulation_steps": 1, "ttt_length": 3, "max_steps": 2, "token_budget": 512,
                     "log_interval": 1},
        "capture": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "specforge_core.train", "--config", str(tmp_path / "run.yaml")],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finite_losses(tmp_path / "run", 2)
    state = read_train_state(latest_checkpoint(tmp_path / "run"))
    assert state["consumed_samples_per_rank"] == 2 * 3  # samples, not packed rows
