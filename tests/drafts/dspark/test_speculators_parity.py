"""Our DSpark objective against speculators 0.9.0's DSpark model: the same SmolLM2-135M-Instruct
batch (two real conversations packed in one row, target features captured in fp32), the same
draft weights and the same anchors give the same per-slot logits, teacher, losses, acceptance
rates and confidence terms, and the same loss and metrics, within 1e-5 relative.

Where we deliberately differ, the difference is pinned: a block that runs past the end of its
sample is masked there by us and supervised across the boundary by speculators
(``test_blocks_stop_at_the_sample_boundary``)."""

import pytest
import torch

from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.objective import ObjectiveSettings, draft_slots, dspark_loss, slot_terms
from specforge_core.drafts.dspark.settings import dspark_config_from_target
from tests.drafts.dspark.fixtures import randomize
from tests.drafts.dspark.speculators_reference import reference_model, run_reference

pytest.importorskip("speculators")
pytestmark = pytest.mark.slow

BLOCK, LAYERS = 4, [3, 17]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris, a city on the Seine known for its museums."}],
    [{"role": "user", "content": "Give me one tip for writing clear code."},
     {"role": "assistant", "content": "Name things for what they are, and keep each function to one idea."}],
]


@pytest.fixture(scope="module")
def captured(smollm2_dir):
    """SmolLM2 features of both conversations, packed in one row: ours (post-norm last hidden) and
    the reference's (pre-norm, which its frozen verifier_norm normalises)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    rows = []
    for conversation in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        ids = torch.tensor(ids if isinstance(ids[0], int) else ids["input_ids"])
        prompt = len(tokenizer.apply_chat_template(conversation[:1], tokenize=True, add_generation_prompt=True,
                                                   return_dict=False))
        pre = {}
        hook = target.model.norm.register_forward_hook(lambda m, args, out: pre.update(x=args[0]))
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        hook.remove()
        lm = torch.zeros(len(ids), dtype=torch.long)
        lm[prompt : len(ids) - BLOCK] = 1  # no block crosses into the next sample (pinned separately)
        rows.append(dict(ids=ids, lm=lm, aux=torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], -1),
                         last=target.model.norm(pre["x"])[0], pre=pre["x"][0]))
    lengths = [len(r["ids"]) for r in rows]
    cat = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    ours = dict(input_ids=cat["ids"][None], attention_mask=torch.ones_like(cat["ids"])[None], loss_mask=cat["lm"][None],
                aux_hidden=cat["aux"][None], last_hidden=cat["last"][None], seq_ids=seq[None], position_ids=pos[None])
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    return dict(ours=ours, pre=cat["pre"][None], embed=embed, head=head, norm=target.model.norm.weight.detach(),
                config=target.config, dir=smollm2_dir)


def _draft(captured, seed, **fields):
    config = dspark_config_from_target(captured["config"], block_size=BLOCK, num_layers=1, target_layer_ids=LAYERS,
                                       mask_token_id=0, **fields)
    return randomize(DSparkDraftModel(config), seed)


def _reference_inputs(captured):
    """The packed row for speculators, with BLOCK padding tokens after it: its anchors must lie
    BLOCK tokens before the row's end, which the padding (document -1, no loss) guarantees."""
    b = captured["ours"]

    def pad(x, value):
        return torch.cat([x, x.new_full((1, BLOCK, *x.shape[2:]), value)], dim=1)

    return dict(aux=pad(b["aux_hidden"], 0.0), input_ids=pad(b["input_ids"], 0), loss_mask=pad(b["loss_mask"], 0),
                pre_norm_last=pad(captured["pre"], 0.0), document_ids=pad(b["seq_ids"], -1),
                position_ids=pad(b["position_ids"], 0))


def _rel(a, b):
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _plant_bigrams(draft, captured):
    """Make the vanilla Markov bias dominate with a bigram table read off the target's greedy
    choices (each previous token → the target's argmax after it), so that the greedy metrics
    (argmax matches, eal, per-slot accuracy) are compared on real hits, not only on zeros."""
    batch = captured["ours"]
    ids = batch["input_ids"][0]
    greedy = (batch["last_hidden"][0] @ captured["head"].T).argmax(-1)
    head = draft.markov_head
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w2.weight.zero_()
        for row, token in enumerate(ids.unique()[: head.rank].tolist()):
            head.markov_w1.weight[token, row] = 1.0
            head.markov_w2.weight[greedy[ids == token][0], row] = 60.0
    return draft


