"""The EAGLE3 draft module: serving names, frozen target embedding, target RoPE, vocab map, step()."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specforge_core.errors import ModelError
from specforge_core.drafts.eagle3.serving import serving_keys
from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
from specforge_core.drafts.eagle3.model import Eagle3DraftModel, read_target_embedding
from specforge_core.drafts.eagle3.attention import step_zero_visibility
from specforge_core.drafts.eagle3.model import ProjectedTokens
from specforge_core.drafts.eagle3.rows import take_rows
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft, tiny_target_config
from tests.drafts.eagle3.reference import reference_eagle3


@pytest.mark.parametrize("fc_norm", [False, True])
def test_state_dict_is_the_serving_key_set_plus_the_embedding(fc_norm):
    draft = tiny_draft(fc_norm=fc_norm)
    keys = serving_keys(draft.config)
    assert {k: tuple(v.shape) for k, v in draft.draft_state_dict().items()} == {k: s for k, (s, _) in keys.items()}
    assert set(draft.state_dict()) - set(keys) == {"embed_tokens.weight"}  # no RoPE tables persisted
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool


def test_trainable_parameters_exclude_the_frozen_embedding():
    draft = tiny_draft()
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" in trainable and "fc.weight" in trainable


def test_load_embedding_copies_the_target_embedding_and_keeps_it_frozen(tiny_target_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    draft = Eagle3DraftModel(draft_config_from_target(target.config, draft_vocab_size=64))
    weight = read_target_embedding(tiny_target_dir)
    draft.load_embedding(weight)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad
    with pytest.raises(ModelError, match="embed_tokens"):
        draft.load_embedding(weight[:, :-1])


@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16, "rope_theta": 5e5}],
    ids=["default", "linear", "yarn", "llama3"],
)
def test_rotary_embedding_equals_the_targets_own(rope):
    target_cfg = tiny_target_config(dict(rope) if rope else None)
    draft = Eagle3DraftModel(draft_config_from_target(target_cfg, 12))
    x, pos = torch.zeros(1, 5, 8), torch.arange(40, 45)[None]
    for a, b in zip(draft.rotary_emb(x, pos), LlamaRotaryEmbedding(target_cfg)(x, pos)):
        assert torch.equal(a, b)


def test_fc_norm_normalises_each_captured_chunk_before_fc():
    draft = tiny_draft(fc_norm=True)
    aux = torch.randn(2, 3, 72)
    chunks = aux.split(24, -1)
    expected = draft.fc(torch.cat([n(c) for n, c in zip(draft.fc_norm, chunks)], -1))
    assert torch.equal(draft.project_hidden(aux), expected)
    with pytest.raises(ModelError, match="aux_hidden"):
        draft.project_hidden(torch.randn(2, 3, 48))


@pytest.mark.parametrize("norm_output", [False, True])
def test_a_step_carries_the_post_norm_hidden_only_with_norm_output(norm_output):
    draft = tiny_draft(seed=3, norm_output=norm_output)
    h, ids, pos = torch.randn(1, 4, 24), torch.randint(0, 24, (1, 4)), torch.arange(4)[None]
    carried, _ = draft.step(ids, h, pos)
    plain = tiny_draft(seed=3)  # the same weights without the option
    layer_out, _ = plain.step(ids, h, pos)
    assert torch.equal(carried, draft.norm(layer_out) if norm_output else layer_out)
    # the logits are lm_head(norm(layer output)) either way
    assert torch.allclose(draft.compute_logits(carried), plain.compute_logits(layer_out), atol=1e-6)


def test_set_vocab_map_refuses_an_inconsistent_or_missized_map():
    draft = tiny_draft()
    t2d = draft.t2d.clone()
    with pytest.raises(ModelError, match="inconsistent"):
        draft.set_vocab_map(draft.d2t + 1, t2d)
    with pytest.raises(ModelError, match="sizes"):
        draft.set_vocab_map(draft.d2t[:-1], t2d)


def test_cast_params_keeps_rope_frequencies_in_fp32():
    draft = tiny_draft().cast_params(torch.bfloat16)
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.rotary_emb.inv_freq.dtype == torch.float32


def test_step_with_explicit_extra_rows_reproduces_the_ttt_unroll():
    """Chaining step() with the TTT mask gives the reference's logits at every unrolled step."""
    draft, K = tiny_draft(seed=9), 3
    batch = random_batch(seed=9, lengths=[8, 8], T=8, target_hidden=24)
    params = {n: p.detach().double() for n, p in draft.named_parameters()}
    ref = reference_eagle3(params, draft.config, batch, target_head(9, 24), draft.t2d, draft.d2t, K)["logits"]
    T = 8
    visible = step_zero_visibility(batch["attention_mask"], torch.zeros(2, T, dtype=torch.long))
    hidden, past = draft.project_hidden(batch["aux_hidden"]), None
    positions = torch.arange(T).expand(2, T)
    with torch.no_grad():
        for k in range(K):
            ids = F.pad(batch["input_ids"][:, 1 + k :], (0, k + 1))
            same_position = torch.eye(T, dtype=torch.bool).repeat(1, k + 1)[None].expand(2, T, T * (k + 1))
            mask = torch.cat([visible, same_position[:, :, T:]], dim=-1) if k else visible
            hidden, (key, value) = draft.step(ids, hidden, positions + k, past, mask)
            past = (key, value) if past is None else (torch.cat([past[0], key], 2), torch.cat([past[1], value], 2))
            logits = draft.compute_logits(hidden)
            expected = torch.stack([torch.stack(row) for row in ref[k]])
            assert (logits.double() - expected).abs().max() < 1e-5, k


