"""The compact teacher: what the loss needs from the target head, without [B, T, V] fp32 logits.

    teacher = compute_teacher(last_hidden, lm_head_weight, draft.t2d)

Target logits are ``last_hidden @ W^T`` (the post-final-norm hidden times the frozen target head),
computed like the target computes them (in the head's dtype) and then read in fp32 (reference
§2.2, §16.6). We stream over chunks of the vocabulary (and of the tokens) and keep only:

- ``logits`` and ``lse``: the Vd draft-vocab logits (ascending target id = draft id order; in
  the head's dtype, which holds them exactly) and their fp32 logsumexp;
  ``probs = exp(logits - lse)``, their softmax, is the soft target of the cross-entropy,
  computed where it is read (the loss's compiled pass over each step's rows), so the teacher
  makes no normalising pass over its ``[N, Vd]`` block;
- ``log_mass``: log of the target's full-vocab probability mass on the draft vocab, so that the
  un-renormalised target probabilities of draft tokens are ``probs * exp(log_mass)``;
- ``argmax``: the full-vocab target argmax (first index on ties, as ``torch.argmax``);
- ``in_draft``: whether that argmax is a draft-vocab token (``t2d[argmax]``).

Peak extra memory is one ``[token_chunk, vocab_chunk]`` fp32 block plus the ``[N, Vd]`` outputs.
On CPU the vocabulary chunk is at most ``CPU_VOCAB_CHUNK``: a block that stays in cache makes the
matmul and the passes over it about 25% faster than 32k-wide blocks (SmolLM2 head, 2 cores).
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from specforge_core.drafts.vocab import kernels as vocab_kernels
from specforge_core.system.compile import fused

CPU_VOCAB_CHUNK = 4096


@dataclass
class Teacher:
    """Teacher quantities per position, shapes ``[..., Vd]`` / ``[...]`` (leading dims of the input)."""

    logits: torch.Tensor
    lse: torch.Tensor
    log_mass: torch.Tensor
    argmax: torch.Tensor
    in_draft: torch.Tensor

    @property
    def probs(self) -> torch.Tensor:
        """The soft target: softmax over the draft-vocab logits (a new tensor each call)."""
        return softmax_from_lse(self.logits, self.lse)

    def take(self, index: torch.Tensor) -> "Teacher":
        """The teacher of the positions ``index`` (along the first dim)."""
        return Teacher(*(x.index_select(0, index) for x in
                         (self.logits, self.lse, self.log_mass, self.argmax, self.in_draft)))

    def target_probs(self) -> torch.Tensor:
        """Un-renormalised target probabilities of the draft tokens ``exp(z_d - logsumexp_V z)``."""
        return self.probs * self.log_mass.exp().unsqueeze(-1)


def softmax_from_lse(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``softmax(logits, -1)`` given their logsumexp ``lse`` (one pass, no reduction)."""
    return (logits - lse.unsqueeze(-1)).exp()


def _chunk_stats(logits: torch.Tensor, cols: torch.Tensor):
    """Of one vocab chunk's logits ``[n, C]``: the draft columns ``cols`` (in the logits' dtype)
    and, read in fp32, their logsumexp, the max and its first index, and the logsumexp of all
    ``C`` (``cols`` not empty)."""
    picked = logits[:, cols]
    return picked, torch.logsumexp(picked.float(), dim=-1), *_chunk_stats_no_draft(logits)


def _chunk_stats_no_draft(logits: torch.Tensor):
    """:func:`_chunk_stats` of a chunk without draft columns: the max, its first index, the logsumexp."""
    z = logits.float()
    top, arg = z.max(dim=-1)
    return top, arg, (z - top[:, None]).exp().sum(dim=-1).log() + top


@lru_cache(maxsize=8)
def full_vocabulary(vocab: int, device: torch.device) -> torch.Tensor:
    """The all-true ``t2d`` of a teacher over the whole vocabulary, one tensor per (size, device):
    :func:`compute_teacher` keeps its chunk layout on the map tensor, so a map made afresh every
    step would make each step wait for the device to list it again."""
    return torch.ones(vocab, dtype=torch.bool, device=device)


def _vocab_chunks(t2d: torch.Tensor, vocab: int, vocab_chunk: int):
    """``(draft_ids, starts, bounds)``: the draft vocabulary's target ids (ascending = draft id
    order), the vocab chunks' first ids, and per chunk the range of draft ids inside it. Kept on
    the map tensor itself until it changes (its version), so a training step does not wait for
    the device to list them."""
    key = (t2d._version, vocab, vocab_chunk)
    kept = getattr(t2d, "_teacher_chunks", None)
    if kept is None or kept[0] != key:
        draft_ids = torch.nonzero(t2d).flatten()
        starts = list(range(0, vocab, vocab_chunk))
        # Draft ids whose target id falls in each vocab chunk form one contiguous range.
        bounds = torch.searchsorted(draft_ids, torch.tensor(starts + [vocab], device=draft_ids.device)).tolist()
        kept = (key, (draft_ids, starts, bounds))
        t2d._teacher_chunks = kept
    return kept[1]


