"""The DSpark objective: DFlash's anchor blocks, the distillation loss against the target's own
next-token distributions, and a confidence head fitted to the analytical acceptance rate.

    loss, sums = dspark_loss(draft, batch, embed_weight=E, lm_head_weight=W, num_anchors=512,
                             settings=ObjectiveSettings(), generator=g)
    loss.backward()                          # the numerator; the trainer divides by Σ m (weight_sum)
    summarize_dspark_metrics(sums)           # after summing sums over micro-steps and ranks

``batch`` as DFlash's (``drafts.dflash.objective``) plus ``last_hidden [b,T,H]``, the target's
post-norm final hidden: the teacher is ``P_t = softmax(W · last_hidden[t])``, the target's
distribution of token t+1. Anchors and blocks are DFlash's (``build_blocks``, same generator
contract). Per block with anchor a and slot k (``s = 0`` with ``sample_from_anchor``, else 1):

- slot k predicts token ``a+k+1-s``: draft ``q_k = softmax(W h_k + b_k)`` (``b_k`` the Markov
  bias given ``prev_k = x[a+k-s]``, the anchor for k = 0), teacher ``p_k = P_{a+k-s}``;
- mask ``m_k`` = the block is kept · ``a+k`` is a token of the same sample · ``lm[a+k]`` · ``k >= s``;
- per-slot loss ``ℓ_k = Σ_terms c · ℓ^term(q_k, p_k)`` (``kl_div``: KL(p‖q); ``tv``: 1 − Σ min(p,q);
  ``ce``: −log q_k[argmax p_k]), each weighed by ``w_k = exp(-(k-s)/γ)`` or, for
  ``per_position_loss_weight="dpace"``, D-PACE's ``w_k = Σ_{j≥k} m_j Π_{i≤j} ((1-α)e^{-ℓ_i m_i} + α)``
  (factors 1 where ``m_i = 0``), computed per term from that term's ``ℓ`` without gradient;
- acceptance rate ``r_k = 1 − d_TV(q_k, p_k) = Σ_v min(q_v, p_v)`` (no gradient);
- confidence loss ``BCE(c_k, r_k)`` at the fixed decay ``exp(-(k-s)/γ)`` (also under D-PACE), times α.

**Normalisation.** ``loss = Σ m·w·ℓ + α Σ m·w·BCE`` is the numerator and ``sums["weight_sum"] =
Σ m`` the denominator: the trainer's sum contract (``drafts.dflash.objective``), giving
speculators' per-batch ``Σ m w ℓ / Σ m`` for one batch and the global mean over many.

``sums`` (float64, added over micro-steps and ranks): ``weight_sum``, ``loss_sum``, ``term_sums``
per loss term, ``confidence_sum``; per slot ``correct``/``total`` (greedy argmax matches of the
masked slots); ``accept_rate_sum`` (Σ m r); per block, ``accept_len_sum`` (Σ over blocks with a
masked slot of ``1 + Σ_k Π_{i≤k} r_i m_i``, the expected tokens per verify pass under rejection
sampling), ``greedy_len_sum`` (``1 +`` the leading run of masked argmax matches) and ``blocks``;
``confidence_abs_error_sum``, ``confidence_pred_sum``, ``confidence_cumprod_bias_sum``.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specforge_core.drafts.dflash.inputs import check_batch
from specforge_core.drafts.dflash.inputs import field as batch_field
from specforge_core.drafts.dflash.blocks import DFlashBlocks, build_blocks
from specforge_core.drafts.dflash.objective import attend_blocks
from specforge_core.drafts.vocab.soft_target_ce import soft_target_terms
from specforge_core.drafts.vocab import kernels as vocab_kernels
from specforge_core.drafts.vocab.teacher import compute_teacher, full_vocabulary, softmax_from_lse
from specforge_core.errors import ConfigError, ModelError

LOSS_TERMS = ("kl_div", "tv", "ce")
WEIGHTINGS = ("fixed-exp-decay", "dpace")


@dataclass(frozen=True)
class ObjectiveSettings:
    """speculators 0.9.0's DSpark defaults (``get_trainer_kwargs`` and its trainer's CLI)."""

    loss_terms: dict[str, float] = field(default_factory=lambda: {"kl_div": 1.0})
    gamma: float = 4.0
    per_position_loss_weight: str = "fixed-exp-decay"
    dpace_alpha: float = 0.5
    confidence_head_alpha: float = 1.0

    def check(self) -> None:
        bad = sorted(set(self.loss_terms) - set(LOSS_TERMS))
        if not self.loss_terms or bad:
            raise ConfigError(f"loss terms {dict(self.loss_terms)}", where="draft.dspark.loss_terms",
                              fix=f"map one or more of {', '.join(LOSS_TERMS)} to weights, e.g. {{kl_div: 1.0}}")
        if not self.gamma > 0:
            raise ConfigError(f"gamma {self.gamma!r}", where="draft.dspark.loss_decay_gamma", fix="set it > 0 (4.0)")
        if self.per_position_loss_weight not in WEIGHTINGS:
            raise ConfigError(f"per_position_loss_weight {self.per_position_loss_weight!r}",
                              where="draft.dspark.per_position_loss_weight", fix=f"use one of {', '.join(WEIGHTINGS)}")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ConfigError(f"dpace_alpha {self.dpace_alpha!r}", where="draft.dspark.dpace_alpha",
                              fix="set it in (0, 1] (0.5)")
        if self.confidence_head_alpha < 0:
            raise ConfigError(f"confidence_head_alpha {self.confidence_head_alpha!r}",
                              where="draft.dspark.confidence_head_alpha", fix="set it >= 0 (1.0)")


def slot_losses(name: str, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``ℓ^name`` per row of ``logits, teacher [n, V]`` (fp32)."""
    logq, logp = logits.float().log_softmax(-1), teacher.float().log_softmax(-1)
    if name == "kl_div":
        return F.kl_div(logq, logp.exp(), reduction="none").sum(-1)
    if name == "tv":
        return 1.0 - torch.minimum(logq.exp(), logp.exp()).sum(-1)
    return -logq.gather(-1, teacher.argmax(-1, keepdim=True))[:, 0]


