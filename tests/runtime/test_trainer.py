"""The training loop on real gloo ranks, a real tiny target and the real rollout stream.

The draft and objective here are a small probe (fc over the captured features → next-token CE),
not EAGLE3: the loop is generic over them. The EAGLE3 pieces run through ``specforge_core.train``
in test_train_cli.py.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specforge_core.capture import build_capture_backend
from specforge_core.config import config_from_dict
from specforge_core.errors import ResumeError
from specforge_core.run.plan import PromptPlan
from specforge_core.loop.checkpoint import latest_checkpoint
from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.loop.metrics import METRICS_FILE
from specforge_core.loop.rollout import RolloutStream
from specforge_core.loop.trainer import Trainer, directory_identity, training_contract
from specforge_core.run.topology import Topology
from tests.runtime.harness import run_ranks, write_draft_files

ROWS = 24  # world 2 × batch 2 × accumulation 2 = 8 prompts per step → 3 steps per epoch, 6 in all


class ProbeDraft(nn.Module):
    """Frozen target embedding, fc over the three captured layers, norm, head over the target vocab."""

    def __init__(self, embed: torch.Tensor, hidden: int = 32):
        super().__init__()
        vocab, target_hidden = embed.shape
        self.embed_tokens = nn.Embedding(vocab, target_hidden)
        self.embed_tokens.weight.data.copy_(embed)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def probe_objective(draft, batch):
    h = draft.fc(batch.aux_hidden)
    logits = draft.lm_head(draft.norm(h))[:, :-1].float()
    target, mask = batch.input_ids[:, 1:], batch.loss_mask[:, 1:].float()
    ce = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    hits = (logits.argmax(-1) == target).float()
    sums = {"loss_sum": (ce * mask).sum().detach(), "tokens": mask.sum(), "hits": (hits * mask).sum()}
    return (ce * mask).sum() / mask.sum().clamp(min=1), sums


def probe_derive(sums):
    return {"loss": float(sums["loss_sum"] / sums["tokens"]), "acc_0": float(sums["hits"] / sums["tokens"])}


def make_rows(n=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(3, 500, (k,), generator=g).tolist(), "loss_mask": [0, 0] + [1] * (k - 2)}
            for k in lengths]


def make_config(target_dir, run_dir, world_size=2, **training):
    opts = dict(batch_size=2, accumulation_steps=2, num_epochs=2, save_interval=3, log_interval=1,
                learning_rate=1e-2, warmup_ratio=0.2)
    opts.update(training)
    return config_from_dict({
        "model": {"target": str(target_dir), "dtype": "float32"},
        "data": {"max_length": 64},
        "capture": {"device": "cpu"},
        "training": opts,
        "deployment": {"nproc_per_node": world_size},
        "output": {"dir": str(run_dir)},
    })


class CrashingBackend:
    """The real backend, except that the target 'crashes' at capture number ``crash_at``."""

    def __init__(self, backend, crash_at):
        self.backend, self.crash_at, self.captures = backend, crash_at, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def capture(self, request):
        self.captures += 1
        if self.captures == self.crash_at:
            raise RuntimeError("target crashed")
        return self.backend.capture(request)


def build_trainer(d, cfg, crash_at=None, heldout=None, wall_clock=None):
    backend = build_capture_backend(cfg, rank=d.rank, local_rank=d.local_rank)
    if crash_at is not None:
        backend = CrashingBackend(backend, crash_at)
    rows = make_rows()
    plan = PromptPlan.from_config(cfg, len(rows), topology=Topology.from_config(cfg))
    torch.manual_seed(cfg.training.seed)
    draft = ProbeDraft(backend.embed_weight.detach())
    contract = training_contract(cfg, plan, prompt_cache="rows-0", vocab_map="none", target="tiny", draft_config={})
    streams = []

    def open_stream(start):
        streams.append(RolloutStream.from_plan(plan, d.rank, rows, backend, start_sample=start))
        return streams[-1]

    trainer = Trainer(cfg, d, plan, draft=draft, objective=probe_objective, derive=probe_derive,
                      open_stream=open_stream, contract=contract, write_draft_files=write_draft_files,
                      heldout=heldout, echo=False, **({"wall_clock": wall_clock} if wall_clock else {}))
    return trainer, streams


def _stream_report(streams):
    return {
        "captures": sum(s.stats.captures for s in streams),
        "peak_live": max(s.stats.peak_live_batches for s in streams),
    }


def _worker(rank, target_dir, straight_dir, crashed_dir):
    d = init_distributed("cpu", timeout_s=60)
    trainer, streams = build_trainer(d, make_config(target_dir, straight_dir))
    trainer.fit()
    straight = _stream_report(streams)
    # The target crashes during step 5's first capture: step-3 is the newest complete checkpoint.
    crashing, _ = build_trainer(d, make_config(target_dir, crashed_dir), crash_at=4 * 2 + 1)
    with pytest.raises(RuntimeError, match="target crashed"):
        crashing.fit()
    del crashing
    resuming, streams = build_trainer(d, make_config(target_dir, crashed_dir))
    resuming.fit()
    resumed = {
        **_stream_report(streams),
        "resumed_from": resuming.resumed_from.name,
        "consumed": resuming.consumed_samples,
    }
    close_distributed()
    return {"straight": straight, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tiny_target_dir, tmp_path_factory):
    straight, crashed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("crashed")
    results = run_ranks(_worker, 2, str(tiny_target_dir), str(straight), str(crashed), timeout_s=120)
    return {
        "straight_dir": straight,
        "crashed_dir": crashed,
        "straight": [r["straight"] for r in results],
        "resumed": [r["resumed"] for r in results],
    }


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (Path(run_dir) / METRICS_FILE).read_text().splitlines())]


def _final_weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "draft.safetensors"))


def test_run_trains_the_plans_horizon_and_logs_every_step(runs):
    assert [s for s, _ in _losses(runs["straight_dir"])] == [1, 2, 3, 4, 5, 6]
    assert latest_checkpoint(runs["straight_dir"]).name == "step-00000006"


def test_each_micro_step_captures_exactly_one_batch(runs):
    assert [r["captures"] for r in runs["straight"]] == [6 * 2, 6 * 2]


def test_captured_batch_is_released_before_the_next_capture(runs):
    assert [r["peak_live"] for r in runs["straight"]] == [1, 1]


def test_resume_starts_from_the_last_complete_checkpoint(runs):
    assert [r["resumed_from"] for r in runs["resumed"]] == ["step-00000003", "step-00000003"]


def test_metrics_count_one_capture_per_micro_batch_per_rank(runs):
    records = [json.loads(x) for x in (Path(runs["crashed_dir"]) / METRICS_FILE).read_text().splitlines()]
    assert [r["captures"] for r in records] == [2 * 2] * 6


def test_resume_never_captures_the_consumed_prompts(runs):
    # 3 remaining steps × 2 micro-batches; the 6 consumed micro-batches are skipped, not re-captured.
    assert [r["captures"] for r in runs["resumed"]] == [3 * 2, 3 * 2]
    assert [r["consumed"] for r in runs["resumed"]] == [6 * 4, 6 * 4]


def test_resumed_run_reproduces_the_straight_losses(runs):
    assert _losses(runs["crashed_dir"]) == _losses(runs["straight_dir"])


def test_resumed_run_ends_with_bit_identical_weights(runs):
    a, b = _final_weights(runs["straight_dir"]), _final_weights(runs["crashed_dir"])
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- one process: resume rules -------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    d = init_distributed("cpu", timeout_s=30)
    yield d
    close_distributed()


@pytest.fixture
def saved_run(world_of_one, tiny_target_dir, tmp_path):
    trainer, _ = build_trainer(world_of_one, make_config(tiny_target_dir, tmp_path, world_size=1))
    trainer.save()
    return tmp_path


def test_resume_with_a_changed_contract_names_each_difference(world_of_one, tiny_target_dir, saved_run):
    cfg = make_config(tiny_target_dir, saved_run, world_size=1, learning_rate=5e-3, seed=7)
    trainer, _ = build_trainer(world_of_one, cfg)
    with pytest.raises(ResumeError) as e:
        trainer.resume()
    text = str(e.value)
    assert "optimization.learning_rate: checkpoint=0.01 run=0.005" in text
    assert "plan.seed: checkpoint=42 run=7" in text


def test_resume_never_refuses_a_directory_with_checkpoints(world_of_one, tiny_target_dir, saved_run):
    trainer, _ = build_trainer(world_of_one, make_config(tiny_target_dir, saved_run, world_size=1, resume="never"))
    with pytest.raises(ResumeError, match="training.resume=never"):
        trainer.resume()


def test_fresh_start_drops_metrics_of_an_attempt_that_never_checkpointed(world_of_one, tiny_target_dir, tmp_path):
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    trainer, _ = build_trainer(world_of_one, make_config(tiny_target_dir, tmp_path, world_size=1))
    assert trainer.resume() is None
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_resume_must_refuses_a_run_without_checkpoints(world_of_one, tiny_target_dir, tmp_path):
    trainer, _ = build_trainer(world_of_one, make_config(tiny_target_dir, tmp_path, world_size=1, resume="must"))
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        trainer.resume()


# --- when it saves -----------------------------------------------------------------------------


def _saved_steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


def _steps_take(trainer_box: list, seconds_per_step: float):
    """A wall clock on which every optimizer step of the trainer in ``trainer_box`` takes ``seconds_per_step``."""
    return lambda: trainer_box[0].step * seconds_per_step if trainer_box else 0.0  # 0 while it is built


def _saves_of_one_rank(d, tiny_target_dir, run_dir, seconds_per_step: float, **training) -> list[int]:
    """Train the 12-step run on one rank whose steps take ``seconds_per_step``; the steps it saved."""
    cfg = make_config(tiny_target_dir, run_dir, world_size=1, keep_checkpoints=20, **training)
    box: list = []
    trainer, _ = build_trainer(d, cfg, wall_clock=_steps_take(box, seconds_per_step))
    box.append(trainer)
    trainer.fit()
    assert trainer.total_steps == 12
    return _saved_steps(run_dir)


def test_a_run_checkpoints_by_wall_time_without_a_save_interval(world_of_one, tiny_target_dir, tmp_path):
    """Steps of 25 s, a save every minute: after steps 3, 6 and 9 (75 s each), and at the end."""
    assert _saves_of_one_rank(world_of_one, tiny_target_dir, tmp_path, 25.0, save_interval=0, save_every_minutes=1) == [3, 6, 9, 12]


def test_steps_and_time_both_trigger_a_save_and_each_save_restarts_the_timer(world_of_one, tiny_target_dir, tmp_path):
    """Steps of 20 s, a save every 4 steps and every 100 s: the step saves at 4 and 8 each restart
    the timer, so time never triggers one (80 s < 100 s)."""
    assert _saves_of_one_rank(world_of_one, tiny_target_dir, tmp_path, 20.0, save_interval=4, save_every_minutes=100 / 60) == [4, 8, 12]


def test_time_triggers_a_save_between_step_saves(world_of_one, tiny_target_dir, tmp_path):
    """Steps of 30 s, a save every 5 steps and every 100 s: time at 4 (120 s), steps at 5 and 10,
    time at 9 (120 s after 5), the end at 12."""
    assert _saves_of_one_rank(world_of_one, tiny_target_dir, tmp_path, 30.0, save_interval=5, save_every_minutes=100 / 60) == [4, 5, 9, 10, 12]


def test_with_time_saves_off_a_run_without_a_save_interval_saves_only_at_the_end(world_of_one, tiny_target_dir, tmp_path):
    assert _saves_of_one_rank(world_of_one, tiny_target_dir, tmp_path, 3600.0, save_interval=0, save_every_minutes=0) == [12]


def test_by_default_a_run_checkpoints_every_30_minutes():
    assert config_from_dict({}).training.save_every_minutes == 30


def _time_save_worker(rank, target_dir, run_dir):
    d = init_distributed("cpu", timeout_s=60)
    cfg = make_config(target_dir, run_dir, save_interval=0, save_every_minutes=1, keep_checkpoints=10)
    box: list = []
    # only rank 1's clock runs: its steps take 25 s, rank 0's take none
    trainer, _ = build_trainer(d, cfg, wall_clock=_steps_take(box, 25.0 if rank == 1 else 0.0))
    box.append(trainer)
    trainer.fit()
    return trainer.step


def test_ranks_whose_clocks_disagree_save_together(tiny_target_dir, tmp_path):
    """A save is collective: the rank whose clock says so makes every rank save, nobody hangs."""
    assert run_ranks(_time_save_worker, 2, str(tiny_target_dir), str(tmp_path), timeout_s=120) == [6, 6]
    assert _saved_steps(tmp_path) == [3, 6]


# --- identities -----------------------------------------------------------------------------------


def test_directory_identity_follows_content_not_location(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 8}')
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 2048)
    assert directory_identity(tmp_path / "a") == directory_identity(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 16}')
    assert directory_identity(tmp_path / "a") != directory_identity(tmp_path / "b")


def test_directory_identity_sees_same_size_weights_with_other_bytes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * (4 << 20))
    before = directory_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"y" * (4 << 20))
    assert directory_identity(tmp_path) != before


def test_a_remembered_digest_is_not_reused_after_a_rewrite_that_restores_mtime(tmp_path):
    """The memo is keyed on size, mtime, ctime and inode: ``cp -p`` or ``touch -r`` over the weights
    keeps size and mtime, not the change time."""
    target, memo = tmp_path / "target", tmp_path / "memo"
    target.mkdir()
    weights = target / "model.safetensors"
    weights.write_bytes(b"x" * 4096)
    old = weights.stat().st_mtime_ns - 10**10
    os.utime(weights, ns=(old, old))  # older than the racily-clean window: the digest is remembered
    before = directory_identity(target, memo_dir=memo)
    assert list(memo.iterdir()) and directory_identity(target, memo_dir=memo) == before
    weights.write_bytes(b"y" * 4096)
    os.utime(weights, ns=(old, old))
    assert directory_identity(target, memo_dir=memo) != before
