"""The draft side: decode-time feeding equals the training unroll; speculation is lossless."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.capture.target_info import default_capture_layers
from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.drafts.eagle3.drafter import DraftRunner
from specforge_core.decoding.measure import measure_acceptance
from specforge_core.decoding.speculative import decode, decode_batch
from specforge_core.decoding.tree import DraftTree, select_tree
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
from specforge_core.drafts.eagle3.model import Eagle3DraftModel
from specforge_core.drafts.eagle3.objective import ttt_unroll


def _target(model_dir, *, greedy_is_always_zero=False):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if greedy_is_always_zero:  # final norm 0 → every logit 0 → argmax is token 0, always
        torch.nn.init.zeros_(model.model.norm.weight)
    return model, DecodingTarget(model, list(default_capture_layers(model.config.num_hidden_layers)))


def _draft(model, draft_vocab_size=None, seed=0, hot_start=0, eagle31=False):
    """A random-init draft for ``model``; with ``draft_vocab_size`` a vocab map of that many ids
    (the smallest being ``hot_start``, the rest random); ``eagle31``: fc_norm and norm_output on."""
    torch.manual_seed(seed)
    v = model.config.vocab_size
    vd = draft_vocab_size or v
    draft = Eagle3DraftModel(draft_config_from_target(model.config, vd, fc_norm=eagle31, norm_output=eagle31)).eval()
    draft.load_embedding(model.get_input_embeddings().weight)
    if vd < v:
        rest = torch.randperm(v - hot_start - 1)[: vd - 1] + hot_start + 1
        hot = torch.cat([torch.tensor([hot_start]), rest]).sort().values
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[hot] = True
        draft.set_vocab_map(hot - torch.arange(vd), t2d)
    return draft


def _unrolled_hidden(draft, batch, lm_head_weight, t, steps=3):
    """The carried hidden of each training step's scored rows (what ``compute_logits`` reads, one
    call for all steps: ``norm``'s input, or with norm_output ``lm_head``'s); with one sample of
    ``t`` tokens, every one supervised, step k scores positions 0..t-2-k."""
    scored = []
    reader = draft.lm_head if draft.norm_output else draft.norm
    hook = reader.register_forward_hook(lambda _m, inputs, _o: scored.append(inputs[0].detach()))
    with torch.no_grad():
        ttt_unroll(draft, batch, lm_head_weight, ttt_length=steps, backend="sdpa")
    hook.remove()
    return scored[0].split([t - 1 - k for k in range(steps)], dim=1)


def _prompt(tokenizer, text="what is the capital of France"):
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, tiny_tokenizer):
    model, target = _target(tiny_target_dir)
    return model, target, _prompt(tiny_tokenizer)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
def test_decode_time_draft_equals_the_training_unroll_at_steps_0_to_2(tiny, eagle31):
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=200, seed=1, eagle31=eagle31)
    ids = prompt + [5, 17, 42, 99, 7, 250, 3, 11]
    aux = target.start([ids]).aux[0]
    t = len(ids)
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, t, dtype=torch.long),
             "loss_mask": torch.ones(1, t, dtype=torch.long), "aux_hidden": aux[None],
             "last_hidden": torch.randn(1, t, model.config.hidden_size)}
    unrolled = _unrolled_hidden(draft, batch, model.lm_head.weight, t)
    runner = DraftRunner(draft)
    p = len(prompt)
    runner.extend([(ids[1 : p + 1], aux[:p])])  # step-0 rows 0..p-1: the prefill
    steps = runner.round_hidden_states([ids[p + 1 : p + 3]])
    for k in range(3):
        torch.testing.assert_close(steps[k][0], unrolled[k][0, p - 1], rtol=0, atol=1e-5)
    # a batch whose rows then accept different numbers of tokens (ragged extension)
    ends = [p + 1, p + 3, t - 3]
    runner.reset()
    runner.extend([(ids[1 : p + 1], aux[:p])] * len(ends))
    runner.extend([(ids[p + 1 : n + 1], aux[p:n]) for n in ends])
    steps = runner.round_hidden_states([ids[n + 1 : n + 3] for n in ends])
    for r, n in enumerate(ends):
        for k in range(3):
            torch.testing.assert_close(steps[k][r], unrolled[k][0, n - 1], rtol=0, atol=1e-5)


def test_draft_ids_are_mapped_to_target_ids_with_d2t(tiny):
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=64, hot_start=37)
    torch.nn.init.zeros_(draft.norm.weight)  # all draft logits 0 → argmax is draft id 0 = target id 37
    runner = DraftRunner(draft)
    runner.extend([(prompt[1:] + [5], target.start([prompt]).aux[0])])
    assert runner.propose(4) == [[37] * 4]


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


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("num_steps,vd", [(1, None), (3, 128), (5, 300)])
def test_a_random_draft_is_lossless(request, tiny_tokenizer, arch_dir, num_steps, vd, eagle31):
    model, target = _target(request.getfixturevalue(arch_dir))
    draft = _draft(model, draft_vocab_size=vd, seed=num_steps, eagle31=eagle31)
    for text in ("what is the capital of France", "tell me a story about a river"):
        prompt = _prompt(tiny_tokenizer, text)
        plain = decode(target, prompt, max_new_tokens=40, stop_ids={2})
        spec = decode(target, prompt, max_new_tokens=40, stop_ids={2}, drafter=DraftRunner(draft), num_steps=num_steps)
        assert spec.tokens == plain.tokens


def test_a_batch_with_a_real_draft_decodes_each_prompt_as_if_alone(tiny, tiny_tokenizer):
    model, target, _ = tiny
    draft = _draft(model, draft_vocab_size=128, seed=2)
    prompts = [_prompt(tiny_tokenizer, q) for q in ("what is the capital of France", "hi", "name three rivers")]
    stops = {460, 502}
    alone = [decode(target, p, max_new_tokens=24, stop_ids=stops, drafter=DraftRunner(draft), num_steps=3)
             for p in prompts]
    together = decode_batch(target, prompts, max_new_tokens=24, stop_ids=stops, drafter=DraftRunner(draft),
                            num_steps=3)
    assert [(g.tokens, g.accepted) for g in together] == [(g.tokens, g.accepted) for g in alone]


def test_measure_reports_lossless_and_the_counts(tiny, tiny_tokenizer):
    model, _, prompt = tiny
    draft = _draft(model, draft_vocab_size=128)
    prompts = [prompt, _prompt(tiny_tokenizer, "hi")]
    layers = list(default_capture_layers(8))
    result = measure_acceptance(model, DraftRunner(draft), prompts, stop_ids={2}, num_steps=3, max_new_tokens=16,
                                capture_layer_ids=layers, check_lossless=True)
    assert result["lossless"] is True and result["prompts"] == 2
    # pooled over prompts: Σ tokens emitted by verify passes / Σ verify passes, from each prompt alone
    target = DecodingTarget(model, layers)
    alone = [decode(target, p, max_new_tokens=16, stop_ids={2}, drafter=DraftRunner(draft), num_steps=3)
             for p in prompts]
    target.close()
    assert result["verify_passes"] == sum(g.verify_passes for g in alone)
    assert result["acceptance_length"] == sum(sum(g.emitted) for g in alone) / sum(g.verify_passes for g in alone)
    assert result["target_forwards"] == 2 + result["verify_passes"]


@pytest.mark.slow
@pytest.mark.parametrize("steps,topk,width", [(3, 1, 4), (5, 4, 8)])
def test_batched_speculation_with_a_random_draft_is_lossless_on_smollm2(smollm2_dir, steps, topk, width):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model, target = _target(smollm2_dir)
    draft = _draft(model, draft_vocab_size=8192)
    stops = {tok.eos_token_id}
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for text in ("What is the capital of France?", "Hi!")]
    plain = [decode(target, p, max_new_tokens=24, stop_ids=stops).tokens for p in prompts]
    spec = decode_batch(target, prompts, max_new_tokens=24, stop_ids=stops, drafter=DraftRunner(draft),
                        num_steps=steps, topk=topk, num_draft_tokens=width)
    assert [g.tokens for g in spec] == plain


@pytest.mark.slow
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
def test_on_smollm2_the_draft_fed_at_decode_equals_the_training_unroll_on_captured_states(smollm2_dir, eagle31):
    """Training's features (the hf capture backend, one full forward) and decode's (the decoding
    target: prefill, then a verify-style forward) drive the same draft to the same pre-norm hidden
    and the same argmax at steps 0..2 of every answer position, on the real target's magnitudes
    (SmolLM2's captured states reach |x| ~ 2.5e4)."""
    from transformers import AutoTokenizer

    from specforge_core.capture.base import TargetRequest
    from specforge_core.capture.hf import HFCaptureBackend

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model, target = _target(smollm2_dir)
    prompt = _prompt(tok, "Name three rivers in Europe.")
    answer = decode(target, prompt, max_new_tokens=12, stop_ids=set()).tokens
    ids, p = prompt + answer, len(prompt)
    step = target.start([prompt])
    aux = torch.cat([step.aux[0], target.forward([answer]).aux[0]])  # what decoding gives the draft

    capture_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    backend = HFCaptureBackend(capture_model, target.capture_layer_ids)
    # every position supervised, so the unroll's output rows are the positions themselves
    batch = backend.capture(TargetRequest.from_rows([ids], [[1] * len(ids)], slice(0, 1)))
    draft = _draft(model, draft_vocab_size=8192, seed=3, eagle31=eagle31)
    unrolled = _unrolled_hidden(draft, batch, backend.lm_head_weight, len(ids))

    ends = list(range(p, len(ids) - 2))  # a round after step-0 rows 0..n-1, fed ids[n+1], ids[n+2]
    runner = DraftRunner(draft)
    runner.extend([(ids[1 : n + 1], aux[:n]) for n in ends])
    steps = runner.round_hidden_states([ids[n + 1 : n + 3] for n in ends])
    for k in range(3):
        train = unrolled[k][0, [n - 1 for n in ends]]
        torch.testing.assert_close(steps[k], train, rtol=1e-5, atol=2e-4)  # seen: 4e-5
        with torch.no_grad():  # steps[k] comes from inference mode
            assert torch.equal(draft.compute_logits(steps[k]).argmax(-1), draft.compute_logits(train).argmax(-1))


# ---- tree drafting (topk > 1) ------------------------------------------------------------------------

def _path(candidates, c):
    tokens, parents, _ = candidates
    path = []
    while c != -1:
        path.append(tokens[c])
        c = parents[c]
    return path[::-1]


def test_every_tree_candidate_is_scored_as_the_chain_along_its_own_path(tiny, tiny_tokenizer):
    """Each candidate's score is the product of the draft probabilities a chain fed with its path
    gives, a node's children are the topk tokens there, and each step expands the previous
    step's topk best: the tree is the chain's feeding along every path (own ancestors only)."""
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=64, seed=4)
    to_draft = {int(i + draft.d2t[i]): i for i in range(64)}
    prompts = [prompt, _prompt(tiny_tokenizer, "name three rivers")]
    starts = [target.start([p]) for p in prompts]
    rows = [(p[1:] + s.greedy[0], s.aux[0]) for p, s in zip(prompts, starts)]
    batch = DraftRunner(draft)
    batch.extend(rows)
    steps, topk = 3, 3
    for r, candidates in enumerate(batch.propose_tree(steps, topk)):
        tokens, parents, scores = candidates
        assert len(tokens) == topk + (steps - 1) * topk * topk
        alone = DraftRunner(draft)
        alone.extend([rows[r]])
        for c in range(len(tokens)):
            path = _path(candidates, c)
            hidden = alone.round_hidden_states([path[:-1]])
            with torch.no_grad():
                probs = [torch.softmax(draft.compute_logits(h[0]).float(), -1) for h in hidden]
            chained = torch.tensor([p[to_draft[t]] for p, t in zip(probs, path)]).prod().item()
            assert scores[c] == pytest.approx(chained, rel=1e-4)
            brothers = [tokens[s] for s in range(len(tokens)) if parents[s] == parents[c]]
            top = probs[-1].topk(topk).indices  # the parent's children: its topk draft tokens
            assert brothers == [int(i + draft.d2t[i]) for i in top]
        for i in range(1, steps):  # step i expands the topk best of step i-1
            before = range(topk + (i - 2) * topk * topk, topk + (i - 1) * topk * topk) if i > 1 else range(topk)
            best = sorted(before, key=lambda c: -scores[c])[:topk]
            step_i = range(topk + (i - 1) * topk * topk, topk + i * topk * topk)
            assert sorted({parents[c] for c in step_i}) == sorted(best)


