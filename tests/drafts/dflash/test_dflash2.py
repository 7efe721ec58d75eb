"""DFlash2 (block-local dynamic convolutions + candidate selector) against a float64 loop reference
and against speculators 0.9.0's ``dflash2`` with the same weights."""

import math

import pytest
import torch

from specforge_core.drafts.dflash import dflash2
from specforge_core.drafts.dflash.draft_config import (
    dflash_config_from_dict,
    dflash_config_from_target,
    dflash_config_to_dict,
)
from specforge_core.drafts.dflash.drafter import DFlashDrafter
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.drafts.dflash.objective import dflash_loss, summarize_dflash_metrics
from specforge_core.drafts.dflash.serving import export_dflash, load_exported_dflash
from specforge_core.errors import ConfigError
from tests.drafts.dflash.fixtures import MASK, packed_batch, random_samples, target_config, target_weights

speculators_dflash2 = pytest.importorskip("speculators.models.dflash2.model_definitions")


def tiny_dflash2(seed=0, *, block_size=4, top_k=4, rank=8, group=16, taps=2, num_layers=1) -> DFlashDraftModel:
    config = dflash_config_from_target(
        target_config(), block_size=block_size, num_layers=num_layers, target_layer_ids=[1, 3], mask_token_id=MASK,
        dflash2_fields={"selector_top_k": top_k, "selector_rank": rank, "conv_group_size": group,
                        "conv_kernel_size": taps},
    )
    draft = DFlashDraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm." in name or name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
            elif "codebook" in name:
                param.copy_(torch.randn(param.shape, generator=g) / 2)
            else:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5)
    return draft


# ---- config ------------------------------------------------------------------------------------


def test_defaults_are_speculators_and_round_trip_through_json():
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig

    fields = DFlash2SpeculatorConfig.model_fields
    for name, default in dflash2.DEFAULTS.items():
        assert fields[name].default == default, name
    config = dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK,
                                       dflash2_fields={})
    data = dflash_config_to_dict(config)
    assert data["architectures"] == ["DFlash2DraftModel"]
    assert {k: data["dflash_config"][k] for k in dflash2.DEFAULTS} == dflash2.DEFAULTS
    assert dflash_config_from_dict(data).dflash_config == config.dflash_config


@pytest.mark.parametrize("fields, where", [
    ({"conv_group_size": 24}, "draft.dflash.conv_group_size"),       # does not divide 64
    ({"conv_kernel_size": 5}, "draft.dflash.conv_kernel_size"),      # > block size 4
    ({"selector_top_k": 300}, "draft.dflash.selector_top_k"),        # > vocab 256
    ({"selector_rank": 0}, "draft.dflash.selector_rank"),
    ({"sliding_window_non_causal": "yes"}, "draft.dflash.sliding_window_non_causal"),
])
def test_invalid_fields_are_refused_naming_the_field(fields, where):
    with pytest.raises(ConfigError) as err:
        dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK,
                                  dflash2_fields=fields)
    assert err.value.where == where


def test_bidirectional_sliding_blocks_are_refused_and_causal_ones_accepted():
    kw = dict(block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK, layer_types=["sliding_attention"],
              sliding_window=8)
    with pytest.raises(ConfigError) as err:
        dflash_config_from_target(target_config(), **kw, dflash2_fields={})
    assert err.value.where == "draft.dflash.sliding_window_non_causal"
    dflash_config_from_target(target_config(), **kw, dflash2_fields={"sliding_window_non_causal": False})


# ---- convolution -------------------------------------------------------------------------------


