"""Target-regenerated data: batched, left-padded, resumable, conversation-format JSONL."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.config import config_from_dict
from specforge_core.errors import DataError
from specforge_core.decoding.speculative import decode
from specforge_core.capture.target_info import default_capture_layers
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.data.formats import parse_record
from specforge_core.decoding.answering import prompt_messages, regenerate, written_ids
from specforge_core.regenerate import main

QUESTIONS = ["what is the capital of France", "tell me a story", "hi", "how do I write python code fast",
             "name three rivers", "why is water good"]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [{"id": f"q{i}", "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}]}
            for i, q in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cfg(tiny_target_dir, source):
    return config_from_dict({"model": {"target": str(tiny_target_dir)},
                             "data": {"train_files": [str(source)], "max_length": 256}})


def _rows(path):
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_rows_are_prompt_turns_plus_the_targets_answer(cfg, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(cfg, out, batch_size=4, max_new_tokens=8)
    rows = {r["id"]: r for r in _rows(out)}
    assert sorted(rows) == [f"q{i}" for i in range(len(QUESTIONS))]
    conv = rows["q0"]["conversations"]
    assert conv[0] == {"role": "user", "content": QUESTIONS[0]}
    assert conv[1]["role"] == "assistant" and conv[1]["content"] != "old" and len(conv) == 2


def test_batched_left_padded_answers_equal_one_at_a_time_greedy(cfg, tiny_target_dir, tiny_tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(cfg, out, batch_size=6, max_new_tokens=12)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    target = DecodingTarget(model, default_capture_layers(model.config.num_hidden_layers))
    for row in _rows(out):
        turns = row["conversations"][:-1]
        text = tiny_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        prompt = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        want = decode(target, prompt, max_new_tokens=12, stop_ids={tiny_tokenizer.eos_token_id}).tokens
        assert row["conversations"][-1]["content"] == tiny_tokenizer.decode(want, skip_special_tokens=True)


def test_a_rerun_answers_only_the_missing_ids(cfg, tmp_path):
    out = tmp_path / "regen.jsonl"
    first = regenerate(cfg, out, batch_size=2, max_new_tokens=4, limit=2)
    before = out.read_text()
    second = regenerate(cfg, out, batch_size=2, max_new_tokens=4)
    assert (first["written"], second["written"], second["already_written"]) == (2, 4, 2)
    assert out.read_text().startswith(before)
    assert len({r["id"] for r in _rows(out)}) == len(QUESTIONS) == len(_rows(out))


def test_a_torn_last_line_is_dropped_and_answered_again(cfg, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(cfg, out, batch_size=2, max_new_tokens=4, limit=2)
    out.write_text(out.read_text() + '{"id": "q5", "conversa')
    result = regenerate(cfg, out, batch_size=2, max_new_tokens=4)
    assert result["already_written"] == 2 and len(_rows(out)) == len(QUESTIONS)


def test_written_ids_reads_answers_holding_unicode_line_separators(tmp_path):
    out = tmp_path / "regen.jsonl"
    rows = [{"id": "a", "conversations": [{"role": "user", "content": "one\u2028two\x85three"}]}, {"id": "b"}]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert written_ids(out) == {"a", "b"}


def test_sampling_with_a_seed_is_reproducible(cfg, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        regenerate(cfg, out, batch_size=3, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=3)
    assert a.read_text() == b.read_text()


def test_the_prompt_is_the_conversation_before_the_first_assistant_turn():
    rec = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                             {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]}
    row = parse_record(rec, "sharegpt", "x:1", vocab_size=512)
    assert prompt_messages(row) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_a_text_row_has_no_prompt_to_answer_and_names_its_line():
    with pytest.raises(DataError, match="f.jsonl:3"):
        prompt_messages(parse_record({"text": "hello"}, "text", "f.jsonl:3", vocab_size=512))


def test_bad_rows_are_skipped_and_counted_when_configured(cfg, source, tmp_path):
    source.write_text(source.read_text() + "not json\n")
    result = regenerate(cfg.model_copy(update={"data": cfg.data.model_copy(update={"on_bad_row": "skip"})}),
                        tmp_path / "regen.jsonl", max_new_tokens=2)
    assert result["skipped_bad_rows"] == 1 and result["written"] == len(QUESTIONS)


def test_cli_prints_one_json_line(tiny_target_dir, source, tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"model:\n  target: {tiny_target_dir}\ndata:\n  train_files: [{source}]\n")
    out = tmp_path / "regen.jsonl"
    assert main(["--config", str(cfg_path), "--out", str(out), "--max-new-tokens", "4", "--limit", "3"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0])["written"] == 3


def test_the_prompt_is_rendered_with_the_chat_template_kwargs(tiny_target_dir, tiny_tokenizer, source, tmp_path):
    from fixtures.tiny import THINKING_SWITCH_TEMPLATE

    def answers(kwargs):
        cfg = config_from_dict({"model": {"target": str(tiny_target_dir), "chat_template": THINKING_SWITCH_TEMPLATE},
                                "data": {"train_files": [str(source)], "max_length": 256,
                                         "chat_template_kwargs": kwargs}})
        out = tmp_path / f"regen-{len(kwargs)}.jsonl"
        regenerate(cfg, out, batch_size=2, max_new_tokens=6, limit=2)
        return {r["id"]: r["conversations"][-1]["content"] for r in _rows(out)}

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    target = DecodingTarget(model, default_capture_layers(model.config.num_hidden_layers))
    want = {}
    for i, q in enumerate(QUESTIONS[:2]):
        text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], chat_template=THINKING_SWITCH_TEMPLATE,
                                                  tokenize=False, add_generation_prompt=True, enable_thinking=False)
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens = decode(target, ids, max_new_tokens=6, stop_ids={tiny_tokenizer.eos_token_id}).tokens
        want[f"q{i}"] = tiny_tokenizer.decode(tokens, skip_special_tokens=True)
    assert answers({"enable_thinking": False}) == want
    assert answers({}) != want


def test_the_sglang_engine_writes_the_same_greedy_answers_as_hf(cfg, tmp_path):
    from fixtures.fake_sglang import FakeSGLangGenerator

    engines = []

    def start(**kwargs):
        engines.append(FakeSGLangGenerator(**kwargs))
        return engines[-1]

    hf, sglang = tmp_path / "hf.jsonl", tmp_path / "sglang.jsonl"
    regenerate(cfg, hf, batch_size=4, max_new_tokens=12)
    result = regenerate(cfg, sglang, batch_size=4, max_new_tokens=12, engine="sglang", engine_factory=start)
    assert result["engine"] == "sglang" and result["written"] == len(QUESTIONS) and result["tokens_per_s"] > 0
    assert _rows(sglang) == _rows(hf)
    [engine] = engines
    assert engine.kwargs["skip_tokenizer_init"] is True and engine.kwargs["model_path"] == cfg.model.target
    assert engine.kwargs["tp_size"] == cfg.capture.tp_size and engine.closed
    again = regenerate(cfg, sglang, batch_size=4, max_new_tokens=12, engine="sglang", engine_factory=start)
    assert again["written"] == 0 and again["already_written"] == len(QUESTIONS)  # resumable as hf is
    assert len(engines) == 1  # nothing left to answer: no engine is started for it
    assert again.keys() == result.keys()


def test_without_sglang_installed_the_sglang_engine_is_refused_naming_the_option(cfg, tmp_path):
    from importlib.util import find_spec

    from specforge_core.errors import CaptureError

    if find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(CaptureError, match="sglang is not installed") as e:
        regenerate(cfg, tmp_path / "out.jsonl", engine="sglang")
    assert e.value.where == "--engine sglang" and "--engine hf" in e.value.fix


def test_the_regeneration_bench_counts_same_answers_and_where_the_others_part(tiny_tokenizer):
    from tests.bench_scripts import load_bench

    bench = load_bench("gpu_regenerate")
    ours = {"a": "the cat sat", "b": "the cat ran far", "c": "hello"}
    reference = {"a": "the cat sat", "b": "the cat sat down", "c": "hello"}
    got = bench.compare_answers(tiny_tokenizer, ours, reference)
    encode = lambda text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    parted = len(encode("the cat"))
    assert (got["compared"], got["same"], got["differ"], got["first_difference_at_tokens"]) == (3, 2, 1, [parted])
    assert got["partings"] == [{"id": "b", "at": parted, "ours_token": encode("the cat ran far")[parted],
                                "reference_token": encode("the cat sat down")[parted]}]


def test_the_regeneration_bench_weighs_each_parting_with_the_float32_target(cfg, tiny_target_dir, tiny_tokenizer,
                                                                           tmp_path):
    from tests.bench_scripts import load_bench

    bench = load_bench("gpu_regenerate")
    row = {"id": "a", "conversations": [{"role": "user", "content": QUESTIONS[0]},
                                        {"role": "assistant", "content": "the cat sat on the mat"}]}
    prompt = tiny_tokenizer(tiny_tokenizer.apply_chat_template(row["conversations"][:1], tokenize=False,
                                                               add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
    answer = tiny_tokenizer(row["conversations"][1]["content"], add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) + 1]  # predicts answer token 2
    first, second, third = logits.topk(3).indices.tolist()
    partings = [{"id": "a", "at": 2, "ours_token": first, "reference_token": second},
                {"id": "a", "at": 2, "ours_token": second, "reference_token": first},
                {"id": "a", "at": 2, "ours_token": second, "reference_token": third},
                {"id": "a", "at": 2, "ours_token": second, "reference_token": None}]  # one answer ended there
    why = bench.parting_margins(cfg, {"a": row}, partings)
    assert [p.get("fp32_picks") for p in partings] == ["ours", "reference", "neither", None]
    gap = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    assert all(p["fp32_gap"] == pytest.approx(gap, abs=1e-4) for p in partings[:3])
    with torch.no_grad():  # every answer position's gap, for the share below this one's
        all_logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    gaps = all_logits.topk(2).values[:, 0] - all_logits.topk(2).values[:, 1]
    assert partings[0]["smaller_gaps_share"] == pytest.approx(float((gaps < gaps[2]).float().mean()), abs=1e-3)
    assert why["weighed"] == 3 and why["fp32_picks"] == {"ours": 1, "reference": 1, "neither": 1}
    assert why["median_gap_at_parting"] == pytest.approx(gap, abs=1e-4)
