"""The EAGLE3 loss's soft-target terms over ``[N, Vd]`` draft logits: one contract, three ways.

    loss, overlap, argmax = soft_target_terms(logits, teacher_logits, teacher_lse, label, weight, log_mass)

:func:`soft_target_terms_plain` states the contract as autograd of the formula. The objective
calls :func:`soft_target_terms`, which runs one of three implementations of it, each a forward
and its backward, picked in one place (:func:`implementation_for`):

- :class:`TritonSoftCE` (CUDA with Triton): ``vocab_kernels``' kernels, which gather the teacher
  rows as they read them; the backward recomputes the draft's softmax from the saved logits
  and their logsumexp.
- :class:`RecomputeSoftCE` (the other CUDA path): the same passes in torch
  (:func:`soft_ce_rows`, :func:`soft_ce_grad`), compiled with ``training.compile``. Saving the
  logits in their own dtype instead of an fp32 softmax halves the activation memory in bf16 and
  keeps no copy of the teacher's rows.
- :class:`SavedSoftmaxSoftCE` (the CPU default): one log-softmax serves the loss, the overlap
  and the backward, which gets the fp32 softmax saved; rows go in blocks of about
  ``EAGER_BLOCK`` values, so each temporary stays small (eager code is memory bound).

All three give the plain function's values and gradient (tests/drafts/vocab/test_soft_target_ce.py).
"""

from dataclasses import dataclass

import torch

from specforge_core.drafts.vocab import kernels as vocab_kernels
from specforge_core.drafts.vocab.teacher import softmax_from_lse
from specforge_core.system.compile import fused

EAGER_BLOCK = 1 << 22  # values per block of rows in SavedSoftmaxSoftCE: 16 MB per fp32 temporary


def soft_target_terms_plain(logits, teacher_logits, teacher_lse, label, weight, log_mass):
    """The contract, by autograd: per row of ``logits [N, Vd]``, in fp32, ``weight`` times the soft
    cross-entropy ``-Σ_v p·log_softmax(logits)`` against ``p = softmax(teacher_logits[label])``
    (given the teacher's logsumexp ``teacher_lse``; gradient to ``logits`` only), the overlap
    ``Σ_v min(softmax(logits), p·exp(log_mass))`` and ``logits.argmax(-1)`` (no gradients).
    The overlap is defined where ``weight > 0`` (the Triton kernels leave zeros elsewhere)."""
    target = softmax_from_lse(teacher_logits[label].float(), teacher_lse[label])
    log_q = torch.log_softmax(logits.float(), dim=-1)
    loss = -(target * log_q).sum(dim=-1)
    loss = torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
    overlap = torch.minimum(log_q.exp(), target * log_mass.exp()[..., None]).sum(dim=-1)
    return loss, overlap.detach(), logits.detach().argmax(dim=-1)


def soft_target_terms(logits, teacher_logits, teacher_lse, label, weight, log_mass, *, recompute: bool | None = None,
                      compile: bool = True):
    """:func:`soft_target_terms_plain`'s ``(loss, overlap, argmax)`` by the implementation
    :func:`implementation_for` picks; ``recompute`` (default: on CUDA) asks for one whose backward
    recomputes the draft's softmax instead of saving it; ``compile`` (``training.compile``) lets the
    torch recompute be compiled. All give the same gradient."""
    recompute = logits.is_cuda if recompute is None else recompute
    impl = implementation_for(logits, teacher_logits, recompute=recompute, compile=compile)
    return SoftTargetTerms.apply(logits, teacher_logits, teacher_lse, label, weight, log_mass, impl)


def implementation_for(logits, teacher_logits, *, recompute: bool, compile: bool = True):
    """The one place the implementation is chosen: Triton where its kernels apply, else the
    torch recompute on request (compiled as ``compile`` says), else the saved softmax."""
    if not recompute:
        return SavedSoftmaxSoftCE
    return TritonSoftCE if vocab_kernels.usable(logits, teacher_logits) else RecomputeSoftCE(compile)


class SoftTargetTerms(torch.autograd.Function):
    """``SoftTargetTerms.apply(logits, teacher_logits, teacher_lse, label, weight, log_mass, impl)``:
    the terms by the implementation ``impl`` (one of the three classes below), which saves what
    its backward reads."""

    @staticmethod
    def forward(ctx, logits, teacher_logits, teacher_lse, label, weight, log_mass, impl):
        loss, overlap, argmax, saved = impl.forward(logits, teacher_logits, teacher_lse, label, weight, log_mass)
        ctx.impl, ctx.logits_dtype = impl, logits.dtype
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(overlap, argmax)
        return loss, overlap, argmax

    @staticmethod
    def backward(ctx, grad, _overlap, _argmax):
        return ctx.impl.backward(grad, ctx.logits_dtype, *ctx.saved_tensors), None, None, None, None, None, None


