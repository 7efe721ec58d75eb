"""DFlash draft configurations: generated from a target config, validated, read and written as JSON.

    from specforge_core.drafts.dflash.draft_config import dflash_config_from_target, resolve_mask_token_id
    mask = resolve_mask_token_id(None, tokenizer, vocab_size=target_cfg.vocab_size)
    cfg = dflash_config_from_target(target_cfg, block_size=16, num_layers=1, mask_token_id=mask)

A DFlash draft config is a transformers ``Qwen3Config`` carrying the DFlash fields SGLang and vLLM
read: ``block_size``, ``num_target_layers``, ``layer_types`` and ``dflash_config =
{target_layer_ids, mask_token_id}``. The draft has no embedding and no LM head (it uses the
target's), so ``hidden_size`` and ``vocab_size`` are the target's. Its attention width (heads,
KV heads, head_dim) and MLP size are copied from the target, its activation is SiLU, and its RoPE
is the draft's own: plain (unscaled) RoPE at the target's ``rope_theta`` — never the target's
scaling or multimodal sections, which serving engines do not apply to the draft.

Every function here refuses an invalid combination with a ConfigError (a run-config field, named
as ``draft.dflash.*``) or a ModelError (a target or draft config that cannot work), saying
where and what to do.
"""

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from specforge_core.drafts.dflash import dflash2
from specforge_core.errors import ConfigError, ModelError

ARCHITECTURE = "DFlashDraftModel"
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
DEFAULT_ROPE_THETA = 1e6
# Fields of a draft JSON we do not implement: refused rather than half-honoured.
_UNSUPPORTED = {"attention_bias": True}


def build_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """The K target layers a DFlash draft reads (output-of-layer ids: HF ``hidden_states[k+1]``; the rule SpecForge, z-lab and SGLang share).

    ``k == 1``: the middle layer ``[L // 2]``; otherwise K ids spread evenly over ``[1, L-3]``
    with Python's ``round`` (banker's rounding on .5), e.g. 36 layers, K=5 → [1, 9, 17, 25, 33].
    Raises ConfigError when K is not positive or the ids would not be K distinct layers.
    """
    if k < 1:
        raise ConfigError(f"cannot pick {k} target layers", where="draft.dflash.target_layer_ids",
                          fix="capture at least one target layer")
    if k == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    if len(set(ids)) != k or ids[0] >= end:
        raise ConfigError(
            f"a target of {num_target_layers} layers has no {k} distinct default layers in [1, {end}]",
            where="draft.dflash.target_layer_ids",
            fix=f"set draft.dflash.target_layer_ids explicitly (distinct ids in [0, {num_target_layers - 1}])",
        )
    return ids


