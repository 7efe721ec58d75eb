"""Tree drafting, decode side: selection, the tree-masked verify forward, the accepted path and the
cache it leaves, the settings refused, and lossless decoding through non-first branches."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.capture.target_info import default_capture_layers
from specforge_core.decoding.speculative import check_draft_shape, decode, decode_batch
from specforge_core.decoding.tree import DraftTree, accept_path, select_tree
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.errors import ConfigError


def _prompt(tokenizer, text):
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _target(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return DecodingTarget(model, list(default_capture_layers(model.config.num_hidden_layers)))


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, tiny_tokenizer):
    return _target(tiny_target_dir), _prompt(tiny_tokenizer, "what is the capital of France")


# ---- the tree itself ----------------------------------------------------------------------------

def test_a_chain_is_the_tree_where_each_token_follows_the_one_before():
    chain = DraftTree.chain(5, [1, 2, 3])
    assert chain.tokens == (5, 1, 2, 3) and chain.parents == (-1, 0, 1, 2) and chain.is_chain
    assert chain.depths == [0, 1, 2, 3]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_each_node_sees_only_itself_and_its_ancestors():
    #        0
    #      1   2
    #     3     4
    #           5
    tree = DraftTree(tokens=(9, 1, 2, 3, 4, 5), parents=(-1, 0, 0, 1, 2, 4))
    assert tree.depths == [0, 1, 1, 2, 2, 3] and not tree.is_chain
    seen = [set(torch.nonzero(row).flatten().tolist()) for row in tree.ancestor_mask()]
    assert seen == [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 2, 4, 5}]


def test_a_parent_after_its_child_is_not_a_tree():
    with pytest.raises(ValueError, match="each parent before its child"):
        DraftTree(tokens=(9, 1, 2), parents=(-1, 2, 0))


def test_selection_keeps_the_best_candidates_in_candidate_order():
    # topk 2, 2 steps: step 0 = the root's children 10 (0.6) and 20 (0.3); step 1 = children of both
    tokens = [10, 20, 11, 12, 21, 22]
    parents = [-1, -1, 0, 0, 1, 1]
    scores = [0.6, 0.3, 0.6 * 0.45, 0.6 * 0.4, 0.3 * 0.95, 0.3 * 0.05]
    tree = select_tree(7, (tokens, parents, scores), num_draft_tokens=5)
    # the four best are 10 (0.6), 20 (0.3), 21 (0.285), 11 (0.27); 12 (0.24) is left out, and 11
    # comes before 21 in the tree, as among the candidates
    assert tree.tokens == (7, 10, 20, 11, 21) and tree.parents == (-1, 0, 0, 1, 2)


def test_ties_go_to_the_earlier_candidate_so_parents_are_kept():
    tokens, parents = [1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 1]
    tree = select_tree(0, (tokens, parents, [0.25] * 6), num_draft_tokens=4)
    assert tree.tokens == (0, 1, 2, 3) and tree.parents == (-1, 0, 0, 1)


def test_a_child_that_outscores_its_parent_is_refused():
    with pytest.raises(ValueError, match="without its parent 0"):
        select_tree(0, ([1, 2, 3], [-1, -1, 0], [0.1, 0.5, 0.9]), num_draft_tokens=3)


def test_the_accepted_path_follows_the_targets_choices_through_any_branch():
    tree = DraftTree(tokens=(9, 1, 2, 3, 4, 5), parents=(-1, 0, 0, 1, 2, 4))
    # the target chose 2 after the root (second child), then 4, then 5, then 8 (no such child)
    assert accept_path(tree, [2, 0, 4, 0, 5, 8]) == [0, 2, 4, 5]
    assert accept_path(tree, [7, 0, 0, 0, 0, 0]) == [0]  # no child matches: only the bonus token


# ---- the settings decode_batch takes --------------------------------------------------------------

class _ChainOnly:
    def propose(self, num_steps):
        return []


class _Trees(_ChainOnly):
    def propose_tree(self, num_steps, topk):
        return []


def test_num_draft_tokens_defaults_to_num_steps_plus_one():
    assert check_draft_shape(_ChainOnly(), 3) == 4
    assert check_draft_shape(_Trees(), 3, topk=2) == 4
    assert check_draft_shape(_Trees(), 5, topk=4, num_draft_tokens=8) == 8  # SGLang's default tree for Llama
    assert check_draft_shape(None, 3, topk=4) == 1


def test_a_chain_with_another_token_count_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="num_draft_tokens") as e:
        check_draft_shape(_Trees(), 3, topk=1, num_draft_tokens=8)
    assert "set num_draft_tokens to 4" in str(e.value)


def test_a_tree_from_a_chain_only_drafter_is_refused_naming_topk():
    with pytest.raises(ConfigError, match="_ChainOnly drafts one chain per verify pass") as e:
        check_draft_shape(_ChainOnly(), 3, topk=2)
    assert e.value.where == "topk" and "use topk 1" in e.value.fix


@pytest.mark.parametrize("steps,topk,width,most", [(3, 2, 12, 11), (1, 4, 6, 5), (2, 2, 1, 7)])
def test_more_draft_tokens_than_the_steps_make_are_refused(steps, topk, width, most):
    with pytest.raises(ConfigError, match=f"between 2 and {most}") as e:
        check_draft_shape(_Trees(), steps, topk=topk, num_draft_tokens=width)
    assert e.value.where == "num_draft_tokens"


# ---- the target's tree forward ----------------------------------------------------------------------

TREE = DraftTree(tokens=(7, 11, 12, 13, 14, 15), parents=(-1, 0, 0, 1, 2, 4))


def _path_to(tree, i):
    path = [i]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return [tree.tokens[p] for p in reversed(path)]


def test_every_tree_node_gets_the_choice_and_states_of_its_own_path(tiny):
    target, prompt = tiny
    rows = [prompt, prompt[3:]]  # the second row is left-padded
    target.start(rows)
    step = target.forward_tree([TREE, TREE])
    for r, p in enumerate(rows):
        for i in range(len(TREE.tokens)):
            alone = target.start([p + _path_to(TREE, i)])
            assert step.greedy[r][i] == alone.greedy[0][0]
            torch.testing.assert_close(step.aux[r][i], alone.aux[0][-1], rtol=1e-4, atol=1e-4)


def test_after_keeping_a_branch_the_sequence_continues_as_if_only_that_path_had_run(tiny):
    target, prompt = tiny
    target.start([prompt, prompt])
    target.forward_tree([TREE, TREE])
    target.keep_path(0, [0, 2, 4, 5])  # 7, 12, 14, 15: through the second child
    target.keep_path(1, [0, 1])  # 7, 11
    assert target.lengths.tolist() == [len(prompt) + 4, len(prompt) + 2]
    after = target.forward([[20, 21], [20, 21]])
    for r, kept in enumerate([[7, 12, 14, 15], [7, 11]]):
        fresh = target.start([prompt + kept + [20, 21]])
        assert after.greedy[r][-1] == fresh.greedy[0][0]
        torch.testing.assert_close(after.aux[r], fresh.aux[0][-2:], rtol=1e-4, atol=1e-4)


def test_a_chain_verified_with_the_tree_mask_equals_the_plain_forward(tiny):
    """The target half of "tree drafting at topk 1 is chain drafting" (decode_batch runs chains
    through the plain forward; the tree mask must give the same choices)."""
    target, prompt = tiny
    chains = [DraftTree.chain(7, [11, 12, 13]), DraftTree.chain(5, [9, 9, 9])]
    target.start([prompt, prompt[2:]])
    plain = target.forward([list(c.tokens) for c in chains])
    target.start([prompt, prompt[2:]])
    masked = target.forward_tree(chains)
    assert masked.greedy == plain.greedy
    for a, b in zip(masked.aux, plain.aux):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- decoding with a drafter that copies the target, ranked anywhere in the tree ---------------------

def expand(children_of, num_steps, topk):
    """SGLang's expansion written out plainly: ``children_of(path) -> [(token, prob)]`` (most
    probable first); each step expands the ``topk`` best nodes of the step before."""
    tokens, parents, scores = [], [], []
    frontier = [(-1, (), 1.0)]  # (candidate index, tokens from the root, score)
    for _ in range(num_steps):
        made = []
        for index, path, score in frontier:
            for token, prob in children_of(path)[:topk]:
                made.append((len(tokens), path + (token,), score * prob))
                tokens.append(token)
                parents.append(index)
                scores.append(score * prob)
        frontier = sorted(made, key=lambda m: (-m[2], m[0]))[:topk]
    return tokens, parents, scores


class CopyingTreeDrafter:
    """Knows the target's greedy continuation of every prompt and drafts it into the tree at a
    rank that changes with the round and the depth (0 = most probable), with distinct wrong
    siblings; records per row the accepted length its own tree implies."""

    PROBS = (0.5, 0.3, 0.15, 0.05)

    def __init__(self, references, vocab, num_draft_tokens):
        self.references, self.vocab, self.width = references, vocab, num_draft_tokens
        self.expected = [[] for _ in references]

    def reset(self):
        self.refs, self.ids, self.rows, self.round = list(self.references), list(range(len(self.references))), None, 0

    def extend(self, rows):
        self.rows = self.rows or [0] * len(rows)
        for r, (tokens, aux) in enumerate(rows):
            assert aux.shape[0] == len(tokens)
            self.rows[r] += len(tokens)

    def keep_rows(self, rows):
        self.refs, self.ids, self.rows = ([x[r] for r in rows] for x in (self.refs, self.ids, self.rows))

    def propose(self, num_steps):
        raise AssertionError("a tree drafter is asked for trees when topk > 1")

    def propose_tree(self, num_steps, topk):
        self.round += 1
        out = []
        for r in range(len(self.rows)):
            truth = self.refs[r][self.rows[r] + 1 :]

            def children_of(path, truth=truth):
                d = len(path)
                right = truth[d] if list(path) == truth[:d] and d < len(truth) else None
                wrong = [t for t in range(self.vocab - 1, self.vocab - 2 - topk, -1) if t != right][:topk]
                if right is not None:
                    wrong.insert((self.round + d) % topk, right)
                return list(zip(wrong[:topk], self.PROBS))

            candidates = expand(children_of, num_steps, topk)
            tree = select_tree(self.refs[r][self.rows[r]], candidates, self.width)
            node, depth = 0, 0  # the deepest node of the tree on the target's own continuation
            while (node := next((i for i, p in enumerate(tree.parents)
                                 if p == node and tree.tokens[i] == truth[depth]), None)) is not None:
                depth += 1
            self.expected[self.ids[r]].append(depth)
            out.append(candidates)
        return out


@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("steps,topk,width", [(5, 4, 8), (3, 2, 6), (4, 3, 10), (1, 4, 5)])
def test_a_copying_tree_draft_is_lossless_and_counted_by_its_accepted_path(
        request, tiny_tokenizer, arch_dir, steps, topk, width):
    target = _target(request.getfixturevalue(arch_dir))
    prompts = [_prompt(tiny_tokenizer, q) for q in ("what is the capital of France", "tell me a story", "hi")]
    # the continuation known 10 tokens past the 30 decoded, so every draft position has its truth
    plain = [decode(target, p, max_new_tokens=40, stop_ids=set()).tokens for p in prompts]
    drafter = CopyingTreeDrafter([p + g for p, g in zip(prompts, plain)], vocab=len(tiny_tokenizer),
                                 num_draft_tokens=width)
    spec = decode_batch(target, prompts, max_new_tokens=30, stop_ids=set(), drafter=drafter,
                        num_steps=steps, topk=topk, num_draft_tokens=width)
    assert [g.tokens for g in spec] == [g[:30] for g in plain]
    for g, expected in zip(spec, drafter.expected):
        assert g.accepted == expected
        assert g.emitted[:-1] == [a + 1 for a in g.accepted[:-1]]  # the last round may be cut at 30 tokens
        assert (g.num_steps, g.topk, g.num_draft_tokens) == (steps, topk, width)
    assert max(max(g.accepted) for g in spec) >= min(steps, 2)  # paths of several nodes were accepted


@pytest.mark.slow
@pytest.mark.parametrize("steps,topk,width", [(5, 4, 8)])  # SGLang's default tree; the tiny targets cover the rest
def test_tree_decoding_on_smollm2_is_lossless_and_counted_by_its_accepted_path(smollm2_dir, steps, topk, width):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    target = _target(smollm2_dir)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for text in ("What is the capital of France?", "Write a haiku about rivers.")]
    plain = decode_batch(target, prompts, max_new_tokens=24, stop_ids=set())
    drafter = CopyingTreeDrafter([p + g.tokens for p, g in zip(prompts, plain)], vocab=len(tok),
                                 num_draft_tokens=width)
    spec = decode_batch(target, prompts, max_new_tokens=18, stop_ids=set(), drafter=drafter,
                        num_steps=steps, topk=topk, num_draft_tokens=width)
    assert [g.tokens for g in spec] == [g.tokens[:18] for g in plain]
    assert [g.accepted for g in spec] == drafter.expected