# --- the torch passes the Triton kernels equal (vocab_kernels' doc) -------------------------
def soft_ce_rows(logits, teacher_logits, teacher_lse, label, weight, log_mass):
    """Per row: :func:`soft_target_terms_plain`'s loss (zero where ``weight`` is not positive),
    overlap and argmax, and what a recomputing backward needs besides the logits: their fp32
    logsumexp and the target's row sums (compiled, one pass over the logits serves all)."""
    target = softmax_from_lse(teacher_logits[label], teacher_lse[label])
    lse = torch.logsumexp(logits.float(), dim=-1)
    log_q = logits.float() - lse[..., None]
    loss = -(target * log_q).sum(dim=-1)
    loss = torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
    overlap = torch.minimum(log_q.exp(), target * log_mass.exp()[..., None]).sum(dim=-1)
    return loss, overlap, logits.argmax(dim=-1), lse, target.sum(dim=-1)


def soft_ce_grad(logits, lse, teacher_logits, teacher_lse, label, target_sum, weight, grad):
    """``d(weight·CE)/d(logits)`` for the upstream ``grad [N]`` from the logits and what
    :func:`soft_ce_rows` returned: one element-wise pass that reads the logits and the teacher's
    rows once each (no reduction to redo), in the logits' dtype."""
    target = softmax_from_lse(teacher_logits[label], teacher_lse[label])
    q = (logits.float() - lse[..., None]).exp()
    return _grad_from_probs(q, target, target_sum, weight, grad, logits.dtype)


def _grad_from_probs(q, target, target_sum, weight, grad, dtype):
    """``d(weight·CE)/d(logits)`` given the draft's fp32 softmax ``q`` and ``target``'s row sums."""
    coef = torch.where(weight > 0, grad * weight, torch.zeros_like(grad))[..., None]
    return (coef * (q * target_sum[..., None] - target)).to(dtype)


# --- the three implementations ------------------------------------------------------------
class TritonSoftCE:
    """``vocab_kernels``' soft CE kernels (CUDA matrices of unit column stride, Triton installed)."""

    @staticmethod
    def forward(logits, teacher_logits, teacher_lse, label, weight, log_mass):
        loss, overlap, argmax, lse, target_sum = vocab_kernels.soft_ce_forward(
            logits, teacher_logits, teacher_lse, label, weight, log_mass)
        return loss, overlap, argmax, (logits, lse, teacher_logits, teacher_lse, label, target_sum, weight)

    @staticmethod
    def backward(grad, dtype, logits, *saved):
        return vocab_kernels.soft_ce_backward(logits, *saved, grad)


@dataclass(frozen=True)
class RecomputeSoftCE:
    """:func:`soft_ce_rows` and :func:`soft_ce_grad`, compiled on CUDA when ``compile``
    (``training.compile``; ``system.compile.fused``). The autograd ctx keeps this object, so the
    backward compiles as its forward did."""

    compile: bool = True

    def forward(self, logits, teacher_logits, teacher_lse, label, weight, log_mass):
        loss, overlap, argmax, lse, target_sum = fused(soft_ce_rows, logits.device, self.compile)(
            logits, teacher_logits, teacher_lse, label, weight, log_mass)
        return loss, overlap, argmax, (logits, lse, teacher_logits, teacher_lse, label, target_sum, weight)

    def backward(self, grad, dtype, logits, *saved):
        return fused(soft_ce_grad, logits.device, self.compile)(logits, *saved, grad)


class SavedSoftmaxSoftCE:
    """Eager, in blocks of rows (:func:`row_blocks`): the forward saves the fp32 softmax and the
    target, the backward is :func:`_grad_from_probs` on them."""

    @staticmethod
    def forward(logits, teacher_logits, teacher_lse, label, weight, log_mass):
        q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        target, loss, overlap = torch.empty_like(q), q.new_empty(q.shape[:-1]), q.new_empty(q.shape[:-1])
        for rows in row_blocks(logits):
            target[rows] = softmax_from_lse(teacher_logits[label[rows]], teacher_lse[label[rows]])
            log_q = torch.log_softmax(logits[rows].float(), dim=-1)
            terms = -(target[rows] * log_q).sum(dim=-1)
            loss[rows] = torch.where(weight[rows] > 0, terms * weight[rows], torch.zeros_like(terms))
            q[rows] = log_q.exp_()
            overlap[rows] = torch.minimum(q[rows], target[rows] * log_mass[rows].exp()[..., None]).sum(dim=-1)
        return loss, overlap, logits.argmax(dim=-1), (q, target, target.sum(dim=-1), weight)

    @staticmethod
    def backward(grad, dtype, q, target, target_sum, weight):
        dlogits = torch.empty(q.shape, dtype=dtype, device=q.device)
        for rows in row_blocks(q):
            dlogits[rows] = _grad_from_probs(q[rows], target[rows], target_sum[rows], weight[rows], grad[rows], dtype)
        return dlogits


def row_blocks(x: torch.Tensor) -> list[slice]:
    """Slices of the rows of ``x [N, Vd]`` of about ``EAGER_BLOCK`` values each."""
    rows = max(1, EAGER_BLOCK // x.shape[-1])
    return [slice(r, r + rows) for r in range(0, x.shape[0], rows)]
