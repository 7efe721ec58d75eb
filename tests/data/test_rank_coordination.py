"""Point 6: processes launched together without Prefect: one builds the missing cache under a
file lock, the others wait for it and open the same dataset (no collective involved)."""

import hashlib
import json
import time
from pathlib import Path

import pytest
import yaml

from tests.runtime.harness import rank_context

from .conftest import CHAT, write_jsonl


def _prepare(config: str, rank: int, world: int, gate: Path, results) -> None:
    """One launched process: load the config and tokenizer, wait for all, then open the cache."""
    from specforge_core.config import load_config
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.data.tokenize import load_tokenizer

    cfg = load_config(config)
    tok = load_tokenizer(cfg)
    (gate / f"ready-{rank}").touch()
    while len(list(gate.glob("ready-*"))) < world:  # start the race only once every process is ready
        time.sleep(0.01)
    cache = ensure_prompt_cache(cfg, tok)
    data = json.dumps([list(cache.train["input_ids"]), list(cache.train["loss_mask"])]).encode()
    results.put({"built": cache.built, "build": cache.meta["build"]["id"], "key": cache.key,
                 "data": hashlib.sha256(data).hexdigest()})


@pytest.mark.slow
def test_four_processes_give_one_build_and_identical_datasets(tmp_path, make_cfg):
    data = write_jsonl(tmp_path / "d.jsonl", [CHAT[i % 3] for i in range(1000)])
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(make_cfg([data]).model_dump(mode="json")))
    gate = tmp_path / "gate"
    gate.mkdir()
    ctx = rank_context()  # separate processes, forked from a server that has imported torch once
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(str(config), r, 4, gate, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"a process ended with {p.exitcode}"
    assert sum(r["built"] for r in results) == 1
    assert len({(r["build"], r["key"], r["data"]) for r in results}) == 1
    prompts = tmp_path / "cache" / "prompts"
    assert sorted(p.name for p in prompts.iterdir()) == [results[0]["key"], results[0]["key"] + ".lock"]
