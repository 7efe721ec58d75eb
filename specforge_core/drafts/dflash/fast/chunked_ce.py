"""The frozen target head's cross-entropy on the draft's outputs, ``[chunk, V]`` logits at a time.

    ce, argmax = target_cross_entropy(hidden, lm_head_weight, labels, chunk_rows=2048)

:func:`target_cross_entropy_plain` states the contract (autograd over the full ``[n, V]`` fp32
logits); :class:`ChunkedTargetCE` computes the same with fp32 logits for one chunk of rows at a
time in the forward and again in the backward, keeping only each row's logsumexp between them
(tests/drafts/dflash/fast/test_chunked_ce.py).
"""

import torch
import torch.nn.functional as F


def target_cross_entropy_plain(hidden, lm_head_weight, labels):
    """``(ce [n] fp32, argmax [n])``: the cross-entropy of the fp32 logits
    ``hidden.to(W.dtype) @ W.T`` against ``labels``, gradient to ``hidden`` only."""
    logits = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.detach().T).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.detach().argmax(dim=-1)


def target_cross_entropy(hidden, lm_head_weight, labels, chunk_rows: int = 2048):
    """:func:`target_cross_entropy_plain`, ``chunk_rows`` rows of logits at a time (module doc)."""
    return ChunkedTargetCE.apply(hidden, lm_head_weight.detach(), labels, chunk_rows)


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
            logits = (hidden[s : s + chunk].to(weight.dtype) @ weight.T).float()
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            ce[s : s + chunk] = lse[s : s + chunk] - logits.gather(1, labels[s : s + chunk, None])[:, 0]
            pred[s : s + chunk] = logits.argmax(dim=-1)
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
            probs = torch.exp((hidden[s:e].to(weight.dtype) @ weight.T).float() - lse[s:e, None])
            probs[torch.arange(probs.shape[0], device=probs.device), labels[s:e]] -= 1.0
            probs *= grad_ce[s:e, None]
            grad[s:e] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad, None, None, None
