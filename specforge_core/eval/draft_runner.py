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
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class DraftRunner:
    """An ``Eagle3DraftModel`` decoding one sequence (inference only, no grad)."""

    def __init__(self, draft):
        self.draft = draft.eval()
        cfg = draft.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        empty = torch.empty(self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self.keys, self.values = empty, empty.clone()  # step-0 rows, post-RoPE keys
        self.rows = 0
        self.last_hidden: torch.Tensor | None = None  # pre-norm output of the last step-0 row

    def layer(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              past_keys: torch.Tensor, past_values: torch.Tensor):
        """The draft's decoder layer on m new rows that see all ``past`` rows and earlier new rows.

        ``emb``, ``hidden``: [m, H]; ``positions``: [m] RoPE positions; past: [nkv, P, hd].
        Returns (pre-norm output [m, H], new keys [nkv, m, hd], new values [nkv, m, hd]).
        """
        mid = self.draft.midlayer
        attn = mid.self_attn
        m = emb.shape[0]
        x = torch.cat([mid.input_layernorm(emb), mid.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(m, self.num_heads, self.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(m, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(m, self.num_kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = self.draft.rotary_emb(v, positions[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        q, k = q[0], k[0]
        keys, values = torch.cat([past_keys, k], dim=1), torch.cat([past_values, v], dim=1)
        group = self.num_heads // self.num_kv_heads
        keys_h, values_h = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q @ keys_h.transpose(1, 2)).float() * self.scale  # [nh, m, P+m]
        past = past_keys.shape[1]
        future = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1)
        scores[:, :, past:] = scores[:, :, past:].masked_fill(future, float("-inf"))
        out = (scores.softmax(-1).to(values_h.dtype) @ values_h).transpose(0, 1).reshape(m, -1)
        h = hidden + attn.o_proj(out)
        h = h + mid.mlp(mid.post_attention_layernorm(h))
        return h, k, v

    def _to_target_id(self, hidden: torch.Tensor) -> int:
        d = int(self.draft.compute_logits(hidden).argmax(-1))
        return d + int(self.draft.d2t[d])

    @torch.inference_mode()
    def extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        """Append step-0 rows for positions rows..rows+m-1: tokens t+1 and the target's aux at t."""
        m = len(next_tokens)
        ids = torch.tensor(next_tokens, dtype=torch.long, device=self.device)
        emb = self.draft.embed_tokens(ids).to(self.dtype)
        hidden = self.draft.project_hidden(aux.to(self.device, self.dtype))
        positions = torch.arange(self.rows, self.rows + m, device=self.device)
        h, k, v = self.layer(emb, hidden, positions, self.keys, self.values)
        self.keys, self.values = torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1)
        self.rows += m
        self.last_hidden = h[-1:]

    def _step(self, token: int, hidden: torch.Tensor, j: int, keys: torch.Tensor, values: torch.Tensor):
        """Draft step j of a round: previous token + previous pre-norm output, RoPE p_last + j."""
        ids = torch.tensor([token], dtype=torch.long, device=self.device)
        emb = self.draft.embed_tokens(ids).to(self.dtype)
        positions = torch.tensor([self.rows - 1 + j], device=self.device)
        hidden, k, v = self.layer(emb, hidden, positions, keys, values)
        return hidden, torch.cat([keys, k], 1), torch.cat([values, v], 1)

    def _check_started(self) -> None:
        if self.last_hidden is None:
            raise RuntimeError("extend() the draft over the prompt before drafting")

    @torch.inference_mode()
    def propose(self, num_steps: int) -> list[int]:
        """A chain of ``num_steps`` target ids following the last step-0 row's token."""
        self._check_started()
        hidden, keys, values = self.last_hidden, self.keys, self.values
        chain = [self._to_target_id(hidden)]
        for j in range(1, num_steps):
            hidden, keys, values = self._step(chain[-1], hidden, j, keys, values)
            chain.append(self._to_target_id(hidden))
        return chain

    @torch.inference_mode()
    def round_hidden_states(self, tokens: list[int]) -> list[torch.Tensor]:
        """Pre-norm outputs [1, H] of steps 0..len(tokens) of a round fed ``tokens`` as d1, d2, ...

        Step 0 is the last step-0 row. ``propose`` is this with each token its predecessor's
        argmax; given the tokens instead, the steps can be compared with the training unroll.
        """
        self._check_started()
        hidden, keys, values = self.last_hidden, self.keys, self.values
        out = [hidden]
        for j, token in enumerate(tokens, start=1):
            hidden, keys, values = self._step(token, hidden, j, keys, values)
            out.append(hidden)
        return out
