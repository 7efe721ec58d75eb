"""The TTT attention pattern (reference §2.3) and the agreement of its sdpa, flex and flash backends."""

import pytest
import torch

from specforge_core.errors import ConfigError
from specforge_core.drafts.eagle3 import eagle3_loss, summarize_metrics
from specforge_core.drafts.eagle3.attention import TTTAttention, resolve_backend, step_zero_visibility
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft


def test_step_zero_keys_are_causal_within_a_sample_and_skip_padding_but_never_empty():
    attention = torch.tensor([[1, 1, 1, 1, 1, 0]])
    seq = torch.tensor([[0, 0, 1, 1, 1, -1]])
    visible = step_zero_visibility(attention, seq)[0].int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


def test_auto_backend_is_sdpa_on_cpu_flash_on_cuda_but_flex_in_fp32_and_unknown_names_are_config_errors():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "flash"
    assert resolve_backend("auto", torch.device("cuda"), torch.float32) == "flex"
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, head_dim=20) == "flex"
    assert resolve_backend("flash", torch.device("cpu")) == "flash"
    with pytest.raises(ConfigError, match="draft.attention_backend"):
        resolve_backend("eager", torch.device("cpu"))


def test_the_flash_backend_is_refused_for_a_dflash_draft_when_the_config_is_read():
    from specforge_core.config import load_config
    from specforge_core.drafts import check_config

    with pytest.raises(ConfigError, match="draft.attention_backend=flash"):
        check_config(load_config(None, ["draft.family=dflash", "draft.attention_backend=flash"]))


def attention_inputs(seed, B=2, T=9, nh=4, nkv=2, hd=8, steps=4, padded=True):
    """Queries and per-step keys on rows: step 0 = the real tokens, step j = a shrinking subset.
    ``padded=False``: every position is a real token (the grid layout of step 0 is a view)."""
    g = torch.Generator().manual_seed(seed)
    attention = torch.ones(B, T, dtype=torch.long)
    seq = torch.tensor([[0] * 4 + [1] * 5, [0] * 3 + [1] * 6])
    if padded:
        attention[1, 6:] = 0
        seq[1, 6:] = -1
    rows = [torch.nonzero(attention.flatten()).flatten()]
    for _ in range(1, steps):
        keep = torch.rand(rows[-1].numel(), generator=g) < 0.8
        keep[-1] = True
        rows.append(rows[-1][keep])
    keys = [torch.randn(1, r.numel(), nkv, hd, generator=g) for r in rows]
    values = [torch.randn(1, r.numel(), nkv, hd, generator=g) for r in rows]
    queries = [torch.randn(1, r.numel(), nh, hd, generator=g) for r in rows]
    return queries, keys, values, rows, attention, seq


