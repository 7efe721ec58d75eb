"""drafts/vocab/kernels.py: the Triton kernels equal the torch passes they replace
(soft_target_ce.py's, the teacher's).

Runs on CUDA, or on the CPU under Triton's interpreter (tests/drafts/triton_mode.py); skipped
otherwise, saying why (a CPU-only torch has no Triton)."""

import pytest
import torch

from specforge_core.drafts.vocab import kernels as vocab_kernels
from specforge_core.drafts.vocab import teacher
from specforge_core.drafts.vocab import soft_target_ce
from tests.drafts.triton_mode import TRITON_DEVICE as DEVICE, needs_triton

pytestmark = needs_triton


def _inputs(n, m, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    teacher = (torch.randn(m, vocab, generator=g) * 3).to(dtype)
    teacher_lse = torch.logsumexp(teacher.float(), -1)
    label = torch.randint(m, (n,), generator=g)
    weight = (torch.rand(n, generator=g) > 0.3).float()
    log_mass = -torch.rand(n, generator=g)
    logits[3, 17] = logits[3, 5] = logits[3].max() + 1  # a tie: the first index wins
    return [x.to(DEVICE) for x in (logits, teacher, teacher_lse, label, weight, log_mass)]


@pytest.mark.parametrize("vocab", [300, 2048, 5000])  # a partial last block, one exact block, several
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_give_the_objectives_loss_overlap_argmax_and_gradient(vocab, dtype):
    logits, teacher, teacher_lse, label, weight, log_mass = _inputs(37, 11, vocab, dtype)
    got = vocab_kernels.soft_ce_forward(logits, teacher, teacher_lse, label, weight, log_mass)
    want = soft_target_ce.soft_ce_rows(logits, teacher, teacher_lse, label, weight, log_mass)
    loss, overlap, argmax, lse, target_sum = got
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-4)
    assert (loss[weight == 0] == 0).all() and (overlap[weight == 0] == 0).all()  # rows that do not count
    counted = weight > 0
    torch.testing.assert_close(overlap[counted], want[1][counted], rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, want[2]) and argmax[3] == 5
    torch.testing.assert_close(lse, want[3], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(target_sum, want[4], rtol=1e-5, atol=1e-6)

    grad = torch.randn(37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dlogits = vocab_kernels.soft_ce_backward(logits, lse, teacher, teacher_lse, label, target_sum, weight, grad)
    expected = soft_target_ce.soft_ce_grad(logits, want[3], teacher, teacher_lse, label, want[4], weight, grad)
    assert dlogits.dtype == dtype and (dlogits[weight == 0] == 0).all()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(dlogits, expected, **tol)


@pytest.mark.parametrize("draft", ["some", "none", "all"])
@pytest.mark.parametrize("columns", [300, 4096])
def test_chunk_stats_give_the_teachers_max_argmax_logsumexp_and_draft_columns(draft, columns):
    g = torch.Generator().manual_seed(columns)
    logits = (torch.randn(23, columns, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    logits[5, 100] = logits[5, 7] = logits[5].max() + 1  # a tie: the first index wins
    cols = {"some": torch.randperm(columns, generator=g)[: columns // 3].sort().values,
            "none": torch.zeros(0, dtype=torch.long), "all": torch.arange(columns)}[draft].to(DEVICE)
    out = torch.full((23, 2 + cols.numel()), 7.0, dtype=logits.dtype, device=DEVICE)  # a wider teacher block
    top, arg, lse, draft_lse = vocab_kernels.chunk_stats(logits, cols, out[:, 1 : 1 + cols.numel()])
    want_top, want_arg, want_lse = teacher._chunk_stats_no_draft(logits)
    torch.testing.assert_close(top, want_top)
    assert torch.equal(arg, want_arg) and arg[5] == 7
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)
    assert (out[:, 0] == 7).all() and (out[:, -1] == 7).all()  # nothing written beside the view
    if cols.numel():
        picked, want_draft_lse, *_ = teacher._chunk_stats(logits, cols)
        assert torch.equal(out[:, 1:-1], picked)
        torch.testing.assert_close(draft_lse, want_draft_lse, rtol=1e-6, atol=1e-5)
    else:
        assert (draft_lse == float("-inf")).all()


def test_only_cuda_matrices_with_unit_column_stride_use_the_kernels():
    x = torch.zeros(4, 8)
    assert not vocab_kernels.usable(x, x)  # CPU tensors: the objective's own path
    if torch.cuda.is_available():
        y = x.cuda()
        assert vocab_kernels.usable(y, y) and not vocab_kernels.usable(y.t(), y) and not vocab_kernels.usable(y[0])


@pytest.mark.parametrize("vocab", [300, 2048, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hard_target_kernels_give_the_cross_entropy_argmax_and_gradient(vocab, dtype):
    from specforge_core.drafts.dflash.fast import chunked_ce

    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(19, vocab, generator=g) * 3).to(dtype)
    logits[4, 9] = logits[4, 2] = logits[4].max() + 1  # a tie: the first index wins
    labels = torch.randint(vocab, (19,), generator=g)
    grad = torch.randn(19, generator=g)
    grad[7] = 0.0
    want_ce, want_arg, want_lse = chunked_ce.hard_ce_stats(logits, labels)  # CPU: the torch passes
    want_grad = chunked_ce.hard_ce_grad(logits, want_lse, labels, grad)

    on = [x.to(DEVICE) for x in (logits, labels, grad)]
    _, arg, lse, _ = vocab_kernels.chunk_stats(on[0], torch.zeros(0, dtype=torch.int32, device=DEVICE), on[0][:, :0])
    assert torch.equal(arg.cpu(), want_arg) and arg[4] == 2
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-5)
    out = vocab_kernels.hard_ce_backward_(on[0].clone(), lse, on[1], on[2])
    assert out.dtype == dtype and (out[7] == 0).all()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(out.cpu(), want_grad, **tol)


@pytest.mark.parametrize("vocab", [300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_entropy_kernel_gives_the_teachers_entropy(vocab, dtype):
    from specforge_core.drafts.dspark.objective import teacher_entropy

    g = torch.Generator().manual_seed(vocab)
    teacher = (torch.randn(13, vocab, generator=g) * 3).to(dtype)
    lse = torch.logsumexp(teacher.float(), -1)
    want = teacher_entropy(teacher, lse)  # CPU tensors: the torch blocks
    got = vocab_kernels.row_entropy(teacher.to(DEVICE), lse.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)
    assert (got > 0).all()
