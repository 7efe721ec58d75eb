"""Tiny DFlash drafts, targets and captured batches built on the fly (no download, no target run)."""

import torch
from transformers import Qwen3Config

from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
from specforge_core.drafts.dflash.model import DFlashDraftModel

VOCAB, HIDDEN, MASK = 256, 64, 255


def target_config(num_layers: int = 6, vocab: int = VOCAB, hidden: int = HIDDEN, **overrides) -> Qwen3Config:
    """A Qwen3 target: 4 query / 2 KV heads of 16, RoPE theta 1e6."""
    fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return Qwen3Config(**(fields | overrides))


def tiny_draft(seed=0, *, block_size=4, num_layers=1, layer_types=None, sliding_window=None,
               target_layer_ids=(1, 3)) -> DFlashDraftModel:
    """A float32 draft with weights large enough for non-uniform attention."""
    config = dflash_config_from_target(
        target_config(), block_size=block_size, num_layers=num_layers, target_layer_ids=list(target_layer_ids),
        mask_token_id=MASK, layer_types=layer_types, sliding_window=sliding_window,
    )
    draft = DFlashDraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
    return draft


def target_weights(seed, vocab=VOCAB, hidden=HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) ``[V, H]`` of a pretend target."""
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(vocab, hidden, generator=g), 0.5 * torch.randn(vocab, hidden, generator=g)


def random_samples(seed, lengths, k_layers=2, hidden=HIDDEN, vocab=VOCAB, supervised=0.8) -> list[dict]:
    """Samples ``{ids, lm, aux}``: random tokens (never the mask id), loss masks and features."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append(dict(
            ids=torch.randint(vocab - 1, (n,), generator=g),
            lm=(torch.rand(n, generator=g) < supervised).long(),
            aux=torch.randn(n, k_layers * hidden, generator=g),
        ))
    return out


def unpacked_batch(samples, width=None) -> dict:
    """One sample per row, right-padded (hidden states zero on padding)."""
    width = width or max(len(s["ids"]) for s in samples)
    b, feat = len(samples), samples[0]["aux"].shape[-1]
    zeros = torch.zeros(b, width, dtype=torch.long)
    batch = dict(input_ids=zeros.clone(), attention_mask=zeros.clone(), loss_mask=zeros.clone(),
                 aux_hidden=torch.zeros(b, width, feat))
    for r, s in enumerate(samples):
        n = len(s["ids"])
        batch["input_ids"][r, :n], batch["loss_mask"][r, :n], batch["aux_hidden"][r, :n] = s["ids"], s["lm"], s["aux"]
        batch["attention_mask"][r, :n] = 1
    return batch


def packed_batch(samples, rows: list[list[int]]) -> dict:
    """Samples back to back in rows (``rows[r]``: sample indices), with position_ids and seq_ids
    as ``capture.packing`` lays them out."""
    width = max(sum(len(samples[i]["ids"]) for i in row) for row in rows)
    batch = unpacked_batch([dict(ids=torch.cat([samples[i]["ids"] for i in row]),
                                 lm=torch.cat([samples[i]["lm"] for i in row]),
                                 aux=torch.cat([samples[i]["aux"] for i in row])) for row in rows], width)
    batch["position_ids"] = torch.zeros_like(batch["input_ids"])
    batch["seq_ids"] = torch.full_like(batch["input_ids"], -1)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = len(samples[i]["ids"])
            batch["position_ids"][r, col : col + n] = torch.arange(n)
            batch["seq_ids"][r, col : col + n] = i
            col += n
    return batch
