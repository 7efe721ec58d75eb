"""The unroll's step-0 attention on FlashAttention kernels, its backward handed the merged output.

    box = MergedOutput()
    out0, lse0 = step_zero_flash(q, k, v, spans, scale, box)   # q [n, nh, hd] on the real rows
    out = merge(out0, lse0, same-position keys ...)              # attention._same_position_merge
    box.hold(out_rows, at, n)                                   # before backward runs

Step 0's block of the TTT attention (``attention.py``) is causal attention within each sample
over the real tokens, so it is variable-length causal attention over the real rows: one
FlashAttention call (``aten._flash_attention_forward`` with the samples' offsets, grouped-query
heads native) on CUDA, one CPU flash call per sample elsewhere. What makes it usable here is its
backward. A flash backward takes the output's gradient only: it needs ``D = rowsum(dO ∘ O)`` and
gets it from the output it is handed. The unroll also differentiates through the block's
log-sum-exp (the merge with the same-position keys weighs the block by it), and for a softmax over
the union of the step-0 keys and the same-position keys the exact gradient of the step-0 scores is

    dS = P0 ∘ (dO0 Vᵀ − rowsum(dO0 ∘ O_merged))         (dO0: the gradient reaching out0)

which is the flash backward's own formula with ``O_merged`` in place of ``O0``: the log-sum-exp's
gradient is folded into D. So the backward is handed the merged output (:class:`MergedOutput`)
and ignores the gradient of ``lse0``. The contract that makes this exact: ``out0`` and ``lse0``
are used only by that merge, and the merged output is held before the backward runs; with nothing
held (no later steps: the output is ``out0`` itself and ``lse0`` is unused) the block's own output
is used, as in plain attention.

Queries are the real rows (zeros where a row is no query: its gradient and its D are then zero,
whatever output it is handed). Inputs are ``[n, heads, hd]`` in fp16/bf16 on CUDA (FlashAttention
has no fp32 kernel), any float dtype on the CPU.
"""

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SampleSpans:
    """The samples of one batch as runs of its real rows: ``bounds`` (host ints, ascending) are each
    sample's first index among the real rows, then their count."""

    bounds: list[int]
    _offsets: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of_rows(cls, real: np.ndarray, seq: np.ndarray, t: int) -> "SampleSpans":
        """From the flattened real rows ``real`` (ascending) of a ``[B, t]`` batch and the seq id
        at each of them ``seq``: a sample starts where the row or the seq id changes."""
        starts = np.ones(real.size, dtype=bool)
        starts[1:] = (real[1:] // t != real[:-1] // t) | (seq[1:] != seq[:-1])
        return cls(np.flatnonzero(starts).tolist() + [real.size])

    @property
    def longest(self) -> int:
        return max((b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])), default=0)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """``bounds`` as the kernel's int32 ``cu_seqlens`` on ``device`` (one copy per batch)."""
        key = str(device)
        if key not in self._offsets:
            host = torch.tensor(self.bounds, dtype=torch.int32)
            if torch.device(device).type == "cuda":
                host = host.pin_memory()
            self._offsets[key] = host.to(device, non_blocking=True)
        return self._offsets[key]


class MergedOutput:
    """The merged attention output of the step whose step-0 block :func:`step_zero_flash` made:
    the caller holds it (``hold``) once it has merged; the block's backward reads it back on the
    real rows. ``expected``: the caller will merge (a step after the first), so a backward without
    a held output is an error, not a silent fall-back to the block's own output."""

    def __init__(self, expected: bool = False):
        self.expected = expected
        self._held = None

    def hold(self, out: torch.Tensor, at: torch.Tensor, n_real: int) -> None:
        """``out [n, nh, hd]``: the merged output on the queries, ``at`` their indices among the
        ``n_real`` real rows."""
        self._held = (out.detach(), at, n_real)

    def on_real_rows(self) -> torch.Tensor | None:
        if self._held is None:
            if self.expected:
                raise RuntimeError(
                    "the step-0 flash block's backward ran before its merged output was held: out0/lse0 "
                    "must be used only by the same-position merge, and the merge must run eagerly after it "
                    "(drafts/eagle3/flash.py, module doc)")
            return None
        out, at, n_real = self._held
        if out.shape[0] == n_real:
            return out.contiguous()
        return out.new_zeros(n_real, *out.shape[1:]).index_copy_(0, at, out)


@torch.compiler.disable  # traced, the backward would not see what the eager caller holds later
def step_zero_flash(q, k, v, spans: SampleSpans, scale: float, merged: MergedOutput):
    """Causal attention within each sample of ``spans``: ``q [n, nh, hd]``, ``k, v [n, nkv, hd]``
    on the real rows → ``(out [n, nh, hd]`` in ``q``'s dtype, ``lse [nh, n]`` fp32``)``, with the
    backward described in the module doc. Always runs eagerly, also inside a compiled caller."""
    return _StepZeroFlash.apply(q, k, v, spans, scale, merged)


class _StepZeroFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, scale, merged):
        out, lse, state = _forward(q, k, v, spans, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.scale, ctx.merged, ctx.state = spans, scale, merged, state
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        merged = ctx.merged.on_real_rows()
        dq, dk, dv = _backward(grad_out.contiguous(), q, k, v, out if merged is None else merged, lse,
                               ctx.spans, ctx.scale, ctx.state)
        return dq, dk, dv, None, None, None


def _forward(q, k, v, spans, scale):
    if q.is_cuda:
        cu, longest = spans.offsets(q.device), spans.longest
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale)
        return out, lse, (rng, unused)
    outs, lses = [], []
    for a, b in _nonempty(spans):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q[a:b]), _heads_first(k[a:b]), _heads_first(v[a:b]), 0.0, True, scale=scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[1], 0, dtype=torch.float32), None
    return torch.cat(outs).contiguous(), torch.cat(lses, dim=1), None


def _backward(grad, q, k, v, out, lse, spans, scale, state):
    if q.is_cuda:
        cu, longest = spans.offsets(q.device), spans.longest
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused, scale=scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in _nonempty(spans):
        parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(_heads_first(x[a:b]) for x in (grad, q, k, v, out)), lse[None, :, a:b], 0.0, True, scale=scale)
        for total, part in zip((dq, dk, dv), parts):
            total[a:b] = part[0].transpose(0, 1)
    return dq, dk, dv


def _nonempty(spans: SampleSpans):
    """The ``(start, end)`` of each sample with rows (torch's CPU kernel faults on an empty one)."""
    return [(a, b) for a, b in zip(spans.bounds[:-1], spans.bounds[1:]) if b > a]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, heads, hd]`` → ``[1, heads, L, hd]`` (a view)."""
    return x.transpose(0, 1)[None]
