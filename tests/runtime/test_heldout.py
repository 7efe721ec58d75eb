"""``training.heldout``: a small held-out decode every N steps, in the metrics, outside the clock.

The loop's side runs on the probe draft of test_trainer.py with a decode that only records what
it was given; the real decode runs through ``python -m specforge_core.train`` with the EAGLE3 draft
on the tiny target.
"""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fixtures.chitchat import write_chitchat_jsonl
from specforge_core.config import config_from_dict
from specforge_core.errors import ConfigError
from specforge_core.loop.checkpoint import latest_checkpoint
from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.launch.heldout import heldout_prompt_ids
from tests.runtime.harness import run_ranks
from tests.runtime.test_time_budget import TickingClock, records
from tests.runtime.test_train_cli import ROOT
from tests.runtime.test_trainer import build_trainer, make_config

DECODE_S = 1000.0


class SlowDecode:
    """Stands in for rank 0's decode: keeps the weights it was handed, takes DECODE_S seconds of
    the run's clock."""

    def __init__(self, clock: TickingClock):
        self.states = []
        self.clock = clock

    def __call__(self, state):
        self.states.append(state)
        self.clock.at += DECODE_S
        return {"heldout_acceptance_length": 1.0 + len(self.states) / 10}


def heldout_config(target_dir, run_dir, interval, **training):
    """test_trainer's probe config with held-out decodes every ``interval`` steps (and the eval
    prompts a config needs for them; the probe's decode never reads them)."""
    data = make_config(target_dir, run_dir, **training).model_dump(mode="json")
    data["data"]["eval_holdout"] = 4
    data["training"]["heldout"]["interval"] = interval
    return config_from_dict(data)


