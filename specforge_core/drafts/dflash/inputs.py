"""What the DFlash objective is given, checked: its settings and the captured batch, whose
fields and samples it reads from here, and the generator that draws a micro-batch's anchors.

``batch`` (mapping or object): ``input_ids``, ``attention_mask``, ``loss_mask`` ``[b,T]``,
``aux_hidden [b,T,K·H]``, optional ``position_ids`` / ``seq_ids`` ``[b,T]`` for packed rows
(``seq_ids`` -1 on padding).
"""

import hashlib

import torch

from specforge_core.errors import ConfigError, ModelError

REQUIRED_FIELDS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden")


def field(batch, name):
    """``batch``'s field ``name`` (None where it has none)."""
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)


def find_samples(attention_mask, seq_ids, position_ids):
    """Each token's sample and within-sample position, and each sample's row, start and length
    (samples numbered in ``seq_ids`` order, rows when unpacked). Checks that every sample is one
    contiguous run of its row and that given ``position_ids`` restart at 0 per sample."""
    b, t = attention_mask.shape
    real = attention_mask.bool()
    device = real.device
    rows = torch.arange(b, device=device)[:, None].expand(b, t)
    sid = torch.where(real, rows if seq_ids is None else seq_ids.long(), -1)
    flat = torch.nonzero(real.flatten()).flatten()
    uniq, rank = torch.unique(sid.flatten()[flat], return_inverse=True)
    ns = uniq.numel()
    row, col = flat // t, flat % t
    start = torch.full((ns,), t, device=device, dtype=torch.long).scatter_reduce(0, rank, col, "amin")
    end = torch.zeros(ns, device=device, dtype=torch.long).scatter_reduce(0, rank, col, "amax")
    row_min = torch.full((ns,), b, device=device, dtype=torch.long).scatter_reduce(0, rank, row, "amin")
    row_max = torch.zeros(ns, device=device, dtype=torch.long).scatter_reduce(0, rank, row, "amax")
    length = torch.bincount(rank, minlength=ns)
    if not bool(((end - start + 1 == length) & (row_min == row_max)).all()):
        raise ModelError(
            "a sample is not one contiguous run of real tokens in one row",
            where="captured batch: seq_ids",
            fix="pack samples back to back (capture.packing.RowLayout); seq_ids -1 only on padding",
        )
    ctx_sample = torch.full((b * t,), -1, device=device, dtype=torch.long)
    ctx_sample[flat] = rank
    ctx_pos = torch.zeros(b * t, device=device, dtype=torch.long)
    ctx_pos[flat] = col - start[rank]
    if position_ids is not None and not torch.equal(position_ids.long().flatten()[flat], ctx_pos[flat]):
        raise ModelError(
            "position_ids do not restart at 0 for every sample",
            where="captured batch: position_ids",
            fix="give within-sample positions (capture.packing.RowLayout does), or leave them out",
        )
    return ctx_sample.view(b, t), ctx_pos.view(b, t), row_min, start, length


def check_objective_settings(draft, block_size, num_anchors, loss_decay_gamma):
    """Raises ConfigError for a block size other than the draft's, a ``num_anchors`` that is not
    an integer >= 1 or a ``loss_decay_gamma`` that is neither None nor positive."""
    if block_size != draft.block_size:
        raise ConfigError(
            f"the objective's block size {block_size} differs from the draft config's {draft.block_size}",
            where="draft.dflash.block_size", fix="train with the block size written in the draft config",
        )
    if not isinstance(num_anchors, int) or isinstance(num_anchors, bool) or num_anchors < 1:
        raise ConfigError(f"num_anchors {num_anchors!r}", where="draft.dflash.num_anchors",
                          fix="set draft.dflash.num_anchors to an integer >= 1 (512 is standard)")
    if loss_decay_gamma is not None and not (isinstance(loss_decay_gamma, (int, float)) and loss_decay_gamma > 0):
        raise ConfigError(f"loss_decay_gamma {loss_decay_gamma!r}", where="draft.dflash.loss_decay_gamma",
                          fix="set draft.dflash.loss_decay_gamma > 0 (7 for B=16, 4 for B=8), or null for no decay")


def check_batch(batch, draft, embed_weight, lm_head_weight):
    """Raises ModelError for a missing field, a field of another ``[b,T]``, or a target
    embedding / head that is not the draft's ``[vocab, hidden]``."""
    missing = [f for f in REQUIRED_FIELDS if field(batch, f) is None]
    if missing:
        raise ModelError(f"captured batch lacks {missing}", where="captured batch",
                         fix="capture all of " + ", ".join(REQUIRED_FIELDS))
    shape = tuple(field(batch, "input_ids").shape)
    for name in ("attention_mask", "loss_mask", "position_ids", "seq_ids"):
        value = field(batch, name)
        if value is not None and tuple(value.shape) != shape:
            raise ModelError(f"{name} shape {tuple(value.shape)} != input_ids {shape}", where=f"captured batch: {name}")
    if tuple(field(batch, "aux_hidden").shape[:2]) != shape:
        raise ModelError(f"aux_hidden shape {tuple(field(batch, 'aux_hidden').shape)} does not start with {shape}",
                         where="captured batch: aux_hidden")
    hidden, vocab = draft.config.hidden_size, draft.config.vocab_size
    for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
        if tuple(w.shape) != (vocab, hidden):
            raise ModelError(f"{name} shape {tuple(w.shape)} != (vocab {vocab}, hidden {hidden})", where=name,
                             fix="pass the frozen target embedding / LM head (the embedding when tied)")


def anchor_generator(seed: int, *, step: int, rank: int, micro_step: int) -> torch.Generator:
    """A CPU generator for one micro-batch's anchors, a pure function of its coordinates (so a
    resumed run redraws the same anchors)."""
    digest = hashlib.sha256(f"dflash-anchors:{seed}:{step}:{rank}:{micro_step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
