"""EAGLE3 draft configurations: generated from a target config, or read from a draft JSON.

    from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
    cfg = draft_config_from_target(AutoConfig.from_pretrained(target_dir), draft_vocab_size=32000)

A draft config is a transformers ``LlamaConfig`` with one decoder layer and the EAGLE3 fields
(``draft_vocab_size``, ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``,
and, only when on, EAGLE-3.1's ``fc_norm`` and ``norm_output``: see ``model.py``). It works for Llama, Qwen2, Qwen3 and Mistral-style targets: their RoPE is
copied as transformers 5 ``rope_parameters`` (legacy ``rope_theta``/``rope_scaling`` are read too)
and evaluated later by transformers' own RoPE code, so the draft rotates exactly like the target.

``serving_config_dict`` is the draft config as SGLang and vLLM read it (``architectures:
[LlamaForCausalLMEagle3]``, both RoPE field forms, capture layer ids); ``vllm_layer_ids`` gives
the capture ids in vLLM's numbering, which an export writes beside them.
"""

import copy
import json
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PretrainedConfig

from specforge_core.errors import ModelError

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX_HIDDEN_STATES = 3
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Target fields the draft inherits as they are (a field the target lacks keeps LlamaConfig's default).
_INHERITED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
)
# EAGLE3 variants we do not implement; a draft JSON asking for them is refused, not half-honoured.
_UNSUPPORTED_FLAGS = {"norm_before_fc": True, "attention_bias": True, "mlp_bias": True}
# EAGLE-3.1's options (model.py): written into a config only when on, so a config without them is
# today's EAGLE3 and keeps its identity (the resume contract hashes the config).
EAGLE31_FLAGS = ("fc_norm", "norm_output")