@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_tree_drafting_at_topk_1_is_chain_drafting(tiny, tiny_tokenizer, num_steps):
    """The draft half of "tree drafting at topk 1 is chain drafting" (the target half is in
    test_tree.py): the tree of topk-1 candidates is the chain ``propose`` drafts, for ragged rows."""
    model, target, prompt = tiny
    draft = _draft(model, draft_vocab_size=128, seed=5)
    prompts = [prompt, _prompt(tiny_tokenizer, "hi"), _prompt(tiny_tokenizer, "tell me a story about a river")]
    runner = DraftRunner(draft)
    runner.extend([(p[1:] + s.greedy[0], s.aux[0]) for p, s in ((p, target.start([p])) for p in prompts)])
    runner.extend([([5, 9, 7][: n], torch.randn(n, 3 * model.config.hidden_size)) for n in (1, 3, 2)])
    trees = [select_tree(0, c, num_steps + 1) for c in runner.propose_tree(num_steps, 1)]
    assert trees == [DraftTree.chain(0, chain) for chain in runner.propose(num_steps)]


SETTINGS = [(5, 4, 8), (3, 2, 6), (2, 3, 7), (6, 2, 12)]  # (5, 4, 8): SGLang 0.5.14's default for Llama targets


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("steps,topk,width", SETTINGS)
def test_a_random_draft_is_lossless_with_trees(request, tiny_tokenizer, arch_dir, steps, topk, width, eagle31):
    model, target = _target(request.getfixturevalue(arch_dir))
    draft = _draft(model, draft_vocab_size=128, seed=steps, eagle31=eagle31)
    prompts = [_prompt(tiny_tokenizer, text) for text in ("what is the capital of France", "tell me a story")]
    plain = decode_batch(target, prompts, max_new_tokens=32, stop_ids={2})
    spec = decode_batch(target, prompts, max_new_tokens=32, stop_ids={2}, drafter=DraftRunner(draft),
                        num_steps=steps, topk=topk, num_draft_tokens=width)
    assert [g.tokens for g in spec] == [g.tokens for g in plain]


