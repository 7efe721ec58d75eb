"""The prompt plan: a pure, deterministic layout of prompts over epochs, islands and TP peers."""

from collections import Counter

import pytest

from specforge_core.config import load_config
from specforge_core.errors import ConfigError, ResumeError
from specforge_core.run.plan import PromptPlan, epoch_permutation
from specforge_core.run.topology import Topology


def plan(**kw) -> PromptPlan:
    args = dict(dataset_size=103, seed=7, epochs=3, world_size=4, tp_size=2, batch_size=3,
                accumulation_steps=2)
    args.update(kw)
    topology = Topology(args.pop("world_size"), args.pop("tp_size"), args.pop("batch_size"))
    return PromptPlan.build(args.pop("dataset_size"), topology=topology, **args)


def all_batches(p: PromptPlan, rank: int, **kw):
    return list(p.island_batches(rank, **kw))


def test_epoch_order_is_a_permutation_seeded_by_seed_plus_epoch():
    assert epoch_permutation(50, 7, 2).tolist() == epoch_permutation(50, 8, 1).tolist()
    assert epoch_permutation(50, 7, 0).tolist() != epoch_permutation(50, 7, 1).tolist()
    assert sorted(epoch_permutation(50, 7, 0).tolist()) == list(range(50))


def test_island_shards_partition_each_epochs_kept_prompts():
    p = plan()
    for epoch in range(p.epochs):
        shards = [p.island_shard(i, epoch) for i in range(p.num_islands)]
        kept = epoch_permutation(p.dataset_size, p.seed, epoch)[: p.prompts_per_epoch].tolist()
        flat = [x for s in shards for x in s]
        assert sorted(flat) == sorted(kept) and len(flat) == len(set(flat))


def test_island_shards_are_equal_and_whole_tp_wide_batches():
    p = plan()
    sizes = {len(p.island_shard(i, 0)) for i in range(p.num_islands)}
    assert len(sizes) == 1
    assert sizes.pop() % p.island_batch_size == 0


def test_the_tail_shorter_than_an_optimizer_step_is_dropped_within_the_epoch():
    p = plan()  # 103 prompts, one optimizer step = 4 × 3 × 2 = 24 prompts → 4 steps, 7 dropped
    assert (p.steps_per_epoch, p.prompts_per_epoch, p.dropped_per_epoch) == (4, 96, 7)
    epochs = Counter(b.epoch for b in all_batches(p, 0))
    assert epochs == {e: p.micro_steps_per_epoch for e in range(p.epochs)}


def test_tp_peers_share_the_tp_wide_batch_and_keep_disjoint_contiguous_slices():
    p = plan()
    b0, b1 = all_batches(p, 0)[0], all_batches(p, 1)[0]
    assert b0.tasks == b1.tasks and len(b0.tasks) == p.tp_size * p.batch_size
    assert b0.local == slice(0, 3) and b1.local == slice(3, 6)
    assert set(b0.local_tasks).isdisjoint(b1.local_tasks)


def test_every_rank_trains_the_same_number_of_micro_steps():
    p = plan()
    counts = {len(all_batches(p, r)) for r in range(p.world_size)}
    assert counts == {p.total_micro_steps}


def trained_per_optimizer_step(p: PromptPlan) -> list[set[int]]:
    steps: dict[int, set[int]] = {}
    for rank in range(p.world_size):
        for b in p.island_batches(rank):
            step = b.micro_step // p.accumulation_steps
            steps.setdefault(step, set()).update(t.prompt_index for t in b.local_tasks)
    return [steps[s] for s in sorted(steps)]


def test_tp1_and_tp2_layouts_train_the_same_samples_per_epoch():
    tp1, tp2 = plan(tp_size=1), plan(tp_size=2)
    for epoch in range(tp1.epochs):
        a = {x for i in range(tp1.num_islands) for x in tp1.island_shard(i, epoch)}
        b = {x for i in range(tp2.num_islands) for x in tp2.island_shard(i, epoch)}
        assert a == b


