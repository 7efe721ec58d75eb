"""fast/flex_blocks.py: flex attention over the anchor blocks equals sdpa under the dense masks of
the same predicate (forward on the CPU; gradients too on CUDA), and the padding for flex's tiles
adds keys no real query sees."""

import pytest
import torch

from specforge_core.drafts.dflash.blocks import StreamIndex, build_blocks, dense_masks, visible
from specforge_core.drafts.dflash.fast.flex_blocks import _mask_mod, flex_attend, pad_for_flex
from specforge_core.drafts.dflash.model import dense_attend
from specforge_core.system import compile as comp
from tests.drafts.dflash.fixtures import MASK, packed_batch, random_samples

BLOCK, WINDOW, LAYERS = 4, 5, ("sliding_attention", "full_attention")


def _padded_blocks(device="cpu"):
    batch = packed_batch(random_samples(6, [9, 7, 10]), [[0, 1], [2]])
    batch = {k: v.to(device) for k, v in batch.items()}
    blocks = build_blocks(batch, block_size=BLOCK, num_anchors=3, mask_token_id=MASK,
                          generator=torch.Generator().manual_seed(2))
    padded, aux = pad_for_flex(blocks, batch["aux_hidden"], MASK)
    return blocks, padded, aux


def _qkv(padded, device, grad):
    b, nb = padded.keep.shape
    q_len, kv_len = nb * BLOCK, padded.ctx_len + nb * BLOCK
    g = torch.Generator().manual_seed(0)
    shapes = [(b, 4, q_len, 16), (b, 2, kv_len, 16), (b, 2, kv_len, 16)]
    return [torch.randn(s, generator=g).to(device).requires_grad_(grad) for s in shapes]


def _attends(padded):
    windows = {lt: (WINDOW if lt == "sliding_attention" else None) for lt in LAYERS}
    return flex_attend(padded, visible, windows), dense_attend(dense_masks(padded, LAYERS, WINDOW))


def test_flex_equals_sdpa_under_the_dense_masks_on_the_cpu():
    _, padded, _ = _padded_blocks()
    q, k, v = _qkv(padded, "cpu", grad=False)
    flex, dense = _attends(padded)
    with torch.no_grad():
        for layer_type in LAYERS:
            torch.testing.assert_close(flex(layer_type, q, k, v), dense(layer_type, q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_the_compiled_block_mask_builder_gives_the_dense_masks_tiles(window, monkeypatch):
    # CUDA builds the mask compiled (tile by tile, no dense grid); the CPU can compile it too
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(comp, "_EAGER_MASKS", set())

    _, padded, _ = _padded_blocks()
    b, nb = padded.keep.shape
    q_len = nb * BLOCK
    sizes = dict(B=b, H=None, Q_LEN=q_len, KV_LEN=padded.ctx_len + q_len, device="cpu", BLOCK_SIZE=8)
    mask_mod = _mask_mod(visible, padded, window, StreamIndex.of(padded))
    compiled = comp.build_block_mask(mask_mod, compiled=True, **sizes)
    assert not comp._EAGER_MASKS  # built compiled, not by the eager fallback
    dense = dense_masks(padded, ["sliding_attention" if window else "full_attention"], window)
    want = next(iter(dense.values()))[:, None]  # [b, 1, Q, T+Q]
    # the block mask holds a tile of 8 queries × 8 keys where some key of it is visible to some query
    tiles = want.unflatten(2, (-1, 8)).unflatten(4, (-1, 8)).any(dim=(3, 5))
    assert tiles.any() and not tiles.all()
    assert torch.equal(compiled.to_dense().bool(), tiles)
    assert torch.equal(compiled.to_dense(), create_block_mask(mask_mod, **sizes).to_dense())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex attention backward)")
def test_flex_equals_sdpa_under_the_dense_masks_with_gradients_on_cuda():
    _, padded, _ = _padded_blocks("cuda")
    flex, dense = _attends(padded)
    for layer_type in LAYERS:
        outs = []
        for attend in (flex, dense):
            q, k, v = _qkv(padded, "cuda", grad=True)
            out = attend(layer_type, q, k, v)
            out.pow(2).sum().backward()
            outs.append((out, q.grad, k.grad, v.grad))
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_padding_for_flex_adds_only_keys_and_queries_that_change_nothing():
    blocks, padded, aux = _padded_blocks()
    (b, nb), t = blocks.keep.shape, blocks.ctx_len
    assert padded.ctx_len % 128 == 0 and (padded.keep.shape[1] * BLOCK) % 128 == 0 and aux.shape[1] == padded.ctx_len
    q_len = nb * BLOCK
    for window in (None, WINDOW):
        (mask,) = dense_masks(blocks, ["full_attention" if window is None else "sliding_attention"], window).values()
        (wide,) = dense_masks(padded, ["full_attention" if window is None else "sliding_attention"], window).values()
        real_keys = torch.cat([torch.arange(t), padded.ctx_len + torch.arange(q_len)])
        assert torch.equal(wide[:, :q_len][:, :, real_keys], mask)  # the real queries see what they saw
        assert wide[:, :q_len].sum() == mask.sum()  # and nothing new
    assert not padded.keep[:, nb:].any() and not padded.valid[:, nb:].any()  # padding slots carry no weight