def test_a_draft_that_always_agrees_is_accepted_along_its_first_branch(tiny_target_dir, tiny_tokenizer):
    """Target and draft both always choose token 0; the draft's probabilities are all 1/V, so at
    (5, 4, 8) the tree holds the root's 4 children (tokens 0..3) and the first 3 children
    (0, 1, 2) of its first child: every round accepts 0, 0 (positions 1 and 5) plus the bonus."""
    model, target = _target(tiny_target_dir, greedy_is_always_zero=True)
    draft = _draft(model)
    torch.nn.init.zeros_(draft.norm.weight)
    n = 1 + 3 * 4 + 1  # the prefill token, 4 full rounds, 1 token more
    gen = decode(target, _prompt(tiny_tokenizer), max_new_tokens=n, stop_ids=set(), drafter=DraftRunner(draft),
                 num_steps=5, topk=4, num_draft_tokens=8)
    assert gen.tokens == [0] * n
    assert gen.accepted == [2] * 5 and gen.emitted == [3, 3, 3, 3, 1]
    chain = decode(target, _prompt(tiny_tokenizer), max_new_tokens=n, stop_ids=set(), drafter=DraftRunner(draft),
                   num_steps=5)
    assert chain.accepted == [5, 5, 5] and chain.emitted == [6, 6, 1]  # the same scale: drafts agreed with per pass