def loop_conv(x, delta, base, block_size, group_size):
    """float64 loops: y[b,q,c] = Σ_{τ <= q % B} x[b,q-τ,c] · (base[τ,c] + delta[b,q,τ,c // group])."""
    x, delta, base = x.double(), delta.double(), base.double()
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for q in range(x.shape[1]):
            for tap in range(base.shape[0]):
                if q % block_size < tap:
                    continue
                for c in range(x.shape[2]):
                    out[b, q, c] += x[b, q - tap, c] * (base[tap, c] + delta[b, q, tap, c // group_size])
    return out


@pytest.mark.parametrize("taps, q_len", [(2, 12), (3, 12), (2, 3)])
def test_block_conv_equals_the_loop_reference(taps, q_len):
    g = torch.Generator().manual_seed(taps)
    x = torch.randn(2, q_len, 8, generator=g)
    delta = torch.randn(2, q_len, taps, 2, generator=g)
    base = torch.randn(taps, 8, generator=g)
    got = dflash2.block_conv(x, delta, base, block_size=4, group_size=4)
    torch.testing.assert_close(got.double(), loop_conv(x, delta, base, 4, 4), rtol=1e-6, atol=1e-6)


def test_block_conv_equals_speculators_grouped_dynamic_conv():
    g = torch.Generator().manual_seed(1)
    x, delta, base = torch.randn(1, 16, 32, generator=g), torch.randn(1, 16, 2, 2, generator=g), torch.randn(2, 32)
    theirs = speculators_dflash2.grouped_dynamic_conv(x, delta, base, block_size=4, group_size=16)
    torch.testing.assert_close(dflash2.block_conv(x, delta, base, block_size=4, group_size=16), theirs)


def test_a_fresh_dflash2_draft_computes_exactly_dflash():
    """Identity convolutions at init: the block stream equals a DFlash draft with the same weights."""
    d2 = DFlashDraftModel(dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3],
                                                    mask_token_id=MASK, dflash2_fields={"selector_rank": 8}))
    d1 = DFlashDraftModel(dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3],
                                                    mask_token_id=MASK))
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if "conv" not in k and "selector" not in k})
    g = torch.Generator().manual_seed(0)
    embeds, aux = torch.randn(1, 8, 64, generator=g), torch.randn(1, 5, 128, generator=g)
    pos, ctx_pos = torch.arange(5, 13)[None], torch.arange(5)[None]
    attend = lambda lt, q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    out2 = d2(embeds, pos, attend, target_hidden=aux, context_positions=ctx_pos)
    torch.testing.assert_close(out2, d1(embeds, pos, attend, target_hidden=aux, context_positions=ctx_pos))


def test_layer_convolutions_equal_speculators_modules_with_the_same_weights():
    draft = tiny_dflash2(3)
    conv = draft.layers[0].attention_conv
    theirs = speculators_dflash2.GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    theirs.load_state_dict(conv.state_dict())
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(4))
    (mine, mk), (ref, rk) = conv.prepare(x), theirs.prepare(x)
    torch.testing.assert_close(mine, ref)
    torch.testing.assert_close(conv.finish(x, mk), theirs.finish(x, rk))


def test_a_dflash2_layer_equals_speculators_decoder_layer_with_the_same_weights():
    """One block of 8 after 5 context rows, full attention, float64 (speculators' eager attention
    takes its softmax in fp32 and HF's RMSNorm computes in fp32, hence 1e-5 relative)."""
    from specforge_core.drafts.dflash.model import Context

    draft = tiny_dflash2(12, block_size=8).double()
    draft.config._attn_implementation = "eager"
    theirs = speculators_dflash2.Qwen3DFlash2DecoderLayer(draft.config, 0, block_size=8, conv_kernel_size=2,
                                                          conv_group_size=16).double()
    theirs.load_state_dict(draft.layers[0].state_dict(), strict=True)
    g = torch.Generator().manual_seed(0)
    ctx, z = torch.randn(1, 5, 64, generator=g).double(), torch.randn(1, 8, 64, generator=g).double()
    cos, sin = draft.rotary_emb(ctx, torch.arange(13)[None])
    attend = lambda lt, q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        ours = draft.layers[0](z, cos[:, 5:], sin[:, 5:], Context(ctx=ctx, cos=cos[:, :5], sin=sin[:, :5]), attend)
        ref = theirs(target_hidden=ctx, hidden_states=z, attention_mask=None, position_embeddings=(cos, sin))
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-5


def test_chunked_candidate_logits_equal_a_plain_gather_and_its_gradient():
    g = torch.Generator().manual_seed(13)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight, ids = torch.randn(40, 16, generator=g, dtype=torch.float64), torch.randint(0, 40, (7, 5), generator=g)
    upstream = torch.randn(7, 5, generator=g, dtype=torch.float64)
    (dflash2.candidate_logits(hidden, weight, ids, chunk_rows=3) * upstream).sum().backward()
    mine, hidden.grad = hidden.grad, None
    plain = torch.einsum("rh,rkh->rk", hidden, weight[ids])
    torch.testing.assert_close(dflash2.candidate_logits(hidden, weight, ids, chunk_rows=3), plain)
    (plain * upstream).sum().backward()
    torch.testing.assert_close(mine, hidden.grad)


# ---- selector and objective vs speculators ---------------------------------------------------------


