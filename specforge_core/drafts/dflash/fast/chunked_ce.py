"""The frozen target head's cross-entropy on the draft's outputs, ``[chunk, V]`` logits at a time.

    ce, argmax = target_cross_entropy(hidden, lm_head_weight, labels, chunk_rows=2048)

:func:`target_cross_entropy_plain` states the contract (autograd over the full ``[n, V]`` fp32
logits); :class:`ChunkedTargetCE` computes the same for one chunk of rows at a time in the forward
and again in the backward, keeping only each row's logsumexp between them
(tests/drafts/dflash/fast/test_chunked_ce.py). Per chunk, :func:`hard_ce_stats` and
:func:`hard_ce_grad` are the torch passes over the logits; on CUDA the Triton kernels of
``drafts/vocab/kernels.py`` do each in one read of the head's-dtype logits (the gradient written
over them), where the torch passes make float32 copies of the ``[chunk, V]`` rows several times
(tests/drafts/vocab/test_kernels.py holds them equal).
"""

import torch
import torch.nn.functional as F

from specforge_core.drafts.vocab import kernels as vocab_kernels


def target_cross_entropy_plain(hidden, lm_head_weight, labels):
    """``(ce [n] fp32, argmax [n])``: the cross-entropy of the fp32 logits
    ``hidden.to(W.dtype) @ W.T`` against ``labels``, gradient to ``hidden`` only."""
    logits = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.detach().T).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.detach().argmax(dim=-1)


def target_cross_entropy(hidden, lm_head_weight, labels, chunk_rows: int = 2048):
    """:func:`target_cross_entropy_plain`, ``chunk_rows`` rows of logits at a time (module doc)."""
    return ChunkedTargetCE.apply(hidden, lm_head_weight.detach(), labels, chunk_rows)


def hard_ce_stats(logits, labels):
    """``(ce, argmax, lse)`` of each row of ``logits [n, V]`` (fp32 arithmetic; the first index
    of a tied maximum)."""
    if vocab_kernels.usable(logits):
        none = torch.zeros(0, dtype=torch.int32, device=logits.device)
        _, argmax, lse, _ = vocab_kernels.chunk_stats(logits, none, logits[:, :0])
    else:
        full = logits.float()
        lse, argmax = torch.logsumexp(full, dim=-1), full.argmax(dim=-1)
    return lse - logits.gather(1, labels[:, None])[:, 0].float(), argmax, lse


def hard_ce_grad(logits, lse, labels, grad):
    """``d(Σ grad·CE)/d(logits) = grad·(softmax − onehot(labels))`` per row, in the logits' dtype
    (fp32 arithmetic); on CUDA written over ``logits``."""
    if vocab_kernels.usable(logits):
        return vocab_kernels.hard_ce_backward_(logits, lse, labels, grad)
    probs = torch.exp(logits.float() - lse[:, None])
    probs[torch.arange(probs.shape[0], device=probs.device), labels] -= 1.0
    probs *= grad[:, None]
    return probs.to(logits.dtype)


class ChunkedTargetCE(torch.autograd.Function):
    """Per row: CE of ``hidden @ weight.T`` (fp32 log-softmax over the full vocab) against
    ``labels``, and the argmax; ``[chunk, V]`` logits at a time, recomputed in backward (only
    the per-row log-sum-exp is saved). No gradient to ``weight`` (the frozen target head)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        n = hidden.shape[0]
        ce = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        pred = labels.new_empty(n)
        for s in range(0, n, chunk):
            e = s + chunk
            ce[s:e], pred[s:e], lse[s:e] = hard_ce_stats(hidden[s:e].to(weight.dtype) @ weight.T, labels[s:e])
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(hidden)
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = s + ctx.chunk
            dlogits = hard_ce_grad(hidden[s:e].to(weight.dtype) @ weight.T, lse[s:e], labels[s:e], grad_ce[s:e])
            grad[s:e] = (dlogits.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad, None, None, None
