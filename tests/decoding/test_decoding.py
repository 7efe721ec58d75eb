"""The target side of speculative decoding: capture, rejection, batching, verify/accept, stop rule."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.capture.target_info import default_capture_layers
from specforge_core.decoding.speculative import decode, decode_batch
from specforge_core.decoding.verifier import DecodingTarget, stop_token_ids


class OracleDrafter:
    """Proposes the next tokens of known sequences (prompt + the target's greedy output): always right."""

    def __init__(self, references: list[list[int]], filler: int):
        self.references, self.filler = references, filler

    def reset(self):
        self.refs, self.rows = list(self.references), None

    def extend(self, rows):
        self.rows = self.rows or [0] * len(rows)
        for r, (tokens, aux) in enumerate(rows):
            assert aux.shape[0] == len(tokens)
            self.rows[r] += len(tokens)

    def keep_rows(self, rows):
        self.refs, self.rows = [self.refs[r] for r in rows], [self.rows[r] for r in rows]

    def chain(self, r, num_steps):
        # the last step-0 row (rows-1) holds token `rows`; its successor is reference[rows + 1]
        chain = self.refs[r][self.rows[r] + 1 : self.rows[r] + 1 + num_steps]
        return chain + [self.filler] * (num_steps - len(chain))

    def propose(self, num_steps):
        return [self.chain(r, num_steps) for r in range(len(self.rows))]


class PartlyRightDrafter(OracleDrafter):
    """Right except for every third proposal: rounds accept 0, 1, 2... of their drafts."""

    def propose(self, num_steps):
        self.calls = getattr(self, "calls", 0) + 1
        wrong = self.calls % (num_steps + 1)
        return [[self.filler if i == wrong else t for i, t in enumerate(c)] for c in super().propose(num_steps)]


class ConstantDrafter(OracleDrafter):
    """Proposes the same token every time: mostly wrong."""

    def propose(self, num_steps):
        return [[self.filler] * num_steps for _ in self.rows]


def _prompt(tokenizer, text):
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    target = DecodingTarget(model, list(default_capture_layers(model.config.num_hidden_layers)))
    return model, target, _prompt(tiny_tokenizer, "what is the capital of France")


def _greedy(target, prompt, n, stop=frozenset()):
    return decode(target, prompt, max_new_tokens=n, stop_ids=set(stop)).tokens


def _hf_aux(model, ids, layer_ids):
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)


def test_aux_states_are_the_capture_layer_outputs(tiny):
    model, target, prompt = tiny
    step = target.start([prompt])
    assert step.aux[0].shape == (len(prompt), 3 * model.config.hidden_size)
    torch.testing.assert_close(step.aux[0], _hf_aux(model, prompt, target.capture_layer_ids), rtol=1e-5, atol=1e-5)


def test_left_padded_rows_get_their_own_aux_states(tiny):
    model, target, prompt = tiny
    short = prompt[-4:]
    step = target.start([prompt, short])
    torch.testing.assert_close(step.aux[1], _hf_aux(model, short, target.capture_layer_ids), rtol=1e-4, atol=1e-4)


def test_a_forward_continues_every_row(tiny):
    model, target, prompt = tiny
    whole = target.start([prompt])
    target.start([prompt[:5], prompt[:7]])
    tail = target.forward([prompt[5:9], prompt[7:11]])
    assert tail.greedy[1][-1] == target.start([prompt[:11]]).greedy[0][0]
    torch.testing.assert_close(tail.aux[0], whole.aux[0][5:9], rtol=1e-4, atol=1e-4)


def test_rejected_tokens_are_never_seen_again(tiny):
    model, target, prompt = tiny
    target.start([prompt, prompt])
    target.forward([[7, 8, 9], [7, 8, 9]])
    target.keep_path(0, [0])
    after = target.forward([[11], [11]])
    assert target.lengths.tolist() == [len(prompt) + 2, len(prompt) + 4]
    fresh = target.start([prompt + [7, 11]])
    assert after.greedy[0][-1] == fresh.greedy[0][0]
    torch.testing.assert_close(after.aux[0][-1], fresh.aux[0][-1], rtol=1e-4, atol=1e-4)


