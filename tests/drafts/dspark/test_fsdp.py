"""The DSpark heads run inside the draft's forward, so a fully sharded draft (FSDP2) gives the
unsharded loss and gradients. One gloo rank in this process: parameters become DTensors, so any
use of a head outside forward would fail."""

import torch

from specforge_core.drafts.dspark.objective import ObjectiveSettings, dspark_loss
from tests.drafts.dflash.fixtures import target_weights
from tests.drafts.dflash.test_fsdp import process_group  # noqa: F401  (fixture)
from tests.drafts.dspark.fixtures import batch_of, samples, tiny_dspark


def _loss_and_grads(draft, batch, E, W):
    loss, sums = dspark_loss(draft, batch, embed_weight=E, lm_head_weight=W, num_anchors=3,
                             settings=ObjectiveSettings(loss_terms={"kl_div": 0.5, "tv": 0.5}),
                             generator=torch.Generator().manual_seed(0), backend="sdpa")
    loss.backward()
    grads = {}
    for name, p in draft.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    return loss.item(), sums, grads


def test_fully_sharded_draft_gives_the_unsharded_loss_and_gradients(process_group):  # noqa: F811
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    E, W = target_weights(8)
    batch = batch_of(samples(8, [9, 6, 11]), [[0, 1], [2]])
    loss, sums, grads = _loss_and_grads(tiny_dspark(8, num_layers=2, markov_head_type="rnn"), batch, E, W)
    sharded = tiny_dspark(8, num_layers=2, markov_head_type="rnn")
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded_loss, sharded_sums, sharded_grads = _loss_and_grads(sharded, batch, E, W)
    assert abs(sharded_loss - loss) <= 1e-6 * abs(loss)
    assert torch.equal(sums["total"], sharded_sums["total"])
    assert grads.keys() == sharded_grads.keys()
    for name in grads:
        torch.testing.assert_close(sharded_grads[name], grads[name], rtol=1e-5, atol=1e-6)
