"""Point 7: the d2t/t2d vocab map from loss-masked token counts (the Vd most frequent supervised tokens, SpecForge's rule)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.errors import ModelError
from specforge_core.data.vocab import ensure_vocab_map, load_vocab_map, select_draft_vocab, token_counts

V = 512


@pytest.fixture
def cache(make_cfg, chat_file, tiny_tokenizer):
    return ensure_prompt_cache(make_cfg([chat_file]), tiny_tokenizer)


def test_counts_cover_exactly_the_loss_masked_tokens(cache):
    counts = token_counts(cache.train, V)
    expected = np.zeros(V, dtype=np.int64)
    for ids, mask in zip(cache.train["input_ids"], cache.train["loss_mask"]):
        np.add.at(expected, [i for i, m in zip(ids, mask) if m], 1)
    assert np.array_equal(counts, expected)


def test_top_tokens_in_ascending_target_id_order():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 2, 9, 4]] = [50, 40, 30, 1]
    d2t, t2d = select_draft_vocab(counts, 3)
    assert (d2t + torch.arange(3)).tolist() == [2, 7, 9]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [2, 6, 7]
    assert t2d.dtype == torch.bool and torch.nonzero(t2d).flatten().tolist() == [2, 7, 9]


def test_too_few_distinct_tokens_are_padded_with_the_lowest_unused_ids():
    counts = np.zeros(10, dtype=np.int64)
    counts[[8, 3]] = [5, 2]
    d2t, _ = select_draft_vocab(counts, 4)
    assert (d2t + torch.arange(4)).tolist() == [0, 1, 3, 8]


def test_equal_sizes_give_the_identity_map():
    d2t, t2d = select_draft_vocab(np.arange(6, dtype=np.int64)[::-1].copy(), 6)
    assert d2t.tolist() == [0] * 6 and t2d.all()


def test_ensure_builds_saves_and_reports_coverage(make_cfg, chat_file, cache):
    cfg = make_cfg([chat_file], "draft.draft_vocab_size=16")
    vm = ensure_vocab_map(cfg, cache, V)
    assert vm.built and vm.path == cache.path.parent.parent / "vocab" / f"{vm.key}.pt"
    saved = torch.load(vm.path, weights_only=True)
    assert set(saved) == {"d2t", "t2d"} and torch.equal(saved["d2t"], vm.d2t) and torch.equal(saved["t2d"], vm.t2d)
    counts = token_counts(cache.train, V)
    top16 = np.sort(counts)[::-1][:16].sum() / counts.sum()
    side = json.loads(vm.path.with_suffix(".json").read_text())
    assert side["coverage"] == pytest.approx(top16) == vm.coverage
    assert side["prompt_cache_key"] == cache.key and (side["target_vocab_size"], side["draft_vocab_size"]) == (V, 16)


def test_a_hit_needs_only_the_cache_key_not_the_corpus(make_cfg, chat_file, cache, tmp_path):
    cfg = make_cfg([chat_file], "draft.draft_vocab_size=16")
    first = ensure_vocab_map(cfg, cache, V)
    key_only = dataclasses.replace(cache, path=tmp_path / "no-such-cache")  # its splits cannot be read
    again = ensure_vocab_map(cfg, key_only, V)
    assert not again.built and again.key == first.key and torch.equal(again.d2t, first.d2t)


def test_key_changes_with_target_and_draft_vocab_sizes(make_cfg, chat_file, cache):
    keys = {ensure_vocab_map(make_cfg([chat_file], f"draft.draft_vocab_size={vd}"), cache, v).key
            for v, vd in [(V, 16), (V, 32), (V + 64, 16)]}
    assert len(keys) == 3


def test_load_rejects_an_inconsistent_map(tmp_path):
    path = tmp_path / "m.pt"
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 4]] = True
    torch.save({"d2t": torch.tensor([1, 2]), "t2d": t2d}, path)  # 1+0, 2+1=3 ≠ 4
    with pytest.raises(ModelError, match=r"nonzero\(t2d\) != d2t \+ arange"):
        load_vocab_map(path, 8, 2)


def test_load_rejects_wrong_sizes(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"d2t": torch.zeros(2, dtype=torch.long), "t2d": torch.tensor([True, True, False])}, path)
    with pytest.raises(ModelError, match=r"t2d is torch.bool \(3,\), expected bool \(8,\)"):
        load_vocab_map(path, 8, 2)


def test_draft_vocab_larger_than_target_is_refused(make_cfg, chat_file, cache):
    with pytest.raises(ModelError, match="draft.draft_vocab_size"):
        ensure_vocab_map(make_cfg([chat_file], f"draft.draft_vocab_size={V + 1}"), cache, V)
