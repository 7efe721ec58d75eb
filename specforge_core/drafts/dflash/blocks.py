"""The anchor blocks of the DFlash objective: which anchors a batch gets, how their blocks are laid
out per row, and what each block query may attend to.

    blocks = build_blocks(batch, block_size=16, num_anchors=512, mask_token_id=m, generator=g)
    masks = dense_masks(blocks, draft.layer_types, draft.sliding_window)   # sdpa: [b, Q, T+Q] per layer type
    visible(blocks, b, q, kv, window, StreamIndex.of(blocks))             # the predicate (flex: fast/flex_blocks.py)

The rules (anchors, blocks, mask) are the first half of the objective's math, stated in
``objective.py``'s docstring. :func:`build_blocks` lays the anchors out from the capture's host
masks when it kept them (no host wait; the same anchors) and from the device masks otherwise.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specforge_core.capture.base import host_masks_of, to_device
from specforge_core.drafts.dflash.inputs import field, find_samples


@dataclass
class DFlashBlocks:
    """The anchor blocks of one batch, laid out per row: ``NB`` block slots per row, each
    ``block_size`` queries (``Q = NB·B``). Rows with fewer blocks have padding slots
    (``keep`` False) that see only their own block and carry no weight.
    """

    block_size: int
    ctx_sample: torch.Tensor  # [b,T] sample index of each token, -1 on padding
    ctx_pos: torch.Tensor  # [b,T] position within its sample
    sample: torch.Tensor  # [b,NB] the block's sample; -2 on padding slots (matches no token: no context)
    anchor_col: torch.Tensor  # [b,NB] the anchor's column in the row
    anchor_pos: torch.Tensor  # [b,NB] the anchor's position within its sample
    keep: torch.Tensor  # [b,NB] bool
    tokens: torch.Tensor  # [b,NB,B] block input ids: [x_a, MASK, ...]
    labels: torch.Tensor  # [b,NB,B] x[a+k]
    valid: torch.Tensor  # [b,NB,B] bool: keep · inbounds · (k>0) · lm[a+k]
    host_valid: torch.Tensor | None = None  # ``valid`` on the CPU where the layout was made there

    def valid_rows(self) -> torch.Tensor:
        """Flat indices of the ``valid`` slots, on ``valid``'s device (from ``host_valid`` when
        there is one: listing them from the device copy would make the host wait)."""
        if self.host_valid is None:
            return torch.nonzero(self.valid.flatten()).flatten()
        return to_device(torch.nonzero(self.host_valid.flatten()).flatten(), self.valid.device)

    @property
    def positions(self) -> torch.Tensor:
        """``[b, NB·B]`` RoPE positions ``a + k`` of the block stream."""
        k = torch.arange(self.block_size, device=self.anchor_pos.device)
        return (self.anchor_pos[..., None] + k).flatten(1)

    @property
    def ctx_len(self) -> int:
        return self.ctx_pos.shape[1]


def _sample_keys(lengths: list[int], generator: torch.Generator | None, device) -> torch.Tensor:
    """One uniform key per token, drawn sample by sample in sample order (the anchor contract)."""
    gen_device = generator.device if generator is not None else "cpu"
    draws = [torch.rand(n, generator=generator, device=gen_device) for n in lengths]
    return torch.cat(draws).to(device) if draws else torch.zeros(0, device=device)


def build_blocks(
    batch, *, block_size: int, num_anchors: int, mask_token_id: int, generator: torch.Generator | None
) -> DFlashBlocks:
    """Sample the anchors of every sample and lay their blocks out per row (module docstring).

    The layout depends on the masks alone, and its sizes on their values; where the capture kept
    the masks on the host (``batch.host_masks``) it is worked out there and sent to the device in
    pinned copies, so the host never waits for the device here (the anchors are the same: the
    generator is a CPU one either way). Without host masks it is worked out from the device masks,
    and given ``position_ids`` are checked against it."""
    ids = field(batch, "input_ids").long()
    b, t = ids.shape
    host = host_masks_of(batch, b, t)
    if host is None:
        masks = [field(batch, name) for name in ("attention_mask", "loss_mask", "seq_ids", "position_ids")]
    else:  # the capture laid the position ids out from these same samples
        masks = [host.attention_mask, host.loss_mask, host.seq_ids, None]
    layout = _anchor_layout(*masks, block_size=block_size, num_anchors=num_anchors, generator=generator)
    ctx_sample, ctx_pos, sample, anchor_col, anchor_pos, keep, valid = (
        layout if host is None else [to_device(x, ids.device) for x in layout])
    nb = keep.shape[1]
    tokens = torch.full((b, nb, block_size), mask_token_id, device=ids.device, dtype=torch.long)
    tokens[..., 0] = torch.where(keep, ids.gather(1, anchor_col), mask_token_id)
    k = torch.arange(block_size, device=ids.device)
    labels = ids.gather(1, (anchor_col[..., None] + k).clamp(max=t - 1).flatten(1)).view(b, nb, block_size)
    return DFlashBlocks(block_size, ctx_sample, ctx_pos, sample, anchor_col, anchor_pos, keep, tokens, labels, valid,
                        None if host is None else layout[-1])


def pick_anchors(keys: torch.Tensor, cand: torch.Tensor, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's anchors: of its candidate positions (``cand [ns, width]``), the
    ``num_anchors`` of smallest ``keys [ns, width]`` (values in [0, 1); ties to the lower
    position), all where there are fewer. Returns ``(sample, position)`` of every anchor, by
    sample then position. One k-th value per sample instead of sorting every key."""
    keys = keys.masked_fill(~cand, 2.0)  # above every candidate's key
    n_keep = min(num_anchors, keys.shape[1])
    kth = keys.kthvalue(n_keep, dim=1, keepdim=True).values
    below, tied = keys < kth, keys == kth
    room = n_keep - below.sum(1, keepdim=True)  # how many of the tied keys are among the n_keep smallest
    chosen = (below | (tied & (tied.cumsum(1) <= room))) & cand
    return torch.nonzero(chosen, as_tuple=True)


