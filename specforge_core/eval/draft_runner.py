"""The EAGLE3 draft at decode time: a KV cache of step-0 rows and chain drafting from it.

Exactly as the draft is trained (specforge-facts §2.3) and served (eagle3-decoding.md):

- **Step-0 rows** are kept in a KV cache. Row t takes the embedding of token t+1 and
  ``fc(aux_t)`` (the target's three captured states at position t), at RoPE position t, and
  attends causally to rows 0..t.
- **Draft steps** j = 1..k-1 of a round take the embedding of the previous draft token and the
  previous step's pre-norm output, at RoPE position ``p_last + j`` (p_last = the last step-0
  row). They attend to every step-0 row plus the earlier steps of the same round — the TTT
  pattern "step-0 keys up to t, then the same position's keys of steps 1..k" — and are thrown
  away after the round.
- A draft token is ``argmax lm_head(norm(h))`` over the draft vocabulary, mapped to the target
  vocabulary with ``d2t`` (``target = d + d2t[d]``).

``DraftRunner`` implements ``eval.speculative.Drafter`` for one sequence.
"""

import torch


class DraftRunner:
    """An ``Eagle3DraftModel`` decoding one sequence (inference only, no grad).

    Every forward is the draft's own ``step`` (one midlayer pass for new rows at explicit RoPE
    positions over extra cached key/value rows; default mask: all of them plus causal over the
    new rows), so decoding runs the very layer that was trained.
    """

    def __init__(self, draft):
        self.draft = draft.eval()
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # step-0 rows, [1, nkv, rows, hd]
        self.rows = 0
        self.last_hidden: torch.Tensor | None = None  # pre-norm output of the last step-0 row, [1, 1, H]

    def _to_target_id(self, hidden: torch.Tensor) -> int:
        d = int(self.draft.compute_logits(hidden).reshape(-1).argmax())
        return d + int(self.draft.d2t[d])

    def _forward(self, tokens: list[int], hidden: torch.Tensor, first_position: int, cache):
        """``draft.step`` on new rows; returns their pre-norm outputs and the cache grown by them."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(first_position, first_position + len(tokens), device=self.device)[None]
        out, (k, v) = self.draft.step(ids, hidden, positions, past_key_values=cache)
        grown = (k, v) if cache is None else (torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2))
        return out, grown

    @torch.inference_mode()
    def extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        """Append step-0 rows for positions rows..rows+m-1: tokens t+1 and the target's aux at t."""
        hidden = self.draft.project_hidden(aux[None].to(self.device, self.dtype))
        out, self.cache = self._forward(next_tokens, hidden, self.rows, self.cache)
        self.rows += len(next_tokens)
        self.last_hidden = out[:, -1:]

    def _step(self, token: int, hidden: torch.Tensor, j: int, cache):
        """Draft step j of a round: previous token + previous pre-norm output, RoPE p_last + j;
        it sees every step-0 row and the round's earlier steps (``cache``)."""
        return self._forward([token], hidden, self.rows - 1 + j, cache)

    def _check_started(self) -> None:
        if self.last_hidden is None:
            raise RuntimeError("extend() the draft over the prompt before drafting")

    @torch.inference_mode()
    def propose(self, num_steps: int) -> list[int]:
        """A chain of ``num_steps`` target ids following the last step-0 row's token."""
        self._check_started()
        hidden, cache = self.last_hidden, self.cache
        chain = [self._to_target_id(hidden)]
        for j in range(1, num_steps):
            hidden, cache = self._step(chain[-1], hidden, j, cache)
            chain.append(self._to_target_id(hidden))
        return chain

    @torch.inference_mode()
    def round_hidden_states(self, tokens: list[int]) -> list[torch.Tensor]:
        """Pre-norm outputs ``[H]`` of steps 0..len(tokens) of a round fed ``tokens`` as d1, d2, ...

        Step 0 is the last step-0 row. ``propose`` is this with each token its predecessor's
        argmax; given the tokens instead, the steps can be compared with the training unroll.
        """
        self._check_started()
        hidden, cache = self.last_hidden, self.cache
        out = [hidden[0, 0]]
        for j, token in enumerate(tokens, start=1):
            hidden, cache = self._step(token, hidden, j, cache)
            out.append(hidden[0, 0])
        return out
