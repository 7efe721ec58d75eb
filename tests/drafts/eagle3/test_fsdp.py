"""The objective sharded as the trainer shards it (``loop.optim.shard``): one FSDP2 unit over
the trainer's root (``loop.trainer.TrainStep``), whose forward runs the whole unroll, so every
parameter use (the draft's forward calls and the q/k/v weights the step folds once) falls inside
it. A sharded draft gives the unsharded loss and gradients (2 gloo ranks on CPU)."""

import os

import pytest
import torch
import torch.distributed as dist

from specforge_core.drafts.eagle3 import eagle3_loss
from specforge_core.system.distributed import exit_after_success
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft
from tests.runtime.harness import rank_context


def _sharded_worker(rank, world, port, queue):
    from torch.distributed.device_mesh import init_device_mesh

    from specforge_core.system.distributed import Dist
    from specforge_core.loop.optim import shard
    from specforge_core.loop.trainer import TrainStep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = Dist(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo",
             mesh=init_device_mesh("cpu", (world,)))
    draft = tiny_draft(seed=12)
    W = target_head(12, 24)
    root = shard(TrainStep(draft, lambda dr, batch: eagle3_loss(dr, batch, W, ttt_length=4, backend="sdpa")), d)
    batch = random_batch(seed=12, lengths=[9, 7], T=9, target_hidden=24)
    loss, _ = root(batch)
    loss.backward()
    grads = {n: p.grad.full_tensor().tolist() for n, p in draft.named_parameters() if p.requires_grad}
    if rank == 0:
        queue.put((loss.item(), grads))
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # the result is in the pipe: exit_after_success skips the queue's own flush at exit
    exit_after_success()  # exit 0, not an abort at teardown (a gloo thread's late release; see there)


@pytest.mark.slow
def test_draft_sharded_as_the_trainer_shards_it_gives_the_unsharded_loss_and_gradients():
    import torch.multiprocessing as mp

    draft = tiny_draft(seed=12)
    batch = random_batch(seed=12, lengths=[9, 7], T=9, target_hidden=24)
    loss, _ = eagle3_loss(draft, batch, target_head(12, 24), ttt_length=4, backend="sdpa")
    loss.backward()
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # held: no port race
    port = store.port
    queue = rank_context().Queue()
    workers = mp.start_processes(_sharded_worker, args=(2, port, queue), nprocs=2, start_method="forkserver",
                                 join=False)
    try:  # before join: the worker exits only once this is read
        sharded_loss, sharded_grads = queue.get(timeout=300)
    except Exception:  # a worker that failed never puts: its error, not a hang
        workers.join(timeout=30)
        raise
    while not workers.join():
        pass
    assert abs(sharded_loss - loss.item()) < 1e-6
    for name, param in draft.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(torch.tensor(sharded_grads[name]), param.grad, atol=1e-6, rtol=1e-5)
