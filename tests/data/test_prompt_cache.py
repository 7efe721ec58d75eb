"""Point 5: the content-keyed Arrow prompt cache: key, hit without reading, atomic build, metadata."""

import json
import os
import time

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from specforge_core.errors import ConfigError
from specforge_core.data.prompt_cache import ensure_prompt_cache, prompt_cache_key
from fixtures.tiny import CHATML_TEMPLATE, build_tokenizer

from .conftest import CHAT, write_jsonl


class CountingFS(LocalFileSystem):
    """The local filesystem under ``countfile://``, counting every file it opens."""

    protocol = "countfile"
    opened: list[str] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("countfile://"))

    def _open(self, path, mode="rb", **kwargs):
        CountingFS.opened.append(path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("countfile", CountingFS, clobber=True)


def age(path, seconds=60):
    t = time.time() - seconds
    os.utime(path, (t, t))


def many(n):
    return [CHAT[i % len(CHAT)] for i in range(n)]


def test_build_writes_train_and_eval_arrow_and_meta(make_cfg, chat_file, tiny_tokenizer):
    cache = ensure_prompt_cache(make_cfg([chat_file]), tiny_tokenizer)
    assert cache.built and cache.path.name == cache.key and len(cache.key) == 64
    assert sorted(p.name for p in cache.path.iterdir()) == ["eval.arrow", "meta.json", "train.arrow"]
    assert cache.train.column_names == ["input_ids", "loss_mask", "length"]
    assert cache.eval.column_names == ["input_ids", "loss_mask", "length", "prompt_ids"]
    assert cache.train.num_rows == 3 and cache.eval.num_rows == 0
    assert cache.train[0]["length"] == len(cache.train[0]["input_ids"]) == len(cache.train[0]["loss_mask"])


def test_cache_is_memory_mapped_from_its_directory(make_cfg, chat_file, tiny_tokenizer):
    cache = ensure_prompt_cache(make_cfg([chat_file]), tiny_tokenizer)
    assert [f["filename"] for f in cache.train.cache_files] == [str(cache.path / "train.arrow")]


def test_rows_read_with_pyarrow_alone_equal_the_datasets_rows(make_cfg, chat_file, tiny_tokenizer):
    cache = ensure_prompt_cache(make_cfg([chat_file], eval_holdout=2), tiny_tokenizer)
    for split, dataset in (("train", cache.train), ("eval", cache.eval)):
        rows = cache.rows(split)
        assert len(rows) == rows.num_rows == dataset.num_rows > 0
        assert [rows[i] for i in range(len(rows))] == [dict(dataset[i]) for i in range(dataset.num_rows)]
    with pytest.raises(IndexError):
        cache.rows("train")[len(cache.train)]


def test_opening_a_cache_for_its_rows_does_not_import_datasets(make_cfg, chat_file, tiny_tokenizer):
    """What a training rank does: every rank process would otherwise pay ≈ 1 s for datasets + pandas."""
    import subprocess
    import sys

    cache = ensure_prompt_cache(make_cfg([chat_file]), tiny_tokenizer)
    code = ("import sys; from specforge_core.data.prompt_cache import open_prompt_cache;"
            f"rows = open_prompt_cache({str(cache.path)!r}).rows('train'); assert len(rows) and rows[0]['input_ids'];"
            "assert 'datasets' not in sys.modules and 'pandas' not in sys.modules, 'datasets or pandas imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_second_call_opens_the_same_cache_without_building(make_cfg, chat_file, tiny_tokenizer):
    cfg = make_cfg([chat_file])
    first = ensure_prompt_cache(cfg, tiny_tokenizer)
    again = ensure_prompt_cache(cfg, tiny_tokenizer)
    assert not again.built and again.key == first.key and again.meta["build"] == first.meta["build"]
    assert again.train["input_ids"] == first.train["input_ids"]


def test_a_hit_does_not_open_the_source(make_cfg, chat_file, tiny_tokenizer):
    age(chat_file)
    cfg = make_cfg([f"countfile://{chat_file}"])
    ensure_prompt_cache(cfg, tiny_tokenizer)
    assert CountingFS.opened, "the build reads the source"
    CountingFS.opened.clear()
    assert not ensure_prompt_cache(cfg, tiny_tokenizer).built
    assert CountingFS.opened == []


def test_a_freshly_rewritten_source_is_hashed_again(make_cfg, tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", CHAT[:1])
    cfg = make_cfg([path])
    before = prompt_cache_key(cfg, tiny_tokenizer)
    path.write_text(path.read_text().replace("Paris", "Lyon!"))  # same size, same second
    assert prompt_cache_key(cfg, tiny_tokenizer) != before


@pytest.mark.parametrize("override", [
    "data.max_length=64", "data.train_only_last_turn=true", "data.min_loss_tokens=3",
    "data.on_bad_row=skip", "data.max_rows=2", "data.eval_holdout=1", "data.format=conversations",
    "data.supervise=all",
])
def test_every_tokenization_option_changes_the_key(make_cfg, chat_file, tiny_tokenizer, override):
    assert prompt_cache_key(make_cfg([chat_file]), tiny_tokenizer) != prompt_cache_key(
        make_cfg([chat_file], override), tiny_tokenizer)


def test_chat_template_and_vocabulary_change_the_key(make_cfg, chat_file, tiny_tokenizer):
    base = prompt_cache_key(make_cfg([chat_file]), tiny_tokenizer)
    other_template = make_cfg([chat_file], "model.chat_template=" + json.dumps(CHATML_TEMPLATE + " "))
    assert prompt_cache_key(other_template, tiny_tokenizer) != base
    assert prompt_cache_key(make_cfg([chat_file]), build_tokenizer(vocab_size=600)) != base


def test_the_key_depends_on_content_not_on_the_path(make_cfg, tmp_path, chat_file, tiny_tokenizer):
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(chat_file.read_bytes())
    assert prompt_cache_key(make_cfg([copy]), tiny_tokenizer) == prompt_cache_key(make_cfg([chat_file]), tiny_tokenizer)


def test_build_leaves_only_the_cache_and_its_lock(make_cfg, chat_file, tiny_tokenizer):
    cache = ensure_prompt_cache(make_cfg([chat_file]), tiny_tokenizer)
    assert sorted(p.name for p in cache.path.parent.iterdir()) == [cache.key, f"{cache.key}.lock"]


def test_meta_counts_rows_drops_tokens_and_lengths(make_cfg, tmp_path, tiny_tokenizer):
    bad = ['{"conversations": [', json.dumps({"conversations": [{"role": "assistant", "content": "x"}]})]
    path = write_jsonl(tmp_path / "d.jsonl", CHAT, raw_lines=bad)
    cache = ensure_prompt_cache(make_cfg([path], on_bad_row="skip", min_loss_tokens=8), tiny_tokenizer)
    m = cache.meta
    assert m["rows_in"] == 5
    assert m["rows_out"] == {"train": cache.train.num_rows, "eval": 0}
    assert m["dropped"]["bad_json"] == 1 and m["dropped"]["role_order"] == 1
    assert sum(m["dropped"].values()) + cache.train.num_rows == 5
    assert m["tokens"]["total"] == sum(cache.train["length"])
    assert m["tokens"]["supervised"] == sum(map(sum, cache.train["loss_mask"]))
    assert sum(m["length_histogram"]["counts"]) == cache.train.num_rows
    assert m["sources"] == [{"url": str(path), "format": "conversations", "rows": 5}]


def test_short_rows_are_dropped_and_counted(make_cfg, chat_file, tiny_tokenizer):
    cache = ensure_prompt_cache(make_cfg([chat_file], min_loss_tokens=12), tiny_tokenizer)
    assert all(sum(m) >= 12 for m in cache.train["loss_mask"])
    assert cache.meta["dropped"]["too_few_loss_tokens"] == 3 - cache.train.num_rows > 0


def test_supervise_all_marks_every_training_token_and_keeps_the_eval_prompts(make_cfg, tmp_path, tiny_tokenizer):
    recs = [{"conversations": [{"role": "user", "content": f"Question {i}, a longer one?"},
                               {"role": "assistant", "content": f"Answer {i}."}]} for i in range(12)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    base = ensure_prompt_cache(make_cfg([path], eval_holdout=3, cache_dir=str(tmp_path / "a")), tiny_tokenizer)
    every = ensure_prompt_cache(make_cfg([path], eval_holdout=3, supervise="all", cache_dir=str(tmp_path / "b")),
                                tiny_tokenizer)
    assert every.train["input_ids"] == base.train["input_ids"]
    assert all(0 < sum(m) < len(m) for m in base.train["loss_mask"])  # the prompt is not supervised by default
    assert all(set(m) == {1} for m in every.train["loss_mask"])
    assert every.eval["prompt_ids"] == base.eval["prompt_ids"] and every.eval["loss_mask"] == base.eval["loss_mask"]
    assert every.meta["options"]["supervise"] == "all"
    assert every.meta["tokens"]["supervised"] == (sum(map(len, every.train["loss_mask"]))  # meta counts both splits
                                                  + sum(map(sum, every.eval["loss_mask"])))


def test_supervise_all_refuses_train_only_last_turn(make_cfg, chat_file):
    with pytest.raises(ConfigError, match="train_only_last_turn"):
        make_cfg([chat_file], supervise="all", train_only_last_turn=True)


def test_eval_holdout_is_deterministic_and_disjoint(make_cfg, tmp_path, tiny_tokenizer):
    recs = [{"conversations": [{"role": "user", "content": f"Question {i}?"},
                               {"role": "assistant", "content": f"Answer {i}."}]} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    a = ensure_prompt_cache(make_cfg([path], eval_holdout=5, cache_dir=str(tmp_path / "a")), tiny_tokenizer)
    b = ensure_prompt_cache(make_cfg([path], eval_holdout=5, cache_dir=str(tmp_path / "b")), tiny_tokenizer)
    assert a.eval.num_rows == 5 and a.train.num_rows == 35
    assert a.eval["input_ids"] == b.eval["input_ids"] and a.train["input_ids"] == b.train["input_ids"]
    assert not set(map(tuple, a.eval["input_ids"])) & set(map(tuple, a.train["input_ids"]))
    for row in a.eval:
        assert row["input_ids"][: len(row["prompt_ids"])] == row["prompt_ids"]


def test_eval_files_become_the_eval_split(make_cfg, tmp_path, chat_file, tiny_tokenizer):
    held = write_jsonl(tmp_path / "eval.jsonl", CHAT[:2])
    cache = ensure_prompt_cache(make_cfg([chat_file], eval_files=[str(held)], eval_holdout=2), tiny_tokenizer)
    assert cache.train.num_rows == 3 and cache.eval.num_rows == 2
    prompt = tiny_tokenizer.decode(cache.eval[0]["prompt_ids"])
    assert prompt.endswith("France?<|im_end|>\n<|im_start|>assistant\n")


def test_max_rows_caps_the_source_rows(make_cfg, tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", many(10))
    cache = ensure_prompt_cache(make_cfg([path], max_rows=4), tiny_tokenizer)
    assert cache.meta["rows_in"] == 4 and cache.train.num_rows == 4


def test_the_chat_template_kwargs_are_part_of_the_key(make_cfg, chat_file, tiny_tokenizer):
    plain = prompt_cache_key(make_cfg([chat_file]), tiny_tokenizer)
    off = prompt_cache_key(make_cfg([chat_file], chat_template_kwargs={"enable_thinking": False}), tiny_tokenizer)
    on = prompt_cache_key(make_cfg([chat_file], chat_template_kwargs={"enable_thinking": True}), tiny_tokenizer)
    assert len({plain, off, on}) == 3


def test_eval_prompts_are_rendered_with_the_chat_template_kwargs(make_cfg, chat_file, tiny_tokenizer):
    from fixtures.tiny import THINKING_SWITCH_TEMPLATE

    cfg = make_cfg([chat_file], f"model.chat_template={json.dumps(THINKING_SWITCH_TEMPLATE)}",
                   eval_holdout=1, chat_template_kwargs={"enable_thinking": False})
    cache = ensure_prompt_cache(cfg, tiny_tokenizer)
    assert cache.meta["options"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert tiny_tokenizer.decode(cache.eval[0]["prompt_ids"]).endswith("<think>\n\n</think>\n\n")
