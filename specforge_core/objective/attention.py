"""Attention across the unrolled training-time-test steps (reference-facts §2.3).

A query of step k at position t attends to
  - the step-0 keys at positions s ≤ t of the same sample that are real tokens (``s == t`` always,
    so no row is empty), and
  - the keys produced at steps 1..k at the same position t (including its own step),
with one softmax over all of them. We never build the dense ``[T, T·(k+1)]`` mask of the
concatenated key sequence: the step-0 block (the same pattern for every step, built once per
batch) and the k same-position scores are two blocks joined in one softmax.

Two backends, same numbers:

- ``sdpa`` (CPU and GPU): explicit scores for the step-0 block ``[B, heads, T, T]`` plus the k
  diagonal scores, one fp32 softmax. Memory grows with T² per step; the reference path.
- ``flex`` (GPU): ``torch.nn.attention.flex_attention`` (compiled) over the step-0 block with a
  block mask, returning its log-sum-exp; the diagonal scores are merged with it exactly
  (``softmax`` over the union = LSE-weighted combination). No T² tensors.

On CPU, flex runs eagerly and only without gradients (torch has no CPU flex backward); ``auto``
picks flex on CUDA and sdpa elsewhere.
"""

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from specforge_core.errors import ConfigError

BACKENDS = ("auto", "sdpa", "flex")
_compiled_flex = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` → ``flex`` on CUDA, ``sdpa`` elsewhere; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown attention backend {backend!r}",
            where="draft.attention_backend",
            fix=f"use one of {', '.join(BACKENDS)}",
        )
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


def step_zero_visibility(attention_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T, T]``: query t may see step-0 key s (causal, same sample, real token or itself).

    This is also the block-causal mask a target forward over packed rows needs.
    """
    t = attention_mask.shape[-1]
    idx = torch.arange(t, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    real = attention_mask.bool()[:, None, :] | torch.eye(t, dtype=torch.bool, device=idx.device)
    return causal & same & real


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


class TTTAttention:
    """The attention of one batch's unroll: built once (masks), called once per step.

    ``attention_mask [B,T]`` (1 = real token) and ``seq_ids [B,T]`` (sample index of each
    position in a packed row; one value per unpacked row) fix the step-0 pattern.
    """

    def __init__(self, attention_mask: torch.Tensor, seq_ids: torch.Tensor, backend: str = "auto"):
        self.backend = resolve_backend(backend, attention_mask.device)
        b, t = attention_mask.shape
        if self.backend == "sdpa":
            # [B, 1(kv head), 1(group), T, T] to broadcast over grouped-query scores.
            self.visible = step_zero_visibility(attention_mask, seq_ids)[:, None, None]
        else:
            real = attention_mask.bool()
            seq = seq_ids

            def mask_mod(bi, hi, qi, ki):
                return (ki <= qi) & (seq[bi, ki] == seq[bi, qi]) & (real[bi, ki] | (ki == qi))

            self.block_mask = create_block_mask(mask_mod, B=b, H=None, Q_LEN=t, KV_LEN=t, device=real.device)

    def __call__(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """``q [B,nh,T,hd]``; ``keys``/``values``: step 0's rows, then steps 1..k (``[B,nkv,T,hd]``).

        Returns the attention output ``[B,nh,T,hd]`` in ``q``'s dtype.
        """
        if self.backend == "sdpa":
            return self._sdpa(q, keys, values)
        return self._flex(q, keys, values)

    def _sdpa(self, q, keys, values):
        b, nh, t, hd = q.shape
        nkv = keys[0].shape[1]
        scale = hd**-0.5
        qg = q.view(b, nkv, nh // nkv, t, hd)
        scores = (qg @ keys[0][:, :, None].transpose(-1, -2)).float() * scale  # [B,nkv,g,T,T]
        scores = scores.masked_fill(~self.visible, float("-inf"))
        if len(keys) > 1:
            scores = torch.cat([scores, _diagonal_scores(qg, keys[1:], scale)], dim=-1)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = probs[..., :t] @ values[0][:, :, None]
        for j, v in enumerate(values[1:]):
            out = out + probs[..., t + j, None] * v[:, :, None]
        return out.view(b, nh, t, hd)

    def _flex(self, q, keys, values):
        b, nh, t, hd = q.shape
        nkv = keys[0].shape[1]
        scale = hd**-0.5
        if q.is_cuda and hd < 16:
            raise ConfigError(
                f"flex attention kernels need head_dim >= 16, the draft has {hd}",
                where="draft.attention_backend",
                fix="use attention_backend: sdpa for this draft",
            )
        fn = _flex() if q.is_cuda else flex_attention
        out0, aux = fn(
            q, keys[0], values[0], block_mask=self.block_mask, scale=scale, enable_gqa=nh != nkv,
            return_aux=AuxRequest(lse=True),
        )
        if len(keys) == 1:
            return out0
        g = nh // nkv
        lse0 = aux.lse.view(b, nkv, g, t).float()
        diag = _diagonal_scores(q.view(b, nkv, g, t, hd), keys[1:], scale)  # [B,nkv,g,T,k]
        # softmax over (step-0 keys ∪ diagonal keys) = LSE-weighted mix of the two parts.
        top = torch.maximum(lse0, diag.amax(dim=-1))
        w0 = torch.exp(lse0 - top)
        wd = torch.exp(diag - top[..., None])
        norm = w0 + wd.sum(dim=-1)
        out = out0.view(b, nkv, g, t, hd).float() * (w0 / norm)[..., None]
        for j, v in enumerate(values[1:]):
            out = out + (wd[..., j] / norm)[..., None] * v[:, :, None].float()
        return out.to(q.dtype).view(b, nh, t, hd)


def _diagonal_scores(qg: torch.Tensor, keys: list[torch.Tensor], scale: float) -> torch.Tensor:
    """fp32 scores of each query against the same-position key of each later step ``[..., T, k]``."""
    qf = qg.float()
    return torch.stack([(qf * k[:, :, None].float()).sum(-1) for k in keys], dim=-1) * scale
