"""Export a DFlash draft as the directory SGLang (``--speculative-algorithm DFLASH``) and vLLM
(``method: dflash``) load; reload and warm-start from it.

    out = export_dflash(draft, "drafts/qwen3-8b-dflash", dtype="bfloat16")
    again = load_exported_dflash(out)               # bit-identical outputs
    draft = warm_start_dflash(out, run_config)      # refuses a draft made for other settings

The directory holds ``config.json`` (``architectures:
["DFlashDraftModel"]``, ``model_type: qwen3``, ``block_size``, ``num_target_layers``,
``layer_types``, ``dflash_config{target_layer_ids, mask_token_id}``, ``vocab_size`` = the
target's, both RoPE forms, no ``auto_map``) and ``model.safetensors`` with exactly the draft's
parameter names (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``), no ``model.`` prefix, no embedding and no LM head. SGLang ignores unknown keys and so
would serve a misnamed draft silently wrong: a missing, unexpected or misshapen key is refused
before anything is written. The directory is written atomically (a temporary sibling directory,
then a rename).
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from specforge_core.drafts.dflash.draft_config import (
    dflash2_of,
    dflash_config_from_dict,
    dflash_config_to_dict,
    target_layer_ids_of,
)
from specforge_core.drafts.dflash import dflash2
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.errors import CheckpointError, ModelError
from specforge_core.io import atomic_write_bytes, atomic_write_json, staged_directory
from specforge_core.loop.checkpoint import DRAFT_CONFIG as CHECKPOINT_CONFIG
from specforge_core.loop.checkpoint import DRAFT_WEIGHTS as CHECKPOINT_WEIGHTS

EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Fields a warm start must share with the run's draft config.
_WARM_START_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rms_norm_eps", "hidden_act", "rope_parameters", "layer_types", "sliding_window",
    "block_size", "num_target_layers",
)


def serving_keys(config) -> dict[str, tuple[int, ...]]:
    """Key → shape of the serving state of a DFlash config."""
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    keys = {"fc.weight": (h, len(target_layer_ids_of(config)) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        keys.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    extra = dflash2_of(config)
    if extra is not None:
        taps, groups, rank = extra["conv_kernel_size"], h // extra["conv_group_size"], extra["selector_rank"]
        for i in range(config.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                keys[f"layers.{i}.{conv}.base_kernel"] = (2, taps, h)
                keys[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
        keys.update({"candidate_selector.predecessor_codebook": (config.vocab_size, rank),
                     "candidate_selector.successor_codebook": (config.vocab_size, rank),
                     "candidate_selector.hidden_projection.weight": (rank, h)})
    return keys


def check_serving_state(state: dict[str, torch.Tensor], config, where: str) -> None:
    """Raise ModelError naming every missing, unexpected, misshapen or non-float key (a wrong
    ``fc.weight`` shape means the captured layer count K is wrong)."""
    expected = serving_keys(config)
    problems = [f"missing {k}" for k in sorted(set(expected) - set(state))]
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(expected))]
    for key in sorted(set(state) & set(expected)):
        tensor = state[key]
        if tuple(tensor.shape) != expected[key] or not tensor.is_floating_point():
            problems.append(f"{key} is {tensor.dtype}{list(tensor.shape)}, expected float{list(expected[key])}")
    if problems:
        raise ModelError(
            "DFlash weights do not match the serving key set: " + "; ".join(problems),
            where=where,
            fix="export a draft built for this config (no renamed, prefixed or extra tensors)",
        )


class DraftFiles(NamedTuple):
    """How a DFlash-family draft's config + weights pair is written and read: its model class, its
    key check and its config dict codec (DSpark passes its own)."""

    model_class: type
    check_state: Callable[[dict, Any, str], None]
    to_dict: Callable[[Any], dict]
    from_dict: Callable[..., Any]


DFLASH_FILES = DraftFiles(DFlashDraftModel, check_serving_state, dflash_config_to_dict, dflash_config_from_dict)


def write_file_pair(model, directory: Path, config_name: str, weights_name: str, dtype: str,
                    state_dict: dict[str, torch.Tensor] | None = None, files: "DraftFiles | None" = None) -> None:
    """Check and write the config + weights pair into ``directory`` (each file atomically)."""
    files = files or DFLASH_FILES
    source = model.draft_state_dict() if state_dict is None else state_dict
    state = {}
    for key, tensor in source.items():
        if dtype != "keep" and tensor.is_floating_point():
            tensor = tensor.to(DTYPES[dtype])
        state[key] = tensor.detach().to("cpu").contiguous()
    files.check_state(state, model.config, str(directory / weights_name))
    floats = {t.dtype for t in state.values()}
    if len(floats) != 1:
        raise ModelError(f"draft parameters mix dtypes {sorted(map(str, floats))}", where="draft model",
                         fix="cast all draft parameters to one dtype (cast_params) or export with --dtype")
    config = files.to_dict(model.config)
    config["torch_dtype"] = config["dtype"] = str(floats.pop()).removeprefix("torch.")
    atomic_write_bytes(directory / weights_name, save(state, metadata={"format": "pt"}))
    atomic_write_json(directory / config_name, config, sort_keys=True)


def load_file_pair(directory: Path, config_name: str, weights_name: str, device,
                   files: "DraftFiles | None" = None) -> nn.Module:
    """The draft written by :func:`write_file_pair`, checked against its config."""
    files = files or DFLASH_FILES
    config_path, weights_path = directory / config_name, directory / weights_name
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"missing {path.name}", where=str(directory),
                                  fix=f"expected {config_name} and {weights_name}")
    config = files.from_dict(json.loads(config_path.read_text()), where=str(config_path))
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    files.check_state(state, config, str(weights_path))
    model = files.model_class(config).cast_params(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model.to(device)


def export_dflash(model: DFlashDraftModel, out_dir: str | Path, dtype: str = "keep",
                  state_dict: dict[str, torch.Tensor] | None = None, files: DraftFiles | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` atomically; return it.

    ``dtype``: ``keep`` or one of ``DTYPES``. ``state_dict``: the full (unsharded) state to write
    instead of ``model``'s, e.g. gathered from FSDP2 shards. ``out_dir`` must be absent, empty or
    a previous export (replaced). Raises ModelError before writing if the weights are not
    exactly the serving key set, CheckpointError if ``out_dir`` holds other files. ``files``: the
    family's file set for a draft built on DFlash's (DSpark's), DFlash's by default.
    """
    if dtype != "keep" and dtype not in DTYPES:
        raise ModelError(f"unknown export dtype {dtype!r}", where="--dtype",
                         fix=f"use keep or one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and {p.name for p in out.iterdir()} <= {EXPORT_CONFIG, EXPORT_WEIGHTS}):
        raise CheckpointError("the export directory holds other files", where=str(out),
                              fix="choose an empty or new output directory")
    with staged_directory(out, replace=True) as stage:
        write_file_pair(model, stage, EXPORT_CONFIG, EXPORT_WEIGHTS, dtype, state_dict, files=files)
    return out


def load_exported_dflash(directory: str | Path, device: str | torch.device = "cpu",
                         files: DraftFiles | None = None) -> DFlashDraftModel:
    """Rebuild a draft from an export (parameters in the file's dtype): with the same target
    embedding and head, its outputs are bit-identical to the exported model's."""
    return load_file_pair(Path(directory), EXPORT_CONFIG, EXPORT_WEIGHTS, device, files=files)


def save_dflash_checkpoint_files(model: DFlashDraftModel, directory: str | Path,
                                 state_dict: dict[str, torch.Tensor] | None = None,
                                 files: DraftFiles | None = None) -> None:
    """``draft_config.json`` + ``draft.safetensors`` of a checkpoint step directory (fp32 masters
    as given: ``state_dict`` is the full state gathered from FSDP2 shards)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_file_pair(model, directory, CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS, "keep", state_dict, files=files)


def load_dflash_from_files(directory: str | Path, device: str | torch.device = "cpu",
                           files: DraftFiles | None = None) -> DFlashDraftModel:
    """The draft of a checkpoint step directory (see ``save_dflash_checkpoint_files``)."""
    return load_file_pair(Path(directory), CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS, device, files=files)


def warm_start_dflash(directory: str | Path, config=None, device: str | torch.device = "cpu") -> DFlashDraftModel:
    """A draft initialised from an export, for further training.

    With ``config`` (the run's DFlash config), every shape- or semantics-relevant field — widths,
    layer layout, RoPE, block size, target layer ids and mask id — must match; ModelError names
    each difference.
    """
    model = load_exported_dflash(directory, device)
    if config is not None:
        diffs = [
            f"{name}: run {getattr(config, name, None)!r} vs {directory} {getattr(model.config, name, None)!r}"
            for name in _WARM_START_FIELDS
            if getattr(config, name, None) != getattr(model.config, name, None)
        ]
        for name in ("target_layer_ids", "mask_token_id", *dflash2.DEFAULTS):
            mine, theirs = config.dflash_config.get(name), model.config.dflash_config.get(name)
            if mine != theirs:
                diffs.append(f"dflash_config.{name}: run {mine!r} vs {directory} {theirs!r}")
        if diffs:
            raise ModelError(
                "the warm-start DFlash draft does not fit this run: " + "; ".join(diffs),
                where="draft.init_from",
                fix="warm-start from a DFlash draft exported for the same target and draft.dflash settings",
            )
    return model
