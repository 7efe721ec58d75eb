"""Greedy speculative decoding: a draft proposes a chain, the target verifies it in one forward.

One round, as SGLang's EAGLE3 worker verifies a chain: the target runs ``[pending, d1..dk]`` on its cache, accepts
the longest prefix where ``d_i`` equals its own greedy choice, adds one bonus token (its greedy
choice after that prefix), and drops the rejected positions from its cache. The draft is then
extended over the accepted positions with the aux states of that same verify forward. With no
draft (``num_steps = 0``) the loop is plain greedy decoding, one target forward per token.

Several prompts are decoded together, one batch row each, to share the weight reads; every row
runs its own rounds and leaves the batch when it is done. The output is the target's own greedy
output, token for token, whatever the draft proposes: every emitted token is the target's
argmax given the tokens before it.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specforge_core.decoding.verifier import DecodingTarget


class Drafter(Protocol):
    """What the decoding loop needs from a draft (``eval.draft_runner.DraftRunner`` is the real one).

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


@dataclass
class Generation:
    """One prompt's decode: the tokens and how the target passes went."""

    tokens: list[int]  # generated ids (prompt excluded), stop token included if reached
    num_steps: int  # draft tokens proposed per verify round (0: plain greedy)
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


def decode_batch(
    target: DecodingTarget,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    drafter: Drafter | None = None,
    num_steps: int = 0,
) -> list[Generation]:
    """Greedy decode every prompt with the target, speculating ``num_steps`` tokens per round.

    A prompt stops after ``max_new_tokens`` tokens or at the first stop token anywhere in a
    round's accepted tokens (the tokens after it are dropped and it runs no further round).
    """
    if drafter is None:
        num_steps = 0
    first = target.start(prompts)
    gens = [Generation(tokens=[g[-1]], num_steps=num_steps) for g in first.greedy]
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
        drafts = drafter.propose(num_steps) if drafter is not None else [[] for _ in active]
        step = target.forward([[gens[i].tokens[-1]] + d for i, d in zip(active, drafts)])
        extensions = []
        for r, (i, d) in enumerate(zip(active, drafts)):
            gen, greedy = gens[i], step.greedy[r]
            a = 0
            while a < len(d) and d[a] == greedy[a]:
                a += 1
            new = d[:a] + [greedy[a]]
            target.reject(r, len(d) - a)
            emitted, gen.stopped = _take_until_stop(new, max_new_tokens - len(gen.tokens), stop_ids)
            gen.tokens += emitted
            gen.accepted.append(a)
            gen.emitted.append(len(emitted))
            extensions.append((new, step.aux[r][: a + 1]))
        if drafter is not None:
            drafter.extend(extensions)


def decode(target: DecodingTarget, prompt: list[int], **kwargs) -> Generation:
    """``decode_batch`` of one prompt."""
    return decode_batch(target, [prompt], **kwargs)[0]