def test_tp1_and_tp2_layouts_train_the_same_samples_in_every_optimizer_step():
    assert trained_per_optimizer_step(plan(tp_size=1)) == trained_per_optimizer_step(plan(tp_size=2))


def test_task_ids_are_stable_and_name_island_epoch_slot_prompt():
    first = all_batches(plan(), 2)[0].tasks[0]
    assert first.task_id == f"island0001-epoch000000-slot000000000-prompt{first.prompt_index:09d}"
    assert [t.task_id for b in all_batches(plan(), 2) for t in b.tasks] == [
        t.task_id for b in all_batches(plan(), 2) for t in b.tasks
    ]


def test_horizon_counts_whole_optimizer_steps_over_all_epochs():
    p = plan()
    assert p.total_optimizer_steps == p.steps_per_epoch * p.epochs == 12
    assert p.total_micro_steps == 24


def test_max_steps_shortens_the_horizon_and_the_stream():
    p = plan(max_steps=5)
    assert p.total_optimizer_steps == 5
    assert len(all_batches(p, 0)) == 5 * p.accumulation_steps


def test_max_steps_beyond_the_data_adds_no_epochs():
    assert plan(max_steps=10_000).total_optimizer_steps == plan().total_optimizer_steps


def test_local_lengths_are_the_lengths_of_each_ranks_samples_in_plan_order():
    import torch

    p = plan(max_steps=7)  # 4 steps per epoch: the horizon ends inside the second epoch
    lengths = torch.randint(1, 1000, (p.dataset_size,), generator=torch.Generator().manual_seed(0))
    got = p.local_lengths(lengths)
    assert got.shape == (p.total_micro_steps, p.world_size, p.batch_size)
    for rank in range(p.world_size):
        for b in all_batches(p, rank):
            assert got[b.micro_step, rank].tolist() == [int(lengths[t.prompt_index]) for t in b.local_tasks]


def test_resume_from_a_sample_offset_yields_the_remaining_suffix():
    p = plan()
    full = all_batches(p, 3)
    cursor = 5 * p.local_samples_per_optimizer_step
    assert all_batches(p, 3, start_sample=cursor) == full[5 * p.accumulation_steps :]


def test_resume_offset_must_be_a_whole_number_of_batches():
    with pytest.raises(ResumeError, match="not a multiple of the batch size 3"):
        next(plan().island_batches(0, start_sample=4))


def test_plan_round_trips_through_plan_json(tmp_path):
    p = plan(max_steps=7)
    assert PromptPlan.load(p.save(tmp_path / "plan.json")) == p
    assert PromptPlan.load(tmp_path / "plan.json").permutation_sha256 == p.permutation_sha256


def test_a_plan_json_from_a_different_permutation_is_refused(tmp_path):
    record = plan().to_json()
    record["permutation_sha256"] = "0" * 64
    with pytest.raises(ResumeError, match="permutation_sha256"):
        PromptPlan.from_json(record)


def test_differences_name_each_changed_input():
    assert plan().differences(plan()) == []
    diffs = plan().differences(plan(world_size=2, tp_size=1))
    assert any(d.startswith("world_size: 4 → 2") for d in diffs)
    assert any(d.startswith("tp_size: 2 → 1") for d in diffs)


def test_a_dataset_smaller_than_one_optimizer_step_is_refused():
    with pytest.raises(ConfigError, match="fewer than one optimizer step"):
        plan(dataset_size=23)


def test_plan_from_config_reads_training_and_deployment():
    cfg = load_config(None, ["capture.tp_size=2", "deployment.nproc_per_node=4", "training.batch_size=2"])
    p = PromptPlan.from_config(cfg, dataset_size=40, topology=Topology.from_config(cfg))
    assert (p.world_size, p.tp_size, p.num_islands, p.batch_size) == (4, 2, 2, 2)
