"""The objective drives a DFlash draft (without DFlash2's selector) only through its forward, so
FSDP2 (``fully_shard``) on the draft itself sees every parameter use: a sharded draft gives the
unsharded loss and gradients. One gloo rank in this process (parameters become DTensors, so any
use outside forward would fail)."""

import pytest
import torch

from specforge_core.drafts.dflash.objective import dflash_loss
from tests.drafts.dflash.fixtures import packed_batch, random_samples, target_weights, tiny_draft


@pytest.fixture
def process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss_and_grads(draft, batch, E, W):
    loss, sums = dflash_loss(draft, batch, embed_weight=E, lm_head_weight=W, block_size=4, num_anchors=3,
                             loss_decay_gamma=4.0, generator=torch.Generator().manual_seed(0), backend="sdpa")
    loss.backward()
    grads = {}
    for name, p in draft.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("_fsdp_wrapped_module.", "")] = grad.detach().clone()
    return loss.item(), sums, grads


def test_fully_sharded_draft_gives_the_unsharded_loss_and_gradients(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))  # keep the shards on the CPU even where CUDA exists

    kwargs = dict(seed=8, block_size=4, num_layers=2, layer_types=["sliding_attention", "full_attention"],
                  sliding_window=5)
    E, W = target_weights(8)
    batch = packed_batch(random_samples(8, [9, 6, 11]), [[0, 1], [2]])
    loss, sums, grads = _loss_and_grads(tiny_draft(**kwargs), batch, E, W)
    sharded = tiny_draft(**kwargs)
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded_loss, sharded_sums, sharded_grads = _loss_and_grads(sharded, batch, E, W)
    assert abs(sharded_loss - loss) <= 1e-6 * abs(loss)
    assert torch.equal(sums["total"], sharded_sums["total"])
    assert grads.keys() == sharded_grads.keys()
    for name in grads:
        torch.testing.assert_close(sharded_grads[name], grads[name], rtol=1e-5, atol=1e-6)
