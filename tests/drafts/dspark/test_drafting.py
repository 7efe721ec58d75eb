"""The DSpark drafter in the evaluator's loop, on a tiny random Qwen3 target: its slot-by-slot
Markov walk proposes what the training objective's block predicts when the block's tokens are
those proposals, the confidence head shortens chains under a threshold, and speculative decoding
stays the target's greedy output."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from specforge_core.decoding.speculative import decode_batch
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.drafts.dspark.drafting import DSparkDrafter
from specforge_core.drafts.dspark.objective import draft_slots
from tests.drafts.dflash.fixtures import MASK, target_config
from tests.drafts.dspark.fixtures import tiny_dspark

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(target_config()).eval()


def _states(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def _drafter(draft, model, threshold=None):
    return DSparkDrafter(draft, embed_weight=model.get_input_embeddings().weight,
                         lm_head_weight=model.lm_head.weight, confidence_threshold=threshold)


@pytest.mark.parametrize("fields", [{}, {"markov_head_type": "rnn"}, {"sample_from_anchor": False}],
                         ids=["vanilla", "rnn", "dflash-slots"])
def test_proposals_are_the_training_blocks_argmax_given_those_proposals(target, fields):
    draft = tiny_dspark(2, block_size=BLOCK, **fields).eval()
    ids = torch.randint(MASK, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    a = 7
    states = _states(target, ids)
    aux = torch.cat([states[k + 1][0] for k in draft.target_layer_ids], -1)
    drafter = _drafter(draft, target)
    drafter.extend([(ids[1 : a + 1], aux[:a])])
    steps = drafter.max_steps
    proposal = drafter.propose(steps)[0]
    # the same prefix with the proposals written after the anchor: teacher forcing = the walk
    forced = ids[: a + 1] + proposal + [0] * 3
    n = len(forced)
    batch = {"input_ids": torch.tensor([forced]), "attention_mask": torch.ones(1, n, dtype=torch.long),
             "loss_mask": torch.ones(1, n, dtype=torch.long),
             "aux_hidden": torch.cat([aux, aux.new_zeros(n - len(ids), aux.shape[-1])])[None],
             "last_hidden": torch.zeros(1, n, target.config.hidden_size)}
    with torch.no_grad():
        slots = draft_slots(draft, batch, embed_weight=target.get_input_embeddings().weight,
                            lm_head_weight=target.lm_head.weight, num_anchors=n, generator=None, backend="sdpa")
    j = slots.blocks.anchor_col[0].tolist().index(a)
    first = 0 if draft.sample_from_anchor else 1
    assert slots.logits[j, first:].argmax(-1).tolist() == proposal


def test_a_confidence_threshold_shortens_chains_and_none_keeps_them_whole(target):
    draft = tiny_dspark(4, block_size=BLOCK).eval()
    ids = [3, 17, 42, 9, 100, 5]
    states = _states(target, ids)
    aux = torch.cat([states[k + 1][0] for k in draft.target_layer_ids], -1)
    lengths = {}
    for threshold in (None, 0.0, 0.99):
        drafter = _drafter(draft, target, threshold)
        drafter.extend([(ids[1:], aux[:-1])])
        lengths[threshold] = len(drafter.propose(BLOCK)[0])
    assert lengths[None] == lengths[0.0] == BLOCK
    assert lengths[0.99] == 1


PROMPTS = [[3, 17, 42, 9, 100], [7, 7, 1], [250, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("threshold", [None, 0.3])
@pytest.mark.parametrize("fields", [{}, {"sample_from_anchor": False, "markov_head_type": "gated"}])
def test_speculative_decoding_with_the_drafter_is_lossless(target, threshold, fields):
    draft = tiny_dspark(5, block_size=BLOCK, **fields).eval()
    drafter = _drafter(draft, target, threshold)
    decoding = DecodingTarget(target, list(draft.target_layer_ids))
    spec = decode_batch(decoding, PROMPTS, max_new_tokens=12, stop_ids=set(), drafter=drafter,
                        num_steps=drafter.max_steps)
    plain = decode_batch(decoding, PROMPTS, max_new_tokens=12, stop_ids=set())
    assert [g.tokens for g in spec] == [g.tokens for g in plain]


def test_the_run_config_sets_the_evaluators_threshold_and_refuses_it_without_the_head(target):
    from specforge_core.config import load_config
    from specforge_core.drafts import check_config, get_family
    from specforge_core.errors import ConfigError

    draft = tiny_dspark(6, block_size=BLOCK).eval()
    family = get_family("dspark")
    cfg = load_config("examples/tiny-cpu.yaml", ["draft.family=dspark", "draft.dspark.confidence_threshold=0.4"])
    assert family.drafter(draft, target, cfg).confidence_threshold == 0.4
    assert family.drafter(draft, target, load_config("examples/tiny-cpu.yaml", ["draft.family=dspark"])) \
        .confidence_threshold is None
    with pytest.raises(ConfigError, match="confidence_threshold"):
        check_config(load_config("examples/tiny-cpu.yaml", ["draft.family=dspark",
                                                            "draft.dspark.confidence_threshold=0.4",
                                                            "draft.dspark.enable_confidence_head=false"]))