def speculators_selector_terms(draft, hidden, head, blocks_valid, labels, gamma):
    """speculators 0.9.0's selector loss, per-position CE and metrics for our blocks (its [1, N·B]
    layout), with hard targets = our labels (one-hot target logits) and its CandidateSelector
    loaded with our selector's weights."""
    from speculators.models.dflash2.metrics import compute_metrics, selector_training_candidates

    sel = draft.candidate_selector
    theirs = speculators_dflash2.CandidateSelector(vocab_size=head.shape[0], hidden_size=head.shape[1],
                                                    rank=sel.predecessor_codebook.shape[1], top_k=sel.top_k)
    theirs.load_state_dict(sel.state_dict())
    block = blocks_valid.shape[-1]
    h = hidden.reshape(1, -1, hidden.shape[-1]).double()
    unary = h @ head.double().T
    lab = labels.reshape(1, -1)
    targets = torch.nn.functional.one_hot(lab, head.shape[0]).double() * 50.0
    pred = torch.cat([labels[..., :1], labels[..., :-1]], -1).reshape(1, -1)
    cand = unary.topk(sel.top_k, dim=-1).indices
    ids, positions, contains = selector_training_candidates(cand, lab)
    theirs.double()
    scores = theirs.score_candidates(unary, h, pred, ids)
    mask = blocks_valid.reshape(1, -1).double()
    per_pos = torch.nn.functional.cross_entropy(scores[0], positions[0], reduction="none")
    from speculators.losses import eager  # the fused losses need a GPU

    _, metrics = compute_metrics(unary, targets, ids, scores, positions, contains, mask, block, sel.top_k,
                                 loss_config={"kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss,
                                 gamma=gamma)
    return per_pos, mask[0].bool(), metrics


def run_ours(draft, batch, E, W, gamma, num_anchors=3):
    """The objective's loss and sums in float64, its blocks, the draft's outputs, and the selector's
    training scores at the weighted slots made from them as the objective makes them."""
    from specforge_core.drafts.dflash.blocks import build_blocks
    from specforge_core.drafts.dflash.fast.chunked_ce import target_cross_entropy

    captured = {}
    handle = draft.register_forward_hook(lambda _m, _a, output: captured.update(hidden=output))
    try:
        loss, sums = dflash_loss(draft.double(), {k: (v.double() if v.is_floating_point() else v)
                                                  for k, v in batch.items()},
                                 embed_weight=E.double(), lm_head_weight=W.double(), block_size=draft.block_size,
                                 num_anchors=num_anchors, loss_decay_gamma=gamma,
                                 generator=torch.Generator().manual_seed(0), backend="sdpa")
    finally:
        handle.remove()
    blocks = build_blocks(batch, block_size=draft.block_size, num_anchors=num_anchors,
                          mask_token_id=draft.mask_token_id, generator=torch.Generator().manual_seed(0))
    rows = blocks.valid_rows()
    slots = captured["hidden"].flatten(0, 1)[rows]
    selector = draft.candidate_selector
    with torch.no_grad():
        *_, top = target_cross_entropy(slots, W.double(), blocks.labels.flatten()[rows], torch.ones(len(rows)),
                                       top_k=selector.top_k)
        captured["selected"] = dflash2.selector_training_scores(selector, slots, W.double(), blocks, rows, top)
    return loss, sums, blocks, captured


def check_against_speculators(draft, batch, E, W, gamma, num_anchors=3):
    loss, sums, blocks, captured = run_ours(draft, batch, E, W, gamma, num_anchors)
    scores, _, label, _ = captured["selected"]
    ours_ce = torch.nn.functional.cross_entropy(scores, label, reduction="none")
    per_pos, valid, metrics = speculators_selector_terms(draft, captured["hidden"], W, blocks.valid, blocks.labels,
                                                         gamma)
    torch.testing.assert_close(ours_ce, per_pos[valid], rtol=1e-5, atol=1e-7)
    # speculators divides Σ mask·decay·CE by Σ mask; ours is the numerator Σ w·CE (w = mask·decay).
    mask_total = float(blocks.valid.sum())
    assert math.isclose(float(sums["selector_loss_sum"]) / mask_total, float(metrics["selector_loss_sum"]),
                        rel_tol=1e-5)
    k = draft.candidate_selector.top_k
    assert float(sums["selector_recall"].sum()) == float(metrics[f"unary_candidate_recall_at_{k}_sum"])
    assert float(sums["selector_correct"].sum()) == float(metrics["teacher_forced_selector_acc_sum"])
    reach = sums["selector_reach"]
    assert math.isclose(float(reach.sum()), float(metrics["eal_sum"]), rel_tol=1e-9)
    assert float(reach[0]) == float(metrics["eal_total"])
    return loss, sums, per_pos[valid]


def test_selector_loss_and_metrics_equal_speculators_on_random_batches():
    """top_k 128 of 256: targets both inside the unary top-k and injected, some picks correct."""
    draft = tiny_dflash2(5, top_k=128)
    E, W = target_weights(5)
    samples = random_samples(5, [21, 19, 24])
    _, sums, _ = check_against_speculators(draft, packed_batch(samples, [[0, 1], [2]]), E, W, gamma=4.0,
                                           num_anchors=6)
    assert 0 < sums["selector_recall"].sum() < sums["total"].sum() and sums["selector_correct"].sum() > 0


def test_the_loss_adds_alpha_times_the_selector_numerator_and_every_parameter_gets_a_gradient():
    draft = tiny_dflash2(6)
    E, W = target_weights(6)
    batch = packed_batch(random_samples(6, [12, 10]), [[0], [1]])
    kw = dict(embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=3, loss_decay_gamma=4.0, backend="sdpa")
    loss0, sums0 = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(0), selector_loss_alpha=0.0,
                               **kw)
    loss2, sums2 = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(0), selector_loss_alpha=2.0,
                               **kw)
    torch.testing.assert_close(loss2, loss0 + 2.0 * sums0["selector_loss_sum"].float())
    loss2.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    summary = summarize_dflash_metrics(sums2)
    assert 0 <= summary["selector_acc"] <= summary["selector_recall"] <= 1
    assert summary["selector_loss"] > 0


