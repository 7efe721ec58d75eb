"""Per-sample causal attention over a flat token stream, as a transformers attention implementation.

    install(model)                                   # once per target (the hf backend does it)
    with packed_call(lengths, device) as kwargs:
        model.model(input_ids=ids[None], position_ids=pos[None], **kwargs)

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

Both sit behind one custom op, :func:`varlen_attention`, which a compiled decoder layer
(``training.compile`` on CUDA) traces as a single call.

Without ``cu_seq_lens_q`` (an unpacked, padded capture) it is transformers' own ``sdpa`` path, mask
included, so installing it changes nothing else. Inside :func:`packed_call` the mask builder
builds no mask at all, and the call passes an all-true padding mask: without one, transformers
would look for packed samples in the positions (a device read that makes the host wait for the
device at every capture) and build their block mask, which the varlen kernel does not need.
"""

import contextvars
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specforge_core.capture.base import to_device

NAME = "specforge_varlen"
_registered = False
_in_packed_call = contextvars.ContextVar("specforge_varlen_packed_call", default=False)


@contextmanager
def packed_call(lengths: list[int], device: torch.device):
    """The keywords of one packed forward of samples of ``lengths`` (cumulative lengths, int32;
    the longest sample; an all-true padding mask made on the device), and no mask built while
    the block runs."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int32), 0)
    cu = to_device(cu, device)
    longest = max(lengths)
    no_padding = torch.ones(1, sum(lengths), dtype=torch.bool, device=device)
    token = _in_packed_call.set(True)
    try:
        yield dict(attention_mask=no_padding, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    finally:
        _in_packed_call.reset(token)


@torch.library.custom_op("specforge::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                     scale: float) -> torch.Tensor:
    """Per-sample causal attention of ``q [N, nh, hd]``, ``k``/``v`` ``[N, nkv, hd]`` over the samples
    that ``cu`` (cumulative lengths, int32) cuts the N tokens into → ``[N, nh, hd]``.

    A custom op, so that a compiled decoder layer (``system.compile.compile_target``) traces it
    as one opaque call: the element-wise work on both sides of it (RoPE and the ``[N, heads, hd]``
    layout before, the residual and norm after) fuses around it, and the per-sample loop of the
    CPU path never reaches the tracer."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, 0.0, True, False, scale=scale
        )[0]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0]
        ).transpose(0, 1)
    return out


@varlen_attention.register_fake
def _(q, k, v, cu, longest, scale):
    return q.new_empty(q.shape)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``query [1, nh, N, hd]``, ``key``/``value`` ``[1, nkv, N, hd]`` → ``([1, N, nh, hd], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one flat row, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, hd]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return varlen_attention(q, k, v, cu, int(kwargs["max_length_q"]), float(scale)).unsqueeze(0), None


def _mask(*args, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or _in_packed_call.get():
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