def position_weights(settings: ObjectiveSettings, mask: torch.Tensor, start: int,
                     loss: torch.Tensor | None = None) -> torch.Tensor:
    """``w [n, B]`` of ``mask [n, B]`` (float): the fixed decay, or D-PACE's from ``loss [n, B]``."""
    k = torch.arange(mask.shape[-1], device=mask.device, dtype=mask.dtype)
    if loss is None or settings.per_position_loss_weight == "fixed-exp-decay":
        return torch.exp(-(k - start).clamp(min=0) / settings.gamma) * (k >= start)
    with torch.no_grad():
        alpha = settings.dpace_alpha
        smooth = torch.where(mask > 0, (1.0 - alpha) * torch.exp(-loss * mask) + alpha, torch.ones_like(loss))
        prefix = torch.cumprod(smooth, dim=-1) * mask
        return prefix.flip(-1).cumsum(-1).flip(-1) * mask


@dataclass
class Slots:
    """Every block slot of one micro-batch, blocks flattened to rows ``n = b·NB``."""

    blocks: DFlashBlocks  # the anchors and their layout (``build_blocks``)
    start: int  # s: the first drafting slot (0 with sample_from_anchor, else 1)
    logits: torch.Tensor  # [n, B, V] draft logits in the head's dtype, Markov bias included (with grad)
    teacher: torch.Tensor  # [n, B, V] target logits (head's dtype) of the token each slot predicts
    teacher_lse: torch.Tensor  # [n, B] fp32 logsumexp of ``teacher``
    teacher_argmax: torch.Tensor  # [n, B] the target's greedy token
    mask: torch.Tensor  # [n, B] float m
    confidence: torch.Tensor | None  # [n, B] fp32 confidence logits (with grad)