def _anchor_layout(attention_mask, loss_mask, seq_ids, position_ids, *, block_size: int, num_anchors: int,
                   generator: torch.Generator | None) -> list[torch.Tensor]:
    """``[ctx_sample, ctx_pos, sample, anchor_col, anchor_pos, keep, valid]`` of
    :class:`DFlashBlocks`, on the masks' device."""
    b, t = attention_mask.shape
    device = attention_mask.device
    lm = loss_mask.bool() & attention_mask.bool()
    ctx_sample, ctx_pos, s_row, s_start, s_len = find_samples(attention_mask, seq_ids, position_ids)
    lengths = s_len.tolist()
    width = max(lengths, default=1)
    span = torch.arange(width, device=device)
    inside = span < s_len[:, None]  # [ns, width]
    lm_grid = lm[s_row[:, None], (s_start[:, None] + span).clamp(max=t - 1)] & inside
    keys = torch.full((len(lengths), width), 2.0, device=device)
    keys[inside] = _sample_keys(lengths, generator, device)
    cand = F.pad(lm_grid[:, :-1] & lm_grid[:, 1:], (0, 1))
    s_idx, a_pos = pick_anchors(keys, cand, num_anchors)
    a_row, a_col = s_row[s_idx], s_start[s_idx] + a_pos
    by_row = torch.argsort(a_row * t + a_col, stable=True)
    s_idx, a_pos, a_row, a_col = s_idx[by_row], a_pos[by_row], a_row[by_row], a_col[by_row]
    per_row = torch.bincount(a_row, minlength=b)
    slot = torch.arange(a_row.numel(), device=device) - (per_row.cumsum(0) - per_row)[a_row]
    nb = max(int(per_row.max()) if per_row.numel() else 0, 1)

    def grid(fill, values):
        out = torch.full((b, nb), fill, device=device, dtype=values.dtype)
        out[a_row, slot] = values
        return out

    keep = grid(False, torch.ones_like(a_row, dtype=torch.bool))
    sample, anchor_col, anchor_pos = grid(-2, s_idx), grid(0, a_col), grid(0, a_pos)
    k = torch.arange(block_size, device=device)
    col = anchor_col[..., None] + k
    at = col.clamp(max=t - 1).flatten(1)

    def read(x):
        return x.gather(1, at).view(b, nb, block_size)

    same = (col < t) & (read(ctx_sample) == sample[..., None])
    valid = keep[..., None] & same & (k > 0) & read(lm)
    return [ctx_sample, ctx_pos, sample, anchor_col, anchor_pos, keep, valid]


