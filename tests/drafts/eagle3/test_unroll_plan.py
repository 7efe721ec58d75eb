"""``UnrollPlan``: every index of the unroll, worked out on the host, equals its definition
(drafts/eagle3/fast/unroll_plan.py) on packed, padded rows."""

import pytest
import torch

from specforge_core.capture.base import HostMasks
from specforge_core.drafts.eagle3.fast.unroll_plan import UnrollPlan
from specforge_core.capture.base import host_masks_of
from specforge_core.errors import ModelError


def _packed_masks(seed=0, b=3, t=17):
    g = torch.Generator().manual_seed(seed)
    attn = torch.zeros(b, t, dtype=torch.long)
    seq = torch.full((b, t), -1, dtype=torch.long)
    for r, (n, cut) in enumerate([(17, 9), (12, 5), (15, 15)]):
        attn[r, :n] = 1
        seq[r, :cut], seq[r, cut:n] = 2 * r, 2 * r + 1
    lm = (torch.rand(b, t, generator=g) < 0.7).long() * attn
    return attn, lm, seq


def test_the_plan_of_a_packed_padded_batch_equals_the_definitions():
    attn, lm, seq = _packed_masks()
    b, t, K = *attn.shape, 5
    plan = UnrollPlan.build(attn, lm, seq, K, device="cpu")
    a, m, s = attn.bool().flatten().tolist(), lm.bool().flatten().tolist(), seq.flatten().tolist()

    def valid(k, p):
        i = p % t
        return i + k + 1 < t and m[p + k] and a[p] and a[p + k + 1] and s[p] == s[p + k + 1]

    for k in range(K):
        assert plan.valid[k].flatten().tolist() == [valid(k, p) for p in range(b * t)]
    real = [p for p in range(b * t) if a[p]]
    assert plan.real.tolist() == real
    # each sample (a run of one row's real tokens with one seq id) starts a span among the real rows
    assert plan.spans == [i for i, p in enumerate(real)
                          if i == 0 or p // t != real[i - 1] // t or s[p] != s[real[i - 1]]] + [len(real)]
    assert plan.spans == [0, 9, 17, 22, 29, 44]
    teacher = plan.teacher_index.tolist()
    assert teacher == sorted({p + k for k in range(K) for p in range(b * t) if valid(k, p)})
    previous = plan.real
    step, position = (plan.placed // (b * t)).tolist(), (plan.placed % (b * t)).tolist()
    assert step == sorted(step)  # the scored rows step after step
    for k in range(K):
        want = [p for p in range(b * t) if any(valid(j, p) for j in range(k, K))]
        if not want and k:
            assert plan.rows[k] is None
            continue
        rows = plan.rows[k]
        assert rows.tolist() == want
        chosen = plan.queries0 if k == 0 else plan.carry[k]
        assert previous[chosen].tolist() == want  # step 0's queries among the real tokens, later: the carried rows
        scored = [p for s_, p in zip(step, position) if s_ == k]
        assert rows[plan.here[k]].tolist() == scored == [p for p in want if valid(k, p)]
        labels = [i for s_, i in zip(step, plan.label.tolist()) if s_ == k]
        assert [teacher[i] for i in labels] == [p + k for p in scored]
        # the same-position keys: step j's rows (j = 1..k) hold every one of step k's rows
        assert len(plan.same[k]) == k
        for j, at in enumerate(plan.same[k], start=1):
            assert plan.rows[j][at].tolist() == want
        # the token each of step k's inputs embeds: ids[p+1+k] in its row, its row's pad (index
        # b·t + row) past its end; distinct within the step (their gradients are copies back)
        inputs = plan.real if k == 0 else rows
        assert plan.token_index[plan.token_rows[k]].tolist() == [
            p + 1 + k if p % t + 1 + k < t else b * t + p // t for p in inputs.tolist()]
        assert len(set(plan.token_rows[k].tolist())) == plan.token_rows[k].numel()
        previous = rows
    # each token is embedded once, and only the ones some step reads
    assert plan.token_index.tolist() == sorted({p + 1 + k if p % t + 1 + k < t else b * t + p // t
                                                for k in range(K) if plan.rows[k] is not None
                                                for p in (plan.real if k == 0 else plan.rows[k]).tolist()})


def _fields(plan):
    out = {}
    for name, value in vars(plan).items():
        items = value if isinstance(value, list) else [value]
        flat = [x for item in items for x in (item if isinstance(item, list) else [item])]
        out[name] = [x if x is None or isinstance(x, int) else x.tolist() for x in flat]
    return out


def test_the_plan_reads_the_host_masks_and_never_the_devices():
    attn, lm, seq = _packed_masks(seed=3)
    want = UnrollPlan.build(attn, lm, seq, 5, device="cpu")
    # the "device" masks on the meta device: any read of their values would raise
    meta = [x.to("meta") for x in (attn, lm, seq)]
    got = UnrollPlan.build(*meta, 5, device="cpu", host=HostMasks(attn, lm, seq))
    assert _fields(got) == _fields(want)


def test_unpacked_host_masks_plan_as_one_sample_per_row():
    attn, lm, _ = _packed_masks(seed=4)
    zeros = torch.zeros_like(attn)
    want = UnrollPlan.build(attn, lm, zeros, 4, device="cpu")
    got = UnrollPlan.build(*(x.to("meta") for x in (attn, lm, zeros)), 4, device="cpu", host=HostMasks(attn, lm))
    assert _fields(got) == _fields(want)


def test_host_masks_of_another_shape_are_refused_naming_the_field():
    attn, lm, seq = _packed_masks()
    batch = {"host_masks": HostMasks(attn, lm[:, :-1], seq)}
    with pytest.raises(ModelError, match=r"host_masks.loss_mask is \(3, 16\) on cpu, expected \(3, 17\)"):
        host_masks_of(batch, *attn.shape)