def default_capture_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE3 default ``[1, N//2 - 1, N - 4]`` (output-of-layer convention)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def three_distinct_layer_ids(ids: list[int]) -> bool:
    """Whether ``ids`` are 3 distinct non-negative layer ids, the layers the draft's ``fc`` fuses:
    the run config's rule on ``model.capture_layer_ids`` (``family.check_config``), before any
    target is known."""
    return (len(ids) == NUM_AUX_HIDDEN_STATES and len(set(ids)) == len(ids)
            and all(isinstance(i, int) and i >= 0 for i in ids))


def check_capture_layer_ids(
    ids: list[int] | None, num_layers: int, where: str = "model.capture_layer_ids"
) -> list[int]:
    """Return the capture ids to use (``ids`` or the default), checked against ``num_layers``.

    Raises ModelError when there are not exactly 3 distinct ids inside ``[0, num_layers)``; the
    default fails that for targets with fewer than 7 layers, and the message says to set the ids.
    """
    chosen = list(default_capture_layer_ids(num_layers) if ids is None else ids)
    if not three_distinct_layer_ids(chosen) or max(chosen) >= num_layers:
        origin = "the default [1, N//2-1, N-4]" if ids is None else "the configured ids"
        raise ModelError(
            f"capture layer ids {chosen} ({origin}) do not fit a target with {num_layers} layers: "
            f"need 3 distinct ids in [0, {num_layers - 1}]",
            where=where,
            fix=f"set {where} to 3 distinct layer ids between 0 and {num_layers - 1}, e.g. low, middle, high",
        )
    return chosen


def rope_parameters_of(config: Any, where: str = "rope") -> dict:
    """The RoPE of a config as one flat transformers-5 ``rope_parameters`` dict.

    Reads ``rope_parameters`` (transformers 5) or legacy ``rope_theta`` + ``rope_scaling`` (an
    object or a plain dict). Per-layer-type nested parameters use their ``full_attention`` entry.
    Raises ModelError for RoPE types other than ``SUPPORTED_ROPE_TYPES``.
    """
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    params = copy.deepcopy(get("rope_parameters", None) or get("rope_scaling", None) or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    theta = params.get("rope_theta", get("rope_theta", None))
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    params.pop("mrope_section", None)  # multimodal sections do not apply to a text-only draft
    params.pop("mrope_interleaved", None)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"RoPE type {params['rope_type']!r} is not supported by the EAGLE3 draft",
            where=where,
            fix=f"use a target whose RoPE is one of {', '.join(SUPPORTED_ROPE_TYPES)}, "
            "or give draft.config_path a draft JSON with a supported rope_parameters",
        )
    return params


def draft_config_from_target(
    target_config: PretrainedConfig,
    draft_vocab_size: int,
    capture_layer_ids: list[int] | None = None,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> LlamaConfig:
    """Generate the draft config for ``target_config`` (Llama, Qwen2, Qwen3, Mistral, ...).

    The draft has the target's width, heads, head_dim, MLP size, norm eps, activation and RoPE,
    one layer, ``vocab_size`` = target vocab, ``draft_vocab_size`` = Vd, ``target_hidden_size`` =
    target width, and the capture ids (default ``[1, N//2-1, N-4]``) in ``eagle_config``;
    ``fc_norm`` / ``norm_output``: EAGLE-3.1's options (recorded only when on). Raises ModelError when Vd exceeds the target vocab or the capture ids do not fit.
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab = int(getattr(text, "padded_vocab_size", None) or text.vocab_size)
    if not 0 < draft_vocab_size <= vocab:
        raise ModelError(
            f"draft vocab size {draft_vocab_size} must be between 1 and the target vocab {vocab}",
            where="draft.draft_vocab_size",
            fix=f"set draft.draft_vocab_size to at most {vocab}",
        )
    ids = check_capture_layer_ids(capture_layer_ids, int(text.num_hidden_layers))
    fields: dict[str, Any] = {}
    for name in _INHERITED_FIELDS:
        value = getattr(text, name, None)
        if value is not None:
            fields[name] = value
    pad = getattr(text, "pad_token_id", None)
    fields.update(
        architectures=[DRAFT_ARCHITECTURE],
        num_hidden_layers=1,
        vocab_size=vocab,
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=int(text.hidden_size),
        num_aux_hidden_states=NUM_AUX_HIDDEN_STATES,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids},
        rope_parameters=rope_parameters_of(text, where="target config RoPE"),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=0 if pad is None else int(pad),
    )
    for flag, on in zip(EAGLE31_FLAGS, (fc_norm, norm_output)):
        if on:
            fields[flag] = True
    return LlamaConfig(**fields)


def draft_config_from_dict(data: dict, where: str = "draft config") -> LlamaConfig:
    """Build a draft config from a JSON dict (a draft config file or an exported ``config.json``).

    Accepts either RoPE form; forces ``num_hidden_layers`` to 1 and ``tie_word_embeddings`` to
    false, defaults ``draft_vocab_size`` to ``vocab_size`` and ``target_hidden_size`` to
    ``hidden_size``; ``fc_norm`` / ``norm_output`` must be booleans and are kept only when true.
    Raises ModelError for more than one layer, ``fc_norm`` together with ``norm_before_fc``, or an
    EAGLE3 variant we do not implement (norm_before_fc, biased linears).
    """
    data = copy.deepcopy(data)
    if data.get("fc_norm") and data.get("norm_before_fc"):
        raise ModelError(
            "fc_norm and norm_before_fc are mutually exclusive: fc_norm normalises each captured layer "
            "before fc, norm_before_fc their concatenation, and both would norm twice",
            where=f"{where}: fc_norm, norm_before_fc",
            fix="remove norm_before_fc (EAGLE-3.1's per-layer fc_norm is the one this trainer implements)",
        )
    for flag in EAGLE31_FLAGS:
        if not isinstance(data.get(flag, False), bool):
            raise ModelError(f"{flag}={data[flag]!r} is not a boolean", where=f"{where}: {flag}",
                             fix=f"set {flag} to true or false")
        if not data.get(flag, False):
            data.pop(flag, None)
    for flag, bad_value in _UNSUPPORTED_FLAGS.items():
        if data.get(flag, not bad_value) == bad_value:
            raise ModelError(
                f"{flag}={bad_value} is an EAGLE3 variant this trainer does not implement",
                where=f"{where}: {flag}",
                fix=f"remove {flag} from the draft config",
            )
    if data.get("num_hidden_layers", 1) != 1:
        raise ModelError(
            f"an EAGLE3 draft has exactly one decoder layer, got num_hidden_layers={data['num_hidden_layers']}",
            where=f"{where}: num_hidden_layers",
            fix="set num_hidden_layers to 1",
        )
    _drop_vllm_layer_ids(data, where)
    rope = rope_parameters_of(data, where=f"{where}: rope_parameters")
    for legacy in ("rope_scaling", "rope_theta", "rope_parameters", "torch_dtype", "dtype"):
        data.pop(legacy, None)
    data.update(num_hidden_layers=1, tie_word_embeddings=False, rope_parameters=rope)
    data.setdefault("draft_vocab_size", data.get("vocab_size"))
    data.setdefault("target_hidden_size", data.get("hidden_size"))
    data.setdefault("architectures", [DRAFT_ARCHITECTURE])
    data.setdefault("num_aux_hidden_states", NUM_AUX_HIDDEN_STATES)
    if data["num_aux_hidden_states"] != NUM_AUX_HIDDEN_STATES:
        raise ModelError(
            f"num_aux_hidden_states={data['num_aux_hidden_states']}: this draft takes exactly 3 captured layers",
            where=f"{where}: num_aux_hidden_states",
            fix="set num_aux_hidden_states to 3 (or remove it)",
        )
    try:
        return LlamaConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"invalid draft config: {exc}", where=where, fix="correct the field named above") from exc


def vllm_layer_ids(capture_layer_ids: list[int]) -> list[int]:
    """Our capture ids in vLLM's and speculators' numbering: our id k is the output of decoder
    layer k (SGLang's numbering), theirs the residual stream entering a layer, so k + 1."""
    return [k + 1 for k in capture_layer_ids]


def _drop_vllm_layer_ids(data: dict, where: str) -> None:
    """Remove the top-level ``eagle_aux_hidden_state_layer_ids`` an export writes for vLLM (ours + 1,
    derived again on every export); ModelError when it disagrees with ``eagle_config`` or stands
    alone, since the trained ids would then be unknown."""
    top = data.pop("eagle_aux_hidden_state_layer_ids", None)
    if top is None:
        return
    ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None or vllm_layer_ids(ids) != list(top):
        raise ModelError(
            f"top-level eagle_aux_hidden_state_layer_ids {top} (vLLM's numbering: the input of layer k) "
            f"does not match eagle_config.eagle_aux_hidden_state_layer_ids {ids} (the output of layer k) + 1",
            where=f"{where}: eagle_aux_hidden_state_layer_ids",
            fix=f"set eagle_config.eagle_aux_hidden_state_layer_ids to {[k - 1 for k in top]} (the same layers in "
            "our numbering) and remove the top-level field, or remove the top-level field if eagle_config is right",
        )


def load_draft_config(path: str | Path) -> LlamaConfig:
    """Read a draft config JSON file (see ``draft_config_from_dict``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"cannot read draft config: {exc}", where=str(path), fix="point to a valid JSON file"
        ) from exc
    return draft_config_from_dict(data, where=str(path))


def capture_layer_ids_of(config: LlamaConfig) -> list[int] | None:
    """The capture ids recorded in a draft config's ``eagle_config``, if any."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids is not None else None


def serving_config_dict(config: LlamaConfig, dtype: str | None = None) -> dict:
    """The exported ``config.json``: the draft config plus what serving engines of every age read.

    Both RoPE forms are written: transformers-5 ``rope_parameters`` and legacy top-level
    ``rope_theta`` + ``rope_scaling`` (``null`` for default RoPE, else the scaling dict without
    the theta). ``dtype`` (e.g. ``"bfloat16"``) is written as ``torch_dtype`` and ``dtype``.
    This dict is also what checkpoints store and the resume contract hashes; the export adds the
    vLLM-numbered ids (``serving.export_draft``).
    """
    out = config.to_dict()
    rope = rope_parameters_of(out)
    out["architectures"] = [DRAFT_ARCHITECTURE]
    out["model_type"] = "llama"
    out["num_hidden_layers"] = 1
    out["tie_word_embeddings"] = False
    out["rope_parameters"] = rope
    out["rope_theta"] = rope["rope_theta"]
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if rope["rope_type"] == "default" else legacy
    out["num_aux_hidden_states"] = NUM_AUX_HIDDEN_STATES
    out.pop("eagle_aux_hidden_state_layer_ids", None)  # vLLM's copy, derived by the export alone
    out.pop("_name_or_path", None)
    if dtype is not None:
        out["torch_dtype"] = dtype
        out["dtype"] = dtype
    return out
