"""Point 9: bad input stops with file:line and the fix, exits non-zero, leaves no cache behind;
``data.on_bad_row: skip`` drops and counts per-row problems instead."""

import json
import shutil

import pytest
import yaml

from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.errors import DataError
from specforge_core.prepare import main as prepare_main

from .conftest import CHAT, write_jsonl

GOOD = json.dumps(CHAT[0])
ROLE_ORDER = json.dumps({"conversations": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]})
EMPTY_CONV = json.dumps({"conversations": []})
TOK_MISMATCH = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]})
TOK_OUT_OF_VOCAB = json.dumps({"input_ids": [1, 99999], "loss_mask": [0, 1]})
TOK_GOOD = json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]})

# (name, file bytes, line named in the error, words in the problem)
CASES = [
    ("malformed_json", f"{GOOD}\n{{\"conversations\": [\n".encode(), 2, "not valid JSON"),
    ("role_order", f"{GOOD}\n{GOOD}\n{ROLE_ORDER}\n".encode(), 3, "wrong role order: message 0 is assistant"),
    ("empty_conversation", f"{EMPTY_CONV}\n".encode(), 1, "empty conversation"),
    ("not_utf8", GOOD.encode() + b"\n" + GOOD.replace("Paris", "Par\xefs").encode("latin-1") + b"\n", 2, "not valid UTF-8"),
    ("tokenized_lengths", f"{TOK_GOOD}\n{TOK_MISMATCH}\n".encode(), 2, "input_ids has 3 tokens but loss_mask has 2"),
    ("tokenized_vocab", f"{TOK_OUT_OF_VOCAB}\n".encode(), 1, "token id 99999 is outside the tokenizer vocabulary"),
]


def run_cli(tmp_path, cfg, capsys):
    cfg.draft.draft_vocab_size = 32  # fits the tiny target, so the data is what prepare refuses
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    code = prepare_main(["--config", str(path)])
    return code, capsys.readouterr().err


def no_cache_left(cfg) -> bool:
    from pathlib import Path

    prompts = Path(cfg.data.cache_dir) / "prompts"
    return not prompts.exists() or all(p.suffix == ".lock" for p in prompts.iterdir())


@pytest.mark.parametrize("name,data,line,problem", CASES, ids=[c[0] for c in CASES])
def test_bad_row_names_file_line_and_fix_and_leaves_no_cache(tmp_path, make_cfg, capsys, name, data, line, problem):
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(data)
    cfg = make_cfg([path])
    code, err = run_cli(tmp_path, cfg, capsys)
    assert code != 0
    assert f"{path}:{line}: " in err and problem in err and "fix:" in err
    assert no_cache_left(cfg)


def test_missing_file_is_named(tmp_path, make_cfg, capsys):
    cfg = make_cfg([tmp_path / "nope.jsonl"])
    code, err = run_cli(tmp_path, cfg, capsys)
    assert code != 0 and f"{tmp_path / 'nope.jsonl'}: file not found" in err and "data.train_files" in err
    assert no_cache_left(cfg)


def test_empty_file_is_named(tmp_path, make_cfg, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    cfg = make_cfg([path])
    code, err = run_cli(tmp_path, cfg, capsys)
    assert code != 0 and f"{path}: contains no rows" in err and "fix:" in err
    assert no_cache_left(cfg)


def test_tokenizer_without_chat_template_asks_for_one(tmp_path, make_cfg, tiny_target_dir, chat_file, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_target_dir, bare)
    (bare / "chat_template.jinja").unlink()
    cfg = make_cfg([chat_file], f"model.target={bare}")
    code, err = run_cli(tmp_path, cfg, capsys)
    assert code != 0 and "model.chat_template: the tokenizer has no chat template" in err
    assert "fix: set model.chat_template" in err
    assert no_cache_left(cfg)


def test_library_raises_data_error_with_where_and_fix(tmp_path, make_cfg, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [], raw_lines=[GOOD, "nonsense"])
    with pytest.raises(DataError) as e:
        ensure_prompt_cache(make_cfg([path]), tiny_tokenizer)
    assert e.value.where == f"{path}:2" and "on_bad_row=skip" in e.value.fix


def test_skip_drops_and_counts_every_per_row_problem(tmp_path, make_cfg, tiny_tokenizer):
    lines = b"".join(data for _, data, _, _ in CASES[:4])  # conversation-shaped problems, with good rows
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(lines)
    cache = ensure_prompt_cache(make_cfg([path], on_bad_row="skip"), tiny_tokenizer)
    assert cache.meta["dropped"] == {"bad_json": 1, "role_order": 1, "bad_row": 1, "not_utf8": 1}
    assert cache.train.num_rows == cache.meta["rows_in"] - 4 == 4


def test_skip_counts_bad_pre_tokenized_rows(tmp_path, make_cfg, tiny_tokenizer):
    path = tmp_path / "tok.jsonl"
    path.write_bytes(CASES[4][1] + CASES[5][1])
    cache = ensure_prompt_cache(make_cfg([path], on_bad_row="skip"), tiny_tokenizer)
    assert cache.meta["dropped"] == {"bad_tokens": 2} and cache.train["input_ids"] == [[5, 6, 7, 8]]