# ---- decoding and export -------------------------------------------------------------------------


def loop_select(draft, hidden, head, pending):
    """Per row and slot: unary top-k of the slot, best unary + transition score given the previous pick."""
    sel, picks = draft.candidate_selector, []
    for b in range(hidden.shape[0]):
        prev, row = int(pending[b]), []
        for i in range(hidden.shape[1]):
            h = hidden[b, i].double()
            logits = head.double() @ h
            cand = logits.topk(sel.top_k).indices.tolist()
            ctx = sel.predecessor_codebook[prev].double() * (sel.hidden_projection.weight.double() @ h)
            best = max(cand, key=lambda c: float(logits[c] + (ctx * sel.successor_codebook[c].double()).sum()))
            row.append(best)
            prev = best
        picks.append(row)
    return picks


def test_drafter_walks_the_selector_like_the_loop_reference():
    draft = tiny_dflash2(7).eval()
    E, W = target_weights(7)
    drafter = DFlashDrafter(draft, embed_weight=E, lm_head_weight=W)
    g = torch.Generator().manual_seed(7)
    drafter.extend([([5, 6, 7], torch.randn(3, 128, generator=g)), ([8, 9], torch.randn(2, 128, generator=g))])
    hidden = drafter.block_hidden(3)[:, 1:]
    assert drafter.propose(3) == loop_select(draft, hidden, W, drafter.pending)


