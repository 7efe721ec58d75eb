"""Point 8: ``python -m specforge_core.prepare --config C.yaml`` builds or finds both artifacts
and prints one JSON line with their keys, paths and row counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from specforge_core.prepare import main

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path, cfg) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def test_cli_builds_and_prints_one_json_line(tmp_path, make_cfg, chat_file):
    config = write_config(tmp_path, make_cfg([chat_file], "draft.draft_vocab_size=32", eval_holdout=1))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "specforge_core.prepare", "--config", str(config)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    (line,) = out.splitlines()
    got = json.loads(line)
    pc, vm = got["prompt_cache"], got["vocab_map"]
    assert pc["built"] and pc["rows"] == {"train": 2, "eval": 1} and Path(pc["path"]).name == pc["key"]
    assert vm["built"] and Path(vm["path"]) == tmp_path / "cache" / "vocab" / f"{vm['key']}.pt"
    assert 0 < vm["coverage"] <= 1


def test_second_run_finds_both_and_overrides_apply(tmp_path, make_cfg, chat_file, capsys):
    config = write_config(tmp_path, make_cfg([chat_file], "draft.draft_vocab_size=32"))
    assert main(["--config", str(config)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["--config", str(config)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert not again["prompt_cache"]["built"] and not again["vocab_map"]["built"]
    assert again["prompt_cache"]["key"] == first["prompt_cache"]["key"]
    assert main(["--config", str(config), "data.max_length=48"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_cache"]["key"] != first["prompt_cache"]["key"]
