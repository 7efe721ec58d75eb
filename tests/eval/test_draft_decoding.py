"""The draft side: decode-time feeding equals the training unroll; speculation is lossless."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.capture.target import default_capture_layers
from specforge_core.eval.acceptance import AcceptanceStats
from specforge_core.eval.draft_runner import DraftRunner
from specforge_core.eval.measure import measure_acceptance
from specforge_core.eval.speculative import decode
from specforge_core.eval.target import DecodingTarget
from specforge_core.models.draft_config import draft_config_from_target
from specforge_core.models.eagle3 import Eagle3DraftModel
from specforge_core.objective.ttt import ttt_unroll


def _target(model_dir, *, greedy_is_always_zero=False):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if greedy_is_always_zero:  # final norm 0 → every logit 0 → argmax is token 0, always
        torch.nn.init.zeros_(model.model.norm.weight)
    return model, DecodingTarget(model, list(default_capture_layers(model.config.num_hidden_layers)))


def _draft(model, draft_vocab_size=None, seed=0, hot_start=0):
    """A random-init draft for ``model``; with ``draft_vocab_size`` a vocab map of that many ids
    (the smallest being ``hot_start``, the rest random)."""
    torch.manual_seed(seed)
    v = model.config.vocab_size
    vd = draft_vocab_size or v
    draft = Eagle3DraftModel(draft_config_from_target(model.config, vd)).eval()
    draft.load_embedding(model.get_input_embeddings().weight)
    if vd < v:
        rest = torch.randperm(v - hot_start - 1)[: vd - 1] + hot_start + 1
        hot = torch.cat([torch.tensor([hot_start]), rest]).sort().values
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[hot] = True
        draft.set_vocab_map(hot - torch.arange(vd), t2d)
    return draft


def _prompt(tokenizer, text="what is the capital of France"):
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, tiny_tokenizer):
    model, target = _target(tiny_target_dir)
    return model, target, _prompt(tiny_tokenizer)


def test_decode_time_draft_equals_the_training_unroll_at_steps_0_to_2(tiny):
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=200, seed=1)
    ids = prompt + [5, 17, 42, 99, 7, 250, 3, 11]
    target.reset()
    aux = target.forward(ids).aux
    unrolled = []  # the pre-norm hidden of every training step: compute_logits(h) = lm_head(norm(h))
    hook = draft.norm.register_forward_hook(lambda _m, inputs, _o: unrolled.append(inputs[0].detach()))
    t = len(ids)
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, t, dtype=torch.long),
             "loss_mask": torch.ones(1, t, dtype=torch.long), "aux_hidden": aux[None],
             "last_hidden": torch.randn(1, t, model.config.hidden_size)}
    with torch.no_grad():
        ttt_unroll(draft, batch, model.lm_head.weight, ttt_length=3, backend="sdpa")
    hook.remove()
    runner = DraftRunner(draft)
    for n in (len(prompt), len(prompt) + 3, t - 3):  # step-0 rows 0..n-1, as after a verify round
        runner.reset()
        runner.extend(ids[1 : len(prompt) + 1], aux[: len(prompt)])  # prefill rows ...
        if n > len(prompt):
            runner.extend(ids[len(prompt) + 1 : n + 1], aux[len(prompt) : n])  # ... then accepted rows
        steps = runner.round_hidden_states(ids[n + 1 : n + 3])
        for k in range(3):
            torch.testing.assert_close(steps[k], unrolled[k][0, n - 1], rtol=0, atol=1e-5)


def test_draft_ids_are_mapped_to_target_ids_with_d2t(tiny):
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=64, hot_start=37)
    torch.nn.init.zeros_(draft.norm.weight)  # all draft logits 0 → argmax is draft id 0 = target id 37
    runner = DraftRunner(draft)
    target.reset()
    runner.reset()
    runner.extend(prompt[1:] + [5], target.forward(prompt).aux)
    assert runner.propose(4) == [37] * 4


@pytest.mark.parametrize("num_steps", [1, 3])
def test_a_draft_that_always_agrees_gets_num_steps_plus_one_per_verify(tiny_target_dir, tiny_tokenizer, num_steps):
    model, target = _target(tiny_target_dir, greedy_is_always_zero=True)
    draft = _draft(model)
    torch.nn.init.zeros_(draft.norm.weight)  # proposes draft id 0 = target id 0, the target's choice
    rounds, n = 4, 1 + 4 * (num_steps + 1) + 2  # the prefill token, 4 full rounds, 2 tokens more
    gen = decode(target, _prompt(tiny_tokenizer), max_new_tokens=n, stop_ids=set(),
                 drafter=DraftRunner(draft), num_steps=num_steps)
    assert gen.tokens == [0] * n
    assert gen.emitted == [num_steps + 1] * rounds + [2]
    stats = AcceptanceStats(num_steps)
    stats.add(gen)
    s = stats.summary()
    assert s["acceptance_length"] == (n - 1) / (rounds + 1) == 1 + s["mean_accepted_draft_tokens"]
    assert s["target_forwards_saved"] == n - (1 + rounds + 1)
    assert s["per_position_acceptance"] == [1.0] * num_steps


@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("num_steps,vd", [(1, None), (3, 128), (5, 300)])
def test_a_random_draft_is_lossless(request, tiny_tokenizer, arch_dir, num_steps, vd):
    model, target = _target(request.getfixturevalue(arch_dir))
    draft = _draft(model, draft_vocab_size=vd, seed=num_steps)
    for text in ("what is the capital of France", "tell me a story about a river"):
        prompt = _prompt(tiny_tokenizer, text)
        plain = decode(target, prompt, max_new_tokens=40, stop_ids={2})
        spec = decode(target, prompt, max_new_tokens=40, stop_ids={2}, drafter=DraftRunner(draft), num_steps=num_steps)
        assert spec.tokens == plain.tokens


def test_measure_reports_lossless_and_the_counts(tiny, tiny_tokenizer):
    model, _, prompt = tiny
    draft = _draft(model, draft_vocab_size=128)
    prompts = [prompt, _prompt(tiny_tokenizer, "hi")]
    result = measure_acceptance(model, draft, prompts, stop_ids={2}, num_steps=3, max_new_tokens=16,
                                capture_layer_ids=list(default_capture_layers(8)), check_lossless=True)
    assert result["lossless"] is True and result["prompts"] == 2
    assert result["acceptance_length"] >= 1.0
    assert result["target_forwards"] == 2 + result["verify_passes"]


@pytest.mark.slow
def test_speculation_with_a_random_draft_is_lossless_on_smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model, target = _target(smollm2_dir)
    draft = _draft(model, draft_vocab_size=8192)
    stops = {tok.eos_token_id}
    for text in ("What is the capital of France?", "Write a haiku about rivers."):
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        plain = decode(target, prompt, max_new_tokens=32, stop_ids=stops)
        spec = decode(target, prompt, max_new_tokens=32, stop_ids=stops, drafter=DraftRunner(draft), num_steps=3)
        assert spec.tokens == plain.tokens
