"""Greedy speculative decoding: a draft proposes a chain or a tree, the target verifies it in one forward.

One round, as SGLang's EAGLE3 worker verifies it: the target runs ``[pending, d1..dk]`` on its
cache, accepts the longest prefix where ``d_i`` equals its own greedy choice, adds one bonus token
(its greedy choice after that prefix), and drops the rejected positions from its cache. The draft
is then extended over the accepted positions with the aux states of that same verify forward.
With ``topk > 1`` the draft proposes a tree of ``num_draft_tokens`` tokens instead (``tree.py``):
the target verifies it in one forward under a tree attention mask, accepts the longest path of
nodes matching its greedy choices plus the bonus token, and keeps only that path. With no draft
(``num_steps = 0``) the loop is plain greedy decoding, one target forward per token.

Several prompts are decoded together, one batch row each, to share the weight reads; every row
runs its own rounds and leaves the batch when it is done. The output is the target's own greedy
output, token for token, whatever the draft proposes: every emitted token is the target's
argmax given the tokens before it.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specforge_core.decoding.tree import DraftTree, accept_path, select_tree
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.errors import ConfigError


class Drafter(Protocol):
    """What the decoding loop needs from a draft (``drafts.eagle3.drafter.DraftRunner``,
    ``drafts.dflash.drafter.DFlashDrafter``).

    The draft keeps, per batch row, one "step-0" row per target position t: embedding of token
    t+1 and the target's aux states at t. Rows are in the target's batch order.
    """

    def reset(self) -> None:
        """Forget every sequence."""

    def extend(self, rows: list[tuple[list[int], torch.Tensor]]) -> None:
        """For every batch row ``(next_tokens, aux [m, 3·Ht])``: append step-0 rows for its next
        ``m`` positions (after ``reset``, this adds the batch rows themselves)."""

    def propose(self, num_steps: int) -> list[list[int]]:
        """Per batch row, a chain of ``num_steps`` target-vocabulary ids after its last token."""

    def keep_rows(self, rows: list[int]) -> None:
        """Continue with only these batch rows."""


class TreeDrafter(Drafter, Protocol):
    """A drafter that also drafts trees (``topk > 1``; EAGLE3's ``DraftRunner``)."""

    def propose_tree(self, num_steps: int, topk: int) -> list[tuple[list[int], list[int], list[float]]]:
        """Per batch row, the candidates ``(tokens, parents, scores)`` of ``num_steps`` expansion
        steps with ``topk`` children per expanded node (``tree.select_tree`` has the layout)."""


@dataclass
class Generation:
    """One prompt's decode: the tokens and how the target passes went."""

    tokens: list[int]  # generated ids (prompt excluded), stop token included if reached
    num_steps: int  # draft steps per verify round: the longest run of draft tokens a round can accept (0: plain greedy)
    topk: int = 1  # children per expanded draft node (1: chain drafting)
    num_draft_tokens: int = 1  # tokens per verify forward: the pending token + the drafted ones (chain: num_steps + 1)
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens the target agreed with
    emitted: list[int] = field(default_factory=list)  # per round: tokens added to the output
    stopped: bool = False  # ended on an end-of-turn token (else on max_new_tokens)

    @property
    def verify_passes(self) -> int:
        return len(self.emitted)

    @property
    def target_forwards(self) -> int:
        """Prefill + verify passes."""
        return 1 + self.verify_passes


def _take_until_stop(new: list[int], budget: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """The prefix of ``new`` that is emitted: at most ``budget`` tokens, ending at a stop token."""
    out = []
    for tok in new[:budget]:
        out.append(tok)
        if tok in stop_ids:
            return out, True
    return out, False


def tree_token_budget(num_steps: int, topk: int) -> int:
    """The most tokens a verify forward can take for ``num_steps`` steps of ``topk``: the pending
    token + every candidate the steps make (topk at the first step, topk² at each later one)."""
    return 1 + topk + (num_steps - 1) * topk * topk


def check_draft_shape(drafter: Drafter | None, num_steps: int, topk: int = 1,
                      num_draft_tokens: int | None = None) -> int:
    """The tokens one verify forward takes (``num_draft_tokens`` resolved), or ConfigError.

    topk = 1 is chain drafting: ``num_draft_tokens`` is ``num_steps + 1`` (or left out). topk > 1
    needs a drafter with ``propose_tree`` (EAGLE3; a DFlash draft drafts one chain per verify
    pass), ``num_steps >= 1`` and ``2 <= num_draft_tokens <= 1 + topk + (num_steps - 1)·topk²``
    (the candidates the steps make); left out it is ``num_steps + 1``. Without a drafter: 1.
    """
    if drafter is None:
        return 1
    if topk < 1 or num_steps < 0:
        raise ConfigError(f"topk={topk}, num_steps={num_steps}", where="topk" if topk < 1 else "num_steps",
                          fix="use topk >= 1 (1: chain drafting) and num_steps >= 0")
    if topk == 1:
        if num_draft_tokens not in (None, num_steps + 1):
            raise ConfigError(
                f"num_draft_tokens={num_draft_tokens} with topk 1: a chain of {num_steps} draft tokens is "
                f"verified as {num_steps + 1} tokens", where="num_draft_tokens",
                fix=f"set num_draft_tokens to {num_steps + 1} or leave it out (SGLang resets it to "
                "num_steps + 1 when topk is 1), or raise topk to draft a tree")
        return num_steps + 1
    if not callable(getattr(drafter, "propose_tree", None)):
        raise ConfigError(f"{type(drafter).__name__} drafts one chain per verify pass, not a tree (topk={topk})",
                          where="topk", fix="use topk 1 with this draft: tree drafting is for EAGLE3 drafts")
    if num_steps < 1:
        raise ConfigError(f"a tree needs at least one draft step, got num_steps={num_steps}", where="num_steps",
                          fix="set num_steps >= 1, or topk 1")
    most = tree_token_budget(num_steps, topk)
    width = num_steps + 1 if num_draft_tokens is None else num_draft_tokens
    if not 2 <= width <= most:
        raise ConfigError(
            f"num_draft_tokens={width}: {num_steps} steps of topk {topk} make {most - 1} candidate tokens",
            where="num_draft_tokens", fix=f"choose num_draft_tokens between 2 and {most} (the pending token "
            "+ the selected candidates), or change num_steps / topk")
    return width


def _draft_trees(drafter, pending: list[int], num_steps: int, topk: int, width: int) -> list[DraftTree]:
    """Each row's tree for this round (a chain when topk is 1 or there is no drafter)."""
    if drafter is None:
        return [DraftTree.chain(p, []) for p in pending]
    if topk == 1:
        return [DraftTree.chain(p, d) for p, d in zip(pending, drafter.propose(num_steps))]
    return [select_tree(p, c, width) for p, c in zip(pending, drafter.propose_tree(num_steps, topk))]


def decode_batch(
    target: DecodingTarget,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    drafter: Drafter | None = None,
    num_steps: int = 0,
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> list[Generation]:
    """Greedy decode every prompt with the target, speculating ``num_steps`` draft steps per round.

    ``topk = 1`` drafts a chain of ``num_steps`` tokens; ``topk > 1`` a tree of
    ``num_draft_tokens`` tokens (``check_draft_shape`` says which settings are valid; ConfigError
    otherwise, before any forward). A chain round runs the target's plain forward; a tree round the
    tree-masked one. Per round, ``Generation.accepted`` counts the draft tokens the target agreed
    with (the accepted path's length; at most ``num_steps``) and ``emitted`` the tokens added to
    the output, for chains and trees alike. A prompt stops after ``max_new_tokens`` tokens or at
    the first stop token anywhere in a round's accepted tokens (the tokens after it are dropped and
    it runs no further round).
    """
    if drafter is None:
        num_steps, topk = 0, 1
    width = check_draft_shape(drafter, num_steps, topk, num_draft_tokens)
    first = target.start(prompts)
    gens = [Generation(tokens=[g[-1]], num_steps=num_steps, topk=topk, num_draft_tokens=width) for g in first.greedy]
    for gen in gens:
        gen.stopped = gen.tokens[0] in stop_ids
    if drafter is not None:
        drafter.reset()
        drafter.extend([(list(p[1:]) + g.tokens, aux) for p, g, aux in zip(prompts, gens, first.aux)])
    active = list(range(len(prompts)))  # batch row r decodes prompt active[r]
    while True:
        keep = [r for r, i in enumerate(active) if not gens[i].stopped and len(gens[i].tokens) < max_new_tokens]
        if len(keep) < len(active):
            if not keep:
                return gens
            active = [active[r] for r in keep]
            target.keep_rows(keep)
            if drafter is not None:
                drafter.keep_rows(keep)
        trees = _draft_trees(drafter, [gens[i].tokens[-1] for i in active], num_steps, topk, width)
        if all(tree.is_chain for tree in trees):
            step = target.forward([list(tree.tokens) for tree in trees])
        else:
            step = target.forward_tree(trees)
        extensions = []
        for r, (i, tree) in enumerate(zip(active, trees)):
            gen, greedy = gens[i], step.greedy[r]
            path = accept_path(tree, greedy)
            target.keep_path(r, path)
            new = [tree.tokens[p] for p in path[1:]] + [greedy[path[-1]]]
            emitted, gen.stopped = _take_until_stop(new, max_new_tokens - len(gen.tokens), stop_ids)
            gen.tokens += emitted
            gen.accepted.append(len(path) - 1)
            gen.emitted.append(len(emitted))
            extensions.append((new, step.aux[r][path]))
        if drafter is not None:
            drafter.extend(extensions)


def decode(target: DecodingTarget, prompt: list[int], **kwargs) -> Generation:
    """``decode_batch`` of one prompt."""
    return decode_batch(target, [prompt], **kwargs)[0]
