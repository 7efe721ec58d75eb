"""Packing: samples share rows under a token budget, and each keeps its own loss and metrics."""

import pytest
import torch

from specforge_core.errors import DataError
from specforge_core.drafts.eagle3 import ttt_unroll
from fixtures.packing import pack_samples, plan_packs
from tests.drafts.eagle3.fixtures import target_head, tiny_draft

LENGTHS = [7, 5, 9, 4]
HT = 24


def samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        dict(
            input_ids=torch.randint(24, (n,), generator=g),
            loss_mask=(torch.rand(n, generator=g) < 0.8).long(),
            aux_hidden=torch.randn(n, 3 * HT, generator=g),
            last_hidden=torch.randn(n, HT, generator=g),
        )
        for n in LENGTHS
    ]


def test_plan_fills_rows_first_fit_in_order_within_the_budget():
    assert plan_packs(LENGTHS, token_budget=16) == [[0, 1, 3], [2]]
    assert plan_packs(LENGTHS, token_budget=9) == [[0], [1, 3], [2]]


def test_a_sample_longer_than_the_budget_is_a_data_error():
    with pytest.raises(DataError, match="token_budget"):
        plan_packs([3, 20], token_budget=16)


def test_packed_rows_restart_positions_and_label_each_token_with_its_sample():
    batch = pack_samples(samples(), [[0, 1, 3], [2]], row_length=16)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["position_ids"][0].tolist() == list(range(7)) + list(range(5)) + list(range(4))
    assert batch["seq_ids"][1].tolist() == [2] * 9 + [-1] * 7
    assert batch["attention_mask"][1].tolist() == [1] * 9 + [0] * 7
    assert torch.equal(batch["aux_hidden"][0, 7:12], samples()[1]["aux_hidden"])


def per_sample_sums(steps, seq_ids, n_samples):
    """{field: [sample][step]} sums of the step terms over each sample's positions."""
    out = {}
    for field in ("loss", "correct", "valid", "accept", "in_draft"):
        out[field] = torch.tensor(
            [[getattr(s, field).detach()[seq_ids == i].sum().item() for s in steps] for i in range(n_samples)]
        )
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
def test_each_sample_has_the_same_loss_and_metric_sums_packed_or_unpacked(backend):
    # seed 7: a random draft that happens to hit some targets, so "correct" is compared on non-zeros
    draft, W, data = tiny_draft(seed=7), target_head(4, HT), samples()
    padded = pack_samples(data, [[i] for i in range(len(data))])  # one sample per row, right-padded
    packed = pack_samples(data, plan_packs(LENGTHS, token_budget=16), row_length=16)
    with torch.no_grad():
        alone = per_sample_sums(ttt_unroll(draft, padded, W, ttt_length=5, backend=backend), padded["seq_ids"], 4)
        shared = per_sample_sums(ttt_unroll(draft, packed, W, ttt_length=5, backend=backend), packed["seq_ids"], 4)
    assert alone["valid"].sum() > 0 and alone["correct"].sum() > 0
    for field in alone:
        assert (alone[field] - shared[field]).abs().max() < 1e-5, field


def test_attention_never_crosses_samples_in_a_packed_row():
    draft, W = tiny_draft(seed=6), target_head(6, HT)
    packed = pack_samples(samples(1), [[0, 1, 3]], row_length=16)
    packed["aux_hidden"].requires_grad_(True)
    steps = ttt_unroll(draft, packed, W, ttt_length=4, backend="sdpa")
    sample_1 = packed["seq_ids"] == 1
    sum(s.loss[sample_1].sum() for s in steps).backward()
    grad_rows = packed["aux_hidden"].grad[0].abs().sum(-1)
    assert grad_rows[sample_1[0]].sum() > 0
    assert torch.all(grad_rows[~sample_1[0]] == 0)
