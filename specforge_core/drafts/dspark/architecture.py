"""The DSpark draft model: the DFlash backbone plus a low-rank Markov logit bias and a confidence head.

    from specforge_core.drafts.dspark.architecture import DSparkDraftModel
    draft = DSparkDraftModel(dspark_config_from_target(target_cfg, mask_token_id=mask))
    out = draft(noise_embeds, block_positions, attend, prev_token_ids=prev, target_hidden=aux,
                context_positions=pos)
    logits = out.hidden @ target_lm_head_weight.T + out.markov_bias       # slot by slot
    accept_probability = out.confidence_logits.sigmoid()

Per slot k of a block, with ``h_k`` the backbone's final-normed output and ``prev_k`` the token
before the one slot k predicts (``sample_from_anchor``: ``x[a+k]``; else ``x[a+k-1]``, the anchor
for k = 0), ``e_k = W1[prev_k]`` (rank r):

- Markov bias ``b_k = W2 f_k`` over the full target vocabulary, where ``f_k`` is ``e_k``
  (``vanilla``), ``σ(G [h_k ; e_k] + g) ⊙ e_k`` (``gated``), or the output ``tanh(o_k)`` of a
  gated recurrence over the block's slots (``rnn``: ``[z_k; c_k; o_k] = J [s_{k-1} ; e_k ; h_k] + j``,
  ``s_k = σ(z_k) ⊙ s_{k-1} + (1 - σ(z_k)) ⊙ tanh(c_k)``, ``s_{-1} = 0``);
- confidence logit ``c_k = w · [h_k ; e_k] + w0`` (``[h_k]`` without ``confidence_head_with_markov``).

Module names are speculators' (``markov_head.markov_w1`` / ``markov_w2`` / ``gate_proj`` /
``joint_proj``, ``confidence_head.proj``), beside DFlash's serving keys. The heads run inside
``forward`` (FSDP2 unshards their weights there); ``MarkovHead.step`` is the one-slot form a
decoder calls with its own drafted tokens.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3Config

from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.drafts.dspark.settings import check_dspark_config, dspark_fields


class MarkovHead(nn.Module):
    """The low-rank logit bias of a slot given the token before it (module docstring)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def reset_parameters(self) -> None:
        """speculators' initialisation: ``W1 ~ N(0, 0.01²)``, torch's defaults for the linears."""
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        for module in self.children():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """``(f_k, s_k)`` of one slot: ``prev_emb [..., r]``, ``hidden [..., H]``, ``state`` the
        recurrent state before it (``rnn`` only; None = zeros)."""
        if self.head_type == "vanilla":
            return prev_emb, state
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb, state
        if state is None:
            state = prev_emb.new_zeros(prev_emb.shape)
        gate, candidate, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(out), state

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Bias ``[n, B, V]`` of blocks given ``prev_emb [n, B, r]`` and ``hidden [n, B, H]``."""
        if self.head_type != "rnn":
            return self.markov_w2(self.step(prev_emb, hidden, None)[0])
        state, features = None, []
        for k in range(prev_emb.shape[1]):
            f, state = self.step(prev_emb[:, k], hidden[:, k], state)
            features.append(f)
        return self.markov_w2(torch.stack(features, dim=1))


class ConfidenceHead(nn.Module):
    """A slot's acceptance-probability logit: one linear map to a scalar."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class DSparkOutput:
    hidden: torch.Tensor  # [b, Q, H] final-normed backbone output (logits: times the target head)
    markov_bias: torch.Tensor | None  # [b, Q, V] added to those logits; None without a Markov head
    confidence_logits: torch.Tensor | None  # [b, Q]; None without a confidence head


class DSparkDraftModel(DFlashDraftModel):
    """A DFlash draft (``drafts.dflash.model``) with the DSpark heads; ``config`` a DSpark
    ``Qwen3Config`` (``drafts.dspark.settings``). Attributes beyond DFlash's: ``markov_head``
    and ``confidence_head`` (each None when disabled), ``sample_from_anchor``."""

    def __init__(self, config: Qwen3Config):
        check_dspark_config(config)
        fields = dspark_fields(config)
        super().__init__(config)
        self.sample_from_anchor = fields["sample_from_anchor"]
        self.with_markov = fields["confidence_head_with_markov"]
        rank, h = fields["markov_rank"], config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, rank, h, fields["markov_head_type"]) if rank else None
        self.confidence_head = None
        if fields["enable_confidence_head"]:
            self.confidence_head = ConfidenceHead(h + (rank if self.with_markov else 0))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DFlash's initialisation for the backbone, speculators' for the heads."""
        super().reset_parameters()
        if getattr(self, "markov_head", None) is not None:
            self.markov_head.reset_parameters()
        if getattr(self, "confidence_head", None) is not None:
            self.confidence_head.proj.reset_parameters()

    def prev_embeddings(self, prev_token_ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head.markov_w1(prev_token_ids.long())

    def confidence(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        """Confidence logits of slots with backbone output ``hidden`` and ``prev_emb`` (or None)."""
        if self.confidence_head is None:
            return None
        if self.with_markov:
            hidden = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.confidence_head(hidden)

    def forward(self, noise_embeds, block_positions, attend, *, prev_token_ids: torch.Tensor | None = None,
                target_hidden=None, context_positions=None, context_kv=None) -> DSparkOutput:
        """The DFlash forward (same arguments) and the heads on whole blocks of ``block_size``
        slots; ``prev_token_ids [b, Q]``: each slot's previous token (module docstring). Without
        ``prev_token_ids`` only the backbone runs (a decoder, which learns each slot's previous
        token one slot at a time, runs the heads itself)."""
        hidden = super().forward(noise_embeds, block_positions, attend, target_hidden=target_hidden,
                                 context_positions=context_positions, context_kv=context_kv)
        if prev_token_ids is None:
            return DSparkOutput(hidden, None, None)
        b, q, width = hidden.shape
        prev_emb = self.prev_embeddings(prev_token_ids)
        bias = None
        if self.markov_head is not None:
            blocks = hidden.reshape(-1, self.block_size, width)
            bias = self.markov_head.block_bias(prev_emb.reshape(*blocks.shape[:2], -1), blocks).reshape(b, q, -1)
        return DSparkOutput(hidden, bias, self.confidence(hidden, prev_emb))