@torch.no_grad()
def compute_teacher(
    last_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    t2d: torch.Tensor,
    vocab_chunk: int = 32768,
    token_chunk: int = 8192,
    *,
    compile: bool = True,
) -> Teacher:
    """Teacher of every position of ``last_hidden [..., Ht]`` under head ``lm_head_weight [V, Ht]``.

    ``t2d`` is the bool ``[V]`` draft-vocab mask. Logits are ``h.to(W.dtype) @ W_chunk^T``, kept in
    that dtype (``Teacher.logits``); softmax, logsumexp and argmax read them in fp32. No gradient.
    ``compile`` (``training.compile``): the per-chunk statistics compiled on CUDA.
    """
    if lm_head_weight.device.type == "cpu":
        vocab_chunk = min(vocab_chunk, CPU_VOCAB_CHUNK)
    lead = last_hidden.shape[:-1]
    hidden = last_hidden.reshape(-1, last_hidden.shape[-1]).to(lm_head_weight.dtype)
    n, vocab = hidden.shape[0], lm_head_weight.shape[0]
    t2d = t2d.to(device=lm_head_weight.device, dtype=torch.bool)
    draft_ids, starts, bounds = _vocab_chunks(t2d, vocab, vocab_chunk)

    device = hidden.device
    cuda = device.type == "cuda"
    # the draft columns in the head's dtype, the logits' own: every value is exact there, and the
    # loss's passes over them (forward and backward, every unrolled step) read half the bytes of fp32
    draft_logits = torch.empty(n, draft_ids.numel(), dtype=lm_head_weight.dtype, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    draft_lse = torch.empty(n, dtype=torch.float32, device=device)
    argmax = torch.empty(n, dtype=torch.long, device=device)
    for t0 in range(0, n, token_chunk):
        h = hidden[t0 : t0 + token_chunk]
        run_lse = torch.full((h.shape[0],), float("-inf"), dtype=torch.float32, device=device)
        run_draft_lse = torch.full_like(run_lse, float("-inf"))
        run_max = torch.full_like(run_lse, float("-inf"))
        run_arg = torch.zeros(h.shape[0], dtype=torch.long, device=device)
        for c, v0 in enumerate(starts):
            logits = h @ lm_head_weight[v0 : v0 + vocab_chunk].T
            lo, hi = bounds[c], bounds[c + 1]
            if vocab_kernels.usable(logits):  # CUDA with Triton: one pass, the draft columns written in place
                chunk_max, chunk_arg, chunk_lse, chunk_draft_lse = vocab_kernels.chunk_stats(
                    logits, draft_ids[lo:hi] - v0, draft_logits[t0 : t0 + h.shape[0], lo:hi])
                if hi > lo:
                    run_draft_lse = torch.logaddexp(run_draft_lse, chunk_draft_lse)
            elif cuda and hi > lo:  # one compiled pass over the chunk, in the head's dtype
                picked, chunk_draft_lse, chunk_max, chunk_arg, chunk_lse = fused(_chunk_stats, device, compile)(
                    logits, draft_ids[lo:hi] - v0)
                draft_logits[t0 : t0 + h.shape[0], lo:hi] = picked
                run_draft_lse = torch.logaddexp(run_draft_lse, chunk_draft_lse)
            elif cuda:
                chunk_max, chunk_arg, chunk_lse = fused(_chunk_stats_no_draft, device, compile)(logits)
            else:
                logits = logits.float()
                if hi > lo:
                    draft_logits[t0 : t0 + h.shape[0], lo:hi] = logits[:, draft_ids[lo:hi] - v0]
                # One pass for max and argmax (first index on ties); logsumexp from the max, in place.
                chunk_max, chunk_arg = logits.max(dim=-1)
                chunk_lse = logits.sub_(chunk_max[:, None]).exp_().sum(dim=-1).log_().add_(chunk_max)
            run_lse = torch.logaddexp(run_lse, chunk_lse)
            better = chunk_max > run_max  # strict: an earlier chunk wins ties, like a full argmax
            run_max = torch.where(better, chunk_max, run_max)
            run_arg = torch.where(better, chunk_arg + v0, run_arg)
        lse[t0 : t0 + h.shape[0]] = run_lse
        draft_lse[t0 : t0 + h.shape[0]] = run_draft_lse
        argmax[t0 : t0 + h.shape[0]] = run_arg

    if not cuda:  # on CUDA each chunk's pass gave its part
        draft_lse = torch.logsumexp(draft_logits.float(), dim=-1)
    return Teacher(
        logits=draft_logits.reshape(*lead, draft_ids.numel()),
        lse=draft_lse.reshape(lead),
        log_mass=(draft_lse - lse).reshape(lead),
        argmax=argmax.reshape(lead),
        in_draft=t2d[argmax].reshape(lead),
    )
