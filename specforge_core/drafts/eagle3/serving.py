"""The EAGLE3 draft's file formats: the serving directory SGLang and vLLM load, and checkpoint files.

    export_draft(model, "drafts/demo", dtype="bfloat16")       # config.json + model.safetensors
    model = load_exported_draft("drafts/demo")                 # same outputs, bit for bit
    save_draft_checkpoint_files(model, step_dir, state_dict)   # draft_config.json + draft.safetensors

The serving directory holds exactly the serving keys: ``fc``, ``midlayer.*`` (SGLang renames it
``layers.0.*``), ``norm``, ``fc_norm.{0,1,2}`` with EAGLE-3.1's ``fc_norm``, ``lm_head`` of
``draft_vocab_size`` rows, ``d2t`` int64 ``[Vd]`` (target
id minus draft id) and ``t2d`` bool ``[V]``; no embedding (the server shares the target's) and no
trainer prefixes. SGLang skips unknown weight names silently and leaves the missing ones random,
so a missing, unexpected or misshapen key is refused here before anything is written. Directories
are written atomically. The exported ``config.json`` records the capture ids twice:
``eagle_config.eagle_aux_hidden_state_layer_ids`` as trained (SGLang reads only these) and a
top-level ``eagle_aux_hidden_state_layer_ids`` one higher (vLLM's numbering: vLLM reads only that
field, and without it uses its default ids, right only when the draft was trained on the default
ones). docs/export.md has the config fields.

Also here, so the format lives in one place: ``load_draft_from_files`` (what checkpoints store)
and ``warm_start_draft`` (start training from an export; its vocab map is kept and a different
one is refused).
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from specforge_core.errors import CheckpointError, ModelError
from specforge_core.io import atomic_write_bytes, atomic_write_json, staged_directory
from specforge_core.loop.checkpoint import DRAFT_CONFIG as CHECKPOINT_CONFIG
from specforge_core.loop.checkpoint import DRAFT_WEIGHTS as CHECKPOINT_WEIGHTS
from specforge_core.drafts.eagle3.draft_config import (
    EAGLE31_FLAGS,
    capture_layer_ids_of,
    draft_config_from_dict,
    serving_config_dict,
    vllm_layer_ids,
)
from specforge_core.drafts.eagle3.model import EMBEDDING_KEY, Eagle3DraftModel

EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Fields a warm start must share with the run's draft config.
_WARM_START_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "hidden_act", "rope_parameters",
)


def serving_keys(config) -> dict[str, tuple[tuple[int, ...], str]]:
    """The serving key set of a draft config: key -> (shape, kind), kind = float / int64 / bool."""
    h, inter = config.hidden_size, config.intermediate_size
    ht = getattr(config, "target_hidden_size", None) or h
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    vd = getattr(config, "draft_vocab_size", None) or config.vocab_size
    shapes = {
        "fc.weight": (h, 3 * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
    }
    if getattr(config, "fc_norm", False):
        shapes.update({f"fc_norm.{i}.weight": (ht,) for i in range(3)})
    keys = {k: (s, "float") for k, s in shapes.items()}
    keys.update({"d2t": ((vd,), "int64"), "t2d": ((config.vocab_size,), "bool")})
    return keys


def check_serving_state(state: dict[str, torch.Tensor], config, where: str) -> None:
    """Raise ModelError naming every missing, unexpected, misshapen or mistyped key."""
    expected = serving_keys(config)
    problems = [f"missing {k}" for k in sorted(set(expected) - set(state))]
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(expected))]
    for key in sorted(set(state) & set(expected)):
        shape, kind = expected[key]
        tensor = state[key]
        got_kind = "float" if tensor.is_floating_point() else str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != shape or got_kind != kind:
            problems.append(f"{key} is {got_kind}{list(tensor.shape)}, expected {kind}{list(shape)}")
    if problems:
        raise ModelError(
            "draft weights do not match the serving key set: " + "; ".join(problems),
            where=where,
            fix="export a checkpoint written by this trainer for this draft config (no renamed or extra tensors)",
        )


def save_draft_checkpoint_files(
    model: Eagle3DraftModel, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Write ``draft_config.json`` + ``draft.safetensors`` (full draft state, no embedding) into
    ``directory`` (created if needed); each file is written to a temporary name and renamed.

    ``state_dict``: the full (unsharded) state to save instead of ``model``'s own, e.g. gathered
    from FSDP2 shards; an embedding entry in it is dropped.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_pair(model, directory, CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS, dtype=None, state_dict=state_dict)


def load_draft_from_files(directory: str | Path, device: str | torch.device = "cpu") -> Eagle3DraftModel:
    """Rebuild the draft of a checkpoint step directory (see ``save_draft_checkpoint_files``).

    Parameters keep the file's dtype; the embedding is absent: call ``load_embedding``.
    """
    return _load_pair(Path(directory), CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS, device)


def load_exported_draft(directory: str | Path, device: str | torch.device = "cpu") -> Eagle3DraftModel:
    """Rebuild a draft from an exported directory; with the same embedding loaded, its outputs are
    bit-identical to the exported model's."""
    return _load_pair(Path(directory), EXPORT_CONFIG, EXPORT_WEIGHTS, device)