@pytest.fixture(scope="module")
def probe_run(tiny_target_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = init_distributed("cpu", timeout_s=30)
    run_dir = tmp_path_factory.mktemp("heldout")
    cfg = heldout_config(tiny_target_dir, run_dir, 4, world_size=1, num_epochs=1, log_interval=100)
    # 6 steps: decodes at 4 and at the last
    clock = TickingClock()
    decode = SlowDecode(clock)
    trainer, _ = build_trainer(d, cfg, heldout=decode, wall_clock=clock)
    trainer.fit()
    close_distributed()
    torch.set_num_threads(threads)
    return run_dir, trainer, decode


def test_held_out_figures_join_the_records_of_every_nth_and_the_last_step(probe_run):
    rows = records(probe_run[0])
    assert [(r["step"], r.get("heldout_acceptance_length")) for r in rows] == [(4, 1.1), (6, 1.2)]


def test_the_decode_is_handed_the_full_trained_weights_without_the_frozen_embedding(probe_run):
    _, trainer, decode = probe_run
    trained = {n for n, p in trainer.draft.named_parameters() if p.requires_grad}
    assert all(set(state) == trained for state in decode.states)
    final = load_file(str(latest_checkpoint(probe_run[0]) / "draft.safetensors"))
    assert all(torch.equal(decode.states[-1][k], final[k]) for k in trained)


def test_decode_time_is_left_out_of_the_clock_and_of_the_step_times(probe_run):
    rows = records(probe_run[0])
    assert rows[-1]["train_seconds"] < DECODE_S  # 6 probe steps of a few ticks; the two decodes took 2 * DECODE_S
    assert all(r["step_time_s"] < DECODE_S for r in rows)


def test_held_out_decodes_need_held_out_prompts():
    with pytest.raises(ConfigError) as e:
        heldout_prompt_ids([{"prompt_ids": []}], 8)
    assert e.value.where == "training.heldout.interval" and "data.eval_holdout" in e.value.fix


# --- the real decode, through the train command ---------------------------------------------------


def train(tmp_path, tiny_target_dir, name, **training):
    cfg = {
        "model": {"target": str(tiny_target_dir), "dtype": "float32"},
        "data": {"train_files": [str(tmp_path / "chat.jsonl")], "eval_holdout": 4, "max_length": 160,
                 "cache_dir": str(tmp_path / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"batch_size": 2, "ttt_length": 3, "max_steps": 4, "log_interval": 1, "learning_rate": 1e-3,
                     **training},
        "capture": {"device": "cpu"},
        "output": {"dir": str(tmp_path / name)},
    }
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "specforge_core.train", "--config", str(tmp_path / f"{name}.yaml")],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp_path / name


@pytest.fixture(scope="module")
def eagle3_runs(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout-eagle3")
    write_chitchat_jsonl(root / "chat.jsonl", 28)
    plain = train(root, tiny_target_dir, "plain")
    decoded = train(root, tiny_target_dir, "decoded", heldout={"interval": 2, "num_prompts": 3, "max_new_tokens": 8})
    return plain, decoded


def evaluate_checkpoint(run_dir, num_prompts: int, max_new_tokens: int) -> dict:
    """``python -m specforge_core.evaluate`` of the run's newest checkpoint: its JSON line."""
    out = subprocess.run(
        [sys.executable, "-m", "specforge_core.evaluate", "--config", str(run_dir.with_suffix(".yaml")),
         "--draft", str(latest_checkpoint(run_dir)), "--prompts", str(num_prompts),
         "--max-new-tokens", str(max_new_tokens), "--report", str(run_dir.with_suffix(".md"))],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_train_command_logs_a_real_held_out_decode(eagle3_runs):
    rows = {r["step"]: r for r in records(eagle3_runs[1])}
    for step in (2, 4):
        r = rows[step]
        assert r["heldout_prompts"] == 3 and r["heldout_tokens"] > 0
        assert [k for k in r if k.startswith("heldout_accept_rate_")] == [f"heldout_accept_rate_{i}" for i in range(3)]
    assert not any(k.startswith("heldout") for k in rows[1] | rows[3])
    # the last figure is the evaluator's own decode of the checkpoint saved at that step
    measured = evaluate_checkpoint(eagle3_runs[1], num_prompts=3, max_new_tokens=8)
    assert rows[4]["heldout_acceptance_length"] == measured["acceptance_length"]
    assert [rows[4][f"heldout_accept_rate_{i}"] for i in range(3)] == measured["per_position_acceptance"]
    assert rows[4]["heldout_tokens"] == measured["generated_tokens"]


def test_held_out_decodes_change_nothing_the_run_trains(eagle3_runs):
    plain, decoded = eagle3_runs
    assert [r["loss"] for r in records(decoded)] == [r["loss"] for r in records(plain)]
    a = load_file(str(latest_checkpoint(plain) / "draft.safetensors"))
    b = load_file(str(latest_checkpoint(decoded) / "draft.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _two_rank_worker(rank, target_dir, run_dir):
    d = init_distributed("cpu", timeout_s=60)
    clock = TickingClock()
    decode = SlowDecode(clock) if rank == 0 else None  # the builder gives rank 0 alone a decoder
    trainer, _ = build_trainer(d, heldout_config(target_dir, run_dir, 2, num_epochs=1), heldout=decode,
                               wall_clock=clock)
    trainer.fit()
    close_distributed()
    shapes = None if decode is None else [{k: tuple(v.shape) for k, v in s.items()} for s in decode.states]
    return {"step": trainer.step, "shapes": shapes}


def test_on_two_ranks_rank_0_decodes_the_gathered_weights_while_the_other_waits(tiny_target_dir, tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tiny_target_dir), str(tmp_path), timeout_s=120)
    assert [r["step"] for r in results] == [3, 3]  # world 2 × batch 2 × accumulation 2: 3 steps of 24 rows
    target_hidden = 128  # the tiny target's: fc reads 3 × hidden, whole (not a rank's shard)
    assert [s["fc.weight"] for s in results[0]["shapes"]] == [(32, 3 * target_hidden)] * 2  # steps 2 and 3
    assert [r["step"] for r in records(tmp_path) if "heldout_acceptance_length" in r] == [2, 3]
