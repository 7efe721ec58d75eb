"""Greedy speculative decoding: a draft proposes a chain, the target verifies it in one forward.

One round (eagle3-decoding.md): the target runs ``[pending, d1..dk]`` on its cache, accepts
the longest prefix where ``d_i`` equals its own greedy choice, adds one bonus token (its greedy
choice after that prefix), and drops the rejected positions from its cache. The draft is then
extended over the accepted positions with the aux states of that same verify forward. With no
draft (``num_steps = 0``) the loop is plain greedy decoding, one target forward per token.

The output is the target's own greedy output, token for token, whatever the draft proposes:
every emitted token is the target's argmax given the tokens before it.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specforge_core.eval.target import DecodingTarget


class Drafter(Protocol):
    """What the decoding loop needs from a draft (``eval.draft_runner.DraftRunner`` is the real one).

    The draft keeps one "step-0" row per target position t: embedding of token t+1 and the
    target's aux states at t.
    """

    def reset(self) -> None:
        """Forget the sequence."""

    def extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        """Append step-0 rows for the next ``len(next_tokens)`` positions (``aux``: [m, 3·Ht])."""

    def propose(self, num_steps: int) -> list[int]:
        """A chain of ``num_steps`` target-vocabulary ids continuing after the last row's token."""


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


def decode(
    target: DecodingTarget,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    drafter: Drafter | None = None,
    num_steps: int = 0,
) -> Generation:
    """Greedy decode ``prompt`` with the target, speculating ``num_steps`` tokens per round.

    Stops after ``max_new_tokens`` tokens or at the first stop token anywhere in a round's
    accepted tokens (the tokens after it are dropped and no further round runs).
    """
    if drafter is None:
        num_steps = 0
    if not prompt:
        raise ValueError("cannot decode an empty prompt")
    target.reset()
    first = target.forward(prompt, last_only=True)
    gen = Generation(tokens=[first.greedy[-1]], num_steps=num_steps)
    if first.greedy[-1] in stop_ids or max_new_tokens <= 1:
        gen.stopped = first.greedy[-1] in stop_ids
        return gen
    if drafter is not None:
        drafter.reset()
        drafter.extend(prompt[1:] + gen.tokens, first.aux)
    while True:
        pending = gen.tokens[-1]
        drafts = drafter.propose(num_steps) if drafter is not None else []
        base = target.length
        step = target.forward([pending] + drafts)
        a = 0
        while a < len(drafts) and drafts[a] == step.greedy[a]:
            a += 1
        new = drafts[:a] + [step.greedy[a]]
        target.truncate(base + a + 1)
        emitted, gen.stopped = _take_until_stop(new, max_new_tokens - len(gen.tokens), stop_ids)
        gen.tokens += emitted
        gen.accepted.append(a)
        gen.emitted.append(len(emitted))
        if gen.stopped or len(gen.tokens) >= max_new_tokens:
            return gen
        if drafter is not None:
            drafter.extend(new, step.aux[: a + 1])
