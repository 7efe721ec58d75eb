"""Point 3: conversation files in every shape users have, from any fsspec URL."""

import json

import fsspec
import pytest

from specforge_core.data.formats import detect_format, iter_records, parse_record

from .conftest import CHAT, write_jsonl

V = 512


def rows_of(url, fmt=None):
    out = []
    for where, rec in iter_records(url):
        out.append(parse_record(rec, fmt or detect_format(rec, where), where, V))
    return out


def test_jsonl_rows_keep_roles_content_and_line_numbers(chat_file):
    rows = rows_of(str(chat_file))
    assert [r.where for r in rows] == [f"{chat_file}:1", f"{chat_file}:2", f"{chat_file}:3"]
    assert [m["role"] for m in rows[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[0].messages[1]["content"] == "The capital of France is Paris."


def test_json_array_gives_the_same_rows_with_element_lines(tmp_path, chat_file):
    arr = tmp_path / "chat.json"
    arr.write_text(json.dumps(CHAT, indent=2))
    rows = rows_of(str(arr))
    assert [r.messages for r in rows] == [r.messages for r in rows_of(str(chat_file))]
    assert rows[0].where == f"{arr}:2" and rows[1].where.startswith(f"{arr}:") and int(rows[1].where.split(":")[-1]) > 2


def test_memory_and_file_urls_are_read_through_fsspec(chat_file):
    with fsspec.open("memory://data/chat.jsonl", "wb") as f:
        f.write(chat_file.read_bytes())
    assert [r.messages for r in rows_of("memory://data/chat.jsonl")] == [r.messages for r in rows_of(str(chat_file))]
    assert len(rows_of(f"file://{chat_file}")) == 3


def test_sharegpt_from_value_maps_to_roles(tmp_path):
    p = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}])
    (row,) = rows_of(str(p))
    assert row.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello!"}]


def test_messages_key_is_read_like_conversations(tmp_path):
    p = write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT[0]["conversations"]}])
    assert detect_format(json.loads(p.read_text()), "x") == "messages"
    assert rows_of(str(p))[0].messages == parse_record(CHAT[0], "conversations", "x", V).messages


def test_tool_calls_reasoning_and_tool_turns_are_kept(tmp_path):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    rec = {"conversations": [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 3."}],
        "tools": [{"type": "function", "function": {"name": "add"}}]}
    row = parse_record(rec, "conversations", "f:1", V)
    assert row.messages[1]["tool_calls"] == [call] and row.messages[1]["content"] == ""
    assert row.messages[1]["reasoning_content"] == "Use the tool."
    assert row.messages[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert row.tools == rec["tools"]


def test_pre_formatted_text_and_pre_tokenized_rows(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "<|im_start|>user\nhi<|im_end|>\n"}])
    q = write_jsonl(tmp_path / "k.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    assert rows_of(str(p))[0].text.startswith("<|im_start|>user")
    row = rows_of(str(q))[0]
    assert (row.input_ids, row.loss_mask) == ([5, 6, 7], [0, 1, 1])


@pytest.mark.parametrize("rec,fmt", [
    ({"conversations": [{"role": "user", "content": "x"}]}, "conversations"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "sharegpt"),
    ({"messages": []}, "messages"),
    ({"text": "x"}, "text"),
    ({"input_ids": [1], "loss_mask": [1]}, "tokenized"),
])
def test_format_is_detected_from_a_row(rec, fmt):
    assert detect_format(rec, "f:1") == fmt
