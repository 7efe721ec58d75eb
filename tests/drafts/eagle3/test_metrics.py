"""Metric sums are additive across micro-batches and ranks; ratios follow reference §2.4."""

import os

import pytest
import torch
import torch.distributed as dist

from specforge_core.drafts.eagle3 import add_metric_sums, all_reduce_metric_sums, eagle3_loss, summarize_metrics
from specforge_core.system.distributed import exit_after_success
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft
from tests.runtime.harness import rank_context


def hand_sums():
    return {
        "loss_sum": torch.tensor([8.0, 4.0], dtype=torch.float64),
        "acc_correct": torch.tensor([3.0, 1.0], dtype=torch.float64),
        "acc_total": torch.tensor([4.0, 2.0], dtype=torch.float64),
        "accept_sum": torch.tensor([1.5, 0.0], dtype=torch.float64),
        "accept_total": torch.tensor([3.0, 0.0], dtype=torch.float64),
        "positions": torch.tensor(16.0, dtype=torch.float64),
    }


def test_summary_gives_per_step_ratios_weighted_loss_and_simulated_accept_length():
    m = summarize_metrics(hand_sums(), decay=0.8)
    assert (m["acc_0"], m["acc_1"]) == (0.75, 0.5)
    assert (m["ploss_0"], m["ploss_1"]) == (0.5, 0.25)
    assert m["loss"] == pytest.approx(0.5 + 0.8 * 0.25)
    assert m["acceptance_rate_0"] == 0.5 and m["acceptance_rate_1"] == 0.0  # empty denominator → 0
    assert m["acc"] == pytest.approx(4 / 6)
    assert m["simulated_accept_length"] == pytest.approx(0.75 + 0.75 * 0.5)
    assert m["simulated_accept_length_with_bonus"] == pytest.approx(1 + 0.75 + 0.375)


def test_sums_of_two_halves_equal_the_sums_of_the_whole_batch():
    draft, W = tiny_draft(seed=8), target_head(8, 24)
    batch = random_batch(seed=8, lengths=[9, 6], T=9, target_hidden=24)
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    with torch.no_grad():
        whole_loss, whole = eagle3_loss(draft, batch, W, ttt_length=3)
        parts = None
        for half in halves:
            parts = add_metric_sums(parts, eagle3_loss(draft, half, W, ttt_length=3)[1])
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key], atol=1e-5, rtol=0)
    assert summarize_metrics(parts)["loss"] == pytest.approx(whole_loss.item(), abs=1e-6)


def _reduce_worker(rank, world, port, queue):

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sums = {k: v * (rank + 1) for k, v in hand_sums().items()}
    reduced = all_reduce_metric_sums(sums)
    queue.put((rank, {k: v.tolist() for k, v in reduced.items()}))
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # the result is in the pipe: exit_after_success skips the queue's own flush at exit
    exit_after_success()  # exit 0, not an abort at teardown (a gloo thread's late release; see there)


@pytest.mark.slow
def test_all_reduce_sums_every_key_across_ranks():
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # held: no port race
    port = store.port
    queue = rank_context().Queue()
    workers = mp.start_processes(_reduce_worker, args=(2, port, queue), nprocs=2, start_method="forkserver", join=False)
    results = dict(queue.get() for _ in range(2))
    while not workers.join():
        pass
    expected = {k: (v * 3).tolist() for k, v in hand_sums().items()}
    assert results[0] == results[1] == expected