@dataclass(frozen=True)
class StreamIndex:
    """Each block-stream query's block ``q // B`` and slot ``q % B``, and each key's block
    ``(kv - T) // B`` (-1 on the context) and slot, as tables read by index: a compiled mask
    builder then loads them instead of dividing symbolic indices (which inductor could not
    simplify)."""

    query_block: torch.Tensor  # [Q]
    query_slot: torch.Tensor  # [Q]
    key_block: torch.Tensor  # [T+Q]
    key_slot: torch.Tensor  # [T+Q]

    @classmethod
    def of(cls, blocks: DFlashBlocks) -> "StreamIndex":
        size, t = blocks.block_size, blocks.ctx_len
        q = torch.arange(blocks.keep.shape[1] * size, device=blocks.keep.device)
        d = torch.arange(t + q.numel(), device=q.device) - t
        return cls(q // size, q % size, torch.where(d >= 0, d.clamp(min=0) // size, -1), d.clamp(min=0) % size)


def visible(blocks: DFlashBlocks, b, q, kv, window: int | None, index: StreamIndex) -> torch.Tensor:
    """The mask predicate for row ``b``, query ``q`` (block stream) and key ``kv`` (context
    ``[0,T)``, then the block stream): broadcasting tensors for the dense mask, or the scalar
    indices of a flex ``mask_mod``. ``window``: the sliding window, None for full attention;
    ``index``: ``StreamIndex.of(blocks)``, made once for every layer type's mask."""
    t = blocks.ctx_len
    q = q.clamp(max=index.query_block.numel() - 1)
    c = kv.clamp(max=t - 1)
    j, o = index.query_block[q], index.query_slot[q]
    key_pos, anchor = blocks.ctx_pos[b, c], blocks.anchor_pos[b, j]
    ctx_ok = (kv < t) & (blocks.ctx_sample[b, c] == blocks.sample[b, j]) & (key_pos < anchor)
    k = kv.clamp(max=index.key_block.numel() - 1)
    blk_ok = (kv >= t) & (index.key_block[k] == j)
    if window is not None:
        ctx_ok = ctx_ok & (key_pos >= anchor + o - (window - 1))
        blk_ok = blk_ok & (index.key_slot[k] <= o)
    return ctx_ok | blk_ok


def window_of(layer_type: str, sliding_window: int | None) -> int | None:
    """The sliding window of a layer of ``layer_type``; None for full attention."""
    return sliding_window if layer_type == "sliding_attention" else None


def dense_masks(blocks: DFlashBlocks, layer_types, sliding_window: int | None) -> dict[str, torch.Tensor]:
    """Bool ``[b, Q, T+Q]`` mask per layer type present (True = may attend)."""
    b, nb = blocks.keep.shape
    q_len, device = nb * blocks.block_size, blocks.keep.device
    rows = torch.arange(b, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(blocks.ctx_len + q_len, device=device)[None, None, :]
    index = StreamIndex.of(blocks)
    return {lt: visible(blocks, rows, q, kv, window_of(lt, sliding_window), index) for lt in set(layer_types)}
