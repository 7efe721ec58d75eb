"""The fast objective equals the slow float64 reference (tests/drafts/eagle3/reference.py) in float32:
loss, every metric and every gradient within 1e-5, for K = 1..7, padding, random loss masks,
fc_norm and norm_output (EAGLE-3.1), a target width different from the draft's, and every supported
RoPE variant."""

import pytest
import torch

from specforge_core.drafts.eagle3 import eagle3_loss, summarize_metrics
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft
from tests.drafts.eagle3.reference import reference_eagle3

TOL = 1e-5
SUM_KEYS = ("loss_sum", "acc_correct", "acc_total", "accept_sum", "accept_total")


def plant_hits(draft, batch, W, K, seed):
    """Steer the target's argmax at about half the teacher positions to what the draft predicts at
    one of the steps that reads it, so the accuracy metric sees hits as well as misses."""
    params = {n: p.detach().double() for n, p in draft.named_parameters()}
    with torch.no_grad():
        logits = reference_eagle3(params, draft.config, batch, W, draft.t2d, draft.d2t, K)["logits"]
    g = torch.Generator().manual_seed(seed)
    B, T = batch["input_ids"].shape
    last = batch["last_hidden"].clone()
    for b in range(B):
        for i in range(T - 1):  # teacher index i (target at position i + 1) is read by step k at t = i - k
            k = int(torch.randint(min(K, i + 1), (1,), generator=g))
            if torch.rand((), generator=g) < 0.5:
                d = int(logits[k][b][i - k].argmax())
                token = d + int(draft.d2t[d])
                last[b, i + 1] = 12 * W[token] / W[token].norm() + 0.1 * last[b, i + 1]
    return dict(batch, last_hidden=last)


def compare_with_reference(draft, batch, W, K, backend="sdpa", device="cpu"):
    """Max abs differences (loss, metrics, grads) between the fast path (on ``device``) and the
    reference (float64, CPU)."""
    batch = plant_hits(draft, batch, W, K, seed=K)
    draft.zero_grad()
    on_device = {k: v.to(device) for k, v in batch.items()}
    loss, sums = eagle3_loss(draft.to(device), on_device, W.to(device), ttt_length=K, backend=backend)
    loss.backward()
    draft.cpu()
    sums = {k: v.cpu() for k, v in sums.items()}
    params = {n: p.detach().double().clone().requires_grad_(p.requires_grad) for n, p in draft.named_parameters()}
    ref = reference_eagle3(params, draft.config, batch, W, draft.t2d, draft.d2t, K)
    ref["loss"].backward()
    ref_sums = {k: ref[k] for k in SUM_KEYS} | {"positions": torch.tensor(float(batch["input_ids"].numel()))}
    fast_m, ref_m = summarize_metrics(sums), summarize_metrics({k: v.detach() for k, v in ref_sums.items()})
    grads = {n: (p.grad.double() - params[n].grad).abs().max().item() for n, p in draft.named_parameters() if p.requires_grad}
    return {
        "loss": abs(loss.item() - ref["loss"].item()),
        "metrics": max(abs(fast_m[k] - ref_m[k]) for k in ref_m),
        "counts": max((sums[k] - ref_sums[k].detach()).abs().max().item() for k in ("acc_correct", "acc_total", "accept_total")),
        "grads": max(grads.values()),
    }, ref


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 7])
def test_fast_path_matches_reference_for_each_ttt_length(K):
    draft = tiny_draft(seed=K)
    batch = random_batch(seed=K, lengths=[10, 7], T=10, target_hidden=24)
    diffs, ref = compare_with_reference(draft, batch, target_head(K, 24), K)
    hits, total = ref["acc_correct"].sum(), ref["acc_total"].sum()
    assert 0 < hits < total and ref["accept_total"].sum() > 0  # the metrics see hits and misses
    assert diffs["counts"] == 0
    assert max(diffs.values()) < TOL, diffs


