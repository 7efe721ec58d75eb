"""The EAGLE3 draft at decode time: a KV cache of step-0 rows and chain drafting from it.

Exactly as the draft is trained (the TTT unroll of ``objective.py``) and as SGLang's EAGLE3 worker
feeds it at decode time:

- **Step-0 rows** are kept in a KV cache. Row t takes the embedding of token t+1 and
  ``fc(aux_t)`` (the target's three captured states at position t), at RoPE position t, and
  attends causally to rows 0..t.
- **Draft steps** j = 1..k-1 of a round take the embedding of the previous draft token and the
  previous step's carried hidden (its pre-norm output, or with EAGLE-3.1's ``norm_output`` the
  normed one: ``Eagle3DraftModel.carry``; "pre-norm output" below means this), at RoPE
  position ``p_last + j`` (p_last = the last step-0 row). They attend to every step-0 row plus
  the earlier steps of the same round — the TTT pattern "step-0 keys up to t, then the same
  position's keys of steps 1..k" — and are thrown away after the round.
- A draft token is ``argmax compute_logits(h)`` (``lm_head(norm(h'))``) over the draft
  vocabulary, mapped to the target vocabulary with ``d2t`` (``target = d + d2t[d]``).
- **Tree drafting** (``propose_tree``, topk > 1, SGLang's EAGLE tree): the same steps, with the
  ``topk`` most probable tokens of a node as its children. Step 0 takes the topk tokens after the
  last step-0 row; each later step feeds the ``topk`` best nodes so far (by the product of the
  draft probabilities along their path, the frontier) as new rows at RoPE position
  ``p_last + depth``, each with its parent's pre-norm output and attending to the step-0 rows, its
  own ancestors in the round and itself — the chain's pattern along every path — and proposes
  their topk children. With topk = 1 it is the chain ``propose`` drafts.

``DraftRunner`` implements ``decoding.speculative.TreeDrafter`` for a batch of sequences.
"""

import torch

from specforge_core.errors import ConfigError


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

    def _top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most probable draft tokens after each pre-norm output ``[..., H]``: their
        probabilities (fp32 softmax over the draft vocabulary) and target ids, ``[..., k]`` each,
        most probable first; ties go to the lower draft id, so ``k = 1`` is ``propose``'s argmax."""
        logits = self.draft.compute_logits(hidden)
        d = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, d)
        return probs, d + self.draft.d2t[d]

    @torch.inference_mode()
    def propose_tree(self, num_steps: int, topk: int) -> list[tuple[list[int], list[int], list[float]]]:
        """Per batch row, the candidates of ``num_steps`` tree steps: ``(tokens, parents, scores)``.

        Candidate c is target id ``tokens[c]``, a child of candidate ``parents[c]`` (-1: of the
        pending token), scored by the product of the draft probabilities along its path. Step 0
        lists the pending token's ``topk`` children; step i >= 1 the ``topk`` children of each of
        step i-1's ``topk`` best candidates (``topk²``), so there are ``topk + (num_steps-1)·topk²``
        and a parent is listed before its children. ``decoding.tree.select_tree`` picks the tree.
        """
        self._check_started()
        if not 1 <= topk <= self.draft.draft_vocab_size or num_steps < 1:
            raise ConfigError(f"topk={topk}, num_steps={num_steps} for a draft vocabulary of "
                              f"{self.draft.draft_vocab_size}", where="topk",
                              fix="use num_steps >= 1 and topk between 1 and the draft vocabulary size")
        b, width = self.last_hidden.shape[0], self.last_hidden.shape[-1]
        probs, ids = self._top(self.last_hidden[:, 0], topk)  # [b, topk]
        tokens, parents, scores = [ids], [torch.full_like(ids, -1)], [probs]
        frontier = torch.arange(topk, device=self.device).expand(b, topk)  # candidate index of each node fed next
        front_scores, front_tokens = probs, ids
        hidden = self.last_hidden.expand(b, topk, width)  # the parent's pre-norm output for each fed node
        round_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # this round's rows, [b, nkv, R, hd]
        ancestors = torch.zeros(b, topk, 0, dtype=torch.bool, device=self.device)  # fed node x round row
        own = torch.eye(topk, dtype=torch.bool, device=self.device).expand(b, topk, topk)
        for i in range(1, num_steps):
            cache = self.cache if round_kv is None else tuple(torch.cat(p, 2) for p in zip(self.cache, round_kv))
            mask = torch.cat([self.live[:, None].expand(b, topk, -1), ancestors, own], dim=-1)
            positions = (self.lengths - 1 + i)[:, None].expand(b, topk)
            out, kv = self.draft.step(front_tokens, hidden, positions, past_key_values=cache, attention_mask=mask)
            rows_before = ancestors.shape[-1]
            round_kv = kv if round_kv is None else tuple(torch.cat(p, 2) for p in zip(round_kv, kv))
            child_p, child_ids = self._top(out, topk)  # [b, topk fed, topk children]
            expanded = (front_scores[:, :, None] * child_p).flatten(1)  # [b, topk²]
            tokens.append(child_ids.flatten(1))
            parents.append(frontier.repeat_interleave(topk, dim=1))
            scores.append(expanded)
            best = torch.sort(expanded, dim=-1, descending=True, stable=True).indices[:, :topk]
            fed = best // topk  # the parent of each new frontier node, as a row of this step
            frontier = topk + (i - 1) * topk * topk + best
            front_scores, front_tokens = expanded.gather(1, best), tokens[-1].gather(1, best)
            hidden = out.gather(1, fed[..., None].expand(-1, -1, width))
            parent_rows = torch.nn.functional.one_hot(rows_before + fed, rows_before + topk).bool()
            inherited = ancestors.gather(1, fed[..., None].expand(-1, -1, rows_before))
            ancestors = torch.cat([inherited, own.new_zeros(b, topk, topk)], dim=-1) | parent_rows
        flat = [torch.cat(part, dim=1).tolist() for part in (tokens, parents, scores)]
        return list(zip(*flat))

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
