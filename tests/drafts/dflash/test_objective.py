"""The fast DFlash objective equals the slow float64 reference (tests/drafts/dflash/reference.py)
in float32: the loss, every metric and every gradient within 1e-5, for block sizes 2/4/16, 1-2
layers, full and sliding layers, padding, and packed rows (which also equal the same samples
unpacked). Loss and gradients are compared as the weighted mean the trainer applies
(numerator / Σw); the numerator itself to 1e-6 relative."""

import dataclasses

import pytest
import torch

from specforge_core.drafts.dflash.inputs import anchor_generator
from specforge_core.drafts.dflash.blocks import build_blocks, pick_anchors
from specforge_core.drafts.dflash.objective import dflash_loss, summarize_dflash_metrics
from specforge_core.errors import ConfigError, ModelError
from tests.drafts.dflash.fixtures import (
    MASK,
    packed_batch,
    random_samples,
    target_weights,
    tiny_draft,
    unpacked_batch,
)
from tests.drafts.dflash.reference import reference_dflash

TOL = 1e-5
SEED = 7
COUNT_KEYS = ("correct", "total", "accept_reach")


def _params(draft):
    return {n: p.detach().double().clone().requires_grad_() for n, p in draft.named_parameters()}


def plant_hits(draft, samples, E, W, num_anchors, gamma, seed):
    """Set the labels of some leading runs of each block to what the reference draft predicts
    there, so accuracy and the simulated acceptance see hits, misses and prefixes of several
    lengths. Only non-anchor tokens change, and a block's predictions depend on its anchor token
    alone, so the anchors and predictions stay what they were."""
    with torch.no_grad():
        ref = reference_dflash(_params(draft), draft.config, samples, E, W, num_anchors=num_anchors, gamma=gamma,
                               generator=torch.Generator().manual_seed(SEED))
    g = torch.Generator().manual_seed(seed)
    size = draft.block_size
    samples = [dict(s, ids=s["ids"].clone()) for s in samples]
    for s, anchors in enumerate(ref["anchors"]):
        fixed = set(anchors)
        for a in anchors:
            run = int(torch.randint(size, (1,), generator=g))
            for k in range(1, run + 1):
                if a + k < len(samples[s]["ids"]) and a + k not in fixed:
                    samples[s]["ids"][a + k] = int(ref["logits"][(s, a)][k].argmax())
                    fixed.add(a + k)
    return samples


def fast(draft, batch, E, W, *, num_anchors, gamma, backend="sdpa", device="cpu", **kw):
    draft.zero_grad()
    on = {k: v.to(device) for k, v in batch.items()}
    loss, sums = dflash_loss(draft.to(device), on, embed_weight=E.to(device), lm_head_weight=W.to(device),
                             block_size=draft.block_size, num_anchors=num_anchors, loss_decay_gamma=gamma,
                             generator=torch.Generator().manual_seed(SEED), backend=backend, **kw)
    loss.backward()
    draft.cpu()
    grads = {n: p.grad.detach().double().cpu() for n, p in draft.named_parameters()}
    return loss.item(), {k: v.cpu() for k, v in sums.items()}, grads


def reference(draft, samples, E, W, *, num_anchors, gamma):
    params = _params(draft)
    ref = reference_dflash(params, draft.config, samples, E, W, num_anchors=num_anchors, gamma=gamma,
                           generator=torch.Generator().manual_seed(SEED))
    ref["loss_sum"].backward()
    ref["grads"] = {n: p.grad for n, p in params.items()}
    return ref


def differences(fast_out, ref):
    """Max |Δ| of (loss, metrics, grads) as the trainer sees them, and exact count checks."""
    loss, sums, grads = fast_out
    den = float(ref["weight_sum"])
    ref = dict(ref, loss_sum=ref["loss_sum"].detach())
    ref_sums = {k: ref[k].detach() for k in ("weight_sum", "loss_sum", "correct", "total", "ce_sum", "accept_reach")}
    fm, rm = summarize_dflash_metrics(sums), summarize_dflash_metrics(ref_sums)
    assert fm.keys() == rm.keys()
    for key in COUNT_KEYS:
        assert torch.equal(sums[key], ref_sums[key]), (key, sums[key], ref_sums[key])
    assert abs(loss - float(ref["loss_sum"])) <= 1e-6 * abs(float(ref["loss_sum"]))
    return {
        "loss": abs(loss - float(ref["loss_sum"])) / den,
        "weight_sum": abs(float(sums["weight_sum"]) - den),
        "metrics": max(abs(fm[k] - rm[k]) for k in rm),
        "grads": max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads) / den,
    }


