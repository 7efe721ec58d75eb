"""Helpers for the data-stage tests: small JSONL files and run configs around the tiny tokenizer."""

import json
from pathlib import Path

import pytest

from specforge_core.config import apply_overrides, config_from_dict

CHAT = [
    {"conversations": [{"role": "user", "content": "Hello, what is the capital of France?"},
                       {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"conversations": [{"role": "system", "content": "Answer in one line."},
                       {"role": "user", "content": "Name two colors."},
                       {"role": "assistant", "content": "Red and blue."},
                       {"role": "user", "content": "One more?"},
                       {"role": "assistant", "content": "Green."}]},
    {"conversations": [{"role": "user", "content": "Count to three."},
                       {"role": "assistant", "content": "One, two, three."}]},
]


def write_jsonl(path: Path, rows, raw_lines: list[str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows] + list(raw_lines or [])
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def assistant_texts(rows) -> list[str]:
    return [m["content"] for r in rows for m in r["conversations"] if m["role"] == "assistant"]


@pytest.fixture
def make_cfg(tmp_path, tiny_target_dir):
    """``make_cfg(files, **data)`` → RunConfig on the tiny target, cache under tmp_path/cache."""

    def make(files, *overrides: str, **data):
        data.setdefault("cache_dir", str(tmp_path / "cache"))
        raw = {"model": {"target": str(tiny_target_dir)},
               "data": {"train_files": [str(f) for f in files], **data}}
        return config_from_dict(apply_overrides(raw, list(overrides)))

    return make


@pytest.fixture
def chat_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", CHAT)
