"""Preflight: what a run can check from configuration files alone, before it builds or writes anything.

    inputs = check_data_inputs(cfg)    # prepare: tokenizer, target vocab, draft vocab, a given vocab map
    inputs = check_target_files(cfg)   # train's checks that need no tokenizer (the dry run stops here)
    inputs = check_run_inputs(cfg)     # train: check_target_files + the tokenizer + this node + the draft config

They load only the tokenizer and config files (the target's config.json, a given draft config, a
given vocab map): no weights, no data, nothing written. Every failure is a
:class:`~specforge_core.errors.SpecForgeError` naming the field and the fix, so an entry point that
calls these first refuses a mismatched model before a cache, plan or checkpoint exists.

``check_data_inputs``: the draft family is known; the tokenizer loads; its ids fit the target's
embedding (``len(tokenizer) ≤ V``); for a family with a draft vocabulary (EAGLE3),
``0 < draft.draft_vocab_size ≤ V`` and a ``draft.vocab_map_path`` fits V and Vd.

``check_target_files`` (the target's config.json and the given draft files, no tokenizer): the
family and the draft vocabulary as above; the colocated rules that need the target config
(:func:`~specforge_core.capture.target_info.validate_colocated`: context headroom, plain logits, TP
heads); the family's capture layer ids inside the target; a ``draft.config_path`` that fits the
target and the run (the family's own check); for ``capture.backend=sglang``, layer ids SGLang can
capture.

``check_run_inputs`` adds: the tokenizer fits the target; for ``capture.backend=sglang``, a GPU and
the pinned SGLang on this node; the draft config the run will train, generated and checked.
"""

from dataclasses import dataclass
from typing import Any

from specforge_core.capture.target_info import load_target_config, text_config
from specforge_core.errors import ModelError


@dataclass
class CheckedInputs:
    """What preflight loaded, for the run to reuse instead of loading again."""

    tokenizer: Any  # None from check_target_files
    target_config: Any | None  # the target's full HF config; None when the run names no target
    vocab_size: int  # V: rows of the target's embedding
    family: Any = None  # the run's draft family (specforge_core.drafts)
    draft_config: Any | None = None  # the draft's config: draft.config_path, or generated for the target
    layer_ids: tuple[int, ...] = ()  # the target layers the draft reads


def check_sglang_node(where: str = "capture.backend", instead: str = "set capture.backend=hf") -> None:
    """The in-process SGLang engine can run on this node: a GPU and the pinned SGLang (``where``: the
    field that asks for it; ``instead``: the way around it)."""
    from specforge_core.capture.sglang_engine import require_sglang
    from specforge_core.errors import ConfigError

    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{where}=sglang needs a CUDA GPU and none is visible", where=where,
                          fix=f"run on a GPU node, or {instead}")
    require_sglang(where=f"{where}=sglang", instead=instead)


def check_tokenizer_fits(cfg, tokenizer, V: int) -> None:
    """Every id the tokenizer can emit must index the target's embedding (rows [0, V))."""
    n = len(tokenizer)
    if n > V:
        raise ModelError(
            f"the tokenizer has {n} tokens but the target's embedding has {V} rows (config vocab_size): "
            "tokenizer and target disagree, and ids ≥ V would index past the embedding",
            where="model.tokenizer" if cfg.model.tokenizer else "model.target",
            fix="use the target's own tokenizer (remove model.tokenizer, or point it at the target's)",
        )


def check_draft_vocab(cfg, family, V: int) -> None:
    """A family with a draft vocabulary: ``0 < Vd ≤ V``, and a given vocab map fits V and Vd."""
    from specforge_core.data.vocab import check_vocab_sizes, load_vocab_map

    if family.uses_vocab_map:
        check_vocab_sizes(V, cfg.draft.draft_vocab_size)
        if cfg.draft.vocab_map_path:
            load_vocab_map(cfg.draft.vocab_map_path, V, cfg.draft.draft_vocab_size)


def check_data_inputs(cfg) -> CheckedInputs:
    """Preflight of ``python -m specforge_core.prepare``; see the module docstring."""
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.drafts import get_family

    family = get_family(cfg.draft.family)
    tokenizer = load_tokenizer(cfg)
    target_config = load_target_config(cfg) if cfg.model.target else None
    V = int(text_config(target_config).vocab_size) if target_config is not None else len(tokenizer)
    check_tokenizer_fits(cfg, tokenizer, V)
    check_draft_vocab(cfg, family, V)
    return CheckedInputs(tokenizer=tokenizer, target_config=target_config, vocab_size=V, family=family)


def check_target_files(cfg) -> CheckedInputs:
    """Train's checks that need the target's config.json and the given draft files but no tokenizer;
    see the module docstring. ``tokenizer`` and ``draft_config`` of the result are None."""
    from specforge_core.capture.sglang_backend import check_layer_ids
    from specforge_core.capture.target_info import validate_colocated
    from specforge_core.drafts import get_family

    family = get_family(cfg.draft.family)
    target_config = load_target_config(cfg)  # ModelError naming model.target when there is none
    V = int(text_config(target_config).vocab_size)
    check_draft_vocab(cfg, family, V)
    validate_colocated(cfg, target_config)
    given = family.given_draft_config(cfg)
    layer_ids = tuple(family.capture_layer_ids(cfg, target_config, given))
    if given is not None:
        family.check_draft_config(cfg, given, target_config, V)
    if cfg.capture.backend == "sglang":
        where = (f"draft.{cfg.draft.family}.target_layer_ids" if cfg.draft.family in ("dflash", "dspark")
                 else "model.capture_layer_ids")
        check_layer_ids(layer_ids, text_config(target_config).num_hidden_layers, where=where)
    return CheckedInputs(tokenizer=None, target_config=target_config, vocab_size=V, family=family,
                         layer_ids=layer_ids)


def check_run_inputs(cfg) -> CheckedInputs:
    """Preflight of ``python -m specforge_core.train``; see the module docstring."""
    from specforge_core.data.tokenize import load_tokenizer

    inputs = check_target_files(cfg)
    inputs.tokenizer = load_tokenizer(cfg)
    check_tokenizer_fits(cfg, inputs.tokenizer, inputs.vocab_size)
    if cfg.capture.backend == "sglang":
        check_sglang_node()
    if cfg.validation.enabled and cfg.validation.engine == "sglang":  # before training, not after it
        check_sglang_node("validation.engine", "set validation.engine: ours")
    # the draft config the run will train (given, or generated from the target: its checks run here)
    inputs.draft_config = inputs.family.draft_config(cfg, inputs.target_config, inputs.layer_ids,
                                                     tokenizer=inputs.tokenizer)
    return inputs
