"""DFlash2's additions to a DFlash draft: block-local dynamic convolutions and a candidate selector.

    conv = BlockConv(hidden, block_size=16, kernel_size=2, group_size=16)   # identity at init
    u, out_kernel = conv.prepare(x);  y = conv.finish(sublayer(u), out_kernel)
    selector = CandidateSelector(vocab, hidden, rank=256, top_k=16)
    scores = unary_logits.gather(-1, cand) + selector(hidden, predecessor_ids, cand)

The semantics are speculators 0.9.0's ``dflash2`` (z-lab's DFlash2), written here from the math:

- **Block-local dynamic convolution.** Around each decoder sublayer (attention and MLP) of the
  block stream, ``y[o] = Σ_{τ<K, τ<=o} x[o-τ] ⊙ (base[τ] + Δ[o, τ, g(c)])``: ``K`` causal taps
  (``conv_kernel_size``) that never cross a block (``o`` is the slot in the block), a learned
  per-channel base kernel and a token-conditioned correction ``Δ = W x`` shared by the
  ``conv_group_size`` channels of a group. One projection ``W [2·K·G, H]`` of the sublayer
  input gives both the input-side and the output-side correction; ``base [2, K, H]``. Initialised
  as the identity (``base[:, 0] = 1``, the rest and ``W`` zero), so a fresh DFlash2 draft
  computes exactly DFlash. Context rows are never convolved.
- **Candidate selector.** A rank-``r`` (``selector_rank``) bilinear correction to the unary
  logits of the ``top_k`` (``selector_top_k``) unary candidates at each slot, conditioned on the
  token chosen at the previous slot: ``score(c) = logit(c) + Σ_r P[prev]_r · (W_h h)_r · S[c]_r``.
  Training is teacher-forced (``prev`` = the true previous token; slot 1's is the anchor) with a
  ``top_k``-way cross-entropy whose label is the target's rank in the candidates; a target outside
  the unary top-k replaces the weakest candidate (``training_candidates``); the unary top-k is
  taken from the unary loss's own logits (``fast.chunked_ce``), so training makes the head's
  product over the vocabulary once. Decoding walks the block left to right, each slot picking the
  best-scored candidate given the previous pick.

Parameter names are speculators': ``layers.{i}.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}`` and ``candidate_selector.{predecessor_codebook, successor_codebook,
hidden_projection.weight}``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from specforge_core.errors import ConfigError

ARCHITECTURE = "DFlash2DraftModel"
# The DFlash2 fields of ``dflash_config`` and their defaults (speculators 0.9.0's).
DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "sliding_window_non_causal": True,
}


def dflash2_fields(dflash_config: dict) -> dict | None:
    """The DFlash2 fields of a ``dflash_config`` (defaults filled in), or None for plain DFlash."""
    if not any(key in dflash_config for key in DEFAULTS):
        return None
    return {key: dflash_config.get(key, default) for key, default in DEFAULTS.items()}


def check_dflash2_fields(fields: dict, *, hidden_size, block_size, vocab_size, layer_types) -> None:
    """Refuse DFlash2 settings the model cannot take (ConfigError naming ``draft.dflash.<field>``)."""
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} is {value!r}", where=f"draft.dflash.{name}",
                              fix=f"set draft.dflash.{name} to an integer >= 1 (default {DEFAULTS[name]})")
    if not isinstance(fields["sliding_window_non_causal"], bool):
        raise ConfigError(f"sliding_window_non_causal is {fields['sliding_window_non_causal']!r}",
                          where="draft.dflash.sliding_window_non_causal", fix="set it to true or false")
    if isinstance(hidden_size, int) and hidden_size % fields["conv_group_size"]:
        raise ConfigError(
            f"conv_group_size {fields['conv_group_size']} does not divide hidden_size {hidden_size}",
            where="draft.dflash.conv_group_size", fix=f"use a divisor of {hidden_size} (16 is standard)",
        )
    if isinstance(block_size, int) and fields["conv_kernel_size"] > block_size:
        raise ConfigError(
            f"conv_kernel_size {fields['conv_kernel_size']} exceeds the block size {block_size}",
            where="draft.dflash.conv_kernel_size", fix=f"use at most {block_size} taps (2 is standard)",
        )
    if isinstance(vocab_size, int) and fields["selector_top_k"] > vocab_size:
        raise ConfigError(
            f"selector_top_k {fields['selector_top_k']} exceeds the vocabulary {vocab_size}",
            where="draft.dflash.selector_top_k", fix=f"use at most {vocab_size} candidates (16 is standard)",
        )
    if "sliding_attention" in (layer_types or ()) and fields["sliding_window_non_causal"]:
        raise ConfigError(
            "bidirectional sliding-window blocks are not implemented: sliding layers attend causally "
            "inside the block",
            where="draft.dflash.sliding_window_non_causal",
            fix="set draft.dflash.sliding_window_non_causal to false, or use full_attention layers "
            "(bidirectional inside the block, which is what the flag asks for)",
        )


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int,
               group_size: int) -> torch.Tensor:
    """``y[b,q] = Σ_τ x[b,q-τ] ⊙ (base[τ] + Δ[b,q,τ,g])`` over taps with ``q % block_size >= τ``.

    ``x [b,Q,H]`` (rows of consecutive blocks, or one partial block from slot 0),
    ``delta [b,Q,K,G]``, ``base [K,H]``; ``G = H / group_size``.
    """
    b, q_len, h = x.shape
    taps, groups = base.shape[0], h // group_size
    slot = torch.arange(q_len, device=x.device) % block_size
    xg = x.view(b, q_len, groups, group_size)
    out = torch.zeros_like(xg)
    for tap in range(taps):
        shifted = F.pad(xg[:, : q_len - tap], (0, 0, 0, 0, tap, 0)) if tap else xg
        coefficient = base[tap].to(x.dtype).view(groups, group_size) + delta[:, :, tap, :, None]
        out = out + shifted * coefficient * (slot >= tap).view(1, q_len, 1, 1).to(x.dtype)
    return out.view(b, q_len, h)


class BlockConv(nn.Module):
    """The input- and output-side convolutions around one sublayer, driven by its input."""

    def __init__(self, hidden_size: int, *, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both base kernels 1, everything else 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the output-side correction to hand to ``finish``."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        y = block_conv(x, delta[..., 0, :, :], self.base_kernel[0], block_size=self.block_size,
                       group_size=self.group_size)
        return y, delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(x, delta, self.base_kernel[1], block_size=self.block_size, group_size=self.group_size)


class CandidateSelector(nn.Module):
    """Rank-r predecessor × hidden × successor scores of candidate tokens."""

    def __init__(self, vocab_size: int, hidden_size: int, *, rank: int, top_k: int, initializer_range: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.initializer_range = initializer_range
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=self.initializer_range)

    def forward(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Transition scores ``[..., K]`` of ``candidate_ids [..., K]`` after ``predecessor_ids [...]``
        at draft outputs ``hidden [..., H]``."""
        context = self.predecessor_codebook[predecessor_ids.long()]
        context = context * self.hidden_projection(hidden).to(context.dtype)
        return (context.unsqueeze(-2) * self.successor_codebook[candidate_ids.long()]).sum(-1)


