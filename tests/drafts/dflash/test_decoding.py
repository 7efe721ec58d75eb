"""The DFlash drafter in the evaluator's loop, on a tiny random Qwen3 target: it proposes exactly
what a direct draft forward over the committed context gives, its block equals the training
objective's block at the same anchor, and speculative decoding with it stays lossless."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from specforge_core.drafts.dflash.drafter import DFlashDrafter
from specforge_core.drafts.dflash.model import dense_attend
from specforge_core.drafts.dflash.blocks import build_blocks, dense_masks
from specforge_core.decoding.speculative import decode_batch
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.errors import ConfigError
from tests.drafts.dflash.fixtures import MASK, target_config, tiny_draft

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(target_config()).eval()


def _features(model, ids, layer_ids):
    """The target's features of ``ids``: outputs of the given layers (HF hidden_states[k+1])."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[k + 1][0] for k in layer_ids], dim=-1)


def _direct(draft, model, feats, pending, n):
    """A direct forward: block [pending, MASK×n] after context 0..C-1, every key visible (full) or
    causal-in-block and windowed (sliding), argmax over the target head."""
    c = feats.shape[0]
    positions = torch.arange(c, c + n + 1)[None]
    o = torch.arange(n + 1)
    masks = {"full_attention": torch.ones(1, n + 1, c + n + 1, dtype=torch.bool)}
    if draft.sliding_window is not None:
        ctx = torch.arange(c)[None, :] >= (c + o[:, None] - (draft.sliding_window - 1))
        masks["sliding_attention"] = torch.cat([ctx, o[None, :] <= o[:, None]], dim=1)[None]
    tokens = torch.tensor([[pending] + [MASK] * n])
    with torch.no_grad():
        h = draft(model.get_input_embeddings().weight[tokens], positions, dense_attend(masks),
                  target_hidden=feats[None], context_positions=torch.arange(c)[None])
    return h, (h[0, 1:] @ model.lm_head.weight.T).argmax(-1).tolist()


def _drafter(draft, model):
    return DFlashDrafter(draft, embed_weight=model.get_input_embeddings().weight, lm_head_weight=model.lm_head.weight)


@pytest.mark.parametrize("layer_types, window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_proposals_equal_a_direct_forward_over_the_committed_context(target, layer_types, window):
    draft = tiny_draft(seed=2, block_size=BLOCK, num_layers=len(layer_types or [0]), layer_types=layer_types,
                       sliding_window=window).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(MASK, (n,), generator=g).tolist() for n in (12, 12, 15)]
    prompts, firsts = [5, 3, 8], [4, 7, 2]  # per row: prefill length, then a ragged extension
    feats = [_features(target, s, draft.target_layer_ids) for s in seqs]
    drafter = _drafter(draft, target)
    drafter.extend([(s[1 : p + 1], f[:p]) for s, p, f in zip(seqs, prompts, feats)])
    for r, (s, p, f) in enumerate(zip(seqs, prompts, feats)):
        assert drafter.propose(BLOCK - 1)[r] == _direct(draft, target, f[:p], s[p], BLOCK - 1)[1]
    drafter.extend([(s[p + 1 : p + m + 1], f[p : p + m]) for s, p, m, f in zip(seqs, prompts, firsts, feats)])
    drafter.keep_rows([2, 0])
    proposals = drafter.propose(BLOCK - 1)
    for out, r in zip(proposals, [2, 0]):
        end = prompts[r] + firsts[r]
        assert out == _direct(draft, target, feats[r][:end], seqs[r][end], BLOCK - 1)[1]
    # a shorter serve block is a block of num_steps + 1, as SGLang runs it
    assert drafter.propose(2)[1] == _direct(draft, target, feats[0][: prompts[0] + firsts[0]],
                                            seqs[0][prompts[0] + firsts[0]], 2)[1]


def test_the_decode_block_equals_the_training_block_at_the_same_anchor(target):
    draft = tiny_draft(seed=3, block_size=BLOCK, num_layers=2, layer_types=["full_attention", "sliding_attention"],
                       sliding_window=6).eval()
    ids = torch.randint(MASK, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    feats = _features(target, ids, draft.target_layer_ids)
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, 14, dtype=torch.long),
             "loss_mask": torch.ones(1, 14, dtype=torch.long), "aux_hidden": feats[None]}
    blocks = build_blocks(batch, block_size=BLOCK, num_anchors=5, mask_token_id=MASK,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = draft(target.get_input_embeddings().weight[blocks.tokens.flatten(1)], blocks.positions,
                        dense_attend(dense_masks(blocks, draft.layer_types, draft.sliding_window)),
                        target_hidden=feats[None], context_positions=blocks.ctx_pos)
    anchors = blocks.anchor_col[0].tolist()
    drafter = _drafter(draft, target)
    for j, a in enumerate(anchors):
        drafter.reset()
        drafter.extend([(ids[1 : a + 1], feats[:a])])
        decoded = drafter.block_hidden(BLOCK - 1)[0]
        torch.testing.assert_close(decoded, trained[0, j * BLOCK : (j + 1) * BLOCK], rtol=0, atol=1e-5)


def _decode(model, draft, prompts, drafter=None):
    target = DecodingTarget(model, list(draft.target_layer_ids))
    kwargs = dict(drafter=drafter, num_steps=BLOCK - 1) if drafter is not None else {}
    return decode_batch(target, prompts, max_new_tokens=12, stop_ids=set(), **kwargs)


PROMPTS = [[3, 17, 42, 9, 100], [7, 7, 1], [250, 11, 12, 13, 14, 15]]


def test_speculative_decoding_with_the_drafter_is_lossless(target):
    draft = tiny_draft(seed=5, block_size=BLOCK).eval()
    spec = _decode(target, draft, PROMPTS, _drafter(draft, target))
    assert [g.tokens for g in spec] == [g.tokens for g in _decode(target, draft, PROMPTS)]


def test_a_draft_that_agrees_with_the_target_is_accepted_whole_blocks():
    """Zero final norms: the target's greedy token is always 0 and so is the draft's, so every
    round accepts all B-1 drafts (12 tokens = the prefill token + 11 in ⌈11 / B⌉ rounds)."""
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(target_config()).eval()
    torch.nn.init.zeros_(model.model.norm.weight)
    draft = tiny_draft(seed=6, block_size=BLOCK).eval()
    torch.nn.init.zeros_(draft.norm.weight)
    spec = _decode(model, draft, PROMPTS, _drafter(draft, model))
    for g in spec:
        assert g.tokens == [0] * 12
        assert g.accepted == [BLOCK - 1] * 3 and g.emitted == [BLOCK, BLOCK, 3]


def test_tree_drafting_is_refused_for_a_dflash_draft_before_any_forward(target):
    draft = tiny_draft(seed=5, block_size=BLOCK).eval()
    with pytest.raises(ConfigError, match="DFlashDrafter drafts one chain per verify pass") as e:
        decode_batch(None, PROMPTS, max_new_tokens=12, stop_ids=set(), drafter=_drafter(draft, target),
                     num_steps=BLOCK - 1, topk=2, num_draft_tokens=6)
    assert e.value.where == "topk" and "use topk 1" in e.value.fix
