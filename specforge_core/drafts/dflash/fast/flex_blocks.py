"""The anchor blocks' attention on flex attention kernels (CUDA; forward only on the CPU).

    blocks, aux_hidden = pad_for_flex(blocks, aux_hidden, mask_token_id)
    attend = flex_attend(blocks, blocks.visible, {layer_type: window, ...})   # draft(..., attend, ...)

The plain attention is sdpa under the dense bool masks ``blocks.dense_masks`` builds from the
predicate ``blocks.visible`` (``model.dense_attend``): ``[b, Q, T+Q]`` per layer type. Here
flex builds a block mask from the same predicate (as its ``mask_mod``), so no dense mask
exists and fully masked tiles are skipped; both give the same output
(tests/drafts/dflash/fast/test_flex_blocks.py). torch has no CPU flex backward.
"""

import dataclasses

import torch

from specforge_core.drafts.dflash.blocks import StreamIndex
from specforge_core.errors import ConfigError
from specforge_core.system.compile import build_block_mask

_compiled_flex = None


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def pad_for_flex(blocks, aux_hidden: torch.Tensor, mask_token_id: int, multiple: int = 128):
    """``(blocks, aux_hidden)`` (``blocks.DFlashBlocks``) with the context and the block stream
    padded to multiples of ``multiple`` (flex's tile): padding context columns belong to no
    sample and padding block slots are not kept, so nothing changes but the shapes (regular
    tiles, few recompiles; and torch 2.11's inductor found no flex kernel for some sub-tile
    lengths)."""
    nb, size, t = blocks.keep.shape[1], blocks.block_size, blocks.ctx_len
    extra_t = -t % multiple
    extra_nb = (-(nb * size) % multiple) // size if multiple % size == 0 else 0

    def pad(x, value, n, dim):
        shape = list(x.shape)
        shape[dim] = n
        return torch.cat([x, x.new_full(shape, value)], dim=dim)

    blocks = dataclasses.replace(
        blocks,
        ctx_sample=pad(blocks.ctx_sample, -1, extra_t, 1),
        ctx_pos=pad(blocks.ctx_pos, 0, extra_t, 1),
        sample=pad(blocks.sample, -2, extra_nb, 1),
        anchor_col=pad(blocks.anchor_col, 0, extra_nb, 1),
        anchor_pos=pad(blocks.anchor_pos, 0, extra_nb, 1),
        keep=pad(blocks.keep, False, extra_nb, 1),
        tokens=pad(blocks.tokens, mask_token_id, extra_nb, 1),
        labels=pad(blocks.labels, 0, extra_nb, 1),
        valid=pad(blocks.valid, False, extra_nb, 1),
        host_valid=None if blocks.host_valid is None else pad(blocks.host_valid, False, extra_nb, 1),
    )
    return blocks, pad(aux_hidden, 0, extra_t, 1)


def flex_attend(blocks, predicate, windows: dict):
    """An ``attend`` running flex attention over ``blocks``' queries and keys (its context, then
    its block stream) with a block mask per layer type: ``predicate(blocks, b, q, kv, window,
    index)`` (``blocks.visible``, ``index`` a ``blocks.StreamIndex``) under each layer type's
    sliding window, ``windows[layer_type]`` (None: full attention)."""
    from torch.nn.attention.flex_attention import flex_attention

    b, nb = blocks.keep.shape
    q_len = nb * blocks.block_size
    device = blocks.keep.device
    index = StreamIndex.of(blocks)
    masks = {lt: build_block_mask(_mask_mod(predicate, blocks, window, index), compiled=device.type == "cuda",
                                  B=b, H=None, Q_LEN=q_len, KV_LEN=blocks.ctx_len + q_len, device=device)
             for lt, window in windows.items()}
    fn = _flex() if device.type == "cuda" else flex_attention

    def attend(layer_type, q, k, v):
        if q.is_cuda and q.shape[-1] < 16:
            raise ConfigError(f"flex attention kernels need head_dim >= 16, the draft has {q.shape[-1]}",
                              where="draft.attention_backend", fix="use attention_backend: sdpa for this draft")
        return fn(q, k, v, block_mask=masks[layer_type], scale=q.shape[-1] ** -0.5, enable_gqa=True)

    return attend


def _mask_mod(predicate, blocks, window: int | None, index):
    # exactly four positional parameters: flex tells a mask_mod from a score_mod by their count
    def mask_mod(b, h, q, kv):
        return predicate(blocks, b, q, kv, window, index)

    return mask_mod


BACKENDS = ("auto", "sdpa", "flex")


def resolve_block_backend(backend: str, device: torch.device) -> str:
    """``draft.attention_backend`` for a DFlash-family draft on ``device``: ``auto`` is flex on CUDA,
    sdpa elsewhere; ConfigError for an unknown name or flex's missing CPU backward."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown attention backend {backend!r}", where="draft.attention_backend",
                          fix=f"use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    if backend == "flex" and torch.device(device).type != "cuda" and torch.is_grad_enabled():
        raise ConfigError("flex attention has no CPU backward", where="draft.attention_backend",
                          fix="use attention_backend: sdpa (or auto) on CPU")
    return backend