def unary_top_k(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int, chunk_rows: int = 2048) -> torch.Tensor:
    """Ids ``[R, k]`` of the k largest target-head logits of ``hidden [R, H]``: decoding's unary
    candidates (training takes them from the unary loss's own logits). No gradient; the logits in
    the head's dtype, as the unary loss computes them, one chunk of rows at a time."""
    with torch.no_grad():
        w = lm_head_weight.detach()
        parts = [(rows.to(w.dtype) @ w.T).topk(k, dim=-1).indices for rows in hidden.detach().split(chunk_rows)]
    return torch.cat(parts) if parts else torch.zeros(0, k, dtype=torch.long, device=hidden.device)


def training_candidates(candidate_ids: torch.Tensor, target_ids: torch.Tensor):
    """``(ids, label, contains)``: the unary candidates with a missing target put in the last
    (weakest) place, the target's index among them, and whether the unary top-k held it."""
    k = candidate_ids.shape[-1]
    match = candidate_ids == target_ids.unsqueeze(-1)
    contains = match.any(-1)
    label = torch.where(contains, match.long().argmax(-1), k - 1)
    ids = candidate_ids.clone()
    ids[..., -1] = torch.where(contains, ids[..., -1], target_ids)
    return ids, label, contains


class _CandidateLogits(torch.autograd.Function):
    """``logits[r, k] = hidden[r] · W[ids[r, k]]`` for a frozen head ``W``, a chunk of rows at a
    time in both directions, so the ``[rows, K, H]`` gathered head rows never exist whole and
    nothing but ``hidden``'s inputs is kept for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, chunk):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.chunk, ctx.hidden_dtype = weight, chunk, hidden.dtype
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        parts = [torch.einsum("rh,rkh->rk", h.to(dtype), weight[i].to(dtype))
                 for h, i in zip(hidden.split(chunk), ids.split(chunk))]
        return torch.cat(parts) if parts else hidden.new_zeros(0, ids.shape[-1], dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        parts = [torch.einsum("rk,rkh->rh", g, ctx.weight[i].to(g.dtype))
                 for g, i in zip(grad.split(ctx.chunk), ids.split(ctx.chunk))]
        return torch.cat(parts).to(ctx.hidden_dtype), None, None, None


def candidate_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, candidate_ids: torch.Tensor,
                     chunk_rows: int = 2048) -> torch.Tensor:
    """The target-head logits ``[R, K]`` (at least fp32) of ``candidate_ids`` at ``hidden [R, H]``,
    with gradient to ``hidden`` only (the head is frozen)."""
    return _CandidateLogits.apply(hidden, lm_head_weight.detach(), candidate_ids, chunk_rows)


def candidate_scores(selector: CandidateSelector, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                     predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """Selector scores ``[R, K]``: the unary logits of ``candidate_ids [R, K]`` (at least fp32,
    with gradient to ``hidden [R, H]``) plus the transition scores."""
    unary = candidate_logits(hidden, lm_head_weight, candidate_ids)
    return unary + selector(hidden, predecessor_ids, candidate_ids).to(unary.dtype)


def select_tokens(selector: CandidateSelector, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                  first_predecessor: torch.Tensor) -> torch.Tensor:
    """Greedy selector decoding of one block: ``hidden [b, n, H]`` (the draft slots), the pending
    tokens ``first_predecessor [b]``; slot i picks the best-scored of its unary top-k candidates
    given slot i-1's pick. Returns ``[b, n]`` ids."""
    b, n, _ = hidden.shape
    cand = unary_top_k(hidden.reshape(b * n, -1), lm_head_weight, selector.top_k).view(b, n, -1)
    prev, picks = first_predecessor.long(), []
    for i in range(n):
        scores = candidate_scores(selector, hidden[:, i], lm_head_weight, prev, cand[:, i])
        prev = cand[:, i].gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        picks.append(prev)
    return torch.stack(picks, dim=1)


