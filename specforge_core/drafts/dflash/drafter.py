"""The DFlash draft at decode time: a cache of context keys/values and one-forward block drafting.

    drafter = DFlashDrafter(draft, embed_weight=target.get_input_embeddings().weight,
                            lm_head_weight=target.lm_head.weight)
    decode_batch(DecodingTarget(target, draft.target_layer_ids), prompts, drafter=drafter,
                 num_steps=draft.block_size - 1, ...)

``DFlashDrafter`` implements ``decoding.speculative.Drafter`` exactly as SGLang's DFLASH worker
decodes:

- **State per sequence**: the draft's context keys/values (every layer) of the *committed*
  tokens, computed from the target's captured features (``aux``: the draft's target layers,
  concatenated in ``target_layer_ids`` order) at their positions 0..s-1, and the pending token
  ``c`` (the last emitted token, not yet run through the target). Context rows depend only on
  ``(features, position)``, so the cache is exact and never recomputed.
- ``extend(rows)``: each row ``(next_tokens, aux [m, K·H])`` brings the features of its next m
  committed positions; ``next_tokens[-1]`` becomes the pending token (the evaluator passes the
  tokens after each featured position, so its last entry is the bonus token).
- ``propose(n)``: the block ``[c, MASK × n]`` at positions ``s .. s+n`` in one forward; full
  layers attend bidirectionally to the whole block and every context row, sliding layers
  causally within the block and to context positions ``>= s + o - (W-1)``; the proposal is the
  full-vocab argmax of ``target_head(h)`` at slots 1..n (DFlash2: the selector's greedy walk,
  ``dflash2.select_tokens``, from the pending token). The block's own keys/values are
  discarded. ``n = block_size - 1`` is the trained setting (and SGLang's default); another n
  runs a block of n+1, as SGLang does when the serve block size differs.

Rows are independent: rows extended by fewer tokens get dead (masked) cache columns.
"""

import torch
import torch.nn.functional as F

from specforge_core.drafts.dflash.dflash2 import select_tokens
from specforge_core.drafts.dflash.model import DFlashDraftModel, dense_attend


class DFlashDrafter:
    """A ``DFlashDraftModel`` decoding a batch of sequences (inference only)."""

    def __init__(self, draft: DFlashDraftModel, *, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        self.draft = draft.eval()
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.embed_weight = embed_weight.detach().to(self.device)
        self.lm_head_weight = lm_head_weight.detach().to(self.device)
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, [b, nkv, L, hd]
        self.live: torch.Tensor | None = None  # [b, L] bool: column holds a context row of that sequence
        self.positions: torch.Tensor | None = None  # [b, L] the column's position
        self.lengths: torch.Tensor | None = None  # [b] committed positions (= the pending token's position)
        self.pending: torch.Tensor | None = None  # [b] the pending token

    @torch.inference_mode()
    def extend(self, rows: list[tuple[list[int], torch.Tensor]]) -> None:
        """Per batch row ``(next_tokens, aux [m, K·H])``: cache context rows for its next m
        positions; ``next_tokens[-1]`` is the new pending token (after ``reset``: creates rows)."""
        b = len(rows)
        counts = torch.tensor([a.shape[0] for _, a in rows], device=self.device)
        if any(len(tokens) != a.shape[0] for tokens, a in rows):
            raise ValueError("each row needs as many next tokens as feature rows")
        width = int(counts.max())
        aux = torch.zeros(b, width, rows[0][1].shape[-1], dtype=self.dtype, device=self.device)
        for r, (_, a) in enumerate(rows):
            aux[r, : a.shape[0]] = a.to(self.device, self.dtype)
        if self.cache is None:
            self.lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        new_live = torch.arange(width, device=self.device)[None] < counts[:, None]
        positions = self.lengths[:, None] + torch.arange(width, device=self.device)
        fresh = self.draft.context_kv(aux, positions)
        if self.cache is None:
            self.cache, self.live, self.positions = fresh, new_live, positions
        else:
            self.cache = [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(self.cache, fresh)]
            self.live = torch.cat([self.live, new_live], dim=1)
            self.positions = torch.cat([self.positions, positions], dim=1)
        self.lengths = self.lengths + counts
        self.pending = torch.tensor([tokens[-1] for tokens, _ in rows], device=self.device)

    def _masks(self, n: int) -> dict[str, torch.Tensor]:
        """Bool ``[b, n, L+n]`` per layer type for a block of n rows at positions ``lengths + o``."""
        b = self.live.shape[0]
        o = torch.arange(n, device=self.device)
        masks = {"full_attention": torch.cat([self.live[:, None].expand(b, n, -1),
                                              torch.ones(b, n, n, dtype=torch.bool, device=self.device)], dim=-1)}
        window = self.draft.sliding_window
        if window is not None:
            lower = self.lengths[:, None, None] + o[None, :, None] - (window - 1)
            ctx = self.live[:, None] & (self.positions[:, None] >= lower)
            causal = (o[None, :] <= o[:, None]).expand(b, n, n)
            masks["sliding_attention"] = torch.cat([ctx, causal], dim=-1)
        return masks

    @torch.inference_mode()
    def block_hidden(self, num_steps: int) -> torch.Tensor:
        """The draft's final-normed output ``[b, n+1, H]`` for the block ``[c, MASK × n]``."""
        if self.cache is None:
            raise RuntimeError("extend() the drafter over the prompts before drafting")
        if num_steps < 1:
            raise ValueError(f"a DFlash block proposes at least one token, got num_steps={num_steps}")
        n = num_steps + 1
        tokens = torch.full((len(self.pending), n), self.draft.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = self.pending
        positions = self.lengths[:, None] + torch.arange(n, device=self.device)
        embeds = F.embedding(tokens, self.embed_weight)
        return self.draft(embeds, positions, dense_attend(self._masks(n)), context_kv=self.cache)

    @torch.inference_mode()
    def propose(self, num_steps: int) -> list[list[int]]:
        """Per batch row, the ``num_steps`` target ids the block predicts after its pending token."""
        hidden = self.block_hidden(num_steps)[:, 1:]
        if self.draft.candidate_selector is not None:
            return select_tokens(self.draft.candidate_selector, hidden, self.lm_head_weight, self.pending).tolist()
        return (hidden.to(self.lm_head_weight.dtype) @ self.lm_head_weight.T).argmax(-1).tolist()

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Continue with only these batch rows."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache = [(k[index], v[index]) for k, v in self.cache]
        self.live, self.positions = self.live[index], self.positions[index]
        self.lengths, self.pending = self.lengths[index], self.pending[index]
