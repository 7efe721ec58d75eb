"""A crash while a checkpoint is being published leaves the previous checkpoints valid and the torn
one ignored; a corrupt checkpoint file is refused, naming it; following the fix resumes from the
previous checkpoint. Each ends, after a re-run, in weights and losses bit-identical to an
uninterrupted run.

Real 2-rank torchrun runs of the tiny target (6 steps, a checkpoint after each, keep 2). The crash
is a SIGKILL of rank 0 just before one of the two renames that publish checkpoint 3
(``crashpoint.py``): the step directory's, or the ``latest`` pointer's.
"""

import shutil

import pytest

from specforge_core.loop.checkpoint import checkpoints_dir, complete_checkpoints, latest_checkpoint

from .runs import Run, final_weights, losses, run_config, run_to_end, same_weights

STEPS = 6


@pytest.fixture(scope="module")
def reference(train_workdir, tiny_target_dir):
    run_to_end(run_config(train_workdir, "reference", tiny_target_dir, world=2, max_steps=STEPS), world=2)
    return train_workdir / "reference"


def names(paths) -> list[str]:
    return [p.name for p in paths]


@pytest.mark.parametrize("crash_on,published", [("rename:/checkpoints/step-", False),
                                                ("replace:/checkpoints/latest", True)],
                         ids=["before_the_step_directory_rename", "before_the_latest_pointer"])
def test_a_crash_while_publishing_a_checkpoint_keeps_the_whole_ones_and_ignores_the_torn_one(
        train_workdir, tiny_target_dir, reference, crash_on, published):
    name = f"torn-{'published' if published else 'unpublished'}"
    config = run_config(train_workdir, name, tiny_target_dir, world=2, max_steps=STEPS)
    run_dir = checkpoints_dir(train_workdir / name)
    crashed = Run.start(config, world=2, crash_on=crash_on, crash_skip=2)  # the third checkpoint
    assert crashed.wait() != 0 and "checkpoint step-00000002 saved" in crashed.output
    assert "checkpoint step-00000003 saved" not in crashed.output

    newest = "step-00000003" if published else "step-00000002"
    assert names(complete_checkpoints(train_workdir / name))[-1] == newest
    assert (run_dir / "latest").read_text().strip() == "step-00000002"
    assert (run_dir / ".step-00000003.tmp").exists() != published  # the torn save, ignored
    out = run_to_end(config, world=2)
    assert f"resumed from {run_dir / newest} at step {newest[-1]}/{STEPS}" in out
    assert not list(run_dir.glob(".step-*.tmp"))
    assert losses(train_workdir / name) == losses(reference)
    assert same_weights(final_weights(train_workdir / name), final_weights(reference))


def corrupt_copy(reference, train_workdir, name: str, file: str):
    shutil.copytree(reference, train_workdir / name)
    newest = latest_checkpoint(train_workdir / name)
    data = bytearray((newest / file).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / file).write_bytes(bytes(data))
    return newest


def snapshot(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("file", ["draft.safetensors", "rank-00001.pt"])
def test_a_corrupt_checkpoint_file_is_refused_naming_it_and_nothing_changes(
        train_workdir, tiny_target_dir, reference, file):
    name = f"corrupt-{file.split('.')[0]}"
    newest = corrupt_copy(reference, train_workdir, name, file)
    config = run_config(train_workdir, name, tiny_target_dir, world=2, max_steps=STEPS)
    before = snapshot(train_workdir / name)
    run = Run.start(config, world=2)
    assert run.wait() != 0
    assert f"{newest / file}: {file} does not match its sha256 in COMPLETE" in run.output
    assert f"fix: restore the file, or delete {newest} to resume from the previous checkpoint" in run.output
    assert snapshot(train_workdir / name) == before


def test_deleting_the_refused_checkpoint_resumes_from_the_previous_one_to_identical_weights(
        train_workdir, tiny_target_dir, reference):
    newest = corrupt_copy(reference, train_workdir, "corrupt-deleted", "draft.safetensors")
    shutil.rmtree(newest)  # what the refusal's fix says
    config = run_config(train_workdir, "corrupt-deleted", tiny_target_dir, world=2, max_steps=STEPS)
    out = run_to_end(config, world=2)
    assert f"resumed from {checkpoints_dir(train_workdir / 'corrupt-deleted') / 'step-00000005'}" in out
    assert losses(train_workdir / "corrupt-deleted") == losses(reference)
    assert same_weights(final_weights(train_workdir / "corrupt-deleted"), final_weights(reference))
