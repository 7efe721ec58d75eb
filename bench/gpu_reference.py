"""Reference figures for the GPU benchmark: the ceilings and the peer, measured in the same run.

Imported by ``bench/gpu_train.py``; needs only torch + transformers (+ the ``specforge==0.2.0``
wheel for the peer, installed with ``--no-deps`` where it is carried). Never copies peer code:
it calls SpecForge's public classes.
"""

import math
import time

import torch

SHAPES = {
    # Qwen3-8B text config (8.19 B params)
    "qwen3-8b": dict(
        arch="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
    ),
    # Llama-3.1-8B
    "llama3-8b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def target_config(shape: str):
    from transformers import LlamaConfig, Qwen3Config

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    rope_theta = spec.pop("rope_theta")
    rope_scaling = spec.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    cfg = cls(**spec, tie_word_embeddings=False, rope_parameters=rope)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_random_target(shape: str, device: str = "cuda"):
    """The target at ``shape`` with random bf16 weights (no download), in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = target_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    return model


def median_seconds(fn, *, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, with device synchronisation."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def timed_back_to_back(fn, *, warmup: int = 1, iters: int = 5) -> float:
    """Seconds per ``fn()`` over ``iters`` runs launched back to back, one synchronisation after
    all of them: as a training loop runs its steps (the host may launch the next while the device
    finishes the last)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    s = median_seconds(lambda: a @ b, warmup=3, iters=10)
    return 2 * n**3 / s / 1e12


def target_forward_tokens_per_s(model, batch: int, seq: int, capture_ids=None) -> float:
    """Plain HF forward (logits of the last position only, as a capture would need none)."""
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (batch, seq), device="cuda")
    base = model.model

    @torch.inference_mode()
    def run():
        base(input_ids=ids, use_cache=False)

    return batch * seq / median_seconds(run)


def peer_eagle3_step(shape: str, batch: int, seq: int, ttt_length: int = 7, vocab_d: int = 32000,
                     teacher: str = "full"):
    """SpecForge 0.2.0's EAGLE3 draft step (flex attention, Triton loss, forward+backward+AdamW) on
    random inputs of one dense shape: returns ``step()``, or None when the ``specforge`` wheel is not
    importable. ``teacher="full"``: full-vocab bf16 target logits, as its online path takes them;
    ``"compact"``: its offline path's teacher built per vocab chunk from the last hidden state."""
    try:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    except Exception as e:  # the wheel is optional: report why it is absent
        print(f"peer: specforge not importable ({type(e).__name__}: {e})")
        return None
    from transformers import LlamaConfig

    tcfg = target_config(shape)
    dcfg = LlamaConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads),
        vocab_size=tcfg.vocab_size,
        num_hidden_layers=1,
        max_position_embeddings=tcfg.max_position_embeddings,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_parameters["rope_theta"],
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    dcfg.draft_vocab_size = vocab_d
    with torch.device("cuda"):
        draft = LlamaForCausalLMEagle3(dcfg, attention_backend="flex_attention").to(torch.bfloat16)
    draft.embed_tokens.weight.requires_grad_(False)
    # a realistic vocab map: Vd ascending target ids
    used = torch.randperm(tcfg.vocab_size, device="cuda")[:vocab_d].sort().values
    draft.d2t.copy_(used - torch.arange(vocab_d, device="cuda"))
    draft.t2d.zero_()
    draft.t2d[used] = True
    model = OnlineEagle3Model(draft, length=ttt_length, attention_backend="flex_attention")
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    H = tcfg.hidden_size
    ids = torch.randint(tcfg.vocab_size, (batch, seq), device="cuda")
    mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    loss_mask = torch.ones(batch, seq, 1, device="cuda")  # SpecForge 0.2.0 takes it as [B, T, 1]
    aux = torch.randn(batch, seq, 3 * H, device="cuda", dtype=torch.bfloat16)
    if teacher == "full":
        inputs = {"target": torch.randn(batch, seq, tcfg.vocab_size, device="cuda", dtype=torch.bfloat16)}
    else:
        inputs = {"target": None, "target_hidden_for_compact": torch.randn(batch, seq, H, device="cuda", dtype=torch.bfloat16),
                  "target_head_weight": torch.randn(tcfg.vocab_size, H, device="cuda", dtype=torch.bfloat16) * H**-0.5}

    def step():
        out = model(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, hidden_states=aux, **inputs)
        loss = sum(0.8**i * p for i, p in enumerate(out[0]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def peer_dflash_step(shape: str, batch: int, seq: int, *, num_layers: int, block_size: int, num_anchors: int,
                     mask_token_id: int, target_layer_ids: list[int], loss_decay_gamma: float | None = 7.0):
    """SpecForge 0.2.0's DFlash draft step (``DFlashDraftModel`` + ``OnlineDFlashModel``, flex
    attention, forward+backward+AdamW) on random inputs of one dense shape, the target's lm_head and
    embeddings frozen: returns ``step()``, or None when the ``specforge`` wheel is not importable."""
    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    except Exception as e:
        print(f"peer: specforge DFlash not importable ({type(e).__name__}: {e})")
        return None
    from transformers import Qwen3Config

    tcfg = target_config(shape)
    dcfg = Qwen3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads), vocab_size=tcfg.vocab_size,
        max_position_embeddings=tcfg.max_position_embeddings, rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_parameters["rope_theta"], tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
    )
    dcfg._attn_implementation = "flex_attention"  # OnlineDFlashModel builds a BlockMask for it
    dcfg.num_target_layers = tcfg.num_hidden_layers
    dcfg.block_size = block_size
    dcfg.dflash_config = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}
    H, V = tcfg.hidden_size, tcfg.vocab_size
    with torch.device("cuda"):
        draft = DFlashDraftModel(dcfg).to(torch.bfloat16)
        lm_head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16).requires_grad_(False)
        embed = torch.nn.Embedding(V, H).to(torch.bfloat16).requires_grad_(False)
    model = OnlineDFlashModel(draft, lm_head, embed, mask_token_id=mask_token_id, block_size=block_size,
                              attention_backend="flex_attention", num_anchors=num_anchors,
                              loss_decay_gamma=loss_decay_gamma)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(V, (batch, seq), device="cuda")
    loss_mask = torch.ones(batch, seq, device="cuda")
    hidden = torch.randn(batch, seq, len(target_layer_ids) * H, device="cuda", dtype=torch.bfloat16)

    def step():
        loss, _, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=loss_mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def flop_bound_tokens_per_s(shape: str, tflops: float, ttt_length: int = 7, vocab_d: int = 32000) -> float:
    """Tokens/s if capture (2·P FLOP/token) plus the draft step ran at the measured matmul rate.

    Draft step ≈ 3 (fwd+bwd) · ttt_length · 2 · P_draft_trainable FLOP/token (attention ignored).
    """
    c = SHAPES[shape]
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = H * (H + 2 * kv) + H * H + 3 * H * I
    target_params = L * per_layer + V * H
    draft_layer = 2 * H * (H + 2 * kv) + H * H + 3 * H * I
    draft_params = draft_layer + vocab_d * H
    flop = 2 * target_params + 3 * 2 * (draft_params * ttt_length + 3 * H * H)
    return tflops * 1e12 / flop if math.isfinite(flop) else float("nan")
