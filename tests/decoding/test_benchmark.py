"""The benchmark table: turns asked in order after the target's own answers, figures per setting,
the losslessness count, settings and template checks, and the evaluate --benchmarks command."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specforge_core.capture.target_info import default_capture_layers
from specforge_core.config import BenchmarkSetting, config_from_dict
from specforge_core.data.benchmarks import BenchmarkPrompt, PromptSet
from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.benchmark import DecodingSetting, SettingFigures, check_settings, run_benchmark
from specforge_core.decoding.evaluation import ChatCodec, evaluate_benchmarks, trained_template_kwargs
from specforge_core.decoding.speculative import Generation, decode
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
from specforge_core.drafts.eagle3.drafter import DraftRunner
from specforge_core.drafts.eagle3.model import Eagle3DraftModel
from specforge_core.drafts.eagle3.serving import export_draft, save_draft_checkpoint_files
from specforge_core.errors import ConfigError
from specforge_core.evaluate import main
from fixtures.tiny import THINKING_SWITCH_TEMPLATE

CHAIN = [DecodingSetting(2, 1, 3)]
TWO_TURNS = PromptSet("chat", "test", [
    BenchmarkPrompt("a", ["what is the capital of France", "and of Italy?"]),
    BenchmarkPrompt("b", ["tell me a story"]),
])


@pytest.fixture(scope="module")
def decoding(tiny_target_dir):
    """The tiny target, a random EAGLE3 draft beside it, and the chat codec."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    draft = Eagle3DraftModel(draft_config_from_target(model.config, 512))
    draft.load_embedding(model.get_input_embeddings().weight.detach())
    target = DecodingTarget(model, list(default_capture_layers(model.config.num_hidden_layers)))
    return target, DraftRunner(draft.eval()), ChatCodec(AutoTokenizer.from_pretrained(tiny_target_dir), {})


def _run(decoding, prompt_set=TWO_TURNS, settings=CHAIN, **kwargs):
    target, drafter, chat = decoding
    kwargs = {"stop_ids": {chat.tokenizer.eos_token_id}, "max_new_tokens": 6, **kwargs}
    return run_benchmark(target, drafter, prompt_set, settings, encode=chat.encode, answer_text=chat.answer_text,
                         **kwargs)


def test_the_second_turn_is_asked_after_the_targets_own_first_answer(decoding):
    target, _, chat = decoding
    run = _run(decoding)
    first, second = [r for r in run.requests if r.prompt_id == "a"]
    q1, q2 = TWO_TURNS.prompts[0].turns
    greedy = decode(target, first.ids, max_new_tokens=6, stop_ids={chat.tokenizer.eos_token_id}).tokens
    assert first.answer == greedy
    assert second.ids == chat.encode([{"role": "user", "content": q1},
                                      {"role": "assistant", "content": chat.answer_text(greedy)},
                                      {"role": "user", "content": q2}])
    summary = run.summary()
    assert (summary["prompts"], summary["requests"]) == (2, 3)
    assert summary["settings"][0]["generated_tokens"] == summary["greedy"]["generated_tokens"]
    assert summary["settings"][0]["differing_prompts"] == []


def test_a_turn_beyond_the_targets_context_is_skipped_with_the_turns_after_it(decoding):
    _, _, chat = decoding
    first_turn = len(chat.encode([{"role": "user", "content": TWO_TURNS.prompts[0].turns[0]}]))
    run = _run(decoding, context_length=first_turn + 6)  # turn 1 of "a" fits, its turn 2 does not
    assert [(r.prompt_id, r.turn) for r in run.requests] == [("a", 0), ("b", 0)]
    assert run.summary()["skipped_too_long"] == 1


def test_every_setting_decodes_every_request(decoding):
    run = _run(decoding, settings=[DecodingSetting(1, 1, 2), DecodingSetting(3, 1, 4)])
    rows = run.summary()["settings"]
    assert [(r["steps"], r["draft_tokens"]) for r in rows] == [(1, 2), (3, 4)]
    assert [f.stats.prompts for f in run.settings] == [3, 3]