def check_sees_hits(ref):
    hits, total = ref["correct"].sum(), ref["total"].sum()
    assert 0 < hits < total, (hits, total)
    assert ref["accept_reach"][2] > 0  # some blocks accept two drafts or more


CASES = [
    dict(block_size=2, num_layers=1, layer_types=None, sliding_window=None, gamma=None),
    dict(block_size=4, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5, gamma=2.0),
    dict(block_size=16, num_layers=1, layer_types=None, sliding_window=None, gamma=7.0),
    dict(block_size=16, num_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=16,
         gamma=7.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c['block_size']}-L{c['num_layers']}-W{c['sliding_window']}")
def test_fast_path_matches_reference_with_padding(case):
    size = case["block_size"]
    draft = tiny_draft(seed=size, block_size=size, num_layers=case["num_layers"], layer_types=case["layer_types"],
                       sliding_window=case["sliding_window"])
    E, W = target_weights(size)
    anchors = 3 if size == 16 else 4
    samples = random_samples(size, [14, 9, 19] if size < 16 else [20, 11])
    samples = plant_hits(draft, samples, E, W, anchors, case["gamma"], seed=size)
    ref = reference(draft, samples, E, W, num_anchors=anchors, gamma=case["gamma"])
    if size > 2:
        check_sees_hits(ref)
    diffs = differences(fast(draft, unpacked_batch(samples), E, W, num_anchors=anchors, gamma=case["gamma"]), ref)
    assert max(diffs.values()) < TOL, diffs


def test_packed_rows_equal_the_same_samples_unpacked_and_the_reference():
    draft = tiny_draft(seed=3, block_size=4, num_layers=2, layer_types=["full_attention", "sliding_attention"],
                       sliding_window=6)
    E, W = target_weights(3)
    samples = plant_hits(draft, random_samples(3, [14, 8, 17, 6, 11], supervised=0.9), E, W, 4, 4.0, seed=3)
    ref = reference(draft, samples, E, W, num_anchors=4, gamma=4.0)
    check_sees_hits(ref)
    unpacked = fast(draft, unpacked_batch(samples), E, W, num_anchors=4, gamma=4.0)
    packed = fast(draft, packed_batch(samples, [[0, 1, 4], [2], [3]]), E, W, num_anchors=4, gamma=4.0)
    for out in (unpacked, packed):
        diffs = differences(out, ref)
        assert max(diffs.values()) < TOL, diffs
    assert abs(packed[0] - unpacked[0]) <= 1e-6 * abs(unpacked[0])
    for key in unpacked[1]:
        torch.testing.assert_close(packed[1][key], unpacked[1][key], rtol=1e-6, atol=1e-6)
    for name in unpacked[2]:
        torch.testing.assert_close(packed[2][name], unpacked[2][name], rtol=1e-5, atol=1e-5)


def test_packed_and_unpacked_rows_draw_the_same_anchors_per_sample():
    samples = random_samples(4, [9, 13, 4, 11])
    common = dict(block_size=4, num_anchors=3, mask_token_id=MASK)
    unpacked = build_blocks(unpacked_batch(samples), generator=torch.Generator().manual_seed(1), **common)
    packed = build_blocks(packed_batch(samples, [[1, 3], [0, 2]]), generator=torch.Generator().manual_seed(1), **common)

    def anchors(blocks):
        out = {}
        for s, a, k in zip(blocks.sample.flatten().tolist(), blocks.anchor_pos.flatten().tolist(),
                           blocks.keep.flatten().tolist()):
            if k:
                out.setdefault(s, []).append(a)
        return out

    got = anchors(unpacked)
    assert got == anchors(packed)
    for s, sample in enumerate(samples):
        lm = sample["lm"].tolist()
        cands = [p for p in range(len(lm) - 1) if lm[p] and lm[p + 1]]
        assert got.get(s, []) == sorted(got.get(s, [])) and set(got.get(s, [])) <= set(cands)
        assert len(got.get(s, [])) == min(3, len(cands))


@pytest.mark.parametrize("num_anchors", [1, 5, 12, 40])
def test_anchors_are_the_smallest_keys_of_the_candidates_ties_to_the_lower_position(num_anchors):
    # keys on a grid of 4 values: most keys tie, and the n-th smallest is usually one of a tie
    g = torch.Generator().manual_seed(num_anchors)
    keys = torch.randint(0, 4, (6, 30), generator=g).float() / 4
    cand = torch.rand(6, 30, generator=g) < 0.6
    cand[2] = False  # a sample without candidates: no anchor
    s_idx, a_pos = pick_anchors(keys, cand, num_anchors)
    got = list(zip(s_idx.tolist(), a_pos.tolist()))
    want = [(s, p) for s in range(6) for p in sorted(sorted((p for p in range(30) if cand[s, p]),
                                                            key=lambda p: (float(keys[s, p]), p))[:num_anchors])]
    assert got == want


def with_host_masks(batch):
    from specforge_core.capture.base import HostMasks

    seq = batch.get("seq_ids")
    return dict(batch, host_masks=HostMasks(batch["attention_mask"].long().clone(), batch["loss_mask"].long().clone(),
                                            None if seq is None else seq.long().clone()))


@pytest.mark.parametrize("packed", [False, True])
def test_blocks_laid_out_from_the_host_masks_equal_those_from_the_device_masks(packed):
    samples = random_samples(4, [9, 13, 4, 11])
    batch = packed_batch(samples, [[1, 3], [0, 2]]) if packed else unpacked_batch(samples)
    common = dict(block_size=4, num_anchors=3, mask_token_id=MASK)
    device = build_blocks(batch, generator=torch.Generator().manual_seed(1), **common)
    host = build_blocks(with_host_masks(batch), generator=torch.Generator().manual_seed(1), **common)
    assert device.host_valid is None and host.host_valid is not None
    for name in ("ctx_sample", "ctx_pos", "sample", "anchor_col", "anchor_pos", "keep", "tokens", "labels", "valid"):
        assert torch.equal(getattr(host, name), getattr(device, name)), name
    assert torch.equal(host.host_valid, host.valid)
    assert torch.equal(host.valid_rows(), device.valid_rows()) and host.valid_rows().numel() > 0


def test_a_loss_over_host_masks_equals_the_loss_over_the_device_masks():
    samples = random_samples(3, [12, 9, 15])
    draft, (E, W) = tiny_draft(block_size=4), target_weights(0)
    batch = packed_batch(samples, [[0, 1], [2]])
    common = dict(embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=3, loss_decay_gamma=7.0, backend="sdpa")
    loss, sums = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(2), **common)
    host_loss, host_sums = dflash_loss(draft, with_host_masks(batch), generator=torch.Generator().manual_seed(2),
                                       **common)
    assert torch.equal(host_loss, loss)
    for key in sums:
        assert torch.equal(host_sums[key], sums[key]), key


