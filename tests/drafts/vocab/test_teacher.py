"""The compact teacher equals what full [N, V] logits give, while streaming over vocab chunks."""

import pytest
import torch

from specforge_core.drafts.eagle3 import eagle3_loss
from specforge_core.drafts.vocab.teacher import compute_teacher, full_vocabulary
from specforge_core.errors import ModelError
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft


def full_teacher(h, W, t2d):
    z = (h @ W.T).double()
    return torch.softmax(z[..., t2d], -1), torch.softmax(z, -1)[..., t2d], z.argmax(-1)


def random_map(V, Vd, seed):
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd]] = True
    return t2d


def test_streamed_teacher_equals_full_vocab_softmax_logsumexp_and_argmax():
    g = torch.Generator().manual_seed(0)
    h, W, t2d = torch.randn(3, 11, 16, generator=g), torch.randn(50, 16, generator=g), random_map(50, 20, 0)
    teacher = compute_teacher(h, W, t2d, vocab_chunk=7, token_chunk=5)
    probs, target_probs, argmax = full_teacher(h, W, t2d)
    assert teacher.probs.shape == (3, 11, 20)
    torch.testing.assert_close(teacher.probs.double(), probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(teacher.target_probs().double(), target_probs, atol=1e-6, rtol=1e-5)
    assert torch.equal(teacher.argmax, argmax)
    assert torch.equal(teacher.in_draft, t2d[argmax])


def test_argmax_tie_across_chunks_takes_the_first_index_like_torch_argmax():
    W = torch.zeros(10, 2)
    W[2, 0] = W[8, 0] = 1.0  # tokens 2 and 8 tie; they sit in different vocab chunks
    teacher = compute_teacher(torch.tensor([[1.0, 0.0]]), W, random_map(10, 4, 1), vocab_chunk=4)
    assert teacher.argmax.tolist() == [2]


def test_logits_are_computed_and_kept_in_the_head_dtype_then_read_in_fp32():
    g = torch.Generator().manual_seed(2)
    h, W = torch.randn(4, 32, generator=g), torch.randn(64, 32, generator=g).bfloat16()
    t2d = torch.ones(64, dtype=torch.bool)
    teacher = compute_teacher(h, W, t2d, vocab_chunk=64)
    in_head_dtype = torch.softmax((h.bfloat16() @ W.T).float(), -1)
    in_fp32 = torch.softmax(h @ W.float().T, -1)
    torch.testing.assert_close(teacher.probs, in_head_dtype, atol=1e-6, rtol=1e-5)
    assert (teacher.probs - in_fp32).abs().max() > 1e-3  # the dtype is visible at this tolerance
    # kept in the head's dtype, exactly the values the head computed
    assert teacher.logits.dtype == torch.bfloat16 and teacher.lse.dtype == torch.float32
    assert torch.equal(teacher.logits, h.bfloat16() @ W.T)


def test_a_map_changed_in_place_gives_the_new_maps_teacher():
    """The vocab chunks are kept on the map tensor; an in-place change (set_vocab_map) is seen."""
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(5, 16, generator=g), torch.randn(40, 16, generator=g)
    t2d = random_map(40, 12, 0)
    compute_teacher(h, W, t2d, vocab_chunk=16)
    t2d.copy_(random_map(40, 12, 1))
    probs, _, _ = full_teacher(h, W, t2d)
    torch.testing.assert_close(compute_teacher(h, W, t2d, vocab_chunk=16).probs.double(), probs, atol=1e-6, rtol=1e-5)


def test_the_whole_vocabulary_map_is_one_tensor_whose_chunk_layout_is_listed_once():
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(4, 8, generator=g), torch.randn(30, 8, generator=g)
    every = full_vocabulary(30, W.device)
    assert every is full_vocabulary(30, W.device) and bool(every.all()) and every.shape == (30,)
    first = compute_teacher(h, W, every, vocab_chunk=7)
    layout = every._teacher_chunks
    second = compute_teacher(h, W, full_vocabulary(30, W.device), vocab_chunk=7)
    assert every._teacher_chunks is layout  # a training step reuses it instead of waiting on the device
    torch.testing.assert_close(second.logits, first.logits)
    torch.testing.assert_close(first.logits.double(), (h @ W.T).double(), atol=1e-5, rtol=1e-5)


def test_a_batch_carrying_its_teacher_trains_exactly_as_one_whose_unroll_makes_it():
    draft = tiny_draft(seed=3)
    head = target_head(4, draft.config.target_hidden_size)
    batch = random_batch(5, [9, 6], 10, draft.config.target_hidden_size)
    made = compute_teacher(batch["last_hidden"].flatten(0, 1), head, draft.t2d)
    results = []
    for given in (None, made):
        draft.zero_grad()
        loss, sums = eagle3_loss(draft, {**batch, "teacher": given}, head, ttt_length=4, backend="sdpa")
        loss.backward()
        results.append((loss.detach(), {k: v.clone() for k, v in sums.items()},
                        [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    (loss0, sums0, grads0), (loss1, sums1, grads1) = results
    assert torch.equal(loss0, loss1) and sums0.keys() == sums1.keys()
    assert all(torch.equal(sums0[k], sums1[k]) for k in sums0)
    assert len(grads0) == len(grads1) > 0 and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    # the given teacher is the one read: another head's teacher gives another loss
    other = compute_teacher(batch["last_hidden"].flatten(0, 1), target_head(9, head.shape[1]), draft.t2d)
    assert not torch.equal(eagle3_loss(draft, {**batch, "teacher": other}, head, ttt_length=4, backend="sdpa")[0], loss0)
    # a teacher of other positions is refused, naming the field
    with pytest.raises(ModelError, match="captured batch: teacher"):
        eagle3_loss(draft, {**batch, "teacher": made.take(torch.arange(5))}, head, ttt_length=4, backend="sdpa")