def draft_slots(draft, batch, *, embed_weight, lm_head_weight, num_anchors: int,
                generator: torch.Generator | None, backend: str = "auto") -> Slots:
    """Anchor blocks, one draft forward and the teacher of every slot (module docstring).
    Logits stay in the head's dtype (the Markov bias added in the head's matmul); on CUDA the
    teacher is made in vocabulary chunks (``compute_teacher``): no fp32 ``[n, B, V]`` copy of either."""
    check_batch(batch, draft, embed_weight, lm_head_weight)
    last = batch_field(batch, "last_hidden")
    if last is None:
        raise ModelError("captured batch lacks last_hidden (the teacher)", where="captured batch",
                         fix="capture with last_hidden (the DSpark family asks for it)")
    size, s = draft.block_size, 0 if draft.sample_from_anchor else 1
    blocks = build_blocks(batch, block_size=size, num_anchors=num_anchors, mask_token_id=draft.mask_token_id,
                          generator=generator)
    ids, aux = batch_field(batch, "input_ids"), batch_field(batch, "aux_hidden")
    b, nb, _ = blocks.tokens.shape
    k = torch.arange(size, device=ids.device)
    # blocks.valid is keep · in-sample · lm[a+k] · (k > 0); an anchor is kept only where lm[a]
    mask = (blocks.valid | ((k == 0) & blocks.keep[..., None])) & (k >= s)
    prev = blocks.labels if s == 0 else torch.cat([blocks.labels[..., :1], blocks.labels[..., :-1]], dim=-1)
    teacher_col = (blocks.anchor_col[..., None] + k - s).clamp(0, ids.shape[1] - 1)
    layout, aux, attend = attend_blocks(blocks, aux, draft, backend)
    grown = layout.tokens.shape[1] - nb  # flex's padding blocks
    prev_ids = F.pad(prev, (0, 0, 0, grown), value=draft.mask_token_id).flatten(1)
    embeds = F.embedding(layout.tokens.flatten(1), embed_weight.detach())
    out = draft(embeds, layout.positions, attend, prev_token_ids=prev_ids, target_hidden=aux,
                context_positions=layout.ctx_pos)
    W = lm_head_weight.detach()
    hidden = out.hidden[:, : nb * size].to(W.dtype).flatten(0, 1)
    if out.markov_bias is None:
        logits = hidden @ W.T
    else:
        logits = torch.addmm(out.markov_bias[:, : nb * size].to(W.dtype).flatten(0, 1), hidden, W.T)
    with torch.no_grad():
        rows = last.gather(1, teacher_col.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).flatten(0, 1)
        if W.is_cuda:  # vocabulary chunks, one pass each (the Triton kernel where it applies)
            made = compute_teacher(rows, W, full_vocabulary(W.shape[0], W.device), compile=False)
            teacher, lse, argmax = made.logits, made.lse, made.argmax
        else:  # the plain loss reads the whole rows anyway: one matmul, its logsumexp and argmax
            teacher = rows.to(W.dtype) @ W.T
            lse, argmax = torch.logsumexp(teacher.float(), dim=-1), teacher.argmax(-1)
    conf = out.confidence_logits
    return Slots(blocks, s, logits.view(b * nb, size, -1), teacher.view(b * nb, size, -1), lse.view(-1, size),
                 argmax.view(-1, size), mask.float().view(-1, size),
                 None if conf is None else conf[:, : nb * size].float().reshape(-1, size))