def test_export_round_trip_keeps_speculators_names_and_outputs(tmp_path):
    draft = tiny_dflash2(8)
    out = export_dflash(draft, tmp_path / "export")
    again = load_exported_dflash(out)
    names = set(again.state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"} <= names
    for key, value in draft.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


# ---- real target ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_selector_equals_speculators_on_a_smollm2_batch(smollm2_dir):
    """Captured SmolLM2-135M-Instruct features (fp32), its real embedding and head, a trained-size
    selector: per-position selector CE within 1e-5 relative of speculators', sums equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    text = ["The quick brown fox jumps over the lazy dog because it wanted to see the river.",
            "Speculative decoding drafts several tokens and lets the target verify them in one pass."]
    enc = tok(text, return_tensors="pt", padding=True)
    layer_ids = [4, 14]
    with torch.no_grad():
        out = target(**enc, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    E, W = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    config = dflash_config_from_target(target.config, block_size=8, num_layers=1, target_layer_ids=layer_ids,
                                       mask_token_id=0, dflash2_fields={"selector_rank": 32})
    draft = DFlashDraftModel(config)
    with torch.no_grad():  # move the convolutions and selector away from their init
        for name, param in draft.named_parameters():
            if "conv" in name or "codebook" in name or "selector" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "loss_mask": enc["attention_mask"].clone(), "aux_hidden": aux}
    _, _, per_pos = check_against_speculators(draft, batch, E, W, gamma=7.0)
    assert per_pos.numel() > 20


def test_speculative_decoding_with_a_dflash2_drafter_is_lossless():
    from transformers import Qwen3ForCausalLM

    from specforge_core.decoding.speculative import DecodingTarget, decode_batch

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(target_config()).eval()
    draft = tiny_dflash2(9).eval()
    drafter = DFlashDrafter(draft, embed_weight=model.get_input_embeddings().weight,
                            lm_head_weight=model.lm_head.weight)
    target = DecodingTarget(model, list(draft.target_layer_ids))
    prompts = [[3, 17, 42, 9, 100], [7, 7, 1]]
    spec = decode_batch(target, prompts, max_new_tokens=12, stop_ids=set(), drafter=drafter, num_steps=3)
    plain = decode_batch(target, prompts, max_new_tokens=12, stop_ids=set())
    assert [g.tokens for g in spec] == [g.tokens for g in plain]


def test_a_dflash2_draft_sharded_as_the_trainer_shards_it_gives_the_unsharded_loss_and_gradients(tmp_path):
    """The objective calls the selector outside the draft's forward: inside the trainer's FSDP root
    (``TrainStep``, sharded by ``loop.optim.shard``) its parameters are gathered there too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from specforge_core.loop.optim import shard
    from specforge_core.loop.trainer import TrainStep
    from specforge_core.system.distributed import Dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        E, W = target_weights(10)
        batch = packed_batch(random_samples(10, [9, 6, 11]), [[0, 1], [2]])

        def objective(draft, b):
            return dflash_loss(draft, b, embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=3,
                               loss_decay_gamma=4.0, generator=torch.Generator().manual_seed(0), backend="sdpa")

        def loss_and_grads(module, run):
            loss, sums = run(batch)
            loss.backward()
            grads = {n.removeprefix("draft."): p.grad for n, p in module.named_parameters()}
            full = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
            return loss.item(), sums, full

        plain = tiny_dflash2(10)
        loss, sums, grads = loss_and_grads(plain, lambda b: objective(plain, b))
        d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                 mesh=init_device_mesh("cpu", (1,)))
        root = shard(TrainStep(tiny_dflash2(10), objective), d)
        sharded_loss, sharded_sums, sharded_grads = loss_and_grads(root, root)
        assert set(sharded_grads) == set(grads)
        assert abs(sharded_loss - loss) <= 1e-6 * abs(loss)
        assert torch.equal(sums["selector_correct"], sharded_sums["selector_correct"])
        for name in grads:
            torch.testing.assert_close(sharded_grads[name], grads[name], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_a_few_optimizer_steps_lower_the_dflash2_loss_on_a_fixed_batch():
    draft = tiny_dflash2(11, top_k=16)
    E, W = target_weights(11)
    batch = packed_batch(random_samples(11, [16, 12]), [[0], [1]])
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, sums = dflash_loss(draft, batch, embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=4,
                                 loss_decay_gamma=4.0, generator=torch.Generator().manual_seed(0), backend="sdpa")
        optimizer.zero_grad()
        (loss / sums["weight_sum"].float()).backward()
        optimizer.step()
        losses.append(float(loss / sums["weight_sum"]))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0], losses


def test_the_memory_estimate_counts_the_convolutions_and_the_selector():
    from types import SimpleNamespace

    from specforge_core.drafts.dflash.family import FAMILY

    cfg = SimpleNamespace(training=SimpleNamespace(param_dtype="bfloat16", token_budget=None),
                          draft=SimpleNamespace(dflash=SimpleNamespace(num_anchors=512)))
    plain = dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK)
    two = dflash_config_from_target(target_config(), block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK,
                                    dflash2_fields={})
    base = FAMILY.activation_bytes(cfg, plain, tokens=1024, samples=2)
    assert FAMILY.activation_bytes(cfg, two, tokens=1024, samples=2) > base


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_flex_backend_pads_blocks_without_moving_the_selector_rows(device):
    """flex pads the block grid; the selector must still read the weighted slots (forward only on
    the CPU: torch has no CPU flex backward)."""
    draft = tiny_dflash2(14, top_k=64).to(device)
    E, W = (w.to(device) for w in target_weights(14))
    batch = {k: v.to(device) for k, v in packed_batch(random_samples(14, [13, 9, 15]), [[0, 1], [2]]).items()}
    args = dict(embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=5, loss_decay_gamma=3.0)
    with torch.no_grad():
        dense, dense_sums = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(2), backend="sdpa",
                                        **args)
        flex, flex_sums = dflash_loss(draft, batch, generator=torch.Generator().manual_seed(2), backend="flex",
                                      **args)
    assert abs(dense.item() - flex.item()) < 1e-4 * abs(dense.item())
    for key in ("selector_correct", "selector_recall", "selector_reach"):
        assert torch.equal(dense_sums[key], flex_sums[key]), key
