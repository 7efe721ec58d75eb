"""Per-sample causal attention over a flat token stream, as a transformers attention implementation.

    install(model)                                   # once per target (the hf backend does it)
    model.model(input_ids=ids[None], position_ids=pos[None], **varlen_kwargs(lengths, device))

The ``hf`` backend captures a packed request as one row ``[1, Σℓ]``: every sample's tokens back
to back, positions restarting at 0 for each. Attention must stay inside each sample without a
dense ``[Σℓ, Σℓ]`` mask (16k tokens would be a 256 M-entry mask per row, and a masked kernel still
computes the masked blocks). This implementation reads the samples' cumulative lengths
(``cu_seq_lens_q``, the keyword transformers already threads from the model's ``forward`` down
to every attention call) and runs:

- on CUDA in bf16/fp16: PyTorch's FlashAttention variable-length kernel
  (``aten._flash_attention_forward`` with ``cu_seqlens``; grouped-query heads natively), which
  computes only each sample's causal triangle;
- elsewhere (CPU tests, fp32): a loop of causal ``scaled_dot_product_attention`` per sample.

Without ``cu_seq_lens_q`` (an unpacked, padded capture) it is transformers' own ``sdpa`` path, mask
included, so installing it changes nothing else. The mask builder returns no mask when the caller
passes none (the packed call), so transformers never materialises the packed block mask.
"""

import torch
import torch.nn.functional as F

NAME = "specforge_varlen"
_registered = False


def varlen_kwargs(lengths: list[int], device: torch.device) -> dict:
    """The keywords a packed forward passes: cumulative lengths (int32) and the longest sample."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(lengths)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``query [1, nh, N, hd]``, ``key``/``value`` ``[1, nkv, N, hd]`` → ``([1, N, nh, hd], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one flat row, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, hd]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        longest = int(kwargs["max_length_q"])
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, 0.0, True, False, scale=scaling
        )[0]
    else:
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=qs.shape[0] != ks.shape[0]
            ).transpose(0, 1)
    return out.unsqueeze(0), None


def _mask(*args, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def install(model) -> None:
    """Register the implementation with transformers (once) and switch ``model`` to it."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)
        _registered = True
    model.set_attn_implementation(NAME)
