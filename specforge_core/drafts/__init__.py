"""Draft families: the one seam where a family plugs in its draft model, objective, files and decoding.

    family = get_family(cfg.draft.family)          # "eagle3" (default) or "dflash"
    cfg = check_config(load_config(path))          # the family's own rules on a loaded config
    k = validation_num_steps(cfg)                  # validation.num_steps, or the family's default
    family = family_of_files(export_or_step_dir)   # from the directory's config "architectures"

A family is an object with the attributes and methods of :class:`DraftFamily`. The trainer, the
capture backends, the exporter, the evaluator and preflight speak only to this protocol, so a new
family (DSpark, Domino, ...) is one new folder beside ``eagle3/`` and ``dflash/`` plus one line in
:data:`FAMILIES`. Families are imported on first use: a run pays only for its own.
"""

import importlib
import json
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from specforge_core.errors import ConfigError, ModelError

# family name -> module whose FAMILY attribute implements it
FAMILIES = {
    "eagle3": "specforge_core.drafts.eagle3.family",
    "dflash": "specforge_core.drafts.dflash.family",
    "dspark": "specforge_core.drafts.dspark.family",
}
# the config files a draft directory may hold: an export, or a checkpoint step directory
CONFIG_FILES = ("config.json", "draft_config.json")


class DraftFamily(Protocol):
    """What a draft family provides. Shapes and formats are each family's own (its docs)."""

    name: str
    architectures: tuple[str, ...]  # config "architectures" values of its exports and checkpoints
    uses_vocab_map: bool  # trains a reduced draft vocabulary (d2t/t2d from the prompt cache)
    captures_last_hidden: bool  # needs the target's post-norm hidden (its teacher)
    loss_is_sum: bool  # True: loss is Σ w·ℓ and the trainer divides gradients by the global sums["weight_sum"]

    # ---- configuration (commands, preflight, build) ---------------------------------------------
    # the family's own rules on the run config (fields another family reads, or reads otherwise):
    # ConfigError naming the field and the fix; every command runs it once where it loads a config
    def check_config(self, cfg) -> None: ...
    def capture_layer_ids(self, cfg, target_config, draft_config=None) -> tuple[int, ...]: ...
    def given_draft_config(self, cfg) -> Any | None: ...
    def check_draft_config(self, cfg, draft_config, target_config, vocab_size: int) -> None: ...
    def draft_config(self, cfg, target_config, layer_ids, *, tokenizer=None) -> Any: ...
    # the token-id fields of the run config that draft_config fills from the tokenizer because the
    # config leaves them unset (the dry run, which reads no tokenizer, reports them unresolved)
    def tokenizer_token_ids(self, cfg) -> tuple[str, ...]: ...
    # draft tokens per verify round when validation.num_steps is unset (validation, held-out decodes,
    # evaluate): the setting the family trains for
    def default_num_steps(self, cfg) -> int: ...
    # estimated bytes one micro-step of `tokens` captured tokens in `samples` samples keeps for backward
    def activation_bytes(self, cfg, draft_config, *, tokens: int, samples: int) -> int: ...
    def contract_fields(self, cfg) -> dict: ...
    def serving_config(self, config) -> dict: ...
    def trained_layer_ids(self, config) -> list[int] | None: ...

    # ---- model and training --------------------------------------------------------------------
    def new_draft(self, config) -> nn.Module: ...
    def warm_start(self, directory, config) -> nn.Module: ...
    def attach_target(self, cfg, draft: nn.Module, backend, vocab, *, fresh: bool) -> None: ...
    def objective(self, cfg, backend): ...
    def summarize(self, cfg, sums: dict) -> dict: ...

    # ---- files -----------------------------------------------------------------------------------
    def save_checkpoint_files(self, draft: nn.Module, directory: Path, state_dict=None) -> None: ...
    def load_checkpoint_files(self, directory: Path) -> nn.Module: ...
    def export(self, draft: nn.Module, out_dir: Path, dtype: str = "keep") -> Path: ...
    def load_export(self, directory: Path) -> nn.Module: ...
    def export_speculators(self, draft: nn.Module, out_dir: Path, *, target_dir, verifier=None,
                           speculative_tokens=None, dtype: str = "keep") -> Path: ...  # vLLM's native layout; None: the family's default

    # ---- decoding --------------------------------------------------------------------------------
    def prepare_for_decoding(self, draft: nn.Module, target_model) -> nn.Module: ...
    def drafter(self, draft: nn.Module, target_model, cfg=None): ...  # cfg: the run config's decoding settings


def get_family(name: str) -> DraftFamily:
    """The family registered as ``name``; ConfigError naming ``draft.family`` otherwise."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown draft family {name!r}", where="draft.family",
                          fix=f"set draft.family to one of {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name]).FAMILY


def check_config(cfg):
    """``cfg`` once its draft family's own rules (:meth:`DraftFamily.check_config`) have passed;
    what every command and the flow call where they load a run config, before anything is written."""
    get_family(cfg.draft.family).check_config(cfg)
    return cfg


def validation_num_steps(cfg) -> int:
    """Draft tokens per verify round for validation: ``validation.num_steps``, or the default of the
    config's draft family (:meth:`DraftFamily.default_num_steps`)."""
    if cfg.validation.num_steps is not None:
        return cfg.validation.num_steps
    return get_family(cfg.draft.family).default_num_steps(cfg)


def family_of_files(directory: str | Path) -> DraftFamily:
    """The family whose draft files ``directory`` holds (an export or a checkpoint step), read from
    the ``architectures`` of its config file. ModelError when none claims it."""
    directory = Path(directory)
    config = next((directory / n for n in CONFIG_FILES if (directory / n).is_file()), None)
    if config is None:
        raise ModelError(f"no {' or '.join(CONFIG_FILES)} here", where=str(directory),
                         fix="point at an exported draft or a checkpoint step directory")
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"unreadable draft config ({e})", where=str(config), fix="re-export the draft") from None
    for name in FAMILIES:
        family = get_family(name)
        if set(architectures) & set(family.architectures):
            return family
    raise ModelError(
        f"architectures {architectures} belong to no draft family this trainer knows",
        where=f"{config}: architectures",
        fix="use a draft exported by this trainer ("
        + ", ".join(a for n in FAMILIES for a in get_family(n).architectures) + ")",
    )


def load_draft(path: str | Path) -> tuple[DraftFamily, nn.Module]:
    """``(family, draft)`` of an exported directory, a checkpoint step directory, or a run directory
    (its newest checkpoint), on the CPU in the files' dtype, without the target's embedding."""
    from specforge_core.loop.checkpoint import resolve_checkpoint_dir

    path = Path(path)
    if (path / "config.json").is_file():
        family = family_of_files(path)
        return family, family.load_export(path)
    step = resolve_checkpoint_dir(path)
    family = family_of_files(step)
    return family, family.load_checkpoint_files(step)