def test_host_masks_of_another_shape_are_refused_naming_the_field():
    samples = random_samples(2, [9, 13])
    batch = with_host_masks(unpacked_batch(samples))
    host = batch["host_masks"]
    batch["host_masks"] = dataclasses.replace(host, loss_mask=host.loss_mask[:, :-1])
    with pytest.raises(ModelError, match=r"host_masks.loss_mask is \(2, 12\) on cpu, expected \(2, 13\)"):
        build_blocks(batch, block_size=4, num_anchors=3, mask_token_id=MASK, generator=torch.Generator().manual_seed(1))


def test_anchor_generator_is_a_pure_function_of_its_coordinates():
    a = anchor_generator(1, step=5, rank=0, micro_step=2)
    b = anchor_generator(1, step=5, rank=0, micro_step=2)
    c = anchor_generator(1, step=5, rank=1, micro_step=2)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    assert not torch.equal(torch.rand(8, generator=anchor_generator(1, step=5, rank=0, micro_step=2)),
                           torch.rand(8, generator=c))


def test_a_batch_without_anchors_has_zero_loss_zero_gradients_and_every_parameter_a_gradient():
    draft = tiny_draft(seed=5)
    E, W = target_weights(5)
    batch = unpacked_batch(random_samples(5, [6, 4]))
    batch["loss_mask"][:, 1::2] = 0  # no two consecutive supervised tokens
    loss, sums, grads = fast(draft, batch, E, W, num_anchors=4, gamma=None)
    assert loss == 0 and float(sums["weight_sum"]) == 0 and float(sums["accept_reach"][0]) == 0
    assert all(not g.any() for g in grads.values())
    assert summarize_dflash_metrics(sums)["simulated_accept_length"] == 0