def test_a_batch_decodes_each_prompt_as_if_alone(tiny, tiny_tokenizer):
    _, target, _ = tiny
    prompts = [_prompt(tiny_tokenizer, q) for q in ("what is the capital of France", "hi",
                                                    "tell me a story about a river", "name three rivers")]
    stops = {460, 502}  # "hi" stops on its first token, "name three rivers" on its fourth
    alone = [decode(target, p, max_new_tokens=20, stop_ids=stops) for p in prompts]
    together = decode_batch(target, prompts, max_new_tokens=20, stop_ids=stops)
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert [len(g.tokens) for g in together] == [20, 1, 20, 4]
    refs = [p + g.tokens for p, g in zip(prompts, alone)]
    spec = decode_batch(target, prompts, max_new_tokens=20, stop_ids=stops,
                        drafter=PartlyRightDrafter(refs, filler=5), num_steps=3)
    assert [g.tokens for g in spec] == [g.tokens for g in alone]


def test_plain_greedy_equals_transformers_generate(tiny):
    model, target, prompt = tiny
    ours = _greedy(target, prompt, 24)
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ours == ref


def test_plain_greedy_counts_one_verify_pass_per_token_after_the_first(tiny):
    _, target, prompt = tiny
    gen = decode(target, prompt, max_new_tokens=10, stop_ids=set())
    assert len(gen.tokens) == 10 and gen.verify_passes == 9 and gen.accepted == [0] * 9


@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_a_wrong_draft_leaves_the_output_unchanged(tiny, num_steps):
    _, target, prompt = tiny
    ref = _greedy(target, prompt, 30)
    gen = decode(
        target, prompt, max_new_tokens=30, stop_ids=set(), drafter=ConstantDrafter([[]], 5), num_steps=num_steps
    )
    assert gen.tokens == ref


@pytest.mark.parametrize("num_steps", [1, 3, 4])
def test_a_perfect_draft_gets_every_token_accepted(tiny, num_steps):
    _, target, prompt = tiny
    n = 1 + 5 * (num_steps + 1)  # prefill token + exactly 5 full rounds
    ref = _greedy(target, prompt, n)
    drafter = OracleDrafter([prompt + ref], filler=5)
    gen = decode(target, prompt, max_new_tokens=n, stop_ids=set(), drafter=drafter, num_steps=num_steps)
    assert gen.tokens == ref
    assert gen.accepted == [num_steps] * 5 and gen.emitted == [num_steps + 1] * 5
    stats = AcceptanceStats(num_steps)
    stats.add(gen)
    assert stats.summary()["acceptance_length"] == num_steps + 1


def test_a_partly_right_draft_leaves_the_output_unchanged(tiny):
    _, target, prompt = tiny
    ref = _greedy(target, prompt, 40)
    drafter = PartlyRightDrafter([prompt + ref], filler=5)
    gen = decode(target, prompt, max_new_tokens=40, stop_ids=set(), drafter=drafter, num_steps=3)
    assert gen.tokens == ref
    assert {0, 1, 2, 3} <= set(gen.accepted)


def test_the_last_round_is_cut_at_max_new_tokens(tiny):
    _, target, prompt = tiny
    ref = _greedy(target, prompt, 7)
    drafter = OracleDrafter([prompt + ref], 5)
    gen = decode(target, prompt, max_new_tokens=7, stop_ids=set(), drafter=drafter, num_steps=4)
    assert gen.tokens == ref and gen.emitted == [5, 1]


def test_decoding_stops_at_an_end_of_turn_token_inside_a_round(tiny):
    _, target, prompt = tiny
    ref = _greedy(target, prompt, 20)
    # the first token unlike the prefill's: with num_steps=4 it is accepted inside round 1 + i // 5
    i = next(i for i, t in enumerate(ref) if t != ref[0])
    assert i % 5 != 0, "the chosen stop token should not end its round"
    gen = decode(
        target, prompt, max_new_tokens=20, stop_ids={ref[i]}, drafter=OracleDrafter([prompt + ref], 5), num_steps=4
    )
    assert gen.tokens == ref[: i + 1] and gen.stopped
    assert gen.verify_passes == 1 + (i - 1) // 5


def test_stop_tokens_include_the_tokenizers_end_of_turn(tiny, tiny_tokenizer):
    model, _, _ = tiny
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(model, tiny_tokenizer)


@pytest.mark.slow
def test_plain_greedy_equals_transformers_generate_on_smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    target = DecodingTarget(model, default_capture_layers(model.config.num_hidden_layers))
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    gen = decode(target, prompt, max_new_tokens=32, stop_ids=stop_token_ids(model, tok))
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    assert gen.tokens == ref and gen.stopped
    assert tok.decode(gen.tokens, skip_special_tokens=True).strip() == "The capital of France is Paris."
