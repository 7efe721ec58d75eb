"""The TTT attention pattern (reference §2.3) and the agreement of its sdpa and flex backends."""

import pytest
import torch

from specforge_core.errors import ConfigError
from specforge_core.objective import eagle3_loss, summarize_metrics
from specforge_core.objective.attention import TTTAttention, resolve_backend, step_zero_visibility
from tests.objective.fixtures import random_batch, target_head, tiny_draft


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


def test_auto_backend_is_sdpa_on_cpu_and_unknown_names_are_config_errors():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ConfigError, match="draft.attention_backend"):
        resolve_backend("eager", torch.device("cpu"))


def attention_inputs(seed, B=2, T=9, nh=4, nkv=2, hd=8, steps=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T, hd, generator=g)
    keys = [torch.randn(B, nkv, T, hd, generator=g) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd, generator=g) for _ in range(steps)]
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, 6:] = 0
    seq = torch.tensor([[0] * 4 + [1] * 5, [0] * 3 + [1] * 3 + [-1] * 3])
    return q, keys, values, attention, seq


@pytest.mark.parametrize("k", [0, 1, 3])
def test_flex_equals_sdpa_forward_on_cpu(k):
    q, keys, values, attention, seq = attention_inputs(seed=k)
    with torch.no_grad():
        sdpa = TTTAttention(attention, seq, "sdpa")(q, keys[: k + 1], values[: k + 1])
        flex = TTTAttention(attention, seq, "flex")(q, keys[: k + 1], values[: k + 1])
    assert (sdpa - flex).abs().max() < 1e-5


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward; run on a CUDA machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_and_sdpa_agree_in_loss_metrics_and_gradients_on_cuda(dtype):
    W = target_head(5, 24).cuda()
    batch = {k: v.cuda() for k, v in random_batch(seed=5, lengths=[40, 29, 33], T=40, target_hidden=24).items()}
    results = {}
    for backend in ("sdpa", "flex"):
        draft = tiny_draft(seed=5, head_dim=32).cuda().cast_params(dtype)  # flex kernels need head_dim >= 16
        loss, sums = eagle3_loss(draft, batch, W, ttt_length=7, backend=backend)
        loss.backward()
        grads = {n: p.grad.float() for n, p in draft.named_parameters() if p.requires_grad}
        results[backend] = (loss.item(), summarize_metrics(sums), grads)
    (ls, ms, gs), (lf, mf, gf) = results["sdpa"], results["flex"]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert abs(ls - lf) < tol * max(1.0, abs(ls))
    assert max(abs(ms[key] - mf[key]) for key in ms if not key.startswith("acc")) < tol * 10
    for name in gs:
        scale = gs[name].abs().max().item() + 1e-6
        assert (gs[name] - gf[name]).abs().max().item() / scale < tol * 10, name
