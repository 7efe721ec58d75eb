"""Fixtures for the reliability tests: run configs on the tiny target with caches under tmp_path."""

from pathlib import Path

import pytest
import yaml

from fixtures.chitchat import write_chitchat_jsonl

from specforge_core.config import apply_overrides, config_from_dict
from tests.data.conftest import CHAT, write_jsonl


@pytest.fixture
def make_cfg(tmp_path, tiny_target_dir):
    """``make_cfg(files, *overrides)`` → RunConfig on the tiny target (Vd = 32), caches in tmp_path."""

    def make(files, *overrides: str):
        raw = {"model": {"target": str(tiny_target_dir)},
               "data": {"train_files": [str(f) for f in files], "cache_dir": str(tmp_path / "cache")},
               "draft": {"draft_vocab_size": 32}, "output": {"dir": str(tmp_path / "out")}}
        return config_from_dict(apply_overrides(raw, list(overrides)))

    return make


@pytest.fixture
def chat_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", CHAT)


def write_config(path: Path, cfg) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


@pytest.fixture(scope="module")
def train_workdir(tmp_path_factory) -> Path:
    """A directory with 48 real conversations (chat.jsonl) for training runs; runs and cache go here."""
    root = tmp_path_factory.mktemp("runs")
    write_chitchat_jsonl(root / "chat.jsonl", 48)
    return root
