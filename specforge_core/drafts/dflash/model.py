"""The DFlash draft model: Qwen3 layers whose keys and values also come from the target's features.

    from specforge_core.drafts.dflash import DFlashDraftModel, dflash_config_from_target
    draft = DFlashDraftModel(dflash_config_from_target(target_cfg, mask_token_id=mask))
    hidden = draft(noise_embeds, block_positions, attend, target_hidden=aux, context_positions=pos)
    logits = hidden @ target_lm_head_weight.T

Module names are the serving keys SGLang and vLLM load: ``fc``, ``hidden_norm``,
``layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``. There is no embedding and no LM
head: block tokens arrive embedded by the frozen target embedding, and the final-normed output
goes to the frozen target head (both held by the caller, like EAGLE3's teacher gets
``lm_head_weight``). The computation ("KV injection"):

    ctx  = hidden_norm(fc(cat_k h_k[t]))                 every context position t, once
    per layer:  u = input_layernorm(z)                   the block stream only, never ctx
      q = rope(q_norm(W_q u)),  k = rope(k_norm(W_k [ctx ; u])),  v = W_v [ctx ; u]
      z = z + o_proj(attend(q, k, v));  z = z + mlp(post_attention_layernorm(z))
    h = norm(z)

The norms are Qwen3's RMSNorm (:class:`RMSNorm`: the same values, one fused kernel on CUDA).
Context keys/values depend only on ``(ctx[t], t)``, so a decoder may cache them (``context_kv``).
The attention pattern is the caller's: ``attend(layer_type, q, k, v)`` with ``q [b,nh,Q,hd]``
and ``k, v [b,nkv,C+Q,hd]`` (C context rows first, then the Q block rows), GQA heads not
repeated. Training supplies the block/anchor masks (``objective``), decoding its own
(``decoding``); ``dense_attend`` turns bool masks into such a callable.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding, rotate_half

from specforge_core.drafts.dflash.dflash2 import BlockConv, CandidateSelector
from specforge_core.drafts.dflash.draft_config import (
    check_dflash_config,
    dflash2_of,
    mask_token_id_of,
    target_layer_ids_of,
)
from specforge_core.errors import ModelError

Attend = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm, ``weight * normalize(x)``, its normalisation in at least fp32 and cast back
    to ``x``'s dtype before the scale, through ``F.rms_norm``: one fused kernel each way on CUDA
    where transformers' ``Qwen3RMSNorm`` makes five passes with fp32 copies. The same values and
    gradients as ``Qwen3RMSNorm`` in fp32 and bf16 (a float64 input stays float64 here)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b,heads,n,hd]`` by ``cos/sin [b,n,hd]`` (rotate-half / neox convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def dense_attend(masks: dict[str, torch.Tensor]) -> Attend:
    """An ``attend`` from bool masks ``[b, Q, C+Q]`` per layer type (True = may attend).

    Scaled dot-product attention at scale ``hd^-0.5``; every query row must see at least one key.
    """

    def attend(layer_type, q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks[layer_type][:, None], scale=q.shape[-1] ** -0.5, enable_gqa=True
        )

    return attend


@dataclass
class Context:
    """One layer's context: the fused features ``ctx [b,C,H]`` with their RoPE ``cos, sin``
    (projected inside the layer's own forward, so FSDP2 has unsharded its weights), or cached
    keys/values ``kv`` ``[b,nkv,C,hd]`` from ``DFlashDraftModel.context_kv``."""

    ctx: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    kv: tuple[torch.Tensor, torch.Tensor] | None = None


class DFlashAttention(nn.Module):
    """Grouped-query attention over ``[context ; block]`` keys, per-head q/k RMSNorm, no biases."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, k-normed keys and values ``[b,nkv,n,hd]`` of rows ``x [b,n,H]``."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, u, cos, sin, context: Context, attend: Attend, layer_type: str):
        """``u [b,Q,H]``: the normed block stream; ``context``: see ``Context``."""
        if context.kv is None:
            context = Context(kv=self.key_value(context.ctx, context.cos, context.sin))
        q = apply_rope(self.q_norm(self._heads(self.q_proj(u), self.num_heads)), cos, sin)
        k, v = self.key_value(u, cos, sin)
        ctx_k, ctx_v = context.kv
        out = attend(layer_type, q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2))
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """One draft layer; a DFlash2 layer also convolves each sublayer's input and output within
    the block (``attention_conv``, ``mlp_conv``: ``dflash2.BlockConv``)."""

    def __init__(self, config: Qwen3Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        extra = dflash2_of(config)
        if extra is not None:
            conv = dict(block_size=int(config.block_size), kernel_size=extra["conv_kernel_size"],
                        group_size=extra["conv_group_size"])
            self.attention_conv = BlockConv(config.hidden_size, **conv)
            self.mlp_conv = BlockConv(config.hidden_size, **conv)

    def forward(self, z, cos, sin, context, attend: Attend):
        if not hasattr(self, "attention_conv"):
            z = z + self.self_attn(self.input_layernorm(z), cos, sin, context, attend, self.layer_type)
            return z + self.mlp(self.post_attention_layernorm(z))
        u, kernel = self.attention_conv.prepare(self.input_layernorm(z))
        z = z + self.attention_conv.finish(self.self_attn(u, cos, sin, context, attend, self.layer_type), kernel)
        u, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(z))
        return z + self.mlp_conv.finish(self.mlp(u), kernel)


