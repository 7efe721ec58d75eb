"""Point 6: processes launched together without Prefect: one builds the missing cache under a
file lock, the others wait for it and open the same dataset (no collective involved)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import CHAT, write_jsonl

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import hashlib, json, sys, time
from pathlib import Path
from specforge_core.config import load_config
from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.data.tokenize import load_tokenizer
config, rank, world, gate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
cfg = load_config(config)
tok = load_tokenizer(cfg)
(gate / f"ready-{rank}").touch()
while len(list(gate.glob("ready-*"))) < world:  # start the race only once every process is ready
    time.sleep(0.01)
cache = ensure_prompt_cache(cfg, tok)
digest = hashlib.sha256(json.dumps([list(cache.train["input_ids"]), list(cache.train["loss_mask"])]).encode()).hexdigest()
print(json.dumps({"built": cache.built, "build": cache.meta["build"]["id"], "key": cache.key, "data": digest}))
"""


@pytest.mark.slow
def test_four_processes_give_one_build_and_identical_datasets(tmp_path, make_cfg):
    data = write_jsonl(tmp_path / "d.jsonl", [CHAT[i % 3] for i in range(1000)])
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(make_cfg([data]).model_dump(mode="json")))
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(config), str(r), "4", str(gate)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["built"] for r in results) == 1
    assert len({(r["build"], r["key"], r["data"]) for r in results}) == 1
    prompts = tmp_path / "cache" / "prompts"
    assert sorted(p.name for p in prompts.iterdir()) == [results[0]["key"], results[0]["key"] + ".lock"]
