"""Draft trees: one verify round's tokens when the draft proposes several continuations at once.

With ``topk > 1`` (SGLang's ``--speculative-eagle-topk``) a round drafts a tree, as SGLang's EAGLE
worker builds and verifies it:

- **Expansion** (the draft's ``propose_tree``; ``Drafter`` in ``speculative.py``): the root is the
  pending token. Step 0 takes the draft's ``topk`` most probable tokens after it; every later step
  takes the ``topk`` best candidates of the step before (the frontier) and proposes the ``topk``
  most probable children of each, ``topk²`` candidates. A candidate's score is the product of the
  draft probabilities along its path. ``num_steps`` steps give ``topk + (num_steps - 1)·topk²``
  candidates, listed step by step, so a parent comes before its children.
- **Selection** (``select_tree``): the ``num_draft_tokens - 1`` best-scoring candidates, kept in
  candidate order. A child never scores above its parent (probabilities are at most 1) and ties go
  to the earlier candidate, so the selection holds every selected node's ancestors.
- **Verification** (``verifier.DecodingTarget.forward_tree``): the target runs the
  ``num_draft_tokens`` tokens in one forward, node i at position ``L + depth(i)`` attending to the
  sequence and to its own ancestors only (``ancestor_mask``), so its greedy choice at node i is the
  one it would make after the path to i.
- **Acceptance** (``accept_path``): from the root, follow the child whose token is the target's
  greedy choice at the current node, while there is one. The path's drafted tokens are accepted,
  the target's choice at its last node is the bonus token, and only the path's positions are kept.

With topk = 1 the tree is the chain (``DraftTree.chain``) and the round is plain chain drafting.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """The tokens of one verify round: position 0 is the pending token (the root), positions 1.. the
    drafted tokens, each after its parent (``parents[0] == -1``, ``0 <= parents[i] < i``)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        ok = len(self.tokens) == len(self.parents) and self.parents[:1] == (-1,)
        if not ok or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"not a draft tree: parents {list(self.parents)} for {len(self.tokens)} tokens "
                             "(need -1 first, then each parent before its child)")

    @classmethod
    def chain(cls, pending: int, drafts: list[int]) -> "DraftTree":
        """The chain ``pending, d1, d2, ...`` (each token the child of the one before)."""
        return cls(tokens=(pending, *drafts), parents=tuple(range(-1, len(drafts))))

    @property
    def depths(self) -> list[int]:
        """Tokens between each position and the root (the root's is 0)."""
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return depths

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    def ancestor_mask(self) -> torch.Tensor:
        """Bool ``[n, n]``: ``[i, j]`` is True when j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], 1):
            mask[i] |= mask[p]
        return mask


def select_tree(pending: int, candidates: tuple[list[int], list[int], list[float]], num_draft_tokens: int) -> DraftTree:
    """The tree of ``pending`` and the ``num_draft_tokens - 1`` best candidates.

    ``candidates = (tokens, parents, scores)``: candidate c proposes target id ``tokens[c]`` as a
    child of candidate ``parents[c]`` (-1: of the pending token), with cumulative score
    ``scores[c]``. Ties go to the earlier candidate. Raises ValueError when there are too few
    candidates, or a selected candidate's parent is not selected (a drafter whose children outscore
    their parents).
    """
    tokens, parents, scores = candidates
    wanted = num_draft_tokens - 1
    if not len(tokens) == len(parents) == len(scores) or not 0 <= wanted <= len(tokens):
        raise ValueError(f"cannot select {wanted} nodes from {len(tokens)} tokens, "
                         f"{len(parents)} parents and {len(scores)} scores")
    chosen = sorted(sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[:wanted])
    position = {c: i for i, c in enumerate(chosen, 1)}
    tree_parents = [-1]
    for c in chosen:
        if parents[c] != -1 and parents[c] not in position:
            raise ValueError(f"candidate {c} (score {scores[c]}) was selected without its parent {parents[c]} "
                             f"(score {scores[parents[c]]}): a child must not score above its parent")
        tree_parents.append(0 if parents[c] == -1 else position[parents[c]])
    return DraftTree(tokens=(pending, *(tokens[c] for c in chosen)), parents=tuple(tree_parents))


def accept_path(tree: DraftTree, greedy: list[int]) -> list[int]:
    """The tree positions the target accepts, root first: from the root, the child whose token is
    ``greedy`` at the current position (the target's choice after it), while there is one.

    ``greedy[i]`` is the target's greedy token after position i; ``greedy[path[-1]]`` is the round's
    bonus token. Of siblings with the same token the first is taken (an EAGLE draft's siblings are
    distinct top-k tokens, so there is at most one).
    """
    if len(greedy) != len(tree.tokens):
        raise ValueError(f"need the target's choice at each of the {len(tree.tokens)} tree positions, got {len(greedy)}")
    children: list[list[int]] = [[] for _ in tree.tokens]
    for i, p in enumerate(tree.parents[1:], 1):
        children[p].append(i)
    path = [0]
    while True:
        here = path[-1]
        step = next((c for c in children[here] if tree.tokens[c] == greedy[here]), None)
        if step is None:
            return path
        path.append(step)
