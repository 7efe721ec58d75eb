"""FSDP2 + AdamW + clipping + accumulation: sharded training equals one process on the whole batch."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.loop.optim import DraftOptimizer, shard
from specforge_core.loop.schedule import build_scheduler
from tests.runtime.harness import TinyDraft, TinyStep, run_ranks, tiny_batch

STEPS = 4
HYPER = dict(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=0.5, warmup_ratio=0.25, lr_scheduler="cosine")


def _build(d, accumulation, param_dtype="float32", fused=None):
    torch.manual_seed(0)
    draft = TinyDraft()
    root = shard(TinyStep(draft), d, param_dtype=param_dtype)
    opt = DraftOptimizer(root, accumulation_steps=accumulation, total_steps=STEPS, fused=fused, **HYPER)
    return draft, root, opt


def _train(d, accumulation, fused=None):
    """Each optimizer step trains global batch ``tiny_batch(step)``, split over ranks × micro-batches."""
    draft, root, opt = _build(d, accumulation, fused=fused)
    norms = []
    for s in range(STEPS):
        chunks = {k: v.chunk(d.world_size * accumulation) for k, v in tiny_batch(s).items()}
        for m in range(accumulation):
            opt.backward(root({k: c[m * d.world_size + d.rank] for k, c in chunks.items()}))
        norms.append(float(opt.step()["grad_norm"]))
    weights = get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"weights": weights, "norms": norms}


def _inspect_bf16(d):
    draft, root, opt = _build(d, 1, "bfloat16")
    seen = {}
    draft.lm_head.register_forward_hook(lambda m, i, o: seen.update(compute=o.dtype))
    opt.backward(root({k: v.chunk(2)[d.rank] for k, v in tiny_batch(0).items()}))
    opt.step()
    optimized = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
    return {
        "compute": seen["compute"],
        "masters": {n: (type(p).__name__, p.dtype) for n, p in draft.named_parameters() if p.requires_grad},
        "adam_state": {v.dtype for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"},
        "embedding": (type(draft.embed_tokens.weight).__name__, draft.embed_tokens.weight.dtype),
        "embedding_optimized": id(draft.embed_tokens.weight) in optimized,
    }


def _two_rank_worker(rank):
    d = init_distributed("cpu", timeout_s=30)
    out = {"accum1": _train(d, 1), "accum2": _train(d, 2), "fused": _train(d, 1, fused=True),
           "bf16": _inspect_bf16(d)}
    close_distributed()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_worker, 2)[0]


@pytest.fixture(scope="module")
def reference():
    """The same training in one process, no FSDP, on the whole batch of every step."""
    torch.manual_seed(0)
    draft = TinyDraft()
    step = TinyStep(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=HYPER["learning_rate"], weight_decay=HYPER["weight_decay"])
    sched = build_scheduler(opt, total_steps=STEPS, warmup_ratio=HYPER["warmup_ratio"], kind="cosine")
    norms = []
    for s in range(STEPS):
        step(tiny_batch(s)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, HYPER["max_grad_norm"])))
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"weights": draft.state_dict(), "norms": norms}


def _assert_same_weights(got, want):
    trained = {k for k in want if k != "embed_tokens.weight"}
    assert trained <= set(got)
    for k in trained:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_two_ranks_train_like_one_process_on_the_whole_batch(two_ranks, reference):
    _assert_same_weights(two_ranks["accum1"]["weights"], reference["weights"])


def test_accumulated_micro_batches_train_like_one_whole_batch(two_ranks, reference):
    _assert_same_weights(two_ranks["accum2"]["weights"], reference["weights"])


def test_fused_adamw_applies_the_clipping_inside_its_kernel_like_clip_grad_norm(two_ranks, reference):
    # the CUDA default: the clip coefficient goes in as the fused kernel's grad_scale, no extra pass
    _assert_same_weights(two_ranks["fused"]["weights"], reference["weights"])
    assert two_ranks["fused"]["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def test_grad_norm_is_the_global_norm_over_all_shards(two_ranks, reference):
    assert two_ranks["accum1"]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert max(reference["norms"]) > HYPER["max_grad_norm"]  # so clipping was exercised


def test_bf16_policy_computes_in_bf16_on_fp32_master_weights(two_ranks):
    bf16 = two_ranks["bf16"]
    assert bf16["compute"] == torch.bfloat16
    assert set(bf16["masters"].values()) == {("DTensor", torch.float32)}
    assert bf16["adam_state"] == {torch.float32}


def test_frozen_embedding_stays_whole_in_compute_dtype_and_untrained(two_ranks):
    assert two_ranks["bf16"]["embedding"] == ("Parameter", torch.bfloat16)
    assert not two_ranks["bf16"]["embedding_optimized"]


@pytest.fixture(scope="module")
def world_of_one():
    d = init_distributed("cpu", timeout_s=30)
    yield d
    close_distributed()


def test_step_refuses_a_partial_accumulation_window(world_of_one):
    _, root, opt = _build(world_of_one, accumulation=2)
    opt.backward(root(tiny_batch(0)))
    with pytest.raises(RuntimeError, match="only whole optimizer steps"):
        opt.step()


def test_backward_past_the_window_without_step_is_refused(world_of_one):
    _, root, opt = _build(world_of_one, accumulation=1)
    opt.backward(root(tiny_batch(0)))
    with pytest.raises(RuntimeError, match="without step"):
        opt.backward(root(tiny_batch(1)))


def test_sharded_parameters_are_dtensors_on_the_run_mesh(world_of_one):
    draft, _, _ = _build(world_of_one, accumulation=1)
    assert isinstance(draft.fc.weight, DTensor)
    assert draft.fc.weight.device_mesh == world_of_one.mesh


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_b):
        return (self.a(x) + (self.b(x) if use_b else 0)).square().sum()


def test_fused_adamw_updates_a_parameter_whose_first_gradient_comes_late(world_of_one):
    # a parameter without a gradient on the first update has no AdamW state yet: the next update
    # that reaches it must make that state (as optimizer.step does), not assume it
    torch.manual_seed(0)
    root = shard(_TwoHeads(), world_of_one)
    opt = DraftOptimizer(root, accumulation_steps=1, total_steps=STEPS, fused=True, **HYPER)
    x = torch.randn(3, 4)
    for use_b in (False, True, True):
        before = root.b.weight.to_local().detach().clone()
        opt.backward(root(x, use_b))
        opt.step()
        assert torch.equal(root.b.weight.to_local(), before) != use_b
    assert set(opt.optimizer.state) == {p for p in root.parameters()}


def test_the_global_norm_counts_sharded_replicated_and_plain_gradients_once(world_of_one):
    # FSDP2's gradients take the local shards' path; a replicated one goes through DTensor
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _, _, opt = _build(world_of_one, accumulation=1)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(6, 4, generator=g) for _ in range(3))
    want = torch.cat([a.flatten(), b.flatten(), c.flatten()]).norm()
    mesh = world_of_one.mesh
    sharded = [distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])]
    torch.testing.assert_close(opt._global_norm(sharded + [c]), want)
    replicated = [distribute_tensor(a, mesh, [Replicate()]), distribute_tensor(b, mesh, [Shard(0)])]
    torch.testing.assert_close(opt._global_norm(replicated), torch.cat([a.flatten(), b.flatten()]).norm())