def dense_ttt_attention(q, q_rows, keys, values, rows, attention, seq):
    """Straight from the rule: one softmax over the visible step-0 keys and same-position keys."""
    T = attention.shape[1]
    k = len(rows) - 1
    nh, nkv, hd = q.shape[2], keys[0].shape[2], q.shape[3]
    out = torch.zeros_like(q)
    for i, flat in enumerate(q_rows.tolist()):
        b, t = divmod(flat, T)
        cand = [j for j, s in enumerate(rows[0].tolist()) if s // T == b and s % T <= t and seq[b, s % T] == seq[b, t]]
        same = [rows[j].tolist().index(flat) for j in range(1, k + 1)]
        for h in range(nh):
            g = h // (nh // nkv)
            ks = [keys[0][0, j, g] for j in cand] + [keys[j][0, same[j - 1], g] for j in range(1, k + 1)]
            vs = [values[0][0, j, g] for j in cand] + [values[j][0, same[j - 1], g] for j in range(1, k + 1)]
            w = torch.softmax(torch.stack([q[0, i, h] @ key for key in ks]) / hd**0.5, dim=0)
            out[0, i, h] = sum(wi * v for wi, v in zip(w, vs))
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
def test_each_backend_equals_the_dense_rule_on_cpu(k, backend):
    queries, keys, values, rows, attention, seq = attention_inputs(seed=k)
    args = (queries[k], rows[k], keys[: k + 1], values[: k + 1], rows[: k + 1])
    with torch.no_grad():
        out = TTTAttention(attention, seq, backend)(*args)
    assert (out - dense_ttt_attention(*args, attention, seq)).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
def test_step_zero_queries_may_be_a_subset_of_its_keys(backend):
    queries, keys, values, rows, attention, seq = attention_inputs(seed=5)
    subset = torch.tensor([0, 2, 3, 7, 10])
    args = (queries[0][:, subset], rows[0][subset], keys[:1], values[:1], rows[:1])
    with torch.no_grad():
        out = TTTAttention(attention, seq, backend)(*args)
    assert (out - dense_ttt_attention(*args, attention, seq)).abs().max() < 1e-5


def test_flex_and_sdpa_give_the_same_loss_and_metrics_on_cpu():
    draft = tiny_draft(seed=3)
    batch = random_batch(seed=3, lengths=[10, 6], T=10, target_hidden=24)
    W = target_head(3, 24)
    with torch.no_grad():
        loss_s, sums_s = eagle3_loss(draft, batch, W, ttt_length=5, backend="sdpa")
        loss_f, sums_f = eagle3_loss(draft, batch, W, ttt_length=5, backend="flex")
    assert abs(loss_s.item() - loss_f.item()) < 1e-5
    ms, mf = summarize_metrics(sums_s), summarize_metrics(sums_f)
    assert max(abs(ms[key] - mf[key]) for key in ms) < 1e-5


def grads_by_backend(backends, batch, W, dtype=torch.float32, device="cpu", **draft_kwargs):
    """``{backend: (loss, metrics, fp32 gradients)}`` of one seeded draft on ``batch``."""
    results = {}
    for backend in backends:
        draft = tiny_draft(seed=5, **draft_kwargs).to(device).cast_params(dtype)
        loss, sums = eagle3_loss(draft, batch, W, ttt_length=7, backend=backend)
        loss.backward()
        grads = {n: p.grad.float() for n, p in draft.named_parameters() if p.requires_grad}
        results[backend] = (loss.item(), summarize_metrics(sums), grads)
    return results


def assert_same_training(a, b, tol):
    (la, ma, ga), (lb, mb, gb) = a, b
    assert abs(la - lb) < tol * max(1.0, abs(la))
    assert max(abs(ma[key] - mb[key]) for key in ma if not key.startswith("acc")) < tol * 10
    for name in ga:
        scale = ga[name].abs().max().item() + 1e-6
        assert (ga[name] - gb[name]).abs().max().item() / scale < tol * 10, name


def test_flash_trains_like_sdpa_through_the_log_sum_exp_of_the_merge_on_cpu():
    """The flash backward is handed the merged output, not its own (flash.py): every parameter's
    gradient, through all seven steps' merges, equals the reference path's in fp32. Packed rows
    (two samples in a row), padding and rows without targets are all in the batch."""
    W = target_head(5, 24)
    batch = random_batch(seed=5, lengths=[12, 7, 10], T=12, target_hidden=24)
    batch["seq_ids"] = torch.zeros_like(batch["input_ids"])
    batch["seq_ids"][0, 5:] = 1  # row 0 holds two samples
    batch["position_ids"] = torch.where(batch["seq_ids"] == 1, torch.arange(12) - 5, torch.arange(12))
    results = grads_by_backend(("sdpa", "flash"), batch, W)
    assert_same_training(results["sdpa"], results["flash"], tol=1e-6)


def _attention_grads(backend, wrap=lambda f: f):
    """The gradients of q, keys and values through four steps of one TTTAttention, each step's
    call made through ``wrap``."""
    queries, keys, values, rows, attention, seq = attention_inputs(seed=11)
    leaves = [x.requires_grad_() for x in queries + keys + values]
    attend = TTTAttention(attention, seq, backend)
    g = torch.Generator().manual_seed(12)
    loss = 0
    for k in range(len(rows)):
        step = wrap(lambda q, ks, vs, k=k: attend(q, rows[k], ks, vs, rows[: k + 1]))
        out = step(queries[k], keys[: k + 1], values[: k + 1])
        loss = loss + (out * torch.randn(out.shape, generator=g)).sum()
    loss.backward()
    return [x.grad for x in leaves]


def test_flash_inside_a_compiled_caller_still_gets_the_merged_output():
    """Traced by torch.compile, the block's backward would never see the output the caller holds
    after it: the flash call stays eager inside a compiled caller, and the gradients stay exact."""
    want = _attention_grads("sdpa")
    got = _attention_grads("flash", lambda f: torch.compile(f, backend="aot_eager"))
    for a, b in zip(want, got):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_a_flash_backward_without_the_merged_output_it_expected_is_an_error(monkeypatch):
    from specforge_core.drafts.eagle3 import flash

    monkeypatch.setattr(flash.MergedOutput, "hold", lambda self, *args: None)
    with pytest.raises(RuntimeError, match="merged output was held"):
        _attention_grads("flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's kernels are CUDA only")
def test_explicit_flash_in_fp32_on_cuda_is_a_config_error_naming_the_field():
    queries, keys, values, rows, attention, seq = attention_inputs(seed=1, hd=16)
    attend = TTTAttention(attention.cuda(), seq.cuda(), "flash")
    with pytest.raises(ConfigError, match="draft.attention_backend"):
        attend(queries[0].cuda(), rows[0].cuda(), [keys[0].cuda()], [values[0].cuda()], [rows[0].cuda()])


def test_flash_handed_its_own_output_would_miss_the_log_sum_exp_gradient(monkeypatch):
    """test_flash_trains_like_sdpa_... can fail: without the merged output the step-0 block's
    gradients differ."""
    from specforge_core.drafts.eagle3 import flash

    W = target_head(5, 24)
    batch = random_batch(seed=5, lengths=[12, 7, 10], T=12, target_hidden=24)
    monkeypatch.setattr(flash.MergedOutput, "on_real_rows", lambda self: None)
    results = grads_by_backend(("sdpa", "flash"), batch, W)
    (_, _, gs), (_, _, gf) = results["sdpa"], results["flash"]
    q = "midlayer.self_attn.q_proj.weight"
    assert (gs[q] - gf[q]).abs().max().item() / gs[q].abs().max().item() > 1e-2


def _bf16_errors(device, backends=("sdpa", "flash")):
    """Per backend run in bf16 and per parameter, ‖grad − sdpa fp32 grad‖ / ‖sdpa fp32 grad‖ on a
    packed, padded batch, and the losses (``"fp32"``: the reference's)."""
    W = target_head(5, 24).to(device)
    batch = {k: v.to(device) for k, v in random_batch(seed=5, lengths=[40, 29, 33], T=40, target_hidden=24).items()}
    batch["seq_ids"] = torch.zeros_like(batch["input_ids"])
    batch["seq_ids"][0, 17:] = 1  # row 0 holds two samples
    want = grads_by_backend(("sdpa",), batch, W, torch.float32, device, head_dim=32)["sdpa"]
    errors, losses = {}, {"fp32": want[0]}
    for backend in backends:
        got = grads_by_backend((backend,), batch, W, torch.bfloat16, device, head_dim=32)[backend]
        errors[backend] = {n: ((got[2][n] - g).norm() / g.norm()).item() for n, g in want[2].items()}
        losses[backend] = got[0]
    return errors, losses


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_flash_in_bf16_trains_as_close_to_fp32_as_sdpa_in_bf16(device):
    """bf16 rounding alone moves this tiny draft's gradients by ≈ 5–9 % in norm (sdpa and flash
    alike, measured on the CPU and an H200); flash stays within that, while the block handed its
    own output instead of the merged one moves them by ≈ 15–28 % (the test below)."""
    errors, losses = _bf16_errors(device)
    assert abs(losses["flash"] - losses["fp32"]) < 2e-2 * max(1.0, abs(losses["fp32"]))
    for name, err in errors["flash"].items():
        assert err < 1.5 * errors["sdpa"][name] + 1e-2, (name, err, errors["sdpa"][name])


@pytest.mark.parametrize("device", DEVICES)
def test_the_bf16_check_above_fails_without_the_merged_output(monkeypatch, device):
    from specforge_core.drafts.eagle3 import flash

    monkeypatch.setattr(flash.MergedOutput, "on_real_rows", lambda self: None)
    errors, _ = _bf16_errors(device)
    q = "midlayer.self_attn.q_proj.weight"
    assert errors["flash"][q] > 1.5 * errors["sdpa"][q] + 1e-2, (errors["flash"][q], errors["sdpa"][q])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward; run on a CUDA machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_and_sdpa_agree_in_loss_metrics_and_gradients_on_cuda(dtype):
    W = target_head(5, 24).cuda()
    batch = {k: v.cuda() for k, v in random_batch(seed=5, lengths=[40, 29, 33], T=40, target_hidden=24).items()}
    # flex kernels need head_dim >= 16
    results = grads_by_backend(("sdpa", "flex"), batch, W, dtype, "cuda", head_dim=32)
    assert_same_training(results["sdpa"], results["flex"], tol=1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
def test_one_attention_serves_every_step_with_or_without_the_plans_indices(backend, padded):
    """The unroll calls one TTTAttention per batch at every step (flex lays the step-0 keys out
    once); with the plan's same-position indices or without, each step equals the dense rule."""
    queries, keys, values, rows, attention, seq = attention_inputs(seed=7, padded=padded)
    attend = TTTAttention(attention, seq, backend)
    with torch.no_grad():
        for k in range(len(rows)):
            args = (queries[k], rows[k], keys[: k + 1], values[: k + 1], rows[: k + 1])
            want = dense_ttt_attention(*args, attention, seq)
            same_at = [torch.searchsorted(rows[j], rows[k]) for j in range(1, k + 1)]
            for given in (None, same_at):
                assert (attend(*args, same_at=given) - want).abs().max() < 1e-5