def test_sdpa_and_flex_agree_on_cpu_without_gradients():
    """The flex block mask comes from the same predicate as the dense one (forward only: torch
    has no CPU flex backward)."""
    draft = tiny_draft(seed=6, block_size=4, num_layers=2, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=5)
    E, W = target_weights(6)
    batch = packed_batch(random_samples(6, [9, 7, 10]), [[0, 1], [2]])
    args = dict(embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=3, loss_decay_gamma=3.0)
    with torch.no_grad():
        dense, dense_sums = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(2), backend="sdpa",
                                        **args)
        flex, flex_sums = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(2), backend="flex",
                                      **args)
    assert abs(dense.item() - flex.item()) < 1e-4
    assert torch.equal(dense_sums["total"], flex_sums["total"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex attention backward)")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c['block_size']}-L{c['num_layers']}-W{c['sliding_window']}")
def test_fast_path_on_cuda_matches_reference_on_packed_rows(case, backend):
    size = case["block_size"]
    draft = tiny_draft(seed=size, block_size=size, num_layers=case["num_layers"], layer_types=case["layer_types"],
                       sliding_window=case["sliding_window"])
    E, W = target_weights(size)
    samples = plant_hits(draft, random_samples(size, [14, 9, 19]), E, W, 3, case["gamma"], seed=size)
    ref = reference(draft, samples, E, W, num_anchors=3, gamma=case["gamma"])
    out = fast(draft, packed_batch(samples, [[0, 1], [2]]), E, W, num_anchors=3, gamma=case["gamma"],
               backend=backend, device="cuda")
    diffs = differences(out, ref)
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize(
    "kwargs, where",
    [
        (dict(block_size=8), "draft.dflash.block_size"),
        (dict(num_anchors=0), "draft.dflash.num_anchors"),
        (dict(loss_decay_gamma=-1.0), "draft.dflash.loss_decay_gamma"),
        (dict(backend="eager"), "draft.attention_backend"),
    ],
)
def test_invalid_objective_settings_are_refused_naming_the_field(kwargs, where):
    draft = tiny_draft()
    E, W = target_weights(0)
    args = dict(embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=4, loss_decay_gamma=7.0,
                generator=None) | kwargs
    with pytest.raises(ConfigError) as err:
        dflash_loss(draft, unpacked_batch(random_samples(0, [6])), **args)
    assert err.value.where == where


@pytest.mark.parametrize(
    "corrupt, where",
    [
        (lambda b: b.pop("aux_hidden"), "captured batch"),
        (lambda b: b.update(aux_hidden=b["aux_hidden"][..., :-1]), "captured batch: aux_hidden"),
        (lambda b: b["position_ids"].add_(1), "captured batch: position_ids"),
        (lambda b: b["seq_ids"][0, 1].fill_(1), "captured batch: seq_ids"),
    ],
    ids=["missing-aux", "aux-width", "positions", "split-sample"],
)
def test_malformed_batches_are_refused_naming_the_field(corrupt, where):
    draft = tiny_draft()
    E, W = target_weights(0)
    batch = packed_batch(random_samples(0, [5, 4]), [[0, 1]])
    corrupt(batch)
    with pytest.raises(ModelError) as err:
        dflash_loss(draft, batch, embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=4,
                    loss_decay_gamma=7.0, generator=None)
    assert err.value.where == where
