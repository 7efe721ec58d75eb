"""Regenerate → train → evaluate on the tiny target: a briefly trained draft gets tokens accepted."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_core.config import load_config
from specforge_core.decoding.evaluation import evaluate
from specforge_core.decoding.answering import regenerate

WORDS = ("the a of to in and is what which who how why you we they good time day year people way thing "
         "world life hand part child question answer capital city country France Paris river water music").split()


@pytest.mark.slow
def test_a_draft_trained_on_regenerated_answers_is_accepted_and_lossless(tiny_target_dir, tmp_path):
    rng = random.Random(0)
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(
        json.dumps({"id": f"q{i}", "conversations": [
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))}]}) + "\n"
        for i in range(64)))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"target": str(tiny_target_dir)},
        "data": {"train_files": [str(tmp_path / "regen.jsonl")], "eval_holdout": 12, "max_length": 96,
                 "cache_dir": str(tmp_path / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 4, "learning_rate": 3e-3, "num_epochs": 4, "ttt_length": 3, "log_interval": 10},
        "output": {"dir": str(tmp_path / "run")},
    }))
    cfg = load_config(config)
    regenerate(cfg, tmp_path / "regen.jsonl", files=[str(source)], max_new_tokens=40)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-m", "specforge_core.train", "--config", str(config)],
                   check=True, cwd=root, env=env, capture_output=True)
    result = evaluate(cfg, tmp_path / "run", num_steps=3, max_new_tokens=40, num_prompts=12, check_lossless=True)
    assert result["lossless"] is True
    assert result["acceptance_length"] > 1.3
    assert result["simulated_acceptance_length"] is not None
    assert "| acceptance length (k=3) |" in Path(result["report"]).read_text()
