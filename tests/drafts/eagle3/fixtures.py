"""Tiny random drafts and captured batches for the objective and model tests (no target needed),
and the pieces a builder test needs around a tiny target directory."""

import torch
from transformers import LlamaConfig

from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
from specforge_core.drafts.eagle3.model import Eagle3DraftModel

V, VD = 24, 12


def tiny_target_config(rope_parameters=None, hidden=24, heads=4, kv_heads=2, head_dim=8, vocab=V) -> LlamaConfig:
    """A Llama target config of 8 layers; head_dim differs from hidden/heads (Qwen3-style)."""
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=40, num_hidden_layers=8,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters=rope_parameters,
    )


def tiny_draft(seed=0, fc_norm=False, rope_parameters=None, target_hidden=None, vocab_draft=VD, head_dim=8,
               norm_output=False) -> Eagle3DraftModel:
    """A float32 draft with weights large enough for non-uniform attention and a random vocab map."""
    target = tiny_target_config(rope_parameters, head_dim=head_dim)
    config = draft_config_from_target(target, vocab_draft, fc_norm=fc_norm, norm_output=norm_output)
    if target_hidden is not None:
        config.target_hidden_size = target_hidden
    g = torch.Generator().manual_seed(seed)
    draft = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
            elif name == "embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=g))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=g))
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(config.vocab_size, generator=g)[:vocab_draft]] = True
    draft.set_vocab_map(torch.nonzero(t2d).flatten() - torch.arange(vocab_draft), t2d)
    return draft


def random_batch(seed, lengths, T, target_hidden, vocab=V) -> dict:
    """Right-padded captured batch: rows of the given real lengths, random loss masks."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    attention = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    loss_mask = (torch.rand(B, T, generator=g) < 0.75).long() * attention
    return dict(
        input_ids=torch.randint(vocab, (B, T), generator=g),
        attention_mask=attention,
        loss_mask=loss_mask,
        aux_hidden=torch.randn(B, T, 3 * target_hidden, generator=g),
        last_hidden=torch.randn(B, T, target_hidden, generator=g),
    )


def target_head(seed, target_hidden, vocab=V) -> torch.Tensor:
    return torch.randn(vocab, target_hidden, generator=torch.Generator().manual_seed(seed + 1000))


def hf_backend(target_dir, device="cpu"):
    """The hf capture backend of a saved target directory, float32 on ``device``."""
    from transformers import AutoModelForCausalLM

    from specforge_core.capture.hf import HFCaptureBackend
    from specforge_core.capture.target_info import default_capture_layers

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    return HFCaptureBackend(model, default_capture_layers(model.config.num_hidden_layers))


def random_vocab_map(vocab_size: int, vd: int):
    """A vocab map of ``vd`` target ids drawn at random (seed 0)."""
    from specforge_core.data.vocab import VocabMap

    used = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:vd].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return VocabMap(key="test", path=None, d2t=used - torch.arange(vd), t2d=t2d, coverage=None)
