"""The training attention mask (dflash-facts §3.3, generalised to packed rows) equals a mask built
by loops from the rows alone, and has the properties serving relies on: context strictly before
the anchor and inside the anchor's sample, no attention to another block, sliding layers causal
inside the block and windowed over the context."""

import pytest
import torch

from specforge_core.drafts.dflash.blocks import build_blocks, dense_masks
from tests.drafts.dflash.fixtures import MASK, packed_batch, random_samples, unpacked_batch
from tests.drafts.dflash.reference import reference_mask

BLOCK = 4


def _batches():
    samples = random_samples(11, [9, 3, 12, 7], supervised=0.9)
    return {"unpacked": unpacked_batch(samples), "packed": packed_batch(samples, [[0, 1], [2], [3]])}


def _blocks(batch, num_anchors=4):
    return build_blocks(batch, block_size=BLOCK, num_anchors=num_anchors, mask_token_id=MASK,
                        generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
@pytest.mark.parametrize("window", [None, 4, 6])
def test_dense_mask_equals_the_loop_built_mask(layout, window):
    batch = _batches()[layout]
    blocks = _blocks(batch)
    layer = "full_attention" if window is None else "sliding_attention"
    mask = dense_masks(blocks, [layer], window)[layer]
    expected = reference_mask(batch, blocks.anchor_col.tolist(), blocks.keep.tolist(), BLOCK, window)
    assert blocks.keep.sum() > 4 and not blocks.keep.all()  # several blocks and some padding slots
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("window", [None, 5])
def test_context_is_strictly_before_the_anchor_and_inside_its_sample(window):
    batch = _batches()["packed"]
    blocks = _blocks(batch, num_anchors=8)
    layer = "full_attention" if window is None else "sliding_attention"
    mask = dense_masks(blocks, [layer], window)[layer]
    t = blocks.ctx_len
    seen = 0
    for r, q, c in torch.nonzero(mask[:, :, :t]).tolist():
        j = q // BLOCK
        assert blocks.keep[r, j]
        assert blocks.ctx_sample[r, c] == blocks.sample[r, j] == batch["seq_ids"][r, blocks.anchor_col[r, j]]
        assert blocks.ctx_pos[r, c] < blocks.anchor_pos[r, j] and c < blocks.anchor_col[r, j]
        seen += 1
    assert seen > 0
    # the anchor's own hidden state is never visible, nor any later one
    for r, j in torch.nonzero(blocks.keep).tolist():
        assert not mask[r, j * BLOCK : (j + 1) * BLOCK, blocks.anchor_col[r, j] : t].any()


def test_no_block_sees_another_block_and_full_layers_see_their_whole_block():
    blocks = _blocks(_batches()["unpacked"])
    full, sliding = (dense_masks(blocks, ["full_attention", "sliding_attention"], 5)[k]
                     for k in ("full_attention", "sliding_attention"))
    t, nb = blocks.ctx_len, blocks.keep.shape[1]
    for j in range(nb):
        rows = slice(j * BLOCK, (j + 1) * BLOCK)
        own = torch.zeros(nb * BLOCK, dtype=torch.bool)
        own[rows] = True
        assert not full[:, rows, t:][..., ~own].any() and not sliding[:, rows, t:][..., ~own].any()
        assert full[:, rows, t:][..., own].all()
        assert torch.equal(sliding[:, rows, t:][..., own], torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril().expand_as(
            sliding[:, rows, t:][..., own]))


def test_padding_blocks_see_only_their_own_block():
    blocks = _blocks(_batches()["unpacked"])
    mask = dense_masks(blocks, ["full_attention"], None)["full_attention"]
    t = blocks.ctx_len
    pads = torch.nonzero(~blocks.keep).tolist()
    assert pads
    for r, j in pads:
        assert not mask[r, j * BLOCK : (j + 1) * BLOCK, :t].any()
        assert not blocks.valid[r, j].any()


def test_block_tokens_positions_and_labels():
    batch = _batches()["packed"]
    blocks = _blocks(batch)
    for r, j in torch.nonzero(blocks.keep).tolist():
        a = int(blocks.anchor_col[r, j])
        assert blocks.tokens[r, j].tolist() == [int(batch["input_ids"][r, a])] + [MASK] * (BLOCK - 1)
        pos = blocks.positions[r, j * BLOCK : (j + 1) * BLOCK].tolist()
        assert pos == [int(batch["position_ids"][r, a]) + k for k in range(BLOCK)]
        for k in range(1, BLOCK):
            if blocks.valid[r, j, k]:
                assert blocks.labels[r, j, k] == batch["input_ids"][r, a + k]
                assert batch["seq_ids"][r, a + k] == batch["seq_ids"][r, a] and batch["loss_mask"][r, a + k]
        assert not blocks.valid[r, j, 0]
