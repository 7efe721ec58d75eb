"""Resume checks what it resumes by content: the target's weights and tokenizer, the prompt cache
and the vocab map. A run on other bytes behind the same paths and sizes is refused, naming both
fingerprints and the fix, before anything is written."""

import json
import shutil
from pathlib import Path

import pytest

from fixtures.tiny import build_tiny_target
from specforge_core.train import main
from tests.reliability.runs import run_config


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and p.name != "RUN.lock"}


@pytest.fixture
def trained(train_workdir, tiny_target_dir, tmp_path):
    """One optimizer step trained and checkpointed on private copies of the tiny target and the data."""
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    data = shutil.copyfile(train_workdir / "chat.jsonl", tmp_path / "chat.jsonl")
    config = run_config(train_workdir, f"identity-{tmp_path.name}", target, world=1, max_steps=1,
                        data={"train_files": [str(data)], "cache_dir": str(tmp_path / "cache")})
    assert main(["--config", str(config)]) == 0
    return config, target, train_workdir / f"identity-{tmp_path.name}"


def _resume_refused(config: Path, run_dir: Path, capsys) -> str:
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["--config", str(config)]) == 2  # the same run again: it would resume its last checkpoint
    out = capsys.readouterr()
    assert "resumed from" not in out.out + out.err and _snapshot(run_dir) == before
    assert "plan." not in out.err  # the same plan: only what changed on disk is named
    return out.err


def test_resume_refuses_a_target_whose_weights_were_replaced_by_same_size_ones(trained, tmp_path, capsys):
    config, target, run_dir = trained
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    build_tiny_target(tmp_path / "other", seed=1)
    shutil.copyfile(tmp_path / "other" / "model.safetensors", weights)
    assert weights.stat().st_size == size  # same name, same size, other weights
    err = _resume_refused(config, run_dir, capsys)
    line = next(x for x in err.splitlines() if "identities.target:" in x)
    recorded, current = line.split("checkpoint=")[1].split(" run=")
    assert len(recorded.strip("'")) == len(current.strip("'")) == 64 and recorded != current
    assert "point model.target at the files the checkpoint was trained on" in err


def test_resume_refuses_a_target_whose_tokenizer_changed(trained, capsys):
    """The tokenizer's files are part of the target's fingerprint, and its definition is part of the
    prompt cache's key: both differences are named."""
    config, target, run_dir = trained
    tokenizer = target / "tokenizer.json"
    definition = json.loads(tokenizer.read_text())
    merges = definition["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # same vocabulary and size, other tokenization
    tokenizer.write_text(json.dumps(definition))
    err = _resume_refused(config, run_dir, capsys)
    assert "identities.target:" in err and "identities.prompt_cache:" in err


def test_resume_refuses_conversations_changed_in_place_at_the_same_size(trained, tmp_path, capsys):
    """The prompt cache's identity is its content key (the sources' bytes, the tokenizer, every
    option), and the vocab map's is derived from it: both are named."""
    config, _, run_dir = trained
    data = tmp_path / "chat.jsonl"
    text = data.read_text()
    i = text.index('"content": "') + len('"content": "')
    data.write_text(text[:i] + ("b" if text[i] != "b" else "c") + text[i + 1:])
    assert len(data.read_text()) == len(text)
    err = _resume_refused(config, run_dir, capsys)
    assert "identities.prompt_cache:" in err and "identities.vocab_map:" in err