def test_fast_path_matches_reference_with_fc_norm_and_wider_target():
    draft = tiny_draft(seed=11, fc_norm=True, target_hidden=20)
    batch = random_batch(seed=11, lengths=[6, 9, 9], T=9, target_hidden=20)
    diffs, _ = compare_with_reference(draft, batch, target_head(11, 20), K=4)
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize("fc_norm", [False, True], ids=["norm_output", "eagle31"])
def test_fast_path_matches_reference_with_norm_output(fc_norm):
    draft = tiny_draft(seed=13, fc_norm=fc_norm, norm_output=True)
    batch = random_batch(seed=13, lengths=[8, 5], T=8, target_hidden=24)
    diffs, ref = compare_with_reference(draft, batch, target_head(13, 24), K=5)
    assert diffs["counts"] == 0
    assert max(diffs.values()) < TOL, diffs


def test_norm_output_changes_only_the_later_steps():
    """Step 0 reads the projected captured states either way; from step 1 on the carried hidden
    is post-norm, so the logits differ."""
    plain, post = tiny_draft(seed=17), tiny_draft(seed=17, norm_output=True)
    batch = random_batch(seed=17, lengths=[7, 7], T=7, target_hidden=24)
    W = target_head(17, 24)
    out = [reference_eagle3({n: q.detach().double() for n, q in d.named_parameters()}, d.config, batch, W,
                            d.t2d, d.d2t, 3)["logits"] for d in (plain, post)]
    assert torch.equal(out[0][0][0][0], out[1][0][0][0])
    assert not torch.allclose(out[0][1][0][0], out[1][1][0][0])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16, "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1000000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_fast_path_matches_reference_for_rope_variants(rope):
    draft = tiny_draft(seed=21, rope_parameters=dict(rope))
    batch = random_batch(seed=21, lengths=[9, 5], T=9, target_hidden=24)
    diffs, _ = compare_with_reference(draft, batch, target_head(21, 24), K=3)
    assert max(diffs.values()) < TOL, diffs


def test_a_batch_without_targets_has_zero_loss_and_zero_gradients():
    draft = tiny_draft(seed=8)
    batch = random_batch(seed=8, lengths=[7, 5], T=7, target_hidden=24)
    batch["loss_mask"].zero_()
    loss, sums = eagle3_loss(draft, batch, target_head(8, 24), ttt_length=3)
    loss.backward()
    assert loss.item() == 0 and sums["acc_total"].sum() == 0
    assert all(p.grad is None or not p.grad.any() for p in draft.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex backward, fused loss kernels)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_layer", "compiled_layer"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_fast_path_on_cuda_matches_reference(backend, compiled):
    """On GPU: fused loss kernels and flex attention (head_dim >= 16 for its kernels), with the
    decoder layer eager or compiled as ``training.compile`` compiles it."""
    from specforge_core.system.compile import compile_pointwise

    draft = tiny_draft(seed=31, head_dim=32)
    if compiled:
        compile_pointwise(draft)
    batch = random_batch(seed=31, lengths=[12, 9], T=12, target_hidden=24)
    diffs, _ = compare_with_reference(draft, batch, target_head(31, 24), K=7, backend=backend, device="cuda")
    assert diffs["counts"] == 0
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex backward, fused loss kernels)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_layer", "compiled_layer"])
@pytest.mark.parametrize("backend, dtype", [("flex", torch.float32), ("flex", torch.bfloat16),
                                            ("flash", torch.bfloat16)])
def test_a_step_with_host_masks_never_waits_for_the_device(compiled, backend, dtype):
    """With the capture's host masks the step (forward and backward; flex attention, auto's choice in
    fp32, or flash, its choice in bf16) reads nothing back from the device, so the host can launch
    it while the device still runs the previous step."""
    from specforge_core.capture.base import HostMasks
    from specforge_core.system.compile import compile_pointwise

    draft = tiny_draft(seed=32, head_dim=32).cuda().cast_params(dtype)
    if compiled:
        compile_pointwise(draft)
    batch = random_batch(seed=32, lengths=[12, 9], T=12, target_hidden=24)
    host = HostMasks(batch["attention_mask"].long(), batch["loss_mask"].long())
    batch = {k: v.cuda() for k, v in batch.items()} | {"host_masks": host}
    W = target_head(32, 24).cuda()
    for _ in range(2):  # the first call compiles and builds what later calls reuse
        loss, _sums = eagle3_loss(draft, batch, W, ttt_length=7, backend=backend)
        loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _sums = eagle3_loss(draft, batch, W, ttt_length=7, backend=backend)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
