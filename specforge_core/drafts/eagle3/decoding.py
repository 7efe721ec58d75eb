"""The EAGLE3 draft at decode time: a KV cache of step-0 rows and chain drafting from it.

Exactly as the draft is trained (the TTT unroll of ``objective.py``) and as SGLang's EAGLE3 worker
feeds it at decode time:

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

``DraftRunner`` implements ``decoding.speculative.Drafter`` for a batch of sequences.
"""

import torch


class DraftRunner:
    """An ``Eagle3DraftModel`` decoding a batch of sequences (inference only, no grad).

    Every forward is the draft's own ``step`` (one midlayer pass for new rows at explicit RoPE
    positions over extra cached key/value rows, under an explicit attention mask), so decoding
    runs the very layer that was trained. Batch rows are independent: each has its own step-0
    rows; rows extended by fewer tokens than others get dead (masked) columns, never seen again.
    """

    def __init__(self, draft):
        self.draft = draft.eval()
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # step-0 rows, [B, nkv, L, hd]
        self.live: torch.Tensor | None = None  # [B, L] bool: column holds a step-0 row of that sequence
        self.lengths: torch.Tensor | None = None  # [B]: step-0 rows per sequence (= next RoPE position)
        self.last_hidden: torch.Tensor | None = None  # [B, 1, H]: pre-norm output of the last step-0 row

    def _to_target_ids(self, hidden: torch.Tensor) -> list[int]:
        d = self.draft.compute_logits(hidden[:, -1]).argmax(-1)
        return (d + self.draft.d2t[d]).tolist()

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache, mask):
        """``draft.step`` on new rows; their pre-norm outputs and the cache grown by them."""
        out, (k, v) = self.draft.step(ids, hidden, positions, past_key_values=cache, attention_mask=mask)
        grown = (k, v) if cache is None else (torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2))
        return out, grown

    @torch.inference_mode()
    def extend(self, rows: list[tuple[list[int], torch.Tensor]]) -> None:
        """Per batch row ``(next_tokens, aux [m, 3·Ht])``: step-0 rows for its next m positions
        (token t+1 and the target's aux at t). After ``reset`` this creates the batch rows."""
        b, width = len(rows), max(len(tokens) for tokens, _ in rows)
        ids = torch.zeros(b, width, dtype=torch.long, device=self.device)
        aux = torch.zeros(b, width, rows[0][1].shape[-1], dtype=self.dtype, device=self.device)
        for r, (tokens, a) in enumerate(rows):
            ids[r, : len(tokens)] = torch.tensor(tokens, device=self.device)
            aux[r, : len(tokens)] = a.to(self.device, self.dtype)
        counts = torch.tensor([len(tokens) for tokens, _ in rows], device=self.device)
        new_live = torch.arange(width, device=self.device)[None] < counts[:, None]
        if self.cache is None:
            self.live = new_live[:, :0]
            self.lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([self.live[:, None].expand(b, width, -1), causal[None] & new_live[:, None]], dim=-1)
        positions = self.lengths[:, None] + torch.arange(width, device=self.device)
        out, self.cache = self._forward(ids, self.draft.project_hidden(aux), positions, self.cache, mask)
        self.live = torch.cat([self.live, new_live], dim=1)
        self.lengths = self.lengths + counts
        self.last_hidden = out[torch.arange(b, device=self.device), counts - 1][:, None]

    def _step(self, tokens: list[int], hidden: torch.Tensor, j: int, cache):
        """Draft step j of a round for every row: previous token + previous pre-norm output at RoPE
        position p_last + j; it sees the row's step-0 rows and the round's earlier steps."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        round_cols = torch.ones(len(tokens), j, dtype=torch.bool, device=self.device)
        mask = torch.cat([self.live, round_cols], dim=1)[:, None]
        return self._forward(ids, hidden, (self.lengths - 1 + j)[:, None], cache, mask)

    def _check_started(self) -> None:
        if self.last_hidden is None:
            raise RuntimeError("extend() the draft over the prompts before drafting")

    @torch.inference_mode()
    def propose(self, num_steps: int) -> list[list[int]]:
        """Per batch row, a chain of ``num_steps`` target ids following its last step-0 row's token."""
        self._check_started()
        hidden, cache = self.last_hidden, self.cache
        chains = [[t] for t in self._to_target_ids(hidden)]
        for j in range(1, num_steps):
            hidden, cache = self._step([c[-1] for c in chains], hidden, j, cache)
            for c, t in zip(chains, self._to_target_ids(hidden)):
                c.append(t)
        return chains

    @torch.inference_mode()
    def round_hidden_states(self, tokens: list[list[int]]) -> list[torch.Tensor]:
        """Pre-norm outputs ``[B, H]`` of steps 0..j of a round whose rows are fed ``tokens[r]``
        (j tokens each) as d1, d2, ...

        Step 0 is the last step-0 row. ``propose`` is this with each token its predecessor's
        argmax; given the tokens instead, the steps can be compared with the training unroll.
        """
        self._check_started()
        hidden, cache = self.last_hidden, self.cache
        out = [hidden[:, 0]]
        for j in range(1, len(tokens[0]) + 1):
            hidden, cache = self._step([t[j - 1] for t in tokens], hidden, j, cache)
            out.append(hidden[:, 0])
        return out

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Continue with only these batch rows."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache = (self.cache[0][index], self.cache[1][index])
        self.live, self.lengths, self.last_hidden = self.live[index], self.lengths[index], self.last_hidden[index]
