"""The DFlash objective: random anchor blocks, one draft forward, weighted same-position CE.

    g = anchor_generator(seed, step=step, rank=rank, micro_step=micro)
    loss, sums = dflash_loss(draft, batch, embed_weight=E, lm_head_weight=W, block_size=16,
                             num_anchors=512, loss_decay_gamma=7.0, generator=g)
    loss.backward()                       # the numerator Σ w·CE: see "normalisation" below
    summarize_dflash_metrics(sums)        # after summing sums over micro-steps and ranks

``batch``: a captured batch (``inputs.py``), ``aux_hidden [b,T,K·H]`` the draft's target
layers concatenated in ``target_layer_ids`` order; ``last_hidden`` is not read. The math
(SpecForge's ``OnlineDFlashModel``), per **sample** (an unpacked row, or one document of a
packed row), with within-sample positions:

- **anchors**: candidates p with ``lm[p]`` and ``lm[p+1]`` (p+1 in the sample). Sample by sample,
  in sample order (``seq_ids`` order; rows when unpacked), ``torch.rand(L_s, generator)`` draws
  one key per position; the ``min(N, #candidates)`` candidates with the smallest keys are the
  anchors, sorted. So a packed batch and the same samples unpacked get the same anchors from
  the same generator state, and no sample's anchors depend on how it is laid out.
- **blocks**: block j is ``[x_a, MASK × (B-1)]`` at positions ``a .. a+B-1``, embedded by the
  frozen target embedding. The context is ``ctx = hidden_norm(fc(aux))`` of every real token.
- **mask** (True = may attend), for block j of sample s and slot o: context key c iff c is in s
  and ``pos[c] < a`` (strictly before the anchor), and for sliding layers also
  ``pos[c] >= a + o - (W-1)``; block key iff it is in block j (sliding layers: slot ``<= o``).
  Nothing crosses a sample or a block.
- **weights**: ``w = keep · inbounds · (k>0) · lm[a+k] · exp(-(k-1)/γ)`` (no decay when γ is
  None), ``inbounds`` = ``a+k`` is a token of the same sample. Slot k predicts ``x[a+k]``.
- **loss**: ``Σ w · CE(target_head(h), x[a+k])`` over the full target vocab (computed in row
  chunks: ``fast/chunked_ce.py``).

**Normalisation (the trainer's contract).** ``loss`` is the *numerator* ``Σ w·CE`` of this
micro-batch and ``sums["weight_sum"]`` its ``Σ w``. The objective is the global weighted mean
``Σ_{micro-steps, ranks} Σ w·CE / Σ_{micro-steps, ranks} Σ w``: back-propagate each micro-step's
numerator unscaled, all-reduce (sum) ``weight_sum`` over the step's micro-steps and ranks, and
divide the accumulated gradients by that global ``Σ w`` before clipping (if the gradient
reduction averages over ranks, as FSDP's does, divide by ``Σ w / world_size`` instead). Skip
the update if the global ``Σ w`` is 0.

``sums`` are float64 tensors that ranks and micro-steps add: ``weight_sum``, ``loss_sum``
(= the numerator, detached), per draft position i = k-1 (``[B-1]``) ``correct``, ``total``
(unweighted counts of weighted slots) and ``ce_sum`` (unweighted CE), and ``accept_reach [B]``:
``accept_reach[i]`` = blocks whose first i drafts (slots 1..i) all have a target and are
argmax-correct (``accept_reach[0]`` = all blocks).

Backends: ``sdpa`` (dense bool masks ``[b, Q, T+Q]`` from :func:`visible`; CPU and GPU),
``flex`` (CUDA: a block mask from the same predicate, ``fast/flex_blocks.py``), ``auto`` = flex
on CUDA, sdpa elsewhere. The anchors' generator is ``inputs.anchor_generator``.
"""

import torch
import torch.nn.functional as F

from specforge_core.drafts.dflash import dflash2
from specforge_core.drafts.dflash.blocks import DFlashBlocks, build_blocks, dense_masks, visible, window_of
from specforge_core.drafts.dflash.fast.chunked_ce import target_cross_entropy
from specforge_core.drafts.dflash.fast.flex_blocks import flex_attend, pad_for_flex, resolve_block_backend
from specforge_core.drafts.dflash.inputs import check_batch, check_objective_settings, field
from specforge_core.drafts.dflash.model import dense_attend

SUM_KEYS = ("weight_sum", "loss_sum", "correct", "total", "ce_sum", "accept_reach")


def attend_blocks(blocks: DFlashBlocks, aux: torch.Tensor, draft, backend: str):
    """``(blocks, aux, attend)``: the draft's attention over ``blocks`` under :func:`visible`, dense
    masks through sdpa or block masks through flex (which pads blocks and context to its tiles)."""
    if resolve_block_backend(backend, aux.device) == "sdpa":
        return blocks, aux, dense_attend(dense_masks(blocks, draft.layer_types, draft.sliding_window))
    blocks, aux = pad_for_flex(blocks, aux, draft.mask_token_id)
    windows = {lt: window_of(lt, draft.sliding_window) for lt in set(draft.layer_types)}
    return blocks, aux, flex_attend(blocks, visible, windows)


