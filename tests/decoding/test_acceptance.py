"""Acceptance accounting: the reported figures from hand-made decode records."""

import pytest

from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.speculative import Generation


def _gen(accepted, emitted, num_steps=3, stopped=False):
    return Generation(tokens=list(range(1 + sum(emitted))), num_steps=num_steps,
                      accepted=accepted, emitted=emitted, stopped=stopped)


def test_acceptance_length_is_one_plus_extra_tokens_per_verify_pass():
    stats = AcceptanceStats(3)
    stats.add(_gen([3, 0, 1], [4, 1, 2]))
    s = stats.summary()
    assert s["acceptance_length"] == pytest.approx(7 / 3)
    assert s["mean_accepted_draft_tokens"] == pytest.approx(4 / 3)


def test_no_speculation_gives_exactly_one():
    stats = AcceptanceStats(0)
    stats.add(_gen([0] * 9, [1] * 9, num_steps=0))
    s = stats.summary()
    assert s["acceptance_length"] == 1.0 and s["target_forwards_saved"] == 0


def test_per_position_rates_are_conditional_on_earlier_acceptance():
    stats = AcceptanceStats(3)
    stats.add(_gen([0, 1, 1, 3], [1, 2, 2, 4]))
    # position 0: 3 of 4 rounds; position 1: 1 of the 3 that got there; position 2: 1 of 1
    assert stats.summary()["per_position_acceptance"] == pytest.approx([3 / 4, 1 / 3, 1.0])


def test_forwards_saved_compares_with_one_forward_per_greedy_token():
    stats = AcceptanceStats(3)
    stats.add(_gen([3, 3], [4, 4]))  # 9 tokens: greedy needs 9 forwards, we used 1 + 2
    s = stats.summary()
    assert (s["greedy_target_forwards"], s["target_forwards"], s["target_forwards_saved"]) == (9, 3, 6)


def test_prompts_pool_tokens_and_passes():
    stats = AcceptanceStats(3)
    stats.add(_gen([3], [4]))
    stats.add(_gen([0, 0, 0], [1, 1, 1]))
    assert stats.summary()["acceptance_length"] == pytest.approx(7 / 4)


def test_a_prompt_done_at_prefill_adds_no_verify_pass():
    stats = AcceptanceStats(3)
    stats.add(_gen([], [], stopped=True))
    s = stats.summary()
    assert s["acceptance_length"] is None and s["stopped_on_end_of_turn"] == 1


def test_the_per_request_figure_is_the_mean_of_each_requests_own_ratio():
    stats = AcceptanceStats(3)
    stats.add(_gen([3], [4]))  # 4 tokens in 1 pass
    stats.add(_gen([0, 0, 0], [1, 1, 1]))  # 1 token per pass
    stats.add(_gen([], [], stopped=True))  # ended at the prefill: no ratio
    s = stats.summary()
    assert s["per_request_acceptance_length"] == pytest.approx((4 + 1) / 2)
    assert s["acceptance_length"] == pytest.approx(7 / 4)