def resolve_mask_token_id(
    explicit: int | None, tokenizer: Any, vocab_size: int, *, draft_config_id: int | None = None
) -> int:
    """The MASK token id: an existing row of the target embedding (``[0, vocab_size)``), never a new one.

    Order (SpecForge's): ``explicit`` (``draft.dflash.mask_token_id``) → ``draft_config_id`` (the
    ``dflash_config.mask_token_id`` of a draft being warm-started) → ``tokenizer.mask_token_id``
    → the first unused embedding row ``len(tokenizer)`` when it is ``< vocab_size`` → pad → eos →
    unk. An explicit, draft-config or tokenizer mask id outside the embedding is refused
    (ConfigError / ModelError); out-of-range fallbacks are skipped. Falling back to pad/eos/unk
    warns: those ids double as real tokens, which quietly lowers acceptance.
    """
    def in_range(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size

    for value, where, error in (
        (explicit, "draft.dflash.mask_token_id", ConfigError),
        (draft_config_id, "draft config: dflash_config.mask_token_id", ModelError),
        (getattr(tokenizer, "mask_token_id", None), "tokenizer mask_token_id", ModelError),
    ):
        if value is None:
            continue
        if not in_range(value):
            raise error(
                f"mask token id {value!r} is not a row of the target embedding [0, {vocab_size})",
                where=where,
                fix=f"set draft.dflash.mask_token_id to an unused embedding row below {vocab_size} "
                "(the target embedding is never resized)",
            )
        return value
    size = len(tokenizer) if tokenizer is not None else vocab_size
    if size < vocab_size:
        return size
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if in_range(value):
            warnings.warn(
                f"DFlash mask token falls back to the tokenizer's {name} {value}; set "
                "draft.dflash.mask_token_id to an unused embedding row for better acceptance",
                stacklevel=2,
            )
            return value
    raise ConfigError(
        f"no mask token id found: the tokenizer has no mask/pad/eos/unk token below {vocab_size} "
        "and no unused embedding row",
        where="draft.dflash.mask_token_id",
        fix=f"set draft.dflash.mask_token_id to a token id below {vocab_size}",
    )


def dflash_config_from_target(
    target_config: PretrainedConfig,
    *,
    block_size: int = 16,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    rope_theta: float | None = None,
    dflash2_fields: dict | None = None,
) -> Qwen3Config:
    """Generate a DFlash draft config for ``target_config`` (any decoder-only text config).

    ``target_layer_ids`` default: ``build_target_layer_ids(L, num_layers)`` (SpecForge ties K to
    the draft depth when the ids are not given). ``layer_types`` default: all full attention;
    sliding layers need ``sliding_window``. ``rope_theta`` default: the target's, else 1e6.
    ``dflash2_fields`` (a subset of ``dflash2.DEFAULTS``; ``{}`` for all defaults) makes it a
    DFlash2 draft: the fields go into ``dflash_config``.
    Raises ConfigError / ModelError for every invalid field (``check_dflash_config``) and for a
    target whose width or attention layout the draft cannot take.
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    where = "target config"
    hidden, layers = getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None)
    vocab = getattr(text, "padded_vocab_size", None) or getattr(text, "vocab_size", None)
    for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("vocab_size", vocab)):
        if not isinstance(value, int) or value < 1:
            raise ModelError(f"{name} is {value!r}", where=f"{where}: {name}",
                             fix="use a decoder-only text target with a standard Hugging Face config")
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"{num_layers!r} draft layers", where="draft.dflash.num_layers",
                          fix="set draft.dflash.num_layers to an integer >= 1")
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(layers, num_layers)
    if layer_types is None:
        layer_types = [FULL_ATTENTION] * num_layers
    theta = rope_theta if rope_theta is not None else _target_rope_theta(text)
    sliding = sliding_window is not None
    fields = dict(
        architectures=[ARCHITECTURE],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=int(head_dim),
        hidden_act="silu",
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 40960),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
        initializer_range=float(getattr(text, "initializer_range", None) or 0.02),
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=sliding,
        sliding_window=sliding_window,
        layer_types=list(layer_types),
        pad_token_id=0 if getattr(text, "pad_token_id", None) is None else int(text.pad_token_id),
        block_size=block_size,
        num_target_layers=int(layers),
        dflash_config={"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                       **({} if dflash2_fields is None else {**dflash2.DEFAULTS, **dflash2_fields})},
    )
    config = _build(fields, "draft config")
    check_fits_target(config, target_config)
    return config


def _target_rope_theta(text) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    return float(theta) if theta is not None else DEFAULT_ROPE_THETA


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_dflash_config(config: Qwen3Config, where: str = "draft config") -> None:
    """Refuse every DFlash config the draft, the objective or serving cannot use.

    Raises ConfigError for the run-config fields (``draft.dflash.block_size`` ≥ 2,
    ``draft.dflash.num_layers`` ≥ 1, ``draft.dflash.target_layer_ids`` distinct and inside the
    target, ``draft.dflash.mask_token_id`` inside the vocab, ``draft.dflash.layer_types`` one
    known type per layer, ``draft.dflash.sliding_window`` ≥ the block size when a layer slides)
    and ModelError for a layout the draft cannot take (heads not a multiple of KV heads, odd
    head_dim, non-SiLU MLP, biased projections). ``where`` names the draft config (a file path).
    """
    _check_fields(config.to_dict(), where)


def _build(fields: dict, where: str) -> Qwen3Config:
    """``Qwen3Config`` of checked ``fields`` (transformers' own validation comes second)."""
    _check_fields(fields, where)
    extras = {k: fields[k] for k in ("block_size", "num_target_layers", "dflash_config")}
    try:
        config = Qwen3Config(**{k: v for k, v in fields.items() if k not in extras})
    except (TypeError, ValueError) as exc:
        raise ModelError(f"invalid DFlash draft config: {exc}", where=where,
                         fix="correct the field named above") from exc
    for key, value in extras.items():
        setattr(config, key, copy.deepcopy(value))
    return config


def _check_fields(f: dict, where: str) -> None:
    block = f.get("block_size")
    if not _is_int(block) or block < 2:
        raise ConfigError(
            f"block size {block!r}: a DFlash block is the anchor plus at least one masked slot",
            where="draft.dflash.block_size", fix="set draft.dflash.block_size to an integer >= 2 (16 is standard)",
        )
    n = f.get("num_hidden_layers")
    if not _is_int(n) or n < 1:
        raise ConfigError(f"{n!r} draft layers", where="draft.dflash.num_layers",
                          fix="set draft.dflash.num_layers to an integer >= 1")
    target_layers = f.get("num_target_layers")
    if not _is_int(target_layers) or target_layers < 1:
        raise ModelError(f"num_target_layers is {target_layers!r}", where=f"{where}: num_target_layers",
                         fix="generate the draft config from the target (dflash_config_from_target)")
    dflash = f.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        raise ConfigError(f"target layer ids {ids!r} are not a non-empty list of integers",
                          where="draft.dflash.target_layer_ids",
                          fix=f"list distinct target layer ids in [0, {target_layers - 1}]")
    bad = [i for i in ids if not 0 <= i < target_layers]
    if bad:
        raise ConfigError(
            f"target layer ids {bad} are outside the target's {target_layers} layers",
            where="draft.dflash.target_layer_ids", fix=f"use ids in [0, {target_layers - 1}] (output of layer k)",
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"target layer ids {list(ids)} repeat a layer", where="draft.dflash.target_layer_ids",
                          fix="list each captured layer once")
    vocab = f.get("vocab_size")
    mask = dflash.get("mask_token_id")
    if not _is_int(mask) or not 0 <= mask < vocab:
        raise ConfigError(
            f"mask token id {mask!r} is not a row of the target embedding [0, {vocab})",
            where="draft.dflash.mask_token_id",
            fix="set draft.dflash.mask_token_id to an unused embedding row (resolve_mask_token_id)",
        )
    types = list(f.get("layer_types") or [])
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"layer_types {types} must list one of {list(LAYER_TYPES)} for each of the {n} draft layers",
            where="draft.dflash.layer_types", fix=f"give {n} entries, each full_attention or sliding_attention",
        )
    window, use_window = f.get("sliding_window"), f.get("use_sliding_window")
    if SLIDING_ATTENTION in types and (not use_window or not _is_int(window) or window < block):
        raise ConfigError(
            f"sliding layers need use_sliding_window and a window >= the block size {block}, got "
            f"use_sliding_window={use_window}, sliding_window={window!r}",
            where="draft.dflash.sliding_window",
            fix=f"set draft.dflash.sliding_window to an integer >= {block} (e.g. 2048), or use full_attention layers",
        )
    fields2 = dflash2.dflash2_fields(dflash)
    if fields2 is not None:
        dflash2.check_dflash2_fields(fields2, hidden_size=f.get("hidden_size"), block_size=block,
                                     vocab_size=vocab, layer_types=types)
    heads, head_dim = f.get("num_attention_heads"), f.get("head_dim")
    kv = f.get("num_key_value_heads") or heads
    problems = []
    if not (_is_int(heads) and _is_int(kv) and heads > 0 and kv > 0 and heads % kv == 0):
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if not _is_int(head_dim) or head_dim < 2 or head_dim % 2:
        problems.append(f"head_dim {head_dim} is not a positive even number (RoPE rotates pairs)")
    if f.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {f.get('hidden_act')!r} (serving engines take only silu)")
    for flag, bad_value in _UNSUPPORTED.items():
        if f.get(flag) == bad_value:
            problems.append(f"{flag}={bad_value} is not implemented")
    if problems:
        raise ModelError("the draft cannot take this attention layout: " + "; ".join(problems),
                         where=where, fix="generate the draft config from a supported target, or fix the fields named")


def check_fits_target(config: Qwen3Config, target_config: PretrainedConfig, where: str = "draft config") -> None:
    """Refuse a draft config made for another target: width, vocab and depth must be the target's.

    The draft consumes the target's embeddings and feeds the target's LM head, so ``hidden_size``
    and ``vocab_size`` must equal the target's, and ``num_target_layers`` its depth.
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab = getattr(text, "padded_vocab_size", None) or text.vocab_size
    diffs = [
        f"{name}: draft {mine!r} vs target {theirs!r}"
        for name, mine, theirs in (
            ("hidden_size", config.hidden_size, text.hidden_size),
            ("vocab_size", config.vocab_size, vocab),
            ("num_target_layers", getattr(config, "num_target_layers", None), text.num_hidden_layers),
        )
        if mine != theirs
    ]
    if diffs:
        raise ModelError("the DFlash draft does not fit this target: " + "; ".join(diffs), where=where,
                         fix="generate the draft config from this target (dflash_config_from_target)")


def target_layer_ids_of(config: Qwen3Config) -> list[int]:
    """The captured target layers, in ``fc`` input order."""
    return list(config.dflash_config["target_layer_ids"])


def mask_token_id_of(config: Qwen3Config) -> int:
    return int(config.dflash_config["mask_token_id"])


def dflash2_of(config: Qwen3Config) -> dict | None:
    """The DFlash2 fields (conv, selector, sliding masking) of a config, None for plain DFlash."""
    return dflash2.dflash2_fields(config.dflash_config)


def dflash_config_to_dict(config: Qwen3Config) -> dict:
    """The JSON form: the config's fields plus both RoPE forms (``rope_parameters`` and legacy
    ``rope_theta``/``rope_scaling``, which older engines read); no ``auto_map``."""
    out = config.to_dict()
    rope = dict(out["rope_parameters"])
    out["architectures"] = [ARCHITECTURE if dflash2_of(config) is None else dflash2.ARCHITECTURE]
    out["model_type"] = "qwen3"
    out["rope_theta"] = rope["rope_theta"]
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else legacy
    for key in ("_name_or_path", "auto_map"):
        out.pop(key, None)
    return out


def dflash_config_from_dict(data: dict, where: str = "draft config") -> Qwen3Config:
    """Build and validate a DFlash config from JSON (a saved config or an exported ``config.json``).

    ``block_size`` may also sit in ``dflash_config.block_size`` (newer checkpoints). Either
    RoPE form is read. Raises ModelError / ConfigError (``check_dflash_config``).
    """
    data = copy.deepcopy(data)
    dflash = dict(data.get("dflash_config") or {})
    data.setdefault("block_size", dflash.pop("block_size", None))
    if "rope_parameters" not in data or not data["rope_parameters"]:
        scaling = dict(data.get("rope_scaling") or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        scaling["rope_theta"] = float(data.get("rope_theta") or DEFAULT_ROPE_THETA)
        data["rope_parameters"] = scaling
    for legacy in ("rope_scaling", "rope_theta", "torch_dtype", "dtype", "auto_map"):
        data.pop(legacy, None)
    data["dflash_config"] = dflash
    for key in ("transformers_version", "model_type", "output_hidden_states", "return_dict", "id2label",
                "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions"):
        data.pop(key, None)
    data.setdefault("num_key_value_heads", data.get("num_attention_heads"))
    return _build(data, where)


def save_dflash_config(config: Qwen3Config, path: str | Path) -> None:
    """Write the config JSON to ``path`` (via a temporary file and a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dflash_config_to_dict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_dflash_config(path: str | Path) -> Qwen3Config:
    """Read and validate a DFlash config JSON file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read the DFlash draft config: {exc}", where=str(path),
                         fix="point to a valid JSON file") from exc
    return dflash_config_from_dict(data, where=str(path))