CASES = [
    dict(fields={}, settings=ObjectiveSettings()),
    dict(fields={"markov_rank": 128}, settings=ObjectiveSettings(), bigrams=True),
    dict(fields={"markov_head_type": "gated"}, settings=ObjectiveSettings(loss_terms={"kl_div": 0.7, "tv": 0.3})),
    dict(fields={"markov_head_type": "rnn", "confidence_head_with_markov": False},
         settings=ObjectiveSettings(gamma=2.0, confidence_head_alpha=0.5)),
    dict(fields={"sample_from_anchor": False}, settings=ObjectiveSettings(loss_terms={"ce": 1.0},
                                                                          per_position_loss_weight="dpace")),
]


@pytest.mark.parametrize("case", CASES, ids=["vanilla", "vanilla-bigram-hits", "gated-kl+tv", "rnn-plain-confidence",
                                             "dflash-slots-dpace"])
def test_losses_and_metrics_equal_speculators(captured, case):
    draft, settings = _draft(captured, 3, **{"markov_rank": 32} | case["fields"]), case["settings"]
    if case.get("bigrams"):
        _plant_bigrams(draft, captured)
    kwargs = dict(embed_weight=captured["embed"], lm_head_weight=captured["head"], num_anchors=6, backend="sdpa")
    slots = draft_slots(draft, captured["ours"], generator=torch.Generator().manual_seed(1), **kwargs)
    terms = slot_terms(slots, settings)
    loss, sums = dspark_loss(draft, captured["ours"], settings=settings, generator=torch.Generator().manual_seed(1),
                             **kwargs)
    anchors = slots.blocks.anchor_col[slots.blocks.keep]
    ref = reference_model(draft, embed_weight=captured["embed"], lm_head_weight=captured["head"],
                          norm_weight=captured["norm"], verifier_dir=captured["dir"])
    ref_loss, metrics, seen = run_reference(
        ref, anchors, **_reference_inputs(captured), loss_terms=settings.loss_terms, gamma=settings.gamma,
        per_position_loss_weight=settings.per_position_loss_weight, dpace_alpha=settings.dpace_alpha,
        confidence_head_alpha=settings.confidence_head_alpha)
    from speculators.losses import eager

    n = anchors.numel()
    ref_logits, ref_teacher = seen["logits"].view(n, BLOCK, -1), seen["targets"].view(n, BLOCK, -1)
    ref_mask = seen["loss_mask"].view(n, BLOCK).float()
    assert torch.equal(slots.mask, ref_mask)
    figures = {
        "logits": _rel(slots.logits, ref_logits),
        "teacher": _rel(slots.teacher, ref_teacher),
        "rate": _rel(terms["rate"] * slots.mask, (1 - eager.tv_loss(seen["logits"], seen["targets"])).view(n, BLOCK) * ref_mask),
    }
    for name in settings.loss_terms:
        ref_term = getattr(eager, f"{name}_loss")(seen["logits"], seen["targets"]).view(n, BLOCK) * ref_mask
        figures[name] = _rel(terms[name], ref_term)
    if slots.confidence is not None:
        figures["confidence_logits"] = _rel(slots.confidence, seen["confidence_logits"].view(n, BLOCK))
    figures["loss"] = _rel(loss.detach().double() / sums["weight_sum"], ref_loss)
    s = 0 if draft.sample_from_anchor else 1
    mine = {
        "accept_rate": sums["accept_rate_sum"] / sums["weight_sum"],
        "accept_len": sums["accept_len_sum"] / sums["blocks"],
        "eal": sums["greedy_len_sum"] / sums["blocks"],
        "full_acc": sums["correct"].sum() / sums["total"].sum(),
    }
    if slots.confidence is not None:
        mine |= {"confidence_loss": sums["confidence_sum"] / sums["weight_sum"],
                 "confidence_abs_error": sums["confidence_abs_error_sum"] / sums["weight_sum"],
                 "confidence_pred_mean": sums["confidence_pred_sum"] / sums["weight_sum"],
                 "confidence_cumprod_bias": sums["confidence_cumprod_bias_sum"] / sums["total"].sum()}
    for i in range(s, BLOCK):
        mine[f"position_{i}_acc"] = sums["correct"][i - s] / sums["total"][i - s]
    for name, value in mine.items():
        figures[name] = _rel(value, metrics[f"{name}_sum"] / metrics[f"{name}_total"])
    print({k: f"{v:.1e}" for k, v in figures.items()})
    assert max(figures.values()) <= 1e-5, figures
    if case.get("bigrams"):
        assert 0 < sums["correct"].sum() < sums["total"].sum() and mine["eal"] > 1.5


