"""DSpark draft configurations: a DFlash config plus the fields of the Markov and confidence heads.

    from specforge_core.drafts.dspark.settings import dspark_config_from_target
    cfg = dspark_config_from_target(target_cfg, block_size=8, num_layers=1, mask_token_id=mask,
                                    markov_rank=256, markov_head_type="vanilla")

A DSpark config is the DFlash ``Qwen3Config`` (``drafts.dflash.draft_config``: width, attention layout,
RoPE, ``block_size``, ``dflash_config{target_layer_ids, mask_token_id}``) with
``architectures: ["Qwen3DSparkModel"]`` (the name SGLang and vLLM load DSpark drafts by) and a
``dspark_config`` dict (its JSON form repeats these fields at the top level, where vLLM and
SGLang's confidence head read them):

- ``markov_rank`` (256; 0 disables the Markov head): rank r of the logit bias ``W2 · W1[prev]``;
- ``markov_head_type`` (``vanilla``): ``vanilla`` (first-order bias from the previous token),
  ``gated`` (the previous token's embedding gated by the slot's hidden), ``rnn`` (a recurrent state
  over the block's slots);
- ``enable_confidence_head`` (True): a linear head predicting each slot's acceptance probability;
- ``confidence_head_with_markov`` (True): its input is ``[hidden ; W1[prev]]`` (needs r > 0);
- ``sample_from_anchor`` (True): slot k predicts token ``a+k+1``, so the anchor slot drafts too
  (B drafts per block); False is DFlash's convention (slot k predicts ``a+k``, B-1 drafts).

These are speculators 0.9.0's ``DSparkSpeculatorConfig`` fields and defaults. Every function
refuses an invalid value with a ConfigError naming the run-config field (``draft.dspark.*``).
"""

import copy
import json
import os
from pathlib import Path

from transformers import PretrainedConfig, Qwen3Config

from specforge_core.drafts.dflash.draft_config import (
    check_dflash_config,
    dflash_config_from_dict,
    dflash_config_from_target,
    dflash_config_to_dict,
)
from specforge_core.errors import ConfigError, ModelError

ARCHITECTURE = "Qwen3DSparkModel"  # the class SGLang and vLLM register for DSpark drafts
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULTS = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "sample_from_anchor": True,
}


def check_dspark_fields(fields: dict) -> None:
    """Refuse a ``dspark_config`` the model cannot build: unknown keys, wrong types, a negative
    rank, an unknown head type, or a confidence head fed by a Markov head that does not exist."""
    unknown = sorted(set(fields) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown DSpark fields {unknown}", where="draft.dspark",
                          fix=f"use only {', '.join(DEFAULTS)}")
    rank = fields["markov_rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"markov_rank {rank!r}", where="draft.dspark.markov_rank",
                          fix="set an integer >= 0 (256 is standard; 0 disables the Markov head)")
    if fields["markov_head_type"] not in MARKOV_HEAD_TYPES:
        raise ConfigError(f"markov_head_type {fields['markov_head_type']!r}", where="draft.dspark.markov_head_type",
                          fix=f"use one of {', '.join(MARKOV_HEAD_TYPES)}")
    for flag in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if not isinstance(fields[flag], bool):
            raise ConfigError(f"{flag} {fields[flag]!r} is not a boolean", where=f"draft.dspark.{flag}",
                              fix="set true or false")
    if fields["enable_confidence_head"] and fields["confidence_head_with_markov"] and rank == 0:
        raise ConfigError(
            "confidence_head_with_markov reads the Markov head, but markov_rank is 0",
            where="draft.dspark.confidence_head_with_markov",
            fix="set draft.dspark.confidence_head_with_markov: false, or markov_rank > 0",
        )


def dspark_fields(config: Qwen3Config) -> dict:
    """The config's ``dspark_config`` with every default filled in."""
    return DEFAULTS | dict(getattr(config, "dspark_config", None) or {})


def check_dspark_config(config: Qwen3Config, where: str = "draft config") -> None:
    """The DFlash checks (``check_dflash_config``) plus ``check_dspark_fields``."""
    check_dflash_config(config, where)
    check_dspark_fields(dspark_fields(config))


def dspark_config_from_target(target_config: PretrainedConfig, *, mask_token_id: int, block_size: int = 8,
                              num_layers: int = 1, target_layer_ids=None, layer_types=None,
                              sliding_window=None, rope_theta=None, **dspark) -> Qwen3Config:
    """A DSpark config for ``target_config``: ``dflash_config_from_target`` with the same
    arguments, plus the ``dspark`` fields (module docstring; unset ones take their defaults)."""
    config = dflash_config_from_target(
        target_config, block_size=block_size, num_layers=num_layers, target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id, layer_types=layer_types, sliding_window=sliding_window, rope_theta=rope_theta,
    )
    return _with_dspark(config, dspark)


def _with_dspark(config: Qwen3Config, dspark: dict) -> Qwen3Config:
    fields = DEFAULTS | dict(dspark)
    check_dspark_fields(fields)
    config.architectures = [ARCHITECTURE]
    config.dspark_config = copy.deepcopy(fields)
    return config


def dspark_config_to_dict(config: Qwen3Config) -> dict:
    """The JSON form: DFlash's (``dflash_config_to_dict``) with the DSpark architecture and fields
    (in ``dspark_config`` and at the top level)."""
    out = dflash_config_to_dict(config)
    out["architectures"] = [ARCHITECTURE]
    out["dspark_config"] = dspark_fields(config)
    out.update(dspark_fields(config))
    return out


def dspark_config_from_dict(data: dict, where: str = "draft config") -> Qwen3Config:
    """Build and validate a DSpark config from its JSON form."""
    data = copy.deepcopy(data)
    dspark = data.pop("dspark_config", None)
    if dspark is None:
        raise ModelError("no dspark_config in a DSpark draft config", where=where,
                         fix="point at a DSpark draft (exported or saved by this trainer)")
    for key in DEFAULTS:
        data.pop(key, None)  # the top-level copies
    data["architectures"] = [ARCHITECTURE]
    return _with_dspark(dflash_config_from_dict(data, where), dspark)


def save_dspark_config(config: Qwen3Config, path: str | Path) -> None:
    """Write the config JSON to ``path`` (via a temporary file and a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dspark_config_to_dict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_dspark_config(path: str | Path) -> Qwen3Config:
    """Read and validate a DSpark config JSON file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read the DSpark draft config: {exc}", where=str(path),
                         fix="point to a valid JSON file") from exc
    return dspark_config_from_dict(data, where=str(path))