def sdpa_attend(mask: torch.Tensor):
    """An ``attend`` for the layer: sdpa under ``mask [Tq, Tk]`` over its rows-first q/k/v
    (``[B, T, heads, hd]``), grouped-query heads repeated."""

    def attend(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask[None, None]
        ).transpose(1, 2)

    return attend


def test_forward_with_queries_returns_those_rows_of_the_full_forward():
    """Keys and values come from every row; only the chosen rows are computed further."""
    draft = tiny_draft(seed=4)
    ids, aux, pos = torch.randint(24, (1, 6)), torch.randn(1, 6, 72), torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()

    rows = torch.tensor([1, 4, 5])
    with torch.no_grad():
        full_h, full_z = draft(ids, draft.project_hidden(aux), pos, sdpa_attend(causal))
        some_h, some_z = draft(ids, draft.project_hidden(aux), pos, sdpa_attend(causal[rows]), queries=rows)
    torch.testing.assert_close(some_h, full_h[:, rows])
    torch.testing.assert_close(some_z, full_z[:, rows])


def test_qkv_from_the_folded_weights_equal_the_projections_of_the_concatenated_input():
    """q/k/v = {q,k,v}_proj(cat(input_layernorm(e), hidden_norm(h))), RoPE on q and k: the layer
    computes them as the embedding half with the norm's weight folded in plus the hidden half."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    draft = tiny_draft(seed=9).double()
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    g = torch.Generator().manual_seed(9)
    e, h = torch.randn(2, 5, 24, generator=g, dtype=torch.float64), torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
    cos, sin = draft.rotary_emb(h, torch.arange(5).expand(2, 5))
    weights = layer.qkv_weights()
    got = layer.project_qkv(layer.project_embeddings(e, weights), h, cos, sin, weights.hidden)
    x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], dim=-1)
    q, k, v = (proj(x).view(2, 5, -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(got, (q, k, v)):
        torch.testing.assert_close(a, b)


def test_forward_on_projected_tokens_equals_the_forward_on_their_ids():
    """The unroll's path: the tokens' embedding half of q/k/v projected once (with
    input_layernorm's weight folded into the matrix), each step reading its rows of it, gives the
    same outputs and gradients as embedding each step's ids."""
    draft = tiny_draft(seed=8).double()
    ids, aux, pos = torch.randint(24, (1, 6)), torch.randn(1, 6, 72, dtype=torch.float64), torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()

    attend = sdpa_attend(causal)

    def run(tokens):
        draft.zero_grad()
        hidden, logits = draft(tokens, draft.project_hidden(aux), pos, attend)
        (hidden.sum() + logits.pow(2).sum()).backward()
        return hidden, logits, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    vocab_ids = torch.tensor([5, 0, 17, 3, 9, 11, 2])  # tokens in some order; the rows pick them
    rows = torch.tensor([3, 6, 2, 0, 4, 1])
    want = run(vocab_ids[rows][None])
    projected = draft.project_tokens(vocab_ids)
    got = run(ProjectedTokens(take_rows(projected.rows, 0, rows), projected.weights))
    # the unroll's form: the steps' rows taken at once (ProjectedTokens.for_steps)
    slot = torch.full((vocab_ids.numel(),), -1)
    slot[rows] = torch.arange(rows.numel())
    (taken,) = draft.project_tokens(vocab_ids).for_steps([rows], [slot])
    at_once = run(taken)
    for other in (got, at_once):
        torch.testing.assert_close(other[0], want[0])
        torch.testing.assert_close(other[1], want[1])
        assert other[2].keys() == want[2].keys() and "midlayer.input_layernorm.weight" in other[2]
        for name in want[2]:
            torch.testing.assert_close(other[2][name], want[2][name], msg=name)


def test_step_default_mask_is_causal_over_new_rows_after_all_past_rows():
    # float64 and seeded inputs: split-versus-whole differs only by summation order, so a
    # tight tolerance separates a wrong mask (differences of order 1) from rounding.
    draft = tiny_draft(seed=2).double()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(24, (1, 4), generator=g)
    hidden = torch.randn(1, 4, 24, generator=g, dtype=torch.float64)
    pos = torch.arange(4)[None]
    with torch.no_grad():
        whole, _ = draft.step(ids, hidden, pos)
        first, cache = draft.step(ids[:, :2], hidden[:, :2], pos[:, :2])
        second, _ = draft.step(ids[:, 2:], hidden[:, 2:], pos[:, 2:], past_key_values=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
def test_smollm2_draft_trains_on_real_hidden_states_and_its_teacher_is_the_targets_next_token(smollm2_dir):
    """Real target: default capture ids of a 30-layer model, tied embedding, and the shifted
    teacher equal to the target's own logits one position ahead."""
    from transformers import AutoTokenizer

    from specforge_core.drafts.eagle3 import eagle3_loss, summarize_metrics
    from specforge_core.drafts.vocab.teacher import compute_teacher

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = draft_config_from_target(target.config, draft_vocab_size=2048)
    assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    draft = Eagle3DraftModel(cfg)
    draft.load_embedding(read_target_embedding(smollm2_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"},
                                   {"role": "assistant", "content": "The capital of France is Paris."}],
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    states = out.hidden_states
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids),
                 aux_hidden=torch.cat([states[i + 1] for i in (1, 14, 26)], -1), last_hidden=states[-1])
    head = target.get_output_embeddings().weight
    teacher = compute_teacher(batch["last_hidden"][:, 1:], head, draft.t2d)
    assert torch.equal(teacher.argmax, out.logits[:, 1:].argmax(-1))
    loss, sums = eagle3_loss(draft, batch, head, ttt_length=3)
    loss.backward()
    assert torch.isfinite(loss) and draft.fc.weight.grad.abs().sum() > 0
    assert set(summarize_metrics(sums)) >= {"acc_0", "acceptance_rate_2", "ploss_1", "simulated_accept_length"}