def teacher_entropy(teacher: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``H(p) = lse - Σ_v p_v t_v`` per row of ``teacher [N, V]`` given its fp32 logsumexp (no
    gradient; rows in blocks, so the fp32 temporaries stay small; on CUDA one Triton pass over
    the rows, ``vocab/kernels.row_entropy``)."""
    if vocab_kernels.usable(teacher):
        return vocab_kernels.row_entropy(teacher, lse)
    rows = max(1, (1 << 22) // teacher.shape[-1])
    out = torch.empty_like(lse)
    with torch.no_grad():
        for r in range(0, teacher.shape[0], rows):
            t = teacher[r : r + rows].float()
            out[r : r + rows] = lse[r : r + rows] - (softmax_from_lse(t, lse[r : r + rows]) * t).sum(-1)
    return out


def slot_terms(slots: Slots, settings: ObjectiveSettings, *, fused: bool | None = None) -> dict[str, torch.Tensor]:
    """Per slot ``[n, B]``: ``<term>`` = m·ℓ^term and ``<term>_weight`` its w, ``rate`` r and
    ``pred`` the draft's greedy token (no grad), ``bce`` and ``bce_weight`` with a confidence head.

    ``fused`` (default: on CUDA) reads ``kl_div`` as ``CE(p, q) - H(p)``: the soft cross-entropy,
    the overlap r and the argmax from one pass over the logits (``soft_target_terms``, the EAGLE3
    loss's fused kernels, whose backward recomputes q) instead of fp32 ``[n, B, V]`` copies. It
    equals the plain form up to fp32 cancellation, ``ε·max|logit|`` per slot; off, every term is
    :func:`slot_losses` on fp32 copies, exact where KL is small next to the logits."""
    m, s, size = slots.mask, slots.start, slots.mask.shape[-1]
    q, p, lse = slots.logits.flatten(0, 1), slots.teacher.flatten(0, 1), slots.teacher_lse.flatten()
    fused = q.is_cuda if fused is None else fused
    if fused:
        rows = torch.arange(lse.numel(), device=lse.device)
        ce, rate, pred = soft_target_terms(q, p, lse, rows, m.flatten(), torch.zeros_like(lse), compile=False)
    else:
        with torch.no_grad():
            rate = torch.minimum(q.float().softmax(-1), p.float().softmax(-1)).sum(-1)
            pred = q.argmax(-1)
    out = {"rate": rate.view(-1, size), "pred": pred.view(-1, size)}
    for name in settings.loss_terms:
        if fused and name == "kl_div":
            out[name] = ce.view(-1, size) - m * teacher_entropy(p, lse).view(-1, size)
        else:
            out[name] = slot_losses(name, q, p).view(-1, size) * m
        out[f"{name}_weight"] = position_weights(settings, m, s, out[name])
    if slots.confidence is not None:
        out["bce"] = F.binary_cross_entropy_with_logits(slots.confidence, out["rate"], reduction="none") * m
        out["bce_weight"] = position_weights(settings, m, s)
    return out


def dspark_loss(draft, batch, *, embed_weight, lm_head_weight, num_anchors: int, settings: ObjectiveSettings,
                generator: torch.Generator | None, backend: str = "auto"):
    """``(loss, sums)`` of one micro-batch (module docstring): ``loss`` the fp32 numerator with
    grad, ``sums`` float64. Raises ConfigError / ModelError as ``dflash_loss`` does, and
    ModelError when ``last_hidden`` is missing."""
    settings.check()
    slots = draft_slots(draft, batch, embed_weight=embed_weight, lm_head_weight=lm_head_weight,
                        num_anchors=num_anchors, generator=generator, backend=backend)
    terms = slot_terms(slots, settings)
    term_sums = [(terms[name] * terms[f"{name}_weight"]).sum() for name in settings.loss_terms]
    loss = sum(c * t for c, t in zip(settings.loss_terms.values(), term_sums))
    confidence_sum = loss.new_zeros(())
    if "bce" in terms:
        confidence_sum = (terms["bce"] * terms["bce_weight"]).sum()
        loss = loss + settings.confidence_head_alpha * confidence_sum
    s = slots.start
    with torch.no_grad():
        conf = None if slots.confidence is None else slots.confidence.sigmoid()[:, s:]
        sums = _metric_sums(slots.mask[:, s:], terms["rate"][:, s:], terms["pred"][:, s:],
                            slots.teacher_argmax[:, s:], conf)
        sums.update(weight_sum=slots.mask.sum(), loss_sum=loss.detach(), confidence_sum=confidence_sum.detach(),
                    term_sums=torch.stack(term_sums).detach())
    return loss, {key: value.double() for key, value in sums.items()}


def _metric_sums(m, rate, pred, target, conf_prob) -> dict[str, torch.Tensor]:
    """Per-slot and per-block sums over the draft slots (columns ``s..B-1``)."""
    hit = (pred == target) & (m > 0)
    block = (m.sum(-1) > 0).float()
    accept_prefix = torch.cumprod(rate * m, dim=-1)
    sums = {
        "correct": hit.float().sum(0),
        "total": m.sum(0),
        "accept_rate_sum": (rate * m).sum(),
        "accept_len_sum": ((accept_prefix.sum(-1) + 1.0) * block).sum(),
        "greedy_len_sum": ((torch.cumprod(hit.float(), dim=-1).sum(-1) + 1.0) * block).sum(),
        "blocks": block.sum(),
    }
    if conf_prob is not None:
        sums["confidence_abs_error_sum"] = ((conf_prob - rate).abs() * m).sum()
        sums["confidence_pred_sum"] = (conf_prob * m).sum()
        sums["confidence_cumprod_bias_sum"] = ((torch.cumprod(conf_prob * m, -1) - accept_prefix) * m).sum()
    return sums


def summarize_dspark_metrics(sums: dict[str, torch.Tensor], loss_terms=("kl_div",)) -> dict[str, float]:
    """Ratios of (reduced) sums; an empty denominator gives 0. ``loss`` (per masked slot),
    ``<term>_loss`` when there are several terms, ``confidence_loss``, ``acc`` and ``acc_i`` per
    draft slot, ``accept_rate``, ``accept_length`` (analytical, rejection sampling) and
    ``simulated_accept_length`` (greedy), both counting the bonus token, ``blocks``, and the
    confidence calibration ``confidence_abs_error``, ``confidence_pred_mean``,
    ``confidence_cumprod_bias`` when the head exists."""
    s = {k: v.detach().double().cpu() for k, v in sums.items()}

    def ratio(num, den):
        return float(num / den) if den > 0 else 0.0

    n, blocks = s["weight_sum"], s["blocks"]
    out = {"loss": ratio(s["loss_sum"], n), "confidence_loss": ratio(s["confidence_sum"], n),
           "acc": ratio(s["correct"].sum(), s["total"].sum()), "accept_rate": ratio(s["accept_rate_sum"], n),
           "accept_length": ratio(s["accept_len_sum"], blocks),
           "simulated_accept_length": ratio(s["greedy_len_sum"], blocks), "blocks": float(blocks)}
    if len(loss_terms) > 1:
        out.update({f"{name}_loss": ratio(v, n) for name, v in zip(loss_terms, s["term_sums"])})
    for i in range(s["correct"].numel()):
        out[f"acc_{i}"] = ratio(s["correct"][i], s["total"][i])
    if "confidence_pred_sum" in s:
        out["confidence_abs_error"] = ratio(s["confidence_abs_error_sum"], n)
        out["confidence_pred_mean"] = ratio(s["confidence_pred_sum"], n)
        out["confidence_cumprod_bias"] = ratio(s["confidence_cumprod_bias_sum"], s["total"].sum())
    return out
