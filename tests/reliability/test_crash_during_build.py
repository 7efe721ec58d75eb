"""kill -9 while building the prompt cache or the vocab map leaves nothing a later run would take
for complete: the later run builds again (``built``), removes the killed build's leftovers, and
gets exactly the files an uninterrupted build gives.

The killed process is a real ``python -m specforge_core.prepare``; ``crashpoint.py`` SIGKILLs it just
before the rename that would publish a build, or before a seeded one of the prompt-cache build's
chunk writes, so every kill lands at the same point of the build on any machine.
"""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_core.data.prompt_cache import ensure_prompt_cache, prompt_cache_key
from specforge_core.data.vocab import ensure_vocab_map, vocab_map_key
from tests.data.conftest import CHAT, write_jsonl

from .conftest import write_config

ROOT = Path(__file__).resolve().parents[2]
CRASHPOINT = Path(__file__).with_name("crashpoint.py")
V = 512


def prepare_process(config: Path, crash_on: str | None = None, crash_skip: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if crash_on:
        env.update(CRASH_ON=crash_on, CRASH_SKIP=str(crash_skip))
    cmd = [sys.executable, str(CRASHPOINT), "specforge_core.prepare", "--config", str(config)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed(proc: subprocess.Popen) -> bool:
    proc.communicate(timeout=300)
    return proc.returncode == -signal.SIGKILL


@pytest.fixture
def reference(make_cfg, tmp_path, tiny_tokenizer):
    """``reference(files)``: the cache files and vocab map an uninterrupted build gives."""

    def build(files):
        cfg = make_cfg(files, f"data.cache_dir={tmp_path / 'reference'}")
        cache = ensure_prompt_cache(cfg, tiny_tokenizer)
        vm = ensure_vocab_map(cfg, cache, V)
        return cache.meta["files"], vm.path.read_bytes()

    return build


def leftovers(root: Path) -> list[str]:
    """Temporaries of an unfinished atomic write (``.tmp-*`` directories, ``.<name>.*.tmp`` files)."""
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-") or
                  (p.name.startswith(".") and p.name.endswith(".tmp")))


def test_kill_before_the_cache_is_published_leaves_no_cache_and_the_next_run_rebuilds_it(
        tmp_path, make_cfg, chat_file, tiny_tokenizer, reference):
    cfg = make_cfg([chat_file])
    want_files, _ = reference([chat_file])
    prompts = Path(cfg.data.cache_dir) / "prompts"
    assert killed(prepare_process(write_config(tmp_path / "c.yaml", cfg), crash_on="rename:/prompts/"))

    key = prompt_cache_key(cfg, tiny_tokenizer)
    assert not (prompts / key).exists() and len(leftovers(prompts)) == 1  # a finished but unpublished build
    again = ensure_prompt_cache(cfg, tiny_tokenizer)
    assert again.built and again.meta["files"] == want_files and leftovers(prompts) == []


def test_kill_between_the_vocab_sidecar_and_the_map_leaves_no_map_and_the_next_run_rebuilds_it(
        tmp_path, make_cfg, chat_file, tiny_tokenizer, reference):
    cfg = make_cfg([chat_file])
    _, want_map = reference([chat_file])
    vocab = Path(cfg.data.cache_dir) / "vocab"
    assert killed(prepare_process(write_config(tmp_path / "c.yaml", cfg), crash_on="replace:/vocab/*.pt"))

    cache = ensure_prompt_cache(cfg, tiny_tokenizer)
    assert not cache.built  # the cache was published before the kill, and is whole
    path = vocab / f"{vocab_map_key(cache.key, V, 32)}.pt"
    assert path.with_suffix(".json").exists() and not path.exists() and leftovers(vocab)
    vm = ensure_vocab_map(cfg, cache, V)
    assert vm.built and vm.path.read_bytes() == want_map and leftovers(vocab) == []


def test_kill_before_a_seeded_chunk_write_of_the_cache_build_never_leaves_a_partial_cache(
        tmp_path, make_cfg, tiny_tokenizer, reference):
    data = write_jsonl(tmp_path / "big.jsonl", [CHAT[i % len(CHAT)] for i in range(4000)])
    cfg = make_cfg([data])
    want_files, want_map = reference([data])
    prompts = Path(cfg.data.cache_dir) / "prompts"
    chunks_written = random.Random(0).randrange(1, 8)  # of the ~15 the train split takes
    assert killed(prepare_process(write_config(tmp_path / "c.yaml", cfg),
                                  crash_on="call:specforge_core.data.prompt_cache:_SplitWriter.flush",
                                  crash_skip=chunks_written))

    key = prompt_cache_key(cfg, tiny_tokenizer)
    assert not (prompts / key).exists() and len(leftovers(prompts)) == 1  # killed mid-build, nothing published
    again = ensure_prompt_cache(cfg, tiny_tokenizer)
    vm = ensure_vocab_map(cfg, again, V)
    assert again.built and again.meta["files"] == want_files and vm.path.read_bytes() == want_map
    assert leftovers(prompts) == []
