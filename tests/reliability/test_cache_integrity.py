"""Prompt cache and vocab map integrity: every file is checked against the sha256 recorded when it
was built, on every open; a changed, torn or missing file is refused with an error that names the
file and says how to rebuild, and deleting what the error names does rebuild it."""

import json
import shutil

import pytest

from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.errors import DataError
from specforge_core.prepare import main as prepare_main
from specforge_core.data.vocab import ensure_vocab_map

from .conftest import write_config

V = 512


@pytest.fixture
def cfg(make_cfg, chat_file):
    return make_cfg([chat_file])


@pytest.fixture
def cache(cfg, tiny_tokenizer):
    return ensure_prompt_cache(cfg, tiny_tokenizer)


def flip_byte(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def test_meta_records_the_size_and_sha256_of_each_split(cache):
    files = cache.meta["files"]
    assert set(files) == {"train.arrow", "eval.arrow"}
    for name, rec in files.items():
        assert rec["bytes"] == (cache.path / name).stat().st_size and len(rec["sha256"]) == 64


def test_a_flipped_byte_in_the_train_split_is_refused_naming_the_file_and_the_fix(cfg, cache, tiny_tokenizer):
    flip_byte(cache.path / "train.arrow")
    with pytest.raises(DataError) as e:
        ensure_prompt_cache(cfg, tiny_tokenizer)
    assert e.value.where == str(cache.path / "train.arrow")
    assert "does not match its checksum" in e.value.problem
    assert f"delete {cache.path}" in e.value.fix and "rebuild" in e.value.fix


def test_a_truncated_eval_split_is_refused(cfg, cache, tiny_tokenizer):
    path = cache.path / "eval.arrow"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="eval.arrow has .* bytes, but .* were written"):
        ensure_prompt_cache(cfg, tiny_tokenizer)


def test_a_missing_split_is_refused(cfg, cache, tiny_tokenizer):
    (cache.path / "train.arrow").unlink()
    with pytest.raises(DataError, match="train.arrow is missing from the prompt cache"):
        ensure_prompt_cache(cfg, tiny_tokenizer)


def test_an_unreadable_meta_json_is_refused(cfg, cache, tiny_tokenizer):
    (cache.path / "meta.json").write_text('{"key": ')
    with pytest.raises(DataError) as e:
        ensure_prompt_cache(cfg, tiny_tokenizer)
    assert e.value.where == str(cache.path / "meta.json") and "unreadable" in e.value.problem


def test_a_meta_json_without_checksums_is_refused(cfg, cache, tiny_tokenizer):
    meta = json.loads((cache.path / "meta.json").read_text())
    del meta["files"]
    (cache.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="not a schema-2 prompt cache record"):
        ensure_prompt_cache(cfg, tiny_tokenizer)


def test_deleting_the_refused_cache_rebuilds_the_same_rows(cfg, cache, tiny_tokenizer):
    first = dict(cache.meta["files"])
    flip_byte(cache.path / "train.arrow")
    shutil.rmtree(cache.path)  # what the error's fix says
    again = ensure_prompt_cache(cfg, tiny_tokenizer)
    assert again.built and again.meta["files"] == first


def test_prepare_refuses_a_corrupt_cache_with_exit_2_and_changes_nothing(tmp_path, cfg, cache, capsys):
    flip_byte(cache.path / "eval.arrow")
    before = {p: p.read_bytes() for p in cache.path.iterdir()}
    code = prepare_main(["--config", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err
    assert code == 2 and f"{cache.path / 'eval.arrow'}: eval.arrow does not match its checksum" in err
    assert "fix: delete" in err
    assert {p: p.read_bytes() for p in cache.path.iterdir()} == before
    assert not (cache.path.parent.parent / "vocab").exists()


def test_a_flipped_byte_in_the_vocab_map_is_refused(cfg, cache):
    vm = ensure_vocab_map(cfg, cache, V)
    flip_byte(vm.path, at=0.9)
    with pytest.raises(DataError) as e:
        ensure_vocab_map(cfg, cache, V)
    assert e.value.where == str(vm.path) and "does not match the checksum" in e.value.problem
    assert "delete the file to rebuild it" in e.value.fix


def test_a_vocab_map_without_its_sidecar_is_refused(cfg, cache):
    vm = ensure_vocab_map(cfg, cache, V)
    vm.path.with_suffix(".json").unlink()
    with pytest.raises(DataError, match="sidecar .* is missing") as e:
        ensure_vocab_map(cfg, cache, V)
    assert f"delete {vm.path}" in e.value.fix


def test_an_unreadable_vocab_sidecar_is_refused(cfg, cache):
    vm = ensure_vocab_map(cfg, cache, V)
    vm.path.with_suffix(".json").write_text("{")
    with pytest.raises(DataError, match="sidecar is unreadable"):
        ensure_vocab_map(cfg, cache, V)


def test_deleting_the_refused_vocab_map_rebuilds_the_same_map(cfg, cache):
    vm = ensure_vocab_map(cfg, cache, V)
    flip_byte(vm.path, at=0.9)
    vm.path.unlink()
    again = ensure_vocab_map(cfg, cache, V)
    assert again.built and again.d2t.equal(vm.d2t) and again.t2d.equal(vm.t2d)
