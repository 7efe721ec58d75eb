"""The frozen target head's weighted cross-entropy on the draft's outputs, ``[chunk, V]`` logits at a time.

    loss, ce, argmax, top = target_cross_entropy(hidden, head, labels, weights, chunk_rows=2048, top_k=0)

:func:`target_cross_entropy_plain` states the contract: ``loss = Σ weights·CE`` of the fp32 logits
``hidden @ W.T`` against ``labels``, with gradient to ``hidden`` only, and each row's CE, argmax and
``top_k`` largest logits' ids (no gradient; DFlash2's selector candidates, taken from the same
logits so the head's product is made once). :class:`ChunkedTargetCE` computes the same one chunk of
rows at a time and, since the loss is linear in the rows' CE with weights known in the forward,
takes the gradient in the same pass: each chunk's logits are made once, their gradient written over
them and multiplied back through the head, and only ``d loss / d hidden`` (``[n, H]``) is kept for
the backward, which scales it by the upstream gradient
(tests/drafts/dflash/fast/test_chunked_ce.py). Per chunk, :func:`hard_ce_stats` and
:func:`hard_ce_grad` are the torch passes over the logits; on CUDA the Triton kernels of
``drafts/vocab/kernels.py`` do each in one read of the head's-dtype logits
(tests/drafts/vocab/test_kernels.py holds them equal).
"""

import torch
import torch.nn.functional as F

from specforge_core.drafts.vocab import kernels as vocab_kernels


def target_cross_entropy_plain(hidden, lm_head_weight, labels, weights, top_k: int = 0):
    """``(loss, ce [n], argmax [n], top [n, top_k])``: ``loss = Σ weights·ce`` (fp32 scalar,
    gradient to ``hidden`` only) where ``ce`` is the cross-entropy of the fp32 logits of
    ``hidden.to(W.dtype) @ W.T`` against ``labels``; ``top`` the ids of each row's ``top_k``
    largest logits in the head's dtype, largest first. ``ce``, ``argmax`` and ``top`` carry no
    gradient."""
    logits = hidden.to(lm_head_weight.dtype) @ lm_head_weight.detach().T
    full = logits.float()
    ce = F.cross_entropy(full, labels, reduction="none")
    top = logits.detach().topk(top_k, dim=-1).indices
    return (ce * weights.detach().float()).sum(), ce.detach(), full.detach().argmax(dim=-1), top


def target_cross_entropy(hidden, lm_head_weight, labels, weights, chunk_rows: int = 2048, top_k: int = 0):
    """:func:`target_cross_entropy_plain`, ``chunk_rows`` rows of logits at a time (module doc)."""
    return ChunkedTargetCE.apply(hidden, lm_head_weight.detach(), labels, weights.detach().float(), chunk_rows,
                                 top_k)


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
    """``(Σ weights·CE, CE, argmax, top-k ids)`` of ``hidden @ weight.T`` (fp32 log-softmax over
    the full vocab) against ``labels``, ``[chunk, V]`` logits at a time; the gradient to ``hidden``
    is made in the forward and kept (module doc). No gradient to ``weight`` (the frozen target head)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk, top_k):
        n = hidden.shape[0]
        ce = hidden.new_empty(n, dtype=torch.float32)
        pred = labels.new_empty(n)
        top = torch.empty(n, top_k, dtype=torch.long, device=labels.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for s in range(0, n, chunk):
            e = s + chunk
            logits = hidden[s:e].to(weight.dtype) @ weight.T
            ce[s:e], pred[s:e], lse = hard_ce_stats(logits, labels[s:e])
            if top_k:  # before the gradient is written over the logits
                top[s:e] = logits.topk(top_k, dim=-1).indices
            if grad is not None:
                grad[s:e] = (hard_ce_grad(logits, lse, labels[s:e], weights[s:e]).to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, pred, top)
        return (ce * weights).sum(), ce, pred, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_pred, _grad_top):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None
