"""The soft-target losses' passes over vocabulary-wide rows as Triton kernels (CUDA).

    if vocab_kernels.usable(logits, teacher_logits):
        loss, overlap, argmax, lse, target_sum = vocab_kernels.soft_ce_forward(
            logits, teacher_logits, teacher_lse, label, weight, log_mass)
        dlogits = vocab_kernels.soft_ce_backward(logits, lse, teacher_logits, teacher_lse, label, target_sum, weight, grad)
    if vocab_kernels.usable(chunk):
        top, arg, lse, draft_lse = vocab_kernels.chunk_stats(chunk, cols, picked_out)

They compute what the soft CE's and the teacher's torch functions compute (the compiled path
where Triton is missing), one program per row, with a running max, its first index and a
rescaled sum of exponentials, so a row's logsumexp and argmax come from one read of it:

- :func:`soft_ce_forward` (``soft_target_ce.soft_ce_rows``): per row of the draft
  logits and its teacher row gathered by ``label``, in the first pass the logsumexp, the argmax,
  ``Σ target·logit`` and ``Σ target`` (the soft CE is ``lse·Σ target − Σ target·logit``); in a
  second pass, only for rows with a weight (the others' loss and overlap are zeros, unread), the
  overlap ``Σ min(exp(logit − lse), target·mass)``, which needs the logsumexp first and re-reads
  the row while it is still in L2.
- :func:`soft_ce_backward` (``soft_target_ce.soft_ce_grad``): ``coef·(exp(logit − lse)·Σ target − target)``
  in the logits' dtype; zeros, without reading anything, for rows whose ``coef`` is zero.
- :func:`chunk_stats` (``teacher._chunk_stats``): per row of one vocabulary chunk of the target
  head's logits, its max, first argmax and logsumexp, then its draft columns written straight
  into the teacher's draft logits with their logsumexp. With no draft columns it is also the
  hard-target cross-entropy's forward pass (``dflash/fast/chunked_ce.hard_ce_stats``).
- :func:`hard_ce_backward_` (``dflash/fast/chunked_ce.hard_ce_grad``): ``grad·(softmax − onehot)``
  of a hard target, written over the logits in their dtype.
- :func:`row_entropy` (``dspark/objective.teacher_entropy``): each row's entropy given its
  logsumexp, ``lse − Σ softmax·logit``.

Inductor's kernels for the same passes read each row two or three times; these read it once.

Triton comes with torch's CUDA wheels; without it (a CPU-only install) :func:`usable` is false.
``TRITON_INTERPRET=1`` (set before Triton is imported) runs the kernels on CPU tensors
(tests/drafts/vocab/test_kernels.py, tests/drafts/vocab/test_soft_target_ce.py).
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the callers keep their own path
    triton = None

MAX_BLOCK = 2048  # columns per iteration: 8 per thread at 8 warps
WARPS = 8


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels apply: Triton is installed and every tensor is a CUDA matrix of unit column stride."""
    return triton is not None and all(x.is_cuda and x.dim() == 2 and x.stride(1) == 1 for x in tensors)


def _block(columns: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(columns))


def _rows(n: int, device, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=device)


def soft_ce_forward(logits, teacher_logits, teacher_lse, label, weight, log_mass):
    """Per row of ``logits [N, V]``: ``(loss, overlap, argmax, lse, target_sum)``, as
    ``fast.soft_target_ce.soft_ce_rows`` (fp32; argmax int64), with ``loss`` and ``overlap`` zero
    where ``weight`` is not positive."""
    n, vocab = logits.shape
    loss, overlap, lse, target_sum = (_rows(n, logits.device) for _ in range(4))
    argmax = _rows(n, logits.device, torch.long)
    if n:
        _soft_ce_forward_kernel[(n,)](
            _by_label(label), logits, logits.stride(0), teacher_logits, teacher_logits.stride(0), teacher_lse.float().contiguous(),
            label.contiguous(), weight.float().contiguous(), log_mass.float().contiguous(),
            loss, overlap, argmax, lse, target_sum, vocab, BLOCK=_block(vocab), num_warps=WARPS,
        )
    return loss, overlap, argmax, lse, target_sum


def soft_ce_backward(logits, lse, teacher_logits, teacher_lse, label, target_sum, weight, grad):
    """``d(weight·CE)/d(logits)`` for the upstream ``grad [N]``, as ``fast.soft_target_ce.soft_ce_grad`` (same
    arguments), in the logits' dtype."""
    n, vocab = logits.shape
    dlogits = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n:
        _soft_ce_backward_kernel[(n,)](
            _by_label(label), logits, logits.stride(0), teacher_logits, teacher_logits.stride(0), teacher_lse.float().contiguous(),
            label.contiguous(), lse, target_sum, weight.float().contiguous(), grad.float().contiguous(),
            dlogits, vocab, BLOCK=_block(vocab), num_warps=WARPS,
        )
    return dlogits


