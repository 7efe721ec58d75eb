"""Point 4: render with the target's own chat template, right-truncate, mask assistant turns."""

import numpy as np
import pytest

from specforge_core.data.formats import Row, parse_record
from specforge_core.data.tokenize import ChatRenderer, RowTokenizer

from .conftest import CHAT, assistant_texts

EOT = "<|im_end|>"

# A Qwen3-style template: reasoning in <think>, tool calls after the content, tool turns as user.
THINK_TOOLS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if m.reasoning_content %}{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>' + m.content + '</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def rows(records):
    return [parse_record(r, "conversations", f"f:{i + 1}", 10**6) for i, r in enumerate(records)]


def masked_text(tok, t):
    return tok.decode(t.input_ids[t.loss_mask == 1].tolist())


def test_masked_tokens_decode_to_assistant_texts_and_end_of_turn_tiny(tiny_tokenizer):
    out = RowTokenizer(tiny_tokenizer, max_length=512)(rows(CHAT))
    got = [masked_text(tiny_tokenizer, t) for t in out]
    expected = ["".join(m["content"] + EOT for m in r["conversations"] if m["role"] == "assistant") for r in CHAT]
    assert got == expected


@pytest.mark.slow
def test_masked_tokens_decode_to_assistant_texts_and_end_of_turn_smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    records = CHAT + [{"conversations": [
        {"role": "user", "content": "Write a haiku about autumn leaves."},
        {"role": "assistant", "content": " Crimson leaves drift down,\nwhispering to the cold earth —\nautumn says goodbye.\n"},
    ]}]
    out = RowTokenizer(tok, max_length=2048)(rows(records))
    for record, t in zip(records, out):
        want = "".join(m["content"] + EOT for m in record["conversations"] if m["role"] == "assistant")
        assert masked_text(tok, t) == want
    # SmolLM2's template injects a default system prompt into rows without one: never supervised.
    assert "SmolLM" in tok.decode(out[0].input_ids.tolist())
    assert "SmolLM" not in masked_text(tok, out[0])


def test_rendering_and_ids_match_apply_chat_template(tiny_tokenizer):
    (t,) = RowTokenizer(tiny_tokenizer, max_length=512)(rows(CHAT[1:2]))
    text = tiny_tokenizer.apply_chat_template(CHAT[1]["conversations"], tokenize=False)
    assert t.input_ids.tolist() == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_probe_finds_header_and_end_of_turn(tiny_tokenizer):
    r = ChatRenderer(tiny_tokenizer)
    assert (r.header, r.end_of_turn) == ("<|im_start|>assistant\n", EOT)


def test_rows_are_right_truncated_to_max_length(tiny_tokenizer):
    full = RowTokenizer(tiny_tokenizer, max_length=10_000)(rows(CHAT[1:2]))[0]
    cut = RowTokenizer(tiny_tokenizer, max_length=20)(rows(CHAT[1:2]))[0]
    assert len(cut.input_ids) == 20 and cut.truncated and not full.truncated
    assert np.array_equal(cut.input_ids, full.input_ids[:20]) and np.array_equal(cut.loss_mask, full.loss_mask[:20])


def test_train_only_last_turn_supervises_the_last_assistant_message(tiny_tokenizer):
    (t,) = RowTokenizer(tiny_tokenizer, max_length=512, train_only_last_turn=True)(rows(CHAT[1:2]))
    assert masked_text(tiny_tokenizer, t) == "Green." + EOT


def test_reasoning_and_tool_calls_are_supervised_with_the_turn(tiny_tokenizer):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    record = {"conversations": [
        {"role": "user", "content": "Add one."},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "It is two."}]}
    tok = RowTokenizer(tiny_tokenizer, max_length=512, chat_template=THINK_TOOLS_TEMPLATE)
    (t,) = tok(rows([record]))
    assert masked_text(tiny_tokenizer, t) == (
        "<think>\nuse the tool\n</think>\n\n<tool_call>add</tool_call>" + EOT + "It is two." + EOT
    )


def test_pre_formatted_text_is_masked_by_the_template_markers(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CHAT[0]["conversations"], tokenize=False)
    (t,) = RowTokenizer(tiny_tokenizer, max_length=512)([Row("f:1", text=text)])
    assert masked_text(tiny_tokenizer, t) == assistant_texts(CHAT[:1])[0] + EOT


def test_pre_tokenized_rows_pass_through_truncated(tiny_tokenizer):
    row = Row("f:1", input_ids=list(range(3, 13)), loss_mask=[0] * 4 + [1] * 6)
    (t,) = RowTokenizer(tiny_tokenizer, max_length=8)([row])
    assert t.input_ids.tolist() == list(range(3, 11)) and t.loss_mask.tolist() == [0] * 4 + [1] * 4


def test_prompt_ids_end_with_the_generation_prompt(tiny_tokenizer):
    rt = RowTokenizer(tiny_tokenizer, max_length=512)
    (row,) = rows(CHAT[1:2])
    prompt = tiny_tokenizer.decode(rt.prompt_ids(row, rt([row])[0]).tolist())
    assert prompt.endswith("Name two colors.<|im_end|>\n<|im_start|>assistant\n") and "Red" not in prompt


def test_template_kwargs_render_as_apply_chat_template_renders_them(tiny_tokenizer):
    from fixtures.tiny import THINKING_SWITCH_TEMPLATE

    turns = CHAT[0]["conversations"][:1]
    on = ChatRenderer(tiny_tokenizer, THINKING_SWITCH_TEMPLATE)
    off = ChatRenderer(tiny_tokenizer, THINKING_SWITCH_TEMPLATE, {"enable_thinking": False})
    want = tiny_tokenizer.apply_chat_template(turns, chat_template=THINKING_SWITCH_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert off.render(turns, add_generation_prompt=True) == want
    assert want.endswith("<think>\n\n</think>\n\n")
    assert on.render(turns, add_generation_prompt=True) != want


def test_prompt_ids_carry_the_template_kwargs_and_the_masks_still_find_every_turn(tiny_tokenizer):
    from fixtures.tiny import THINKING_SWITCH_TEMPLATE

    rt = RowTokenizer(tiny_tokenizer, max_length=512, chat_template=THINKING_SWITCH_TEMPLATE,
                      chat_template_kwargs={"enable_thinking": False})
    (row,) = rows(CHAT[1:2])
    (t,) = rt([row])
    assert masked_text(tiny_tokenizer, t) == "Red and blue." + EOT + "Green." + EOT
    assert tiny_tokenizer.decode(rt.prompt_ids(row, t).tolist()).endswith("assistant\n<think>\n\n</think>\n\n")
