"""Facts about the target that capture needs: its config, capture layers, run checks, head weights.

The rules here need the target's own config (layer count, context length), so they run where the
target is loaded (:func:`specforge_core.capture.build_capture_backend`), not at config load.
"""

import json
from pathlib import Path

import torch

from specforge_core.errors import ConfigError, ModelError


def text_config(target_config):
    """The language-model part of a (possibly multimodal) HF config."""
    getter = getattr(target_config, "get_text_config", None)
    return getter() if getter else target_config


def load_target_config(cfg):
    """The target's Hugging Face config from ``model.target`` (``model.gguf_file`` honoured).

    The one place the run reads the target's config.json: preflight, both capture backends and
    the dry run call this. Raises ModelError naming ``model.target`` when it cannot be read.
    """
    from transformers import AutoConfig

    if not cfg.model.target:
        raise ModelError("no target model", where="model.target", fix="set model.target to a Hugging Face directory")
    kwargs = {"trust_remote_code": cfg.model.trust_remote_code}
    if cfg.model.gguf_file:
        kwargs["gguf_file"] = cfg.model.gguf_file
    try:
        return AutoConfig.from_pretrained(cfg.model.target, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the target config: {e}", where="model.target",
                         fix="point model.target at a Hugging Face model directory") from None


def target_vocab_size(cfg, tokenizer) -> int:
    """V: rows of the target's embedding (its config's vocab_size), else the tokenizer's size."""
    return int(text_config(load_target_config(cfg)).vocab_size) if cfg.model.target else len(tokenizer)


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3's default: outputs of layers 1, N//2-1 and N-4 (SGLang serves the same by default)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def _draft_layer_ids(draft_config) -> list[int] | None:
    if draft_config is None:
        return None
    eagle = (
        draft_config.get("eagle_config") if isinstance(draft_config, dict) else getattr(draft_config, "eagle_config", None)
    )
    if not eagle:
        return None
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    return list(ids) if ids else None


def resolve_capture_layers(cfg, target_config, draft_config=None) -> tuple[int, int, int]:
    """The three capture ids: ``model.capture_layer_ids``, else the draft config's
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, else ``[1, N//2-1, N-4]``.

    Id ``i`` is the output of decoder layer ``i`` (HF ``hidden_states[i+1]``). Raises ModelError
    if an id is outside ``[0, N)`` or the ids are not three distinct values.
    """
    n = text_config(target_config).num_hidden_layers
    if cfg.model.capture_layer_ids is not None:
        ids, where = list(cfg.model.capture_layer_ids), "model.capture_layer_ids"
    elif (from_draft := _draft_layer_ids(draft_config)) is not None:
        ids, where = from_draft, "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        ids, where = list(default_capture_layers(n)), f"default capture layers for {n} target layers"
    if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= n:
        raise ModelError(
            f"capture layer ids {ids} must be 3 distinct ids in [0, {n}) for a {n}-layer target",
            where=where,
            fix="set model.capture_layer_ids to 3 distinct layer ids below the target's layer count"
            + (" (targets with fewer than 7 layers need explicit ids)" if n < 7 else ""),
        )
    return tuple(ids)


def validate_colocated(cfg, target_config) -> None:
    """Checks of ``deployment.mode: local_colocated`` that need the target's config.

    - context headroom: ``data.max_length + training.ttt_length`` positions must fit the target's
      context (the draft unrolls ``ttt_length`` positions past the longest row, with the target's
      RoPE);
    - the SGLang engine's ``capture.sglang.context_length`` may not exceed that context;
    - SGLang target TP: ``capture.tp_size`` must divide the attention heads;
    - the teacher is ``last_hidden @ lm_head^T``: targets that soft-cap or scale logits are refused;
    - packing: a sample of ``data.max_length`` tokens must fit one row of ``training.token_budget``.
    """
    text = text_config(target_config)
    for name, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        value = getattr(text, name, neutral)
        if value is not None and value != neutral:
            raise ModelError(
                f"the target's {name}={value} changes its logits beyond last_hidden @ lm_head^T, "
                "which the teacher assumes",
                where=f"model.target config.json: {name}",
                fix="use a target without logit soft-capping or scaling",
            )
    context = getattr(text, "max_position_embeddings", None)
    need = cfg.data.max_length + cfg.training.ttt_length
    if context is not None and need > context:
        raise ConfigError(
            f"data.max_length ({cfg.data.max_length}) + training.ttt_length ({cfg.training.ttt_length}) "
            f"= {need} positions exceed the target's context of {context} (max_position_embeddings)",
            where="data.max_length",
            fix=f"set data.max_length ≤ {context - cfg.training.ttt_length}",
        )
    budget = cfg.training.token_budget
    if budget is not None and budget < cfg.data.max_length:
        raise ConfigError(
            f"training.token_budget={budget} is shorter than data.max_length={cfg.data.max_length}: "
            "a sample that long would fit no packed row",
            where="training.token_budget",
            fix=f"set training.token_budget ≥ {cfg.data.max_length} (training.batch_size × data.max_length "
            "packs every micro-step into one row)",
        )
    if cfg.capture.backend != "sglang":
        return
    engine_context = cfg.capture.sglang.context_length
    if context is not None and engine_context is not None and engine_context > context:
        raise ConfigError(
            f"capture.sglang.context_length={engine_context} exceeds the target's context of {context}",
            where="capture.sglang.context_length",
            fix=f"set capture.sglang.context_length ≤ {context}, or remove it (default: data.max_length)",
        )
    heads, tp = getattr(text, "num_attention_heads", None), cfg.capture.tp_size
    if heads is not None and heads % tp:
        raise ConfigError(
            f"capture.tp_size={tp} does not divide the target's {heads} attention heads",
            where="capture.tp_size",
            fix="choose a capture.tp_size that divides num_attention_heads",
        )


def load_target_head(
    model_dir: str | Path, target_config, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed_weight, lm_head_weight)``, each ``[V, Ht]``, read from the checkpoint's safetensors.

    For backends whose in-process model holds sharded heads (SGLang TP). Tied targets return the
    embedding twice. Handles single-file and indexed (``*.index.json``) checkpoints.
    """
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = root / "model.safetensors"
        if not single.is_file():
            raise ModelError("no model.safetensors or model.safetensors.index.json", where=str(root),
                             fix="point model.target at a Hugging Face directory with safetensors weights")
        with safe_open(single, "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    embed_key = next((k for k in weight_map if k.endswith("embed_tokens.weight")), None)
    tied = getattr(target_config, "tie_word_embeddings", False) or "lm_head.weight" not in weight_map
    head_key = embed_key if tied else "lm_head.weight"
    if embed_key is None:
        raise ModelError("no *embed_tokens.weight tensor in the checkpoint", where=str(root),
                         fix="use a checkpoint of a decoder-only causal LM")

    def read(key: str) -> torch.Tensor:
        with safe_open(root / weight_map[key], "pt") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed = read(embed_key)
    return embed, (embed if head_key == embed_key else read(head_key))