def _by_label(label: torch.Tensor) -> torch.Tensor:
    """The order the soft CE kernels visit the rows in: grouped by teacher row, so that the up to
    ttt_length rows that read one teacher row run together and read it once from HBM (the steps'
    rows come step after step, a teacher row's readers ≈ 10k rows apart at Qwen3-8B shape)."""
    return torch.argsort(label, stable=True).to(torch.int32)


def chunk_stats(logits, cols, picked):
    """Of one vocab chunk's logits ``[n, C]``: the max, its first index and the logsumexp of
    each row (fp32, int64, fp32), as ``teacher._chunk_stats_no_draft``; with draft columns
    ``cols`` (ascending, may be empty) also their values written into ``picked [n, len(cols)]``
    (a view with unit column stride, the teacher's draft logits) and returned: their fp32
    logsumexp (``-inf`` without columns)."""
    n, columns = logits.shape
    top, lse, draft_lse = (_rows(n, logits.device) for _ in range(3))
    arg = _rows(n, logits.device, torch.long)
    if n:
        _chunk_stats_kernel[(n,)](
            logits, logits.stride(0), cols.to(torch.int32), cols.numel(), picked, picked.stride(0),
            top, arg, lse, draft_lse, columns, BLOCK=_block(columns), num_warps=WARPS,
        )
    return top, arg, lse, draft_lse


def hard_ce_backward_(logits, lse, label, grad):
    """In place: each row of ``logits [N, V]`` becomes ``grad·(exp(logit − lse) − onehot(label))``
    in the logits' dtype (fp32 arithmetic), as ``dflash/fast/chunked_ce.hard_ce_grad``; returns
    ``logits``."""
    n, vocab = logits.shape
    if n:
        _hard_ce_backward_kernel[(n,)](logits, logits.stride(0), lse.float().contiguous(), label.contiguous(),
                                       grad.float().contiguous(), vocab, BLOCK=_block(vocab), num_warps=WARPS)
    return logits


def row_entropy(logits, lse):
    """The entropy ``lse − Σ exp(logit − lse)·logit`` of each row of ``logits [N, V]`` (fp32) from
    one read of it, as ``dspark/objective.teacher_entropy``."""
    n, vocab = logits.shape
    out = _rows(n, logits.device)
    if n:
        _row_entropy_kernel[(n,)](logits, logits.stride(0), lse.float().contiguous(), out, vocab,
                                  BLOCK=_block(vocab), num_warps=WARPS)
    return out


