"""The EAGLE3 draft model: one Llama decoder layer fed by the target's captured hidden states.

    from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
    from specforge_core.drafts.eagle3.model import Eagle3DraftModel
    draft = Eagle3DraftModel(draft_config_from_target(target_cfg, draft_vocab_size=32000))
    draft.load_embedding(target.get_input_embeddings().weight)    # frozen copy
    draft.set_vocab_map(vocab.d2t, vocab.t2d)

Module and buffer names are the serving key names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``; ``fc_norm.{0,1,2}`` with ``config.fc_norm``), so a state dict without the
embedding is exactly what SGLang and vLLM load. The layer, as SGLang's ``LlamaForCausalLMEagle3`` computes it:

    h0   = fc(cat(aux_low, aux_mid, aux_high))            project_hidden
    x    = cat(input_layernorm(embed(ids)), hidden_norm(h))   embedding first, 2H wide
    h'   = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   RoPE on q, k; residual un-normed
    h'   = h' + mlp(post_attention_layernorm(h'))          carried to the next step pre-norm
    z    = lm_head(norm(h'))                               compute_logits, draft vocab only

EAGLE-3.1 (two config flags, both off by default): ``fc_norm`` normalises each captured layer on
its own before ``fc`` (``h0 = fc(cat(fc_norm_0(aux_low), fc_norm_1(aux_mid), fc_norm_2(aux_high)))``,
so no layer dominates the fused input by scale); ``norm_output`` carries the post-norm
``norm(h')`` to the next step instead of ``h'`` (``carry``), against the hidden's magnitude
drifting across speculation depths, and the logits are then ``lm_head`` of that carried hidden.

In training the embedding half of q/k/v is projected once per step for every token the unroll
reads (``project_tokens``), with ``input_layernorm``'s weight folded into the matrix; each
unrolled step adds the rows it needs to its hidden half (``Eagle3DecoderLayer``'s doc).

The training-time-test unroll (attention across unrolled steps) lives in
``specforge_core.drafts.eagle3``; ``step`` is the plain forward for decoding: new query rows at explicit
positions attending over given extra key/value rows.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specforge_core.errors import ModelError
from specforge_core.drafts.eagle3.draft_config import NUM_AUX_HIDDEN_STATES
from specforge_core.drafts.eagle3.rows import take_parts, take_rows

EMBEDDING_KEY = "embed_tokens.weight"


class Eagle3Attention(nn.Module):
    """q/k/v over the 2H-wide input, grouped-query heads, bias-free projections."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B,T,2H]`` → ``q [B,T,nh,hd]``, ``k, v [B,T,nkv,hd]`` with RoPE applied to q and k."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections ``q [B,T,nh·hd]``, ``k, v [B,T,nkv·hd]`` as rows-first heads ``[B,T,heads,hd]``
        (views), RoPE applied to q and k."""
        b, t = q.shape[:2]
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v.view(b, t, self.num_kv_heads, self.head_dim)


class QKVWeights(NamedTuple):
    """The q/k/v projections as two ``[O, H]`` matrices, ``O = (nh + 2·nkv)·hd`` (q, k, v rows in
    that order), made once per training step (:meth:`Eagle3DecoderLayer.qkv_weights`):

    - ``embedding``: their embedding half with ``input_layernorm``'s weight folded in, so
      ``input_layernorm(e) @ W_e^T == rms_normalize(e) @ embedding^T``;
    - ``hidden``: their hidden half.
    """

    embedding: torch.Tensor
    hidden: torch.Tensor


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` without its weight: ``x / rms(x)`` computed in fp32, in ``x``'s dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Eagle3DecoderLayer(nn.Module):
    """The single decoder layer, split where the attention pattern is plugged in.

    q/k/v act on ``cat(input_layernorm(embed(ids)), hidden_norm(h))``. Their embedding half
    depends on the tokens only, and the unroll's step k reads the same tokens as step 0, k rows
    further on. So the training step projects each token's embedding once
    (:meth:`project_embeddings`, with the norm's weight folded into the matrix) and every step
    adds the rows it reads to its hidden half (:meth:`project_qkv`). That is the same sum, with
    the embedding half's matmuls done once instead of once per step; and the backward no longer
    makes the embedding half's input gradient, which only ``input_layernorm``'s weight needed
    (it now gets its gradient through the folded matrix). Decoding (no ``weights``) keeps the
    serving order: the concatenated input through ``q/k/v_proj``.

    ``compiled_regions``: the two halves around the attention, each one ``torch.compile`` region
    with ``training.compile`` on CUDA (``system.compile.compile_pointwise``)."""

    compiled_regions = ("project_qkv", "complete")
    recomputed_regions = ("complete",)  # training.activation_checkpointing (system/recompute.py)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def qkv_weights(self) -> QKVWeights:
        """q/k/v's two halves as :class:`QKVWeights` (concatenated copies: call once a step)."""
        attn = self.self_attn
        h = attn.q_proj.in_features // 2
        ws = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        embedding = torch.cat([w[:, :h] for w in ws]) * self.input_layernorm.weight
        return QKVWeights(embedding, torch.cat([w[:, h:] for w in ws]))

    def project_embeddings(self, embeds: torch.Tensor, weights: QKVWeights) -> torch.Tensor:
        """The embedding half of q/k/v for ``embeds [..., H]``: ``[..., O]``."""
        return F.linear(rms_normalize(embeds, self.input_layernorm.variance_epsilon), weights.embedding)

    def project_qkv(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    weight_hidden: torch.Tensor):
        """q ``[B,T,nh,hd]``, k, v ``[B,T,nkv,hd]`` (RoPE on q and k) of the rows whose embedding
        half is ``embedded [B,T,O]`` (:meth:`project_embeddings`) and whose hidden is ``hidden``;
        ``weight_hidden``: ``QKVWeights.hidden``. Rows first, as the projection lays them out: a
        compiled region's backward receives its outputs' gradients contiguous in their shape, so
        a heads-first output would make it transpose them."""
        attn = self.self_attn
        b, t, o = embedded.shape
        normed = self.hidden_norm(hidden)
        qkv = torch.addmm(embedded.reshape(b * t, o), normed.reshape(b * t, -1), weight_hidden.t()).view(b, t, -1)
        nq, nkv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return attn.heads(*qkv.split([nq, nkv, nkv], dim=-1), cos, sin)

    def complete(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual on the un-normed ``hidden`` plus the MLP block; ``attn`` is ``[B,T,nh,hd]``."""
        h = hidden + self.self_attn.o_proj(attn.flatten(2))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, x, hidden, cos, sin, attend: Callable, queries: torch.Tensor | None = None,
                weights: QKVWeights | None = None) -> torch.Tensor:
        """The layer with the attention pattern supplied by ``attend(q, k, v) -> [B,Tq,nh,hd]``
        (``q [B,Tq,nh,hd]``, ``k, v [B,T,nkv,hd]``: rows first, see :meth:`project_qkv`).

        With ``weights`` (the training unroll), ``x`` is the rows' embedding half of q/k/v
        (:meth:`project_embeddings` with those weights); without, ``x`` is the rows' token
        embeddings and q/k/v are made from the concatenated input in the serving order
        (decoding: one call per draft token, nothing to share). ``queries``: index along T of the
        rows to compute outputs for (default all); keys and values are made for every row."""
        if weights is None:
            x = torch.cat([self.input_layernorm(x), self.hidden_norm(hidden)], dim=-1)
            q, k, v = self.self_attn.project(x, cos, sin)
        else:
            q, k, v = self.project_qkv(x, hidden, cos, sin, weights.hidden)
        if queries is not None:  # distinct rows: the backward copies into place (rows.take_rows)
            q, hidden = take_rows(q, 1, queries), take_rows(hidden, 1, queries)
        return self.complete(hidden, attend(q, k, v))


class ProjectedTokens(NamedTuple):
    """A training step's tokens, embedded and projected once (``Eagle3DraftModel.project_tokens``):
    ``rows [N, O]``, the embedding half of q/k/v of each token, and the step's ``weights``."""

    rows: torch.Tensor
    weights: QKVWeights

    def for_steps(self, rows: list, slots: list, *, compile: bool = True) -> list["ProjectedTokens"]:
        """Each unrolled step's tokens, ``rows[j]`` (indices without repeats, with their slot
        maps ``slots[j]``), taken at once: ``rows.take_parts`` gives the tokens their gradient in
        one pass for all steps, instead of a scatter into zeros per step and an add per step
        (``compile``: ``training.compile``, for that pass)."""
        return [ProjectedTokens(x, self.weights) for x in take_parts(self.rows, 0, rows, slots, compile=compile)]


class Eagle3DraftModel(nn.Module):
    """The EAGLE3 draft: one decoder layer over three captured target layers. ``config``: a draft ``LlamaConfig`` (see draft_config).

    Trainable: ``fc``, ``fc_norm`` (with ``config.fc_norm``), ``midlayer``, ``norm``, ``lm_head``. Frozen and never
    saved: ``embed_tokens`` (a copy of the target's). Persistent buffers: ``d2t`` (int64 ``[Vd]``,
    draft id i ↔ target id ``i + d2t[i]``) and ``t2d`` (bool ``[V]``). Until ``set_vocab_map`` is
    called the map is the identity on the first Vd target ids.
    """

    def __init__(self, config: LlamaConfig, *, init_embedding: bool = True):
        super().__init__()
        _check_config(config)
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or hidden)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or vocab)
        # init_embedding=False: the caller copies the target's embedding in next (load_embedding), so
        # its [V, H] random draw is skipped (≈ 10 s of CPU for a 152k × 4096 vocabulary): zeros until then.
        self.embed_tokens = (nn.Embedding(vocab, hidden) if init_embedding
                             else nn.Embedding(vocab, hidden, _weight=torch.zeros(vocab, hidden)))
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(NUM_AUX_HIDDEN_STATES * self.target_hidden_size, hidden, bias=False)
        self.fc_norm = (
            nn.ModuleList(
                LlamaRMSNorm(self.target_hidden_size, eps=config.rms_norm_eps) for _ in range(NUM_AUX_HIDDEN_STATES)
            )
            if getattr(config, "fc_norm", False)
            else None
        )
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)
        # Set when the map came with a warm-start directory: a different map is then refused.
        self.vocab_map_origin: str | None = None
        self.reset_parameters(embedding=init_embedding)

    def reset_parameters(self, *, embedding: bool = True) -> None:
        """Initialise like transformers' Llama: normal(0, initializer_range) linears, unit norms;
        ``embedding=False`` leaves the embedding as it is."""
        std = self.config.initializer_range
        for module in self.modules():
            if module is self.embed_tokens and not embedding:
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    # --- the pieces every caller composes -------------------------------------------------
    def project_hidden(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., 3·Ht]`` captured states (low, mid, high) → step-0 hidden ``[..., H]``."""
        if aux_hidden.shape[-1] != NUM_AUX_HIDDEN_STATES * self.target_hidden_size:
            raise ModelError(
                f"aux hidden width {aux_hidden.shape[-1]} != 3 x target_hidden_size {self.target_hidden_size}",
                where="captured batch: aux_hidden",
                fix="capture exactly 3 layers of the target this draft config was made for",
            )
        aux = aux_hidden.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.split(self.target_hidden_size, dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def carry(self, layer_out: torch.Tensor) -> torch.Tensor:
        """The hidden a step carries to the next one (and scores): the layer's output, or with
        ``norm_output`` (EAGLE-3.1) its ``norm``. Every draft step, trained or decoded, ends here."""
        return self.norm(layer_out) if self.norm_output else layer_out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits ``[..., Vd]`` of a carried hidden (:meth:`carry`): ``lm_head(norm(hidden))``,
        or ``lm_head(hidden)`` with ``norm_output``, whose carried hidden is normed already. Both
        are ``lm_head(norm(h'))`` of the layer's output ``h'``."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def project_tokens(self, token_ids: torch.Tensor) -> "ProjectedTokens":
        """Embed ``token_ids [N]`` and project their embedding half of q/k/v once
        (:class:`ProjectedTokens`): what a training step's unrolled steps read their rows from
        (``ProjectedTokens.for_steps``, then :meth:`next_hidden`)."""
        weights = self.midlayer.qkv_weights()
        embeds = self.embed_tokens(token_ids).to(weights.hidden.dtype)
        return ProjectedTokens(self.midlayer.project_embeddings(embeds, weights), weights)

    def forward(self, tokens: "torch.Tensor | ProjectedTokens", hidden: torch.Tensor, position_ids: torch.Tensor,
                attend: Callable, queries: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for every row: ``(new carried hidden [B,T,H], logits [B,T,Vd])``;
        the arguments are :meth:`next_hidden`'s."""
        hidden = self.next_hidden(tokens, hidden, position_ids, attend, queries)
        with record_function("eagle3.lm_head"):
            return hidden, self.compute_logits(hidden)

    def next_hidden(self, tokens: "torch.Tensor | ProjectedTokens", hidden: torch.Tensor, position_ids: torch.Tensor,
                    attend: Callable, queries: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step for every row without its logits: the new carried hidden ``[B,T,H]``
        (:meth:`carry`; the training unroll scores the rows of all its steps in one :meth:`compute_logits`).

        ``tokens``: the token following each row's hidden state, as ids ``[B,T]`` (embedded here,
        q/k/v made from the concatenated input in the serving order), or as
        :class:`ProjectedTokens` holding exactly the rows' own, in order (B = 1:
        ``ProjectedTokens.for_steps``). ``hidden [B,T,H]``: each row's hidden state,
        ``project_hidden(aux_hidden)`` at the first step, else the carried one. ``position_ids
        [B,T]``: the rows' RoPE positions; ``attend(q, k, v)``: the attention over this step's
        q/k/v (``q [B,T,nh,hd]``, ``k, v [B,T,nkv,hd]``, rotated) and whatever keys it keeps.
        ``queries`` (a long index along T, without repeats) restricts the outputs to those rows:
        keys and values are still made for every row, ``q`` and the result have
        ``Tq = len(queries)`` rows.
        """
        if isinstance(tokens, ProjectedTokens):
            weights, x = tokens.weights, tokens.rows[None]
        else:
            weights, x = None, self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        with record_function("eagle3.layer"):
            return self.carry(self.midlayer(x, hidden, cos, sin, attend, queries, weights))

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One midlayer forward for ``Tq`` new rows (the helper for decoding and tests).

        ``input_ids [B,Tq]``: the token following each row's hidden state; ``hidden [B,Tq,H]``:
        ``project_hidden(aux)`` or a carried draft hidden (:meth:`carry`); ``position_ids [B,Tq]``: RoPE
        positions of the rows. ``past_key_values``: extra rows ``(k, v)`` of shape ``[B,nkv,Tp,hd]``
        already rotated (what earlier calls returned). ``attention_mask``: bool ``[B,Tq,Tp+Tq]``,
        True = may attend; default: every past row plus causal over the new rows.
        Returns the new carried hidden ``[B,Tq,H]`` (logits: ``compute_logits``) and the new
        rows' ``(k, v)`` ``[B,nkv,Tq,hd]`` for the caller's cache.
        """
        new_rows = []

        def attend(q, k, v):  # the layer's rows-first q/k/v, heads first for sdpa and the cache
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            new_rows.append((k, v))
            keys, values = k, v
            if past_key_values is not None:
                keys = torch.cat([past_key_values[0], k], dim=2)
                values = torch.cat([past_key_values[1], v], dim=2)
            b, tq, tk = q.shape[0], q.shape[2], keys.shape[2]
            mask = attention_mask
            if mask is None:
                new = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
                mask = torch.cat([new.new_ones(tq, tk - tq), new], dim=1).expand(b, tq, tk)
            groups = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(
                q,
                keys.repeat_interleave(groups, dim=1),
                values.repeat_interleave(groups, dim=1),
                attn_mask=mask[:, None],
                scale=self.midlayer.self_attn.scaling,
            ).transpose(1, 2)

        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.carry(self.midlayer(embeds, hidden, cos, sin, attend)), new_rows[0]

    # --- vocabulary map and embedding ------------------------------------------------------
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary map after checking ``nonzero(t2d) == d2t + arange(Vd)``.

        Raises ModelError on wrong shapes or an inconsistent map, and when this draft was warm
        started from a directory (``vocab_map_origin``) whose map differs: that map is kept, never
        silently replaced.
        """
        d2t = torch.as_tensor(d2t).to(device="cpu", dtype=torch.long).flatten()
        t2d = torch.as_tensor(t2d).to(device="cpu", dtype=torch.bool).flatten()
        where = "vocab map (d2t/t2d)"
        if d2t.numel() != self.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ModelError(
                f"vocab map sizes d2t={d2t.numel()}, t2d={t2d.numel()} do not match the draft "
                f"(Vd={self.draft_vocab_size}, V={self.config.vocab_size})",
                where=where,
                fix="build the vocab map for this target vocab and draft.draft_vocab_size",
            )
        used = torch.nonzero(t2d).flatten()
        if used.numel() != d2t.numel() or not torch.equal(used, d2t + torch.arange(d2t.numel())):
            raise ModelError(
                "inconsistent vocab map: target ids of t2d must equal d2t + arange(Vd) in ascending order",
                where=where,
                fix="rebuild the vocab map (specforge_core.data.vocab)",
            )
        if self.vocab_map_origin is not None and not (
            torch.equal(d2t, self.d2t.cpu()) and torch.equal(t2d, self.t2d.cpu())
        ):
            raise ModelError(
                f"this draft was warm-started from {self.vocab_map_origin}, "
                "whose vocab map differs from the one given",
                where=where,
                fix="drop draft.vocab_map_path (the warm-start map is used), "
                "or train from scratch without draft.init_from",
            )
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def load_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding ``[V, H]`` into ``embed_tokens`` (stays frozen)."""
        expected = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != expected:
            raise ModelError(
                f"target embedding shape {tuple(weight.shape)} != draft embedding {expected}",
                where="target model.embed_tokens.weight",
                fix="generate the draft config from this target (vocab_size and hidden_size must match)",
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def load_lm_head_from_target(self, weight: torch.Tensor) -> None:
        """Start ``lm_head`` from the target's output rows ``[V, Ht]`` of the draft vocabulary
        (target id ``i + d2t[i]`` for draft id i): the draft then begins by scoring its tokens the
        way the target does, and trains from there. Call after ``set_vocab_map``."""
        if tuple(weight.shape) != (self.config.vocab_size, self.lm_head.in_features):
            raise ModelError(
                f"target lm_head shape {tuple(weight.shape)} != [vocab_size {self.config.vocab_size}, "
                f"hidden {self.lm_head.in_features}]",
                where="draft.lm_head_init=target",
                fix="the draft's hidden size must equal the target's to start from its lm_head; "
                "use draft.lm_head_init=random",
            )
        rows = self.d2t.cpu() + torch.arange(self.draft_vocab_size)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.detach().cpu()[rows].to(self.lm_head.weight.dtype))

    def cast_params(self, dtype: torch.dtype) -> "Eagle3DraftModel":
        """Cast the parameters to ``dtype``. Unlike ``.to(dtype)`` this keeps the RoPE frequency
        buffers in fp32, as transformers computes them, so cos/sin do not lose precision."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        return self

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict without the frozen embedding: the checkpoint and serving tensors."""
        return {k: v.detach() for k, v in self.state_dict().items() if k != EMBEDDING_KEY}


def read_target_embedding(target_dir: str | Path, key: str = "model.embed_tokens.weight") -> torch.Tensor:
    """Read the input embedding ``[V, H]`` from a Hugging Face safetensors checkpoint directory."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(key)
        files = [target_dir / shard] if shard else []
    else:
        files = sorted(target_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise ModelError(
        f"no tensor {key!r} in the safetensors files of the target",
        where=str(target_dir),
        fix="point model.target at a Hugging Face directory with safetensors weights",
    )


def _check_config(config: LlamaConfig) -> None:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    vd = getattr(config, "draft_vocab_size", None) or config.vocab_size
    problems = []
    if heads % kv:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if not 0 < vd <= config.vocab_size:
        problems.append(f"draft_vocab_size {vd} is not in [1, vocab_size {config.vocab_size}]")
    if config.num_hidden_layers != 1:
        problems.append(f"num_hidden_layers is {config.num_hidden_layers}, an EAGLE3 draft has 1")
    if problems:
        raise ModelError("; ".join(problems), where="draft config", fix="fix the draft config fields named")