def dflash_loss(
    draft,
    batch,
    *,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    block_size: int,
    num_anchors: int,
    loss_decay_gamma: float | None,
    generator: torch.Generator | None,
    backend: str = "auto",
    ce_chunk_rows: int = 2048,
    selector_loss_alpha: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, sums)`` of one micro-batch (module docstring): ``loss`` = Σ w·CE, the numerator
    (fp32 scalar with grad; divide the gradients by the global Σ w, ``sums["weight_sum"]``
    summed over micro-steps and ranks), ``sums`` the float64 metric sums.

    ``embed_weight`` / ``lm_head_weight``: the target's frozen ``[V, H]`` embedding and head (no
    gradient reaches them). ``generator`` draws the anchors (``anchor_generator``; None: the
    global CPU RNG). The draft is used through its forward and, for DFlash2, its
    ``candidate_selector``, both inside the FSDP root's forward (the trainer's), where FSDP2 has
    gathered every parameter; every rank runs them even when its batch has no anchor (one
    padding block), so collectives match. A DFlash2 draft adds ``selector_loss_alpha`` times its
    selector's numerator and sums (``dflash2.selector_objective``), its candidates the unary
    loss's top-k. Raises ConfigError for invalid objective settings and
    ModelError for a malformed batch.
    """
    check_objective_settings(draft, block_size, num_anchors, loss_decay_gamma)
    check_batch(batch, draft, embed_weight, lm_head_weight)
    blocks = build_blocks(batch, block_size=block_size, num_anchors=num_anchors,
                          mask_token_id=draft.mask_token_id, generator=generator)
    ids, aux = field(batch, "input_ids"), field(batch, "aux_hidden")
    blocks, aux, attend = attend_blocks(blocks, aux, draft, backend)
    b, nb, size = blocks.tokens.shape
    embeds = F.embedding(blocks.tokens.flatten(1), embed_weight.detach())
    rows = blocks.valid_rows()
    hidden = draft(embeds, blocks.positions, attend, target_hidden=aux, context_positions=blocks.ctx_pos)
    selector = getattr(draft, "candidate_selector", None)
    k = torch.arange(size, device=ids.device)
    decay = torch.ones(size, device=ids.device, dtype=torch.float64)
    if loss_decay_gamma is not None:
        decay = torch.exp(-(k - 1).clamp(min=0).double() / loss_decay_gamma)
    weight64 = blocks.valid.double() * decay
    weight = weight64.float()
    slots = hidden.flatten(0, 1)[rows]  # the weighted slots' outputs, targets and weights
    slot_labels, slot_weight = blocks.labels.flatten()[rows], weight.flatten()[rows]
    loss, ce, pred, top = target_cross_entropy(slots, lm_head_weight, slot_labels, slot_weight, ce_chunk_rows,
                                               top_k=0 if selector is None else selector.top_k)
    if selector is not None:
        selected = dflash2.selector_training_scores(selector, slots, lm_head_weight, blocks, rows, top)
        extra, selector_sums = dflash2.selector_objective(selected, slot_weight, blocks, rows, selector_loss_alpha)
        loss = loss + extra
    with torch.no_grad():
        hit = torch.zeros(b * nb * size, dtype=torch.bool, device=ids.device)
        hit[rows] = pred == slot_labels
        hit = hit.view(b, nb, size)
        ce_grid = torch.zeros(b * nb * size, device=ids.device).index_copy(0, rows, ce.detach()).view(b, nb, size)
        reach = torch.cumprod(hit[..., 1:].long(), dim=-1).sum((0, 1))
        sums = {
            "weight_sum": weight64.sum(),
            "loss_sum": loss.detach(),
            "correct": hit[..., 1:].sum((0, 1)),
            "total": blocks.valid[..., 1:].sum((0, 1)),
            "ce_sum": ce_grid[..., 1:].sum((0, 1)),
            "accept_reach": torch.cat([blocks.keep.sum().view(1), reach]),
        }
        if selector is not None:
            sums.update(selector_sums)
    return loss, {key: value.double() for key, value in sums.items()}


def summarize_dflash_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Ratios from (reduced) sums; an empty denominator gives 0.

    ``loss`` (Σ w·CE / Σ w), ``acc`` (pooled over draft positions), per draft position i
    (0 = the first masked slot): ``acc_i``, ``ce_i`` and ``accept_rate_i`` (P(draft i correct |
    drafts before it correct), comparable to the evaluator's per-position acceptance),
    ``simulated_accept_length`` = mean over blocks of (leading correct drafts + 1): tokens per
    verify pass with the bonus token, the scale of the evaluator's measured acceptance length
    (at most B), and ``blocks``.
    """
    s = {k: v.detach().double().cpu() for k, v in sums.items()}

    def ratio(num, den):
        return float(num / den) if den > 0 else 0.0

    reach = s["accept_reach"]
    out = {"loss": ratio(s["loss_sum"], s["weight_sum"]), "acc": ratio(s["correct"].sum(), s["total"].sum())}
    for i in range(s["correct"].numel()):
        out[f"acc_{i}"] = ratio(s["correct"][i], s["total"][i])
        out[f"ce_{i}"] = ratio(s["ce_sum"][i], s["total"][i])
        out[f"accept_rate_{i}"] = ratio(reach[i + 1], reach[i])
    out["simulated_accept_length"] = ratio(reach.sum(), reach[0])
    out["blocks"] = float(reach[0])
    return out | dflash2.summarize_selector_metrics(sums)