def test_a_prompt_whose_output_differs_from_greedy_is_counted_once():
    figures = SettingFigures(DecodingSetting(3, 1, 4), AcceptanceStats(3))
    same, other = [1, 2, 3], [1, 2, 4]
    figures.add("a", Generation(tokens=same, num_steps=3, accepted=[1], emitted=[2]), reference=same)
    figures.add("b", Generation(tokens=other, num_steps=3, accepted=[1], emitted=[2]), reference=same)
    figures.add("b", Generation(tokens=other, num_steps=3, accepted=[1], emitted=[2]), reference=same)
    assert figures.summary(greedy_tokens_per_s=None)["differing_prompts"] == ["b"]


def test_speedup_is_speculative_over_greedy_tokens_per_second():
    figures = SettingFigures(DecodingSetting(3, 1, 4), AcceptanceStats(3), seconds=2.0)
    figures.add("a", Generation(tokens=list(range(10)), num_steps=3, accepted=[3, 3, 1], emitted=[4, 4, 1]),
                reference=list(range(10)))
    row = figures.summary(greedy_tokens_per_s=2.5)
    assert row["tokens_per_s"] == pytest.approx(5.0) and row["speedup"] == pytest.approx(2.0)
    assert row["acceptance_length"] == pytest.approx(9 / 3)


def test_a_tree_setting_asking_for_more_tokens_than_its_steps_make_is_refused_naming_it():
    check_settings([DecodingSetting(3, 1, 4), DecodingSetting(5, 4, 8)])  # SGLang's default tree
    with pytest.raises(ConfigError, match="2,2,8.*at most 7 verify tokens"):
        check_settings([DecodingSetting(2, 2, 8)])


def test_a_repeated_setting_is_refused():
    with pytest.raises(ConfigError, match="repeat"):
        check_settings([DecodingSetting(3, 1, 4), DecodingSetting(3, 1, 4)])


def test_a_chain_setting_must_verify_steps_plus_one_tokens():
    with pytest.raises(ValueError, match="draft_tokens must be 4"):
        BenchmarkSetting(steps=3, topk=1, draft_tokens=5)


def test_benchmark_prompts_are_rendered_with_the_chat_template_kwargs(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.chat_template = THINKING_SWITCH_TEMPLATE
    turns = [{"role": "user", "content": "hi"}]
    ids = ChatCodec(tok, {"enable_thinking": False}).encode(turns)
    plain = ChatCodec(tok, {}).encode(turns)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids[: len(plain)] == plain and len(ids) > len(plain)


# ---------------------------------------------------------------------------------------------
# Where the training template variables are read from


def _train_state(step_dir, data: dict):
    (step_dir / "train_state.json").write_text(json.dumps({"config": {"data": data}}))


@pytest.fixture(scope="module")
def run(tiny_target_dir, tmp_path_factory):
    """A run directory with one checkpoint of a random draft trained with enable_thinking=false,
    its export, and a prompts file."""
    root = tmp_path_factory.mktemp("bench-run")
    torch.manual_seed(0)
    draft = Eagle3DraftModel(draft_config_from_target(AutoConfig.from_pretrained(tiny_target_dir), 512))
    step = root / "run" / "checkpoints" / "step-00000004"
    save_draft_checkpoint_files(draft, step)
    (step.parent / "latest").write_text(step.name + "\n")
    _train_state(step, {"chat_template_kwargs": {"enable_thinking": False}})
    export_draft(draft, root / "export")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "turns": ["name three rivers"]}) + "\n")
    cfg = {"model": {"target": str(tiny_target_dir), "chat_template": THINKING_SWITCH_TEMPLATE},
           "data": {"chat_template_kwargs": {"enable_thinking": False}},
           "output": {"dir": str(root / "run")}, "validation": {"max_new_tokens": 4}}
    return root, cfg, prompts


def test_the_training_kwargs_come_from_the_checkpoint(run):
    root, _, _ = run
    kwargs, source = trained_template_kwargs(root / "run", root / "elsewhere")
    assert kwargs == {"enable_thinking": False} and source.endswith("step-00000004/train_state.json")


def test_an_export_takes_the_training_kwargs_from_the_run_manifest(run, tmp_path):
    root, _, _ = run
    assert trained_template_kwargs(root / "export", tmp_path) == (None, None)
    (tmp_path / "run.json").write_text(json.dumps({
        "format": "specforge-run/1", "config": {"data": {}}, "prompt_cache": {"key": "k", "path": "p"},
        "plan": {"key": "k", "path": "p"}}))
    assert trained_template_kwargs(root / "export", tmp_path) == ({}, str(tmp_path / "run.json"))