def selector_training_scores(selector: CandidateSelector, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                             blocks, rows: torch.Tensor, unary_top: torch.Tensor):
    """``(scores [R, K], candidate_ids, label, contains)`` of the teacher-forced selector at the
    weighted slots ``rows`` of ``blocks``, whose draft outputs are ``hidden [R, H]`` and unary
    top-k ids ``unary_top [R, K]`` (``training_candidates``). Slot k's predecessor is the true
    token ``x[a+k-1]`` (slot 1's is the anchor), its target ``x[a+k]``, the objective's label."""
    labels = blocks.labels
    predecessors = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).flatten()[rows]
    ids, label, contains = training_candidates(unary_top, labels.flatten()[rows])
    return candidate_scores(selector, hidden, lm_head_weight, predecessors, ids), ids, label, contains


def selector_objective(selected, weight: torch.Tensor, blocks, rows: torch.Tensor, alpha: float):
    """The selector's loss numerator ``alpha · Σ w · CE_K(scores, label)`` and its metric sums.

    ``selected``: :func:`selector_training_scores`' ``(scores, candidate_ids, label, contains)`` of
    the weighted slots ``rows``; ``weight [R]``: their unary loss weights (the same decay). Sums
    (per draft position i = k-1, ``[B-1]``): ``selector_loss_sum`` (Σ w·CE_K before ``alpha``; a
    scalar), ``selector_correct`` (the teacher-forced pick is the target and the unary top-k held
    it: what decoding can draft), ``selector_recall`` (the unary top-k held the target) and
    ``selector_reach [B]`` (blocks whose first i drafts are all selector-correct; ``accept_reach``'s
    form).
    """
    scores, _, label, contains = selected
    numerator = (F.cross_entropy(scores, label, reduction="none") * weight).sum()
    with torch.no_grad():
        grid = blocks.valid
        flat = torch.zeros(grid.numel(), dtype=torch.bool, device=scores.device)
        correct, recall = flat.clone(), flat.clone()
        correct[rows] = (scores.argmax(-1) == label) & contains
        recall[rows] = contains
        correct, recall = correct.view_as(grid), recall.view_as(grid)
        reach = torch.cumprod(correct[..., 1:].long(), dim=-1).sum((0, 1))
        sums = {
            "selector_loss_sum": numerator.detach(),
            "selector_correct": correct[..., 1:].sum((0, 1)),
            "selector_recall": recall[..., 1:].sum((0, 1)),
            "selector_reach": torch.cat([blocks.keep.sum().view(1), reach]),
        }
    return alpha * numerator, {k: v.double() for k, v in sums.items()}


def summarize_selector_metrics(sums: dict) -> dict[str, float]:
    """Ratios of the selector sums: ``selector_loss`` (Σ w·CE_K / Σ w), ``selector_acc``,
    ``selector_recall`` (pooled over draft positions, per weighted slot) and
    ``selector_accept_length`` (mean leading selector-correct drafts + 1); {} without them."""
    if "selector_correct" not in sums:
        return {}
    s = {k: v.detach().double().cpu() for k, v in sums.items()}

    def ratio(num, den):
        return float(num / den) if den > 0 else 0.0

    total = s["total"].sum()
    reach = s["selector_reach"]
    return {"selector_loss": ratio(s["selector_loss_sum"], s["weight_sum"]),
            "selector_acc": ratio(s["selector_correct"].sum(), total),
            "selector_recall": ratio(s["selector_recall"].sum(), total),
            "selector_accept_length": ratio(reach.sum(), reach[0])}