if triton is not None:

    @triton.jit
    def _start(BLOCK: tl.constexpr):
        """Each lane's running max, its column and sum of exponentials before a row's first block."""
        return tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.int32)

    @triton.jit
    def _running(run_max, run_sum, best, x, cols, inside):
        """One block of a row into each lane's running max, its first column and its rescaled
        sum of exponentials (lanes past the row's end read ``-inf`` and add nothing)."""
        new_max = tl.maximum(run_max, x)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        run_sum = run_sum * scale + tl.where(inside, tl.exp(x - new_max), 0.0)
        best = tl.where(x > run_max, cols, best)  # strict: a lane keeps its first maximum
        return new_max, run_sum, best

    @triton.jit
    def _finish(run_max, run_sum, best, columns):
        """The row's max, first argmax (the first of the lanes' maxima) and logsumexp."""
        top = tl.max(run_max, axis=0)
        lse = top + tl.log(tl.sum(run_sum * tl.exp(run_max - top), axis=0))
        first = tl.min(tl.where(run_max == top, best, columns), axis=0)
        return top, first, lse

    @triton.jit
    def _soft_ce_forward_kernel(order, logits, stride_l, teacher, stride_t, teacher_lse, label, weight, log_mass,
                                loss, overlap, argmax, lse, target_sum, vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.load(order + tl.program_id(0)).to(tl.int64)
        lab = tl.load(label + row).to(tl.int64)
        t_lse = tl.load(teacher_lse + lab)
        x_row = logits + row * stride_l
        t_row = teacher + lab * stride_t
        lanes = tl.arange(0, BLOCK)
        run_max, run_sum, best = _start(BLOCK)
        dot = tl.zeros([BLOCK], tl.float32)
        t_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            t = tl.exp(tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
            run_max, run_sum, best = _running(run_max, run_sum, best, x, cols, inside)
            dot += tl.where(inside, t * x, 0.0)
            t_sum += t
        _, first, row_lse = _finish(run_max, run_sum, best, vocab)
        total = tl.sum(t_sum, axis=0)
        w = tl.load(weight + row)
        ce = tl.where(w > 0, (row_lse * total - tl.sum(dot, axis=0)) * w, 0.0)
        acc = tl.zeros([BLOCK], tl.float32)
        if w > 0:  # the overlap is read only where the row counts
            mass = tl.exp(tl.load(log_mass + row))
            for start in range(0, vocab, BLOCK):
                cols = start + lanes
                inside = cols < vocab
                x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                t = tl.exp(tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
                acc += tl.minimum(tl.exp(x - row_lse), t * mass)
        tl.store(loss + row, ce)
        tl.store(overlap + row, tl.sum(acc, axis=0))
        tl.store(argmax + row, first.to(tl.int64))
        tl.store(lse + row, row_lse)
        tl.store(target_sum + row, total)

    @triton.jit
    def _soft_ce_backward_kernel(order, logits, stride_l, teacher, stride_t, teacher_lse, label, lse, target_sum, weight,
                                 grad, out, vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.load(order + tl.program_id(0)).to(tl.int64)
        w = tl.load(weight + row)
        coef = tl.where(w > 0, tl.load(grad + row) * w, 0.0)
        o_row = out + row * vocab
        lanes = tl.arange(0, BLOCK)
        if coef == 0:
            for start in range(0, vocab, BLOCK):
                cols = start + lanes
                tl.store(o_row + cols, tl.zeros([BLOCK], tl.float32).to(out.dtype.element_ty), mask=cols < vocab)
        else:
            lab = tl.load(label + row).to(tl.int64)
            t_lse = tl.load(teacher_lse + lab)
            row_lse = tl.load(lse + row)
            total = tl.load(target_sum + row)
            x_row = logits + row * stride_l
            t_row = teacher + lab * stride_t
            for start in range(0, vocab, BLOCK):
                cols = start + lanes
                inside = cols < vocab
                x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
                t = tl.exp(tl.load(t_row + cols, mask=inside, other=0.0).to(tl.float32) - t_lse)
                d = coef * (tl.exp(x - row_lse) * total - t)
                tl.store(o_row + cols, d.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _chunk_stats_kernel(logits, stride_l, cols, n_cols: tl.constexpr, picked, stride_p, top_out, arg_out, lse_out,
                            draft_lse_out, columns: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = logits + row * stride_l
        lanes = tl.arange(0, BLOCK)
        run_max, run_sum, best = _start(BLOCK)
        for start in range(0, columns, BLOCK):
            at = start + lanes
            inside = at < columns
            x = tl.load(x_row + at, mask=inside, other=float("-inf")).to(tl.float32)
            run_max, run_sum, best = _running(run_max, run_sum, best, x, at, inside)
        top, first, lse = _finish(run_max, run_sum, best, columns)
        tl.store(top_out + row, top)
        tl.store(arg_out + row, first.to(tl.int64))
        tl.store(lse_out + row, lse)
        # the draft columns, re-read from L2 and written in the logits' dtype (exact)
        d_max, d_sum, d_best = _start(BLOCK)
        p_row = picked + row * stride_p
        for start in range(0, n_cols, BLOCK):
            j = start + lanes
            inside = j < n_cols
            col = tl.load(cols + j, mask=inside, other=0)
            raw = tl.load(x_row + col, mask=inside)
            tl.store(p_row + j, raw, mask=inside)
            x = tl.where(inside, raw.to(tl.float32), float("-inf"))
            d_max, d_sum, d_best = _running(d_max, d_sum, d_best, x, j, inside)
        d_top = tl.max(d_max, axis=0)
        d_lse = tl.where(d_top == float("-inf"), float("-inf"),
                         d_top + tl.log(tl.sum(d_sum * tl.exp(d_max - d_top), axis=0)))
        tl.store(draft_lse_out + row, d_lse)

    @triton.jit
    def _hard_ce_backward_kernel(logits, stride_l, lse, label, grad, vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        coef = tl.load(grad + row)
        row_lse = tl.load(lse + row)
        lab = tl.load(label + row).to(tl.int64)
        x_row = logits + row * stride_l
        lanes = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
            d = coef * (tl.exp(x - row_lse) - tl.where(cols == lab, 1.0, 0.0))
            tl.store(x_row + cols, d.to(logits.dtype.element_ty), mask=inside)

    @triton.jit
    def _row_entropy_kernel(logits, stride_l, lse, out, vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_lse = tl.load(lse + row)
        x_row = logits + row * stride_l
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
            acc += tl.where(inside, tl.exp(x - row_lse) * x, 0.0)
        tl.store(out + row, row_lse - tl.sum(acc, axis=0))
