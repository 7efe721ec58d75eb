"""Tiny DSpark drafts and captured batches (DFlash's fixtures plus the teacher's last hidden)."""

import torch

from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.settings import dspark_config_from_target
from tests.drafts.dflash.fixtures import HIDDEN, MASK, packed_batch, random_samples, target_config, unpacked_batch

__all__ = ["HIDDEN", "MASK", "batch_of", "randomize", "samples", "tiny_dspark"]


def randomize(draft, seed: int):
    """Every weight drawn large enough that attention is not uniform and the heads move the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) / max(param.shape[-1], 1) ** 0.5)
    return draft


def tiny_dspark(seed=0, *, block_size=4, num_layers=1, target_layer_ids=(1, 3), markov_rank=8, **fields):
    """A float32 draft with random weights (``randomize``)."""
    config = dspark_config_from_target(target_config(), block_size=block_size, num_layers=num_layers,
                                       target_layer_ids=list(target_layer_ids), mask_token_id=MASK,
                                       markov_rank=markov_rank, **fields)
    return randomize(DSparkDraftModel(config), seed)


def samples(seed, lengths, vocab=64):
    """DFlash's random samples (ids below ``vocab``) with a teacher hidden ``last [n, H]``."""
    out = random_samples(seed, lengths, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 77)
    for s in out:
        s["last"] = torch.randn(len(s["ids"]), HIDDEN, generator=g)
    return out


def batch_of(samples_, rows=None) -> dict:
    """Packed (``rows``: sample indices per row) or unpacked, with ``last_hidden``."""
    if rows is None:
        batch = unpacked_batch(samples_)
        batch["last_hidden"] = torch.zeros(*batch["input_ids"].shape, HIDDEN)
        for r, s in enumerate(samples_):
            batch["last_hidden"][r, : len(s["ids"])] = s["last"]
        return batch
    batch = packed_batch(samples_, rows)
    batch["last_hidden"] = torch.zeros(*batch["input_ids"].shape, HIDDEN)
    for r, row in enumerate(rows):
        last = torch.cat([samples_[i]["last"] for i in row])
        batch["last_hidden"][r, : len(last)] = last
    return batch