def test_the_command_prints_one_json_line_shows_progress_and_writes_the_table(run, tmp_path, capsys):
    root, cfg, prompts = run
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    report = tmp_path / "table.md"
    code = main(["--config", str(cfg_path), "--draft", str(root / "run"), "--benchmarks", f"mt-bench,{prompts}",
                 "--limit", "1", "--settings", "2,1,3", "--report", str(report)])
    out, err = capsys.readouterr()
    assert code == 0 and len(out.strip().splitlines()) == 1
    result = json.loads(out)
    assert result["benchmarks"]["mt-bench"]["requests"] == 2 and result["benchmarks"][str(prompts)]["requests"] == 1
    assert result["warnings"] == []
    assert "mt-bench:" in err and "request" in err
    text = report.read_text()
    assert "| mt-bench | 2, 1, 3 | **" in text and f"| {prompts} | 2, 1, 3 | **" in text
    assert '`{"enable_thinking": false}`' in text and "Warning" not in text


def test_evaluating_with_other_template_kwargs_than_training_warns_in_the_report(run, tmp_path):
    root, cfg, prompts = run
    cfg = config_from_dict({**cfg, "data": {"chat_template_kwargs": {"enable_thinking": True}}})
    result = evaluate_benchmarks(cfg, root / "run", benchmarks=[str(prompts)], settings=[BenchmarkSetting(
        steps=1, topk=1, draft_tokens=2)], report_path=tmp_path / "t.md")
    [warning] = result["warnings"]
    assert '{"enable_thinking": true}' in warning and '{"enable_thinking": false}' in warning
    assert f"> **Warning:** {warning}" in (tmp_path / "t.md").read_text()


def test_a_bad_setting_is_an_input_error_naming_the_flag(run, tmp_path, capsys):
    root, cfg, prompts = run
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    code = main(["--config", str(cfg_path), "--draft", str(root / "run"), "--benchmarks", str(prompts),
                 "--settings", "3,1,5"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --settings: setting '3,1,5'" in err and "draft_tokens must be 4" in err


def test_an_unknown_benchmark_is_refused_before_the_target_loads(run, tmp_path, capsys):
    root, cfg, _ = run
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({**cfg, "model": {"target": str(tmp_path / "no-such-model")}}))
    code = main(["--config", str(cfg_path), "--draft", str(root / "run"), "--benchmarks", "mt-bench,gsm8k"])
    err = capsys.readouterr().err
    assert code == 2 and "'gsm8k' is neither a prompt set nor a file" in err


# ---------------------------------------------------------------------------------------------
# The real check's command (docs/validation.md, "Benchmark table on SmolLM2"), on the tiny target


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_the_real_check_command_runs_every_packaged_set_at_the_default_settings(family, tiny_target_dir, tmp_path,
                                                                                capsys):
    from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
    from specforge_core.drafts.dflash.model import DFlashDraftModel
    from specforge_core.drafts.dflash.serving import export_dflash

    torch.manual_seed(0)
    target_config = AutoConfig.from_pretrained(tiny_target_dir)
    if family == "eagle3":
        export_draft(Eagle3DraftModel(draft_config_from_target(target_config, 512)), tmp_path / "draft")
    else:
        config = dflash_config_from_target(target_config, block_size=8, target_layer_ids=[1, 4], mask_token_id=0)
        export_dflash(DFlashDraftModel(config), tmp_path / "draft")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({"model": {"target": str(tiny_target_dir)}, "output": {"dir": str(tmp_path)}}))
    code = main(["--config", str(cfg_path), "--draft", str(tmp_path / "draft"),
                 "--benchmarks", "mt-bench,humaneval,sharegpt", "--limit", "1", "--max-new-tokens", "4"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["draft_family"] == family
    assert {name: b["prompts"] for name, b in result["benchmarks"].items()} == {
        "mt-bench": 1, "humaneval": 1, "sharegpt": 1}
    for b in result["benchmarks"].values():
        assert [(s["steps"], s["topk"], s["draft_tokens"]) for s in b["settings"]] == [(3, 1, 4), (7, 1, 8)]
        assert all(s["differing_prompts"] == [] for s in b["settings"])
    assert (tmp_path / "benchmarks.md").read_text().count("| mt-bench | ") == 3  # two settings + its time row
