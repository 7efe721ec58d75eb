"""Learning-rate schedule: linear warmup of int(ratio · horizon) steps, then cosine to 0 or constant."""

import math

import pytest
import torch

from specforge_core.errors import ConfigError
from specforge_core.loop.schedule import build_scheduler, lr_multiplier, warmup_steps


def test_warmup_truncates_ratio_times_horizon():
    assert warmup_steps(1000, 0.015) == 15
    assert warmup_steps(99, 0.015) == 1
    assert warmup_steps(50, 0.015) == 0


def test_warmup_rises_linearly_from_zero():
    got = [lr_multiplier(s, total_steps=100, warmup=4, kind="cosine") for s in range(5)]
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_cosine_halves_midway_and_reaches_zero_at_the_horizon():
    kw = dict(total_steps=110, warmup=10, kind="cosine")
    assert lr_multiplier(60, **kw) == pytest.approx(0.5)
    assert lr_multiplier(110, **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(35, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_constant_holds_the_peak_after_warmup():
    assert [lr_multiplier(s, total_steps=10, warmup=2, kind="constant") for s in (1, 2, 9)] == [0.5, 1.0, 1.0]


def test_scheduler_sets_the_lr_of_each_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = build_scheduler(opt, total_steps=20, warmup_ratio=0.1, kind="cosine")
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:3] == [0.0, 5e-4, 1e-3]
    assert seen[-1] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 17 / 18)))


def test_scheduler_state_round_trip_continues_the_same_curve():
    def make():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=1.0)
        return opt, build_scheduler(opt, total_steps=10, warmup_ratio=0.2, kind="cosine")

    opt, sched = make()
    for _ in range(4):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    # what a checkpoint restores: the optimizer state (its param groups hold the current lr) and the
    # scheduler state, nothing set by hand
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for _ in range(3):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()


def test_unknown_schedule_kind_is_a_config_error():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError, match="training.lr_scheduler"):
        build_scheduler(opt, total_steps=10, warmup_ratio=0.0, kind="linear")