def test_blocks_stop_at_the_sample_boundary(captured):
    """Supervised to the end of each sample, a block near the end of the first conversation runs
    into the second: speculators supervises those slots (with the next sample's tokens as the
    Markov head's previous tokens), we mask them. Every other slot agrees."""
    batch = dict(captured["ours"])
    seq = batch["seq_ids"][0]
    first_end = int((seq == 0).sum())
    lm = batch["loss_mask"].clone()
    lm[0, first_end - BLOCK : first_end] = 1
    lm[0, first_end - 1] = 0  # the last token of a sample never anchors, for either side
    batch["loss_mask"] = lm
    draft = _draft(captured, 5)
    generator = torch.Generator().manual_seed(0)
    slots = draft_slots(draft, batch, embed_weight=captured["embed"], lm_head_weight=captured["head"],
                        num_anchors=64, generator=generator, backend="sdpa")
    anchors = slots.blocks.anchor_col[slots.blocks.keep]
    ref = reference_model(draft, embed_weight=captured["embed"], lm_head_weight=captured["head"],
                          norm_weight=captured["norm"], verifier_dir=captured["dir"])
    inputs = _reference_inputs(dict(captured, ours=batch))
    _, _, seen = run_reference(ref, anchors, **inputs, loss_terms={"kl_div": 1.0}, gamma=4.0)
    ref_mask = seen["loss_mask"].view(-1, BLOCK).float()
    columns = anchors[:, None] + torch.arange(BLOCK)
    crosses = seq[columns.clamp(max=len(seq) - 1)] != seq[anchors][:, None]
    assert crosses.any()
    assert torch.equal(ref_mask - slots.mask, (crosses & (ref_mask > 0)).float())
    same = slots.mask > 0
    assert _rel(slots.logits[same], seen["logits"].view(-1, BLOCK, seen["logits"].shape[-1])[same]) <= 1e-5


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_gradients_equal_speculators(captured, head_type):
    """The gradient of every draft parameter (backbone and heads) of our loss divided by Σ m equals
    that of speculators' loss."""
    draft = _draft(captured, 7, markov_rank=32, markov_head_type=head_type)
    settings = ObjectiveSettings(loss_terms={"kl_div": 0.5, "tv": 0.5})
    loss, sums = dspark_loss(draft, captured["ours"], embed_weight=captured["embed"], lm_head_weight=captured["head"],
                             num_anchors=6, settings=settings, generator=torch.Generator().manual_seed(2), backend="sdpa")
    (loss / sums["weight_sum"].float()).backward()
    slots = draft_slots(draft, captured["ours"], embed_weight=captured["embed"], lm_head_weight=captured["head"],
                        num_anchors=6, generator=torch.Generator().manual_seed(2), backend="sdpa")
    ref = reference_model(draft, embed_weight=captured["embed"], lm_head_weight=captured["head"],
                          norm_weight=captured["norm"], verifier_dir=captured["dir"]).train()
    ref_loss, _, _ = run_reference(ref, slots.blocks.anchor_col[slots.blocks.keep], **_reference_inputs(captured),
                                   loss_terms=settings.loss_terms, gamma=settings.gamma, grad=True)
    ref_loss.backward()
    theirs = dict(ref.named_parameters())
    worst = {name: _rel(p.grad, theirs[name].grad) for name, p in draft.named_parameters()}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
