"""``training.time_budget``: parsed with its unit, a clock the ranks agree on, a schedule by progress,
a stop at a whole step, and a resume that goes on with the same clock and schedule.

The trainer runs here are the probe draft of test_trainer.py on the real tiny target and rollout
stream, with budgets of a few seconds.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from specforge_core.config import config_from_dict
from specforge_core.errors import ConfigError, ResumeError
from specforge_core.run.plan import PromptPlan
from specforge_core.loop.budget import TrainClock, budget_progress
from specforge_core.loop.checkpoint import complete_checkpoints, latest_checkpoint, read_train_state
from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.loop.metrics import METRICS_FILE
from specforge_core.loop.schedule import progress_multiplier
from specforge_core.loop.trainer import training_contract
from specforge_core.run.topology import Topology
from tests.runtime.harness import run_ranks
from tests.runtime.test_trainer import build_trainer, make_config

PEAK = 1e-2  # make_config's learning rate
WARMUP = 0.2  # and warmup ratio


# --- the setting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text,seconds", [("45s", 45), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("0.5h", 1800)])
def test_time_budget_reads_hours_minutes_and_seconds(text, seconds):
    assert config_from_dict({"training": {"time_budget": text}}).training.time_budget_s == seconds


@pytest.mark.parametrize("value,says", [
    ("30", "not a duration"), (30, "has no unit"), ("30min", "not a duration"), ("0m", "no time at all"),
])
def test_a_budget_without_a_unit_or_time_is_refused_naming_the_field(value, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"training": {"time_budget": value}})
    assert "training.time_budget:" in str(e.value) and says in str(e.value) and "30m" in str(e.value)


def test_no_budget_by_default():
    assert config_from_dict({}).training.time_budget_s is None


# --- progress and the clock ------------------------------------------------------------------------


def test_progress_schedule_warms_up_over_the_ratio_then_follows_the_cosine_to_zero():
    kw = dict(warmup_ratio=0.2, kind="cosine")
    assert [progress_multiplier(p, **kw) for p in (0.0, 0.1, 0.2)] == [0.0, 0.5, 1.0]
    assert progress_multiplier(0.6, **kw) == pytest.approx(0.5)
    assert progress_multiplier(1.0, **kw) == pytest.approx(0.0, abs=1e-12)
    assert progress_multiplier(1.7, **kw) == progress_multiplier(1.0, **kw)


def test_progress_schedule_constant_holds_the_peak_after_warmup():
    assert [progress_multiplier(p, warmup_ratio=0.5, kind="constant") for p in (0.25, 0.5, 1.0)] == [0.5, 1.0, 1.0]


def test_progress_is_the_larger_of_budget_spent_and_horizon_trained():
    assert budget_progress(30, 100, steps_done=1, total_steps=10) == 0.3
    assert budget_progress(30, 100, steps_done=5, total_steps=10) == 0.5
    assert budget_progress(130, 100, steps_done=5, total_steps=10) == 1.0


class TickingClock:
    """A clock that moves ``tick`` seconds each time it is read: a run's timing without the machine's."""

    def __init__(self, tick: float = 0.1, at: float = 0.0):
        self.tick, self.at = tick, at

    def __call__(self) -> float:
        self.at += self.tick
        return self.at


def test_the_clock_leaves_paused_time_out():
    now = [100.0]
    clock = TrainClock(spent_s=10.0, now=lambda: now[0])
    assert clock.read() == 10.0  # stopped until started
    clock.start()
    now[0] += 1.0
    with clock.paused():
        now[0] += 5.0
    now[0] += 2.0
    assert clock.read() == 13.0


# --- a budgeted run, one process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    # One thread, as each rank has: these runs are timed, and a second spinning thread on a busy
    # machine turns a 0.1 s step into seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = init_distributed("cpu", timeout_s=30)
    yield d
    close_distributed()
    torch.set_num_threads(threads)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines()]


def budgeted(tiny_target_dir, run_dir, budget="3s", **training):
    opts = dict(time_budget=budget, num_epochs=500, save_interval=1, keep_checkpoints=10_000)
    return make_config(tiny_target_dir, run_dir, world_size=1, **{**opts, **training})


def expected_lrs(rows: list[dict], budget_s: float) -> list[float]:
    """The rate of each update: the multiplier at the progress the previous update recorded."""
    total = rows[0]["total_steps"]
    progress = [0.0] + [budget_progress(r["train_seconds"], budget_s, steps_done=r["step"], total_steps=total)
                        for r in rows[:-1]]
    return [PEAK * progress_multiplier(p, warmup_ratio=WARMUP, kind="cosine") for p in progress]


@pytest.fixture(scope="module")
def budget_run(world_of_one, tiny_target_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("budget")
    trainer, _ = build_trainer(world_of_one, budgeted(tiny_target_dir, run_dir), wall_clock=TickingClock())
    trainer.fit()
    return run_dir, trainer


def test_a_budgeted_run_stops_at_the_first_step_that_spends_the_budget(budget_run):
    run_dir, trainer = budget_run
    rows = records(run_dir)
    assert rows[-1]["train_seconds"] >= 3.0 > rows[-2]["train_seconds"]
    assert trainer.step == rows[-1]["step"] < trainer.total_steps
    assert latest_checkpoint(run_dir).name == f"step-{trainer.step:08d}"


def test_the_learning_rate_follows_the_budget_spent_not_the_steps(budget_run):
    rows = records(budget_run[0])
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(rows, 3.0), rel=1e-9, abs=1e-12)
    lrs = [r["lr"] for r in rows]
    top = lrs.index(max(lrs))
    assert lrs[0] == 0.0 and lrs[top] > 0.9 * PEAK and lrs[top:] == sorted(lrs[top:], reverse=True)
    assert lrs[-1] < 0.15 * PEAK  # the last update runs at the progress the one before it recorded: 2.5 of 3 s


def test_records_and_checkpoints_carry_the_budget_spent(budget_run):
    run_dir, _ = budget_run
    by_step = {r["step"]: r for r in records(run_dir)}
    assert by_step[1]["train_seconds"] == 0.0 < by_step[2]["train_seconds"]  # the first step is start-up
    for ckpt in complete_checkpoints(run_dir)[-3:]:
        state = read_train_state(ckpt)
        assert state["train_seconds"] == by_step[state["step"]]["train_seconds"]
    assert by_step[max(by_step)]["budget_fraction"] == by_step[max(by_step)]["train_seconds"] / 3.0


def test_a_resumed_run_goes_on_with_the_same_clock_and_schedule(world_of_one, tiny_target_dir, budget_run,
                                                                 tmp_path):
    straight, _ = budget_run
    # a crash after the checkpoint nearest the middle of the budget: copy the run up to it
    ckpts = complete_checkpoints(straight)
    middle = min(ckpts, key=lambda c: abs(read_train_state(c)["train_seconds"] - 1.5))
    k = read_train_state(middle)["step"]
    run_dir = tmp_path / "resumed"
    shutil.copytree(straight, run_dir)
    for later in complete_checkpoints(run_dir):
        if read_train_state(later)["step"] > k:
            shutil.rmtree(later)
    trainer, _ = build_trainer(world_of_one, budgeted(tiny_target_dir, run_dir), wall_clock=TickingClock())
    assert trainer.resume().name == middle.name and trainer.train_seconds == read_train_state(middle)["train_seconds"]
    # the rate AdamW applies next is the one the straight run's next update applied
    assert trainer.optimizer.optimizer.param_groups[0]["lr"] == records(straight)[k]["lr"]
    trainer.fit()
    rows = records(run_dir)
    assert rows[k - 1] == records(straight)[k - 1]  # the kept records, untouched
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(rows, 3.0), rel=1e-9, abs=1e-12)
    assert rows[-1]["train_seconds"] >= 3.0 > rows[-2]["train_seconds"]  # the same total, not 3 s more


def test_a_run_whose_budget_is_spent_resumes_to_nothing(world_of_one, tiny_target_dir, budget_run):
    run_dir, done = budget_run
    before = records(run_dir)
    trainer, streams = build_trainer(world_of_one, budgeted(tiny_target_dir, run_dir))
    trainer.fit()
    assert trainer.step == done.step and not streams and records(run_dir) == before


def test_resuming_with_another_budget_is_refused_naming_it(world_of_one, tiny_target_dir, budget_run):
    trainer, _ = build_trainer(world_of_one, budgeted(tiny_target_dir, budget_run[0], budget="1h"))
    with pytest.raises(ResumeError, match=r"optimization.time_budget_s: checkpoint=3.0 run=3600.0"):
        trainer.resume()


def test_adding_a_budget_to_a_run_trained_without_one_is_refused(world_of_one, tiny_target_dir, tmp_path):
    plain, _ = build_trainer(world_of_one, make_config(tiny_target_dir, tmp_path, world_size=1))
    plain.save()
    trainer, _ = build_trainer(world_of_one, make_config(tiny_target_dir, tmp_path, world_size=1, time_budget="1h"))
    with pytest.raises(ResumeError, match=r"optimization.time_budget_s: checkpoint=<absent> run=3600.0"):
        trainer.resume()


def test_without_a_budget_the_contract_is_what_it_was(tiny_target_dir, tmp_path):
    cfg = make_config(tiny_target_dir, tmp_path, world_size=1)
    contract = training_contract(cfg, PromptPlan.from_config(cfg, 24, topology=Topology.from_config(cfg)), prompt_cache="c", vocab_map=None,
                                 target="t", draft_config={})
    assert "time_budget_s" not in contract["optimization"]


def test_the_plans_horizon_caps_a_budget_and_ends_the_schedule(world_of_one, tiny_target_dir, tmp_path):
    trainer, _ = build_trainer(world_of_one, budgeted(tiny_target_dir, tmp_path, budget="1h", num_epochs=1))
    trainer.fit()
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and trainer.step == trainer.total_steps == 6
    assert [r["lr"] for r in rows] == pytest.approx(
        [PEAK * progress_multiplier(s / 6, warmup_ratio=WARMUP, kind="cosine") for s in range(6)], rel=1e-6)


# --- two ranks ----------------------------------------------------------------------------------------


def _two_rank_worker(rank, target_dir, run_dir):
    d = init_distributed("cpu", timeout_s=60)
    cfg = make_config(target_dir, run_dir, time_budget="2s", num_epochs=500, save_interval=0)
    # the ranks' clocks run at different rates: the agreed figure must still be one
    trainer, _ = build_trainer(d, cfg, wall_clock=TickingClock(tick=0.05 if rank == 0 else 0.08))
    trainer.fit()
    lrs = [g["lr"] for g in trainer.optimizer.optimizer.param_groups]
    close_distributed()
    return {"step": trainer.step, "train_seconds": trainer.train_seconds, "lr": lrs}


def test_ranks_agree_on_when_the_budget_is_spent_and_on_every_rate(tiny_target_dir, tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tiny_target_dir), str(tmp_path), timeout_s=120)
    assert results[0] == results[1]
    assert results[0]["train_seconds"] >= 2.0
    rows = records(tmp_path)
    assert rows[-1]["step"] == results[0]["step"]
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(rows, 2.0), rel=1e-9, abs=1e-12)