def warm_start_draft(directory: str | Path, config=None, device: str | torch.device = "cpu") -> Eagle3DraftModel:
    """A draft initialised from an exported directory, for further training.

    Its vocab map comes from the directory and is locked (``set_vocab_map`` refuses another).
    With ``config`` (the run's draft config), every shape-relevant field and the capture ids must
    match; ModelError names each difference.
    """
    model = load_exported_draft(directory, device)
    if config is not None:
        diffs = [
            f"{name}: run {getattr(config, name, None)!r} vs {directory} {getattr(model.config, name, None)!r}"
            for name in _WARM_START_FIELDS
            if getattr(config, name, None) != getattr(model.config, name, None)
        ]
        diffs += [f"{flag}: run {bool(getattr(config, flag, False))} vs {directory} "
                  f"{bool(getattr(model.config, flag, False))}"
                  for flag in EAGLE31_FLAGS
                  if bool(getattr(config, flag, False)) != bool(getattr(model.config, flag, False))]
        if capture_layer_ids_of(config) != capture_layer_ids_of(model.config):
            diffs.append(
                f"capture layer ids: run {capture_layer_ids_of(config)} vs {capture_layer_ids_of(model.config)}"
            )
        if diffs:
            raise ModelError(
                "the warm-start draft does not fit this run: " + "; ".join(diffs),
                where="draft.init_from",
                fix="warm-start from a draft exported for the same target and draft settings",
            )
    model.vocab_map_origin = str(directory)
    return model


def export_draft(model: Eagle3DraftModel, out_dir: str | Path, dtype: str = "keep") -> Path:
    """Write ``config.json`` + ``model.safetensors`` for serving into ``out_dir`` (atomically).

    ``dtype``: ``keep`` (the parameters' dtype) or one of ``DTYPES``. ``out_dir`` must be absent,
    empty, or a previous export (which is replaced). Raises ModelError before writing anything if
    the weights are not exactly the serving key set.
    """
    if dtype != "keep" and dtype not in DTYPES:
        raise ModelError(
            f"unknown export dtype {dtype!r}", where="--dtype", fix=f"use keep or one of {', '.join(DTYPES)}"
        )
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and set(p.name for p in out.iterdir()) <= {EXPORT_CONFIG, EXPORT_WEIGHTS}):
        raise CheckpointError(
            "the export directory holds other files", where=str(out), fix="choose an empty or new --out directory"
        )
    ids = capture_layer_ids_of(model.config)
    # vLLM reads only a top-level copy, in its own numbering, and uses its default ids without one
    for_vllm = {} if ids is None else {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(ids)}
    with staged_directory(out, replace=True) as stage:
        _write_pair(model, stage, EXPORT_CONFIG, EXPORT_WEIGHTS, dtype=None if dtype == "keep" else DTYPES[dtype],
                    extra=for_vllm)
    return out


def _write_pair(model, directory: Path, config_name: str, weights_name: str, dtype, state_dict=None,
                extra: dict | None = None) -> None:
    source = model.draft_state_dict() if state_dict is None else state_dict
    state = {}
    for key, tensor in source.items():
        if key == EMBEDDING_KEY:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[key] = tensor.detach().to("cpu").contiguous()
    check_serving_state(state, model.config, where=str(directory / weights_name))
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) != 1:
        raise ModelError(f"draft parameters mix dtypes {sorted(map(str, floats))}", where="draft model",
                         fix="cast all draft parameters to one dtype before saving")
    config = serving_config_dict(model.config, dtype=str(floats.pop()).removeprefix("torch.")) | (extra or {})
    atomic_write_bytes(directory / weights_name, save(state, metadata={"format": "pt"}))
    atomic_write_json(directory / config_name, config, sort_keys=True)


def _load_pair(directory: Path, config_name: str, weights_name: str, device) -> Eagle3DraftModel:
    config_path, weights_path = directory / config_name, directory / weights_name
    for p in (config_path, weights_path):
        if not p.is_file():
            raise CheckpointError(
                f"missing {p.name}", where=str(directory), fix=f"expected {config_name} and {weights_name}"
            )
    config = draft_config_from_dict(json.loads(config_path.read_text()), where=str(config_path))
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    check_serving_state(state, config, where=str(weights_path))
    model = Eagle3DraftModel(config)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model.cast_params(dtype)
    model.load_state_dict(state, strict=False)  # strict key check done above; embedding is absent
    return model.to(device)
