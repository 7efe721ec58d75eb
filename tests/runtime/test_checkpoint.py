"""Checkpoints: documented layout, atomic save + keep-N, exact restore, torn/corrupt handling, resume diffs."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from specforge_core.io import sha256_file
from specforge_core.errors import CheckpointError, ResumeError
from specforge_core.loop.checkpoint import (
    COMPLETE,

    check_resume,
    checkpoints_dir,
    complete_checkpoints,
    contract_differences,
    latest_checkpoint,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
    verify_files,
)
from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.loop.optim import DraftOptimizer, shard
from tests.runtime.harness import TinyDraft, TinyStep, run_ranks, tiny_batch, write_draft_files

CONTRACT = {"seed": 42, "world_size": 2, "plan": {"batch_size": 2, "accumulation_steps": 1}}


def _build(d, fused=None):
    torch.manual_seed(0)
    draft = TinyDraft()
    root = shard(TinyStep(draft), d)
    opt = DraftOptimizer(
        root,
        learning_rate=1e-2,
        weight_decay=0.0,
        max_grad_norm=0.5,
        accumulation_steps=1,
        total_steps=10,
        warmup_ratio=0.2,
        lr_scheduler="cosine",
        fused=fused,
    )
    return draft, root, opt


def _train_step(d, root, opt, s):
    opt.backward(root({k: v.chunk(d.world_size)[d.rank] for k, v in tiny_batch(s).items()}))
    opt.step()


def _full(draft):
    return get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True))


def _save(run_dir, d, draft, opt, step, keep=2):
    return save_checkpoint(
        run_dir,
        d,
        step=step,
        draft=draft,
        optimizer=opt.optimizer,
        scheduler=opt.scheduler,
        write_draft_files=write_draft_files,
        train_state={"consumed_samples": step * 4, "contract": CONTRACT},
        keep=keep,
    )


def _save_load_worker(rank, run_dir, fused=None):
    d = init_distributed("cpu", timeout_s=30)
    draft, root, opt = _build(d, fused)
    for s in range(4):
        _train_step(d, root, opt, s)
        if s >= 1:
            _save(run_dir, d, draft, opt, step=s + 1)
    at_save = _full(draft)
    rand_after_save = torch.rand(3)
    _train_step(d, root, opt, 4)
    continued = _full(draft)

    draft2, root2, opt2 = _build(d, fused)
    ckpt = latest_checkpoint(run_dir)
    state = load_checkpoint(ckpt, d, draft=draft2, optimizer=opt2.optimizer, scheduler=opt2.scheduler)
    rand_after_load = torch.rand(3)
    loaded = _full(draft2)
    _train_step(d, root2, opt2, 4)
    resumed = _full(draft2)
    close_distributed()
    same = lambda a, b: set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    return {
        "state": state,
        "loaded_equals_saved": same(loaded, at_save),
        "resumed_equals_continued": same(resumed, continued),
        "rng_restored": torch.equal(rand_after_save, rand_after_load),
        "saved_weights": at_save,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    results = run_ranks(_save_load_worker, 2, str(run_dir))
    return run_dir, results


def test_step_directory_has_the_documented_files(saved):
    run_dir, _ = saved
    names = sorted(p.name for p in (checkpoints_dir(run_dir) / "step-00000004").iterdir())
    assert names == sorted(
        ["COMPLETE", "draft.safetensors", "draft_config.json", "train_state.json", "rank-00000.pt", "rank-00001.pt"]
    )


def test_complete_marker_holds_the_sha256_of_every_file(saved):
    run_dir, _ = saved
    ckpt = checkpoints_dir(run_dir) / "step-00000004"
    files = json.loads((ckpt / COMPLETE).read_text())["files"]
    assert set(files) == {p.name for p in ckpt.iterdir()} - {COMPLETE}
    assert all(sha256_file(ckpt / name) == digest for name, digest in files.items())


def test_saved_weights_are_full_tensors_without_the_frozen_embedding(saved):
    run_dir, results = saved
    weights = load_file(str(checkpoints_dir(run_dir) / "step-00000004" / "draft.safetensors"))
    assert "embed_tokens.weight" not in weights
    assert weights["fc.weight"].shape == (8, 24) and "d2t" in weights
    expected = {k: v for k, v in results[0]["saved_weights"].items() if k != "embed_tokens.weight"}
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


def test_keep_n_leaves_the_newest_and_latest_names_it(saved):
    run_dir, _ = saved
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000003", "step-00000004"]
    assert (checkpoints_dir(run_dir) / "latest").read_text().strip() == "step-00000004"


def test_train_state_records_step_and_the_given_fields(saved):
    _, results = saved
    state = results[1]["state"]
    assert state["step"] == 4 and state["consumed_samples"] == 16 and state["contract"] == CONTRACT


def test_load_restores_the_exact_weights_on_every_rank(saved):
    _, results = saved
    assert [r["loaded_equals_saved"] for r in results] == [True, True]


def test_training_after_load_is_bit_identical_to_training_on(saved):
    _, results = saved
    assert [r["resumed_equals_continued"] for r in results] == [True, True]


def test_fused_adamw_trains_on_after_load_bit_identically(tmp_path):
    # the CUDA default: the fused update runs on the local shards of the state the load restored
    results = run_ranks(_save_load_worker, 2, str(tmp_path), True)
    assert [(r["loaded_equals_saved"], r["resumed_equals_continued"]) for r in results] == [(True, True)] * 2


def test_load_restores_each_ranks_rng(saved):
    _, results = saved
    assert [r["rng_restored"] for r in results] == [True, True]


# --- one process: torn and corrupt checkpoints -------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    d = init_distributed("cpu", timeout_s=30)
    yield d
    close_distributed()


@pytest.fixture
def one_rank_run(world_of_one, tmp_path):
    draft, root, opt = _build(world_of_one)
    _train_step(world_of_one, root, opt, 0)
    ckpt = _save(tmp_path, world_of_one, draft, opt, step=1)
    return tmp_path, ckpt, draft, opt


def test_directory_without_complete_marker_is_ignored(one_rank_run):
    run_dir, ckpt, _, _ = one_rank_run
    torn = ckpt.with_name("step-00000009")
    torn.mkdir()
    (torn / "draft.safetensors").write_bytes(b"half")
    assert latest_checkpoint(run_dir) == ckpt


def test_loading_a_torn_checkpoint_explicitly_is_refused(one_rank_run, world_of_one):
    _, ckpt, draft, opt = one_rank_run
    (ckpt / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_checkpoint(ckpt, world_of_one, draft=draft, optimizer=opt.optimizer, scheduler=opt.scheduler)


def test_corrupt_file_is_refused_naming_the_file_and_the_fix(one_rank_run, world_of_one):
    _, ckpt, draft, opt = one_rank_run
    weights = ckpt / "draft.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, world_of_one, draft=draft, optimizer=opt.optimizer, scheduler=opt.scheduler)
    assert str(weights) in str(e.value) and "sha256" in str(e.value) and "fix: " in str(e.value)


def test_rank_file_missing_for_this_world_is_refused(one_rank_run):
    _, ckpt, _, _ = one_rank_run
    (ckpt / "rank-00000.pt").unlink()
    with pytest.raises(CheckpointError, match="rank-00000.pt is missing"):
        verify_files(ckpt, ["rank-00000.pt"])


def test_leftover_temp_directory_of_a_crashed_save_is_removed(one_rank_run, world_of_one):
    run_dir, _, draft, opt = one_rank_run
    stale = checkpoints_dir(run_dir) / ".step-00000002.tmp"
    stale.mkdir()
    _save(run_dir, world_of_one, draft, opt, step=3)
    assert not stale.exists()
    assert sorted(os.listdir(checkpoints_dir(run_dir))) == ["latest", "step-00000001", "step-00000003"]


def test_train_state_is_read_only_after_its_checksum_passes(one_rank_run):
    _, ckpt, _, _ = one_rank_run
    assert read_train_state(ckpt)["step"] == 1
    (ckpt / "train_state.json").write_text('{"step": 99, "format": 1}')
    with pytest.raises(CheckpointError, match="train_state.json"):
        read_train_state(ckpt)


# --- resume contract ----------------------------------------------------------------------------


def test_identical_contract_resumes():
    check_resume(CONTRACT, json.loads(json.dumps(CONTRACT)), where="ckpt")


def test_every_difference_is_named_with_both_values():
    current = {"seed": 7, "world_size": 4, "plan": {"batch_size": 2, "accumulation_steps": 1}}
    with pytest.raises(ResumeError) as e:
        check_resume(CONTRACT, current, where="runs/x/checkpoints/step-00000004/train_state.json")
    text = str(e.value)
    assert "seed: checkpoint=42 run=7" in text
    assert "world_size: checkpoint=2 run=4" in text
    assert "plan.batch_size" not in text
    assert text.startswith("runs/x/checkpoints/step-00000004/train_state.json:") and "fix: " in text


def test_nested_and_absent_fields_are_reported_dotted():
    diffs = contract_differences({"plan": {"epochs": 1}}, {"plan": {"epochs": 2}, "vocab_map": "abc"})
    assert diffs == ["plan.epochs: checkpoint=1 run=2", "vocab_map: checkpoint=<absent> run='abc'"]


def test_tuples_and_lists_compare_equal_after_the_json_round_trip():
    assert contract_differences({"ids": [1, 14, 26]}, {"ids": (1, 14, 26)}) == []


def test_a_deletion_cut_short_never_leaves_a_complete_looking_checkpoint(one_rank_run, monkeypatch):
    run_dir, first, draft, opt = one_rank_run
    world = init_distributed("cpu", timeout_s=30)
    import specforge_core.loop.checkpoint as ckpt_mod

    def crash(path, *a, **k):  # the process dies right after the rename, before the files go
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(run_dir, world, draft, opt, step=2, keep=1)  # rotation deletes step 1
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000002"]
    assert not first.exists()
    _save(run_dir, world, draft, opt, step=3, keep=2)  # the next save sweeps the leftover
    assert sorted(p.name for p in checkpoints_dir(run_dir).iterdir() if p.name.startswith(".")) == []
