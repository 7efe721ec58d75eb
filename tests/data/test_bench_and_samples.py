"""Point 10: real conversations for the benchmark, and bench/data_prep.py end to end (tiny run)."""

import importlib.util
import json
from pathlib import Path

from fixtures.chitchat import write_chitchat_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_chitchat_rows_alternate_user_and_assistant(tmp_path):
    path = write_chitchat_jsonl(tmp_path / "c.jsonl", 20)
    for line in path.read_text().splitlines():
        roles = [m["role"] for m in json.loads(line)["conversations"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles


def test_min_chars_joins_chats_into_long_conversations(tmp_path):
    path = write_chitchat_jsonl(tmp_path / "c.jsonl", 5, min_chars=3000)
    for line in path.read_text().splitlines():
        assert sum(len(m["content"]) for m in json.loads(line)["conversations"]) >= 3000


def test_samples_are_deterministic(tmp_path):
    a = write_chitchat_jsonl(tmp_path / "a.jsonl", 5, min_chars=3000, max_chars=6000)
    b = write_chitchat_jsonl(tmp_path / "b.jsonl", 5, min_chars=3000, max_chars=6000)
    assert a.read_bytes() == b.read_bytes()


def test_bench_runs_end_to_end_and_reports_every_number(tmp_path, tiny_target_dir, capsys):
    spec = importlib.util.spec_from_file_location("data_prep", ROOT / "bench" / "data_prep.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--rows", "40", "--min-chars", "300", "--target", str(tiny_target_dir),
                      "--draft-vocab-size", "64", "--workdir", str(tmp_path)])
    assert res["rows_cached"] == 40 and res["Vd"] == 64
    # a cache hit opens the built cache without walking the corpus: faster than building it
    assert res["hit_s"] < res["rows_cached"] / res["cold_rows_s"]
    out = capsys.readouterr().out
    assert "| rows | tokens/row |" in out
    row = next(line for line in out.splitlines() if line.startswith(f"| {res['rows']} |"))
    for key in ("floor_rows_s", "chunked_floor_rows_s", "cold_rows_s", "cold_over_floor", "hit_s", "vocab_map_s"):
        assert f" {res[key]} " in row or f"| {res[key]} " in row, key  # the table shows the JSON's numbers
