"""The DSpark draft at decode time: DFlash's cached context and one backbone forward per block,
then the Markov bias slot by slot and a draft length scheduled from the confidence head.

    drafter = DSparkDrafter(draft, embed_weight=E, lm_head_weight=W, confidence_threshold=0.3)
    decode_batch(DecodingTarget(target, draft.target_layer_ids), prompts, drafter=drafter,
                 num_steps=drafter.max_steps, ...)

``propose(n)`` runs the trained block ``[c, MASK × (B-1)]`` (c the pending token) through the
backbone once, as ``DFlashDrafter`` does, then walks the drafting slots (all B with
``sample_from_anchor``, else slots 1..B-1) in order: slot k's token is the argmax of
``W h_k + b_k`` where the Markov bias ``b_k`` conditions on the token before it, c for the first
slot and this walk's own previous token after that (``rnn`` heads carry their state along). The
chain stops after ``n`` tokens, or (``confidence_threshold`` set and a confidence head present)
before the first slot whose running product of predicted acceptance probabilities
``Π_{i≤k} σ(c_i)`` falls below the threshold; at least one token is always proposed. The target
verifies a batch's chains in one forward of one length, so every row proposes the longest length
any row scheduled (one sequence: exactly its own). Without a threshold the length is fixed at ``n``. Greedy verification keeps the output the target's own
whatever is proposed.
"""

import torch

from specforge_core.drafts.dflash.drafter import DFlashDrafter
from specforge_core.drafts.dspark.architecture import DSparkDraftModel


class DSparkDrafter(DFlashDrafter):
    """A ``DSparkDraftModel`` decoding a batch of sequences (inference only)."""

    def __init__(self, draft: DSparkDraftModel, *, embed_weight, lm_head_weight,
                 confidence_threshold: float | None = None):
        super().__init__(draft, embed_weight=embed_weight, lm_head_weight=lm_head_weight)
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.confidence_threshold = confidence_threshold
        self.first_slot = 0 if draft.sample_from_anchor else 1

    @property
    def max_steps(self) -> int:
        """Tokens one block drafts: B with ``sample_from_anchor``, else B - 1."""
        return self.draft.block_size - self.first_slot

    @torch.inference_mode()
    def propose(self, num_steps: int) -> list[list[int]]:
        if not 1 <= num_steps <= self.max_steps:
            raise ValueError(f"a DSpark block drafts 1..{self.max_steps} tokens, asked for {num_steps}")
        draft, W = self.draft, self.lm_head_weight
        hidden = self.block_hidden(draft.block_size - 1).hidden
        prev, state = self.pending, None
        tokens, running = [], torch.ones(len(prev), device=self.device)
        stopped = torch.zeros(len(prev), dtype=torch.bool, device=self.device)
        lengths = torch.zeros(len(prev), dtype=torch.long, device=self.device)
        for k in range(self.first_slot, self.first_slot + num_steps):
            h = hidden[:, k]
            logits = (h.to(W.dtype) @ W.T).float()
            emb = draft.prev_embeddings(prev)
            if draft.markov_head is not None:
                features, state = draft.markov_head.step(emb, h, state)
                logits = logits + draft.markov_head.markov_w2(features).float()
            token = logits.argmax(-1)
            confidence = draft.confidence(h, emb)
            if self.confidence_threshold is not None and confidence is not None:
                running = running * confidence.float().sigmoid()
                if tokens:  # the first slot is always proposed
                    stopped |= running < self.confidence_threshold
            tokens.append(token)
            lengths = lengths + (~stopped).long()
            prev = token
        # one verify forward takes chains of one length: the longest any row scheduled
        return torch.stack(tokens, dim=1)[:, : int(lengths.max())].tolist()