class DFlashDraftModel(nn.Module):
    """The DFlash draft: Qwen3-style layers over the target's token embedding, conditioned on K captured target layers. ``config``: a DFlash ``Qwen3Config`` (``drafts.dflash.draft_config``).

    Attributes: ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``layer_types``,
    ``sliding_window`` (None without sliding layers). Every parameter is trainable; the rotary
    frequencies are a non-persistent fp32 buffer.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        check_dflash_config(config)
        self.config = config
        self.block_size = int(config.block_size)
        self.mask_token_id = mask_token_id_of(config)
        self.target_layer_ids = target_layer_ids_of(config)
        self.layer_types = list(config.layer_types)
        self.sliding_window = config.sliding_window if "sliding_attention" in self.layer_types else None
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, t) for t in self.layer_types)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        extra = dflash2_of(config)
        self.candidate_selector = None if extra is None else CandidateSelector(
            config.vocab_size, h, rank=extra["selector_rank"], top_k=extra["selector_top_k"],
            initializer_range=config.initializer_range,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' init: normal(0, initializer_range) linears, unit norms (no copy from the
        target's layers); DFlash2's convolutions start as the identity, its selector normal."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():
            if isinstance(module, (BlockConv, CandidateSelector)):
                module.reset_parameters()

    def _fused_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        width = len(self.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != width:
            raise ModelError(
                f"captured feature width {target_hidden.shape[-1]} != {len(self.target_layer_ids)} layers "
                f"x hidden {self.config.hidden_size}",
                where="captured batch: aux_hidden",
                fix=f"capture exactly the draft's target layers {self.target_layer_ids}, concatenated in that order",
            )
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def context_kv(
        self, target_hidden: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys and values ``[b,nkv,C,hd]`` of captured features
        ``target_hidden [b,C,K·H]`` at RoPE ``positions [b,C]``: what ``forward`` computes
        inside each layer, for a decoder to cache (exact: they depend on nothing else).

        Decode-time only: it uses every layer's weights outside that layer's forward, which
        FSDP2-sharded layers do not allow, and runs without gradients.
        """
        ctx = self._fused_context(target_hidden)
        cos, sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        attend: Attend,
        *,
        target_hidden: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The final-normed draft output ``[b,Q,H]`` of the block stream (logits: times the
        target head).

        ``noise_embeds [b,Q,H]``: target embeddings of the block tokens (``[anchor, MASK, ...]``
        per block); ``block_positions [b,Q]``: their RoPE positions. Context: either the captured
        features ``target_hidden [b,C,K·H]`` at ``context_positions [b,C]`` (training: each
        layer projects them in its own forward) or cached ``context_kv`` (decoding, from
        ``context_kv``). ``attend``: see the module docstring.
        """
        if (target_hidden is None) == (context_kv is None):
            raise ValueError("give either target_hidden (with context_positions) or context_kv")
        z = noise_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(z, block_positions)
        if context_kv is None:
            ctx = self._fused_context(target_hidden)
            ctx_cos, ctx_sin = self.rotary_emb(ctx, context_positions)
            contexts = [Context(ctx=ctx, cos=ctx_cos, sin=ctx_sin)] * len(self.layers)
        else:
            contexts = [Context(kv=kv) for kv in context_kv]
        for layer, context in zip(self.layers, contexts):
            z = layer(z, cos, sin, context, attend)
        return self.norm(z)

    def cast_params(self, dtype: torch.dtype) -> "DFlashDraftModel":
        """Cast the parameters to ``dtype``, keeping the RoPE frequencies in fp32."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        return self

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint and serving tensors (exactly the serving keys)."""
        return {k: v.detach() for k, v in self.state_dict().items()}
