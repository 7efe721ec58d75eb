"""DSpark draft files: a checkpoint step's pair, our export, reload and warm start.

    out = export_dspark(draft, "drafts/smollm2-dspark", dtype="bfloat16")
    again = load_exported_dspark(out)                 # bit-identical outputs
    draft = warm_start_dspark(out, run_config)        # refuses a draft made for other settings

An export is ``config.json`` (the DFlash fields, ``architectures: ["Qwen3DSparkModel"]`` and
the DSpark fields: ``settings.dspark_config_to_dict``) and ``model.safetensors`` holding DFlash's
serving keys plus the heads' (``markov_head.markov_w1.weight`` ``[V, r]``, ``markov_head.markov_w2.weight`` ``[V, r]``, the
``gate_proj`` or ``joint_proj`` weight and bias of a gated or rnn head,
``confidence_head.proj.{weight,bias}``). A missing, unexpected or misshapen key is refused before
anything is written; directories are written atomically. vLLM's layout is ``speculators_format``.
"""

from pathlib import Path

import torch

from specforge_core.drafts.dflash.serving import (
    _WARM_START_FIELDS, DraftFiles, export_dflash, load_dflash_from_files, load_exported_dflash,
    save_dflash_checkpoint_files, serving_keys,
)
from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.settings import dspark_config_from_dict, dspark_config_to_dict, dspark_fields
from specforge_core.errors import ModelError


def dspark_keys(config) -> dict[str, tuple[int, ...]]:
    """Key → shape of a DSpark draft's tensors: DFlash's serving keys and the heads'."""
    keys = serving_keys(config)
    f, v, h = dspark_fields(config), config.vocab_size, config.hidden_size
    r = f["markov_rank"]
    if r:
        keys |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
        if f["markov_head_type"] == "gated":
            keys |= {"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)}
        elif f["markov_head_type"] == "rnn":
            keys |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)}
    if f["enable_confidence_head"]:
        width = h + (r if f["confidence_head_with_markov"] else 0)
        keys |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return keys


def check_dspark_state(state: dict[str, torch.Tensor], config, where: str) -> None:
    """Raise ModelError naming every missing, unexpected, misshapen or non-float key."""
    expected = dspark_keys(config)
    problems = [f"missing {k}" for k in sorted(set(expected) - set(state))]
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(expected))]
    for key in sorted(set(state) & set(expected)):
        if tuple(state[key].shape) != expected[key] or not state[key].is_floating_point():
            problems.append(f"{key} is {state[key].dtype}{list(state[key].shape)}, expected float{list(expected[key])}")
    if problems:
        raise ModelError("DSpark weights do not match the draft's key set: " + "; ".join(problems), where=where,
                         fix="write a draft built for this config (no renamed, prefixed or extra tensors)")


DSPARK_FILES = DraftFiles(DSparkDraftModel, check_dspark_state, dspark_config_to_dict, dspark_config_from_dict)


def export_dspark(model: DSparkDraftModel, out_dir: str | Path, dtype: str = "keep", state_dict=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` atomically; return it
    (``dtype``: ``keep`` or one of ``DTYPES``; ``state_dict``: e.g. gathered from FSDP2 shards)."""
    return export_dflash(model, out_dir, dtype, state_dict, files=DSPARK_FILES)


def load_exported_dspark(directory: str | Path, device="cpu") -> DSparkDraftModel:
    return load_exported_dflash(directory, device, files=DSPARK_FILES)


def save_dspark_checkpoint_files(model: DSparkDraftModel, directory: str | Path, state_dict=None) -> None:
    """``draft_config.json`` + ``draft.safetensors`` of a checkpoint step directory."""
    save_dflash_checkpoint_files(model, directory, state_dict, files=DSPARK_FILES)


def load_dspark_from_files(directory: str | Path, device="cpu") -> DSparkDraftModel:
    return load_dflash_from_files(directory, device, files=DSPARK_FILES)


def warm_start_dspark(directory: str | Path, config=None, device="cpu") -> DSparkDraftModel:
    """A draft initialised from an export; with ``config`` (the run's), every shape- or
    semantics-relevant field must match (ModelError names each difference)."""
    model = load_exported_dspark(directory, device)
    if config is not None:
        diffs = [f"{name}: run {getattr(config, name, None)!r} vs {directory} {getattr(model.config, name, None)!r}"
                 for name in _WARM_START_FIELDS if getattr(config, name, None) != getattr(model.config, name, None)]
        for group, mine, theirs in (("dflash_config", config.dflash_config, model.config.dflash_config),
                                    ("dspark_config", dspark_fields(config), dspark_fields(model.config))):
            diffs += [f"{group}.{k}: run {mine.get(k)!r} vs {directory} {theirs.get(k)!r}"
                      for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if diffs:
            raise ModelError("the warm-start DSpark draft does not fit this run: " + "; ".join(diffs),
                             where="draft.init_from",
                             fix="warm-start from a DSpark draft exported for the same target and draft.dspark settings")
    return model
