"""The vectorised DSpark objective equals the float64 loop reference (``reference.py``), packed or
not, for every head type, both slot conventions and both slot weightings; and it trains."""

import pytest
import torch

from specforge_core.drafts.dspark.objective import ObjectiveSettings, dspark_loss, summarize_dspark_metrics
from tests.drafts.dflash.fixtures import target_weights
from tests.drafts.dspark.fixtures import batch_of, samples, tiny_dspark
from tests.drafts.dspark.reference import reference_dspark

LENGTHS = [11, 7, 13]


def _compare(draft, settings, rows, dpace=None):
    E, W = target_weights(4)
    data = samples(4, LENGTHS)
    loss, sums = dspark_loss(draft, batch_of(data, rows), embed_weight=E, lm_head_weight=W, num_anchors=3,
                             settings=settings, generator=torch.Generator().manual_seed(9), backend="sdpa")
    ref = reference_dspark(draft, data, E, W, num_anchors=3, generator=torch.Generator().manual_seed(9),
                           loss_terms=settings.loss_terms, gamma=settings.gamma,
                           confidence_head_alpha=settings.confidence_head_alpha, dpace_alpha=dpace)
    assert sums["weight_sum"] > 0
    for key, value in ref.items():
        torch.testing.assert_close(sums[key], torch.as_tensor(value, dtype=torch.float64), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")
    return loss


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("rows", [None, [[0, 1], [2]]], ids=["unpacked", "packed"])
def test_objective_equals_the_loop_reference(head_type, rows):
    _compare(tiny_dspark(1, markov_head_type=head_type), ObjectiveSettings(loss_terms={"kl_div": 0.6, "tv": 0.4},
                                                                           confidence_head_alpha=0.7), rows)


def test_dflash_slot_convention_equals_the_loop_reference():
    _compare(tiny_dspark(2, sample_from_anchor=False, confidence_head_with_markov=False), ObjectiveSettings(),
             [[0, 1], [2]])


def test_dpace_weights_equal_the_loop_reference():
    settings = ObjectiveSettings(loss_terms={"ce": 1.0}, per_position_loss_weight="dpace", dpace_alpha=0.3)
    _compare(tiny_dspark(3), settings, None, dpace=0.3)


def test_without_heads_the_objective_is_plain_distillation():
    draft = tiny_dspark(5, markov_rank=0, enable_confidence_head=False)
    assert draft.markov_head is None and draft.confidence_head is None
    _compare(draft, ObjectiveSettings(), None)


def test_every_parameter_gets_a_gradient():
    draft = tiny_dspark(6, markov_head_type="rnn")
    _compare(draft, ObjectiveSettings(), None).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())


def test_a_few_steps_lower_the_loss():
    draft = tiny_dspark(7)
    E, W = target_weights(7)
    batch = batch_of(samples(7, LENGTHS), [[0, 1], [2]])
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss, sums = dspark_loss(draft, batch, embed_weight=E, lm_head_weight=W, num_anchors=3,
                                 settings=ObjectiveSettings(), generator=torch.Generator().manual_seed(0),
                                 backend="sdpa")
        opt.zero_grad()
        (loss / sums["weight_sum"].float()).backward()
        opt.step()
        losses.append(summarize_dspark_metrics(sums)["loss"])
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_the_fused_kl_equals_the_plain_terms_and_their_gradient(head_type):
    """The fused path (KL as the soft cross-entropy minus the teacher's entropy, one pass over the
    logits, the CUDA default) gives the plain terms, rate, greedy tokens and parameter gradients,
    up to fp32 cancellation at the logits' scale."""
    from specforge_core.drafts.dspark.objective import draft_slots, slot_terms

    E, W = target_weights(8)
    batch = batch_of(samples(8, LENGTHS), [[0, 1], [2]])
    settings = ObjectiveSettings(loss_terms={"kl_div": 0.6, "tv": 0.4}, confidence_head_alpha=0.7)
    results = {}
    for fused in (False, True):
        draft = tiny_dspark(8, markov_head_type=head_type)
        slots = draft_slots(draft, batch, embed_weight=E, lm_head_weight=W, num_anchors=3,
                            generator=torch.Generator().manual_seed(3), backend="sdpa")
        terms = slot_terms(slots, settings, fused=fused)
        total = sum((terms[n] * terms[f"{n}_weight"]).sum() for n in settings.loss_terms) + terms["bce"].sum()
        total.backward()
        results[fused] = (terms, {n: p.grad for n, p in draft.named_parameters()}, slots.logits.abs().max())
    (plain, plain_grads, scale), (fused, fused_grads, _) = results[False], results[True]
    assert plain["kl_div"].abs().sum() > 0
    atol = 1e-6 * float(scale)
    for key in ("kl_div", "tv", "rate", "bce"):
        torch.testing.assert_close(fused[key], plain[key], rtol=1e-5, atol=atol, msg=lambda m, key=key: f"{key}: {m}")
    assert torch.equal(fused["pred"], plain["pred"])
    worst = {name: float((fused_grads[name] - grad).norm() / grad.norm()) for name, grad in plain_grads.items()}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
