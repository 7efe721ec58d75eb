"""Preflight: what a run can check from configuration files alone, before it builds or writes anything.

    inputs = check_data_inputs(cfg)    # prepare: tokenizer, target vocab, draft vocab, a given vocab map
    inputs = check_run_inputs(cfg)     # train: the same + target/draft/capture checks

Both load only the tokenizer and config files (the target's config.json, a given draft config, a
given vocab map): no weights, no data, nothing written. Every failure is a
:class:`~specforge_core.errors.SpecForgeError` naming the field and the fix, so an entry point that
calls these first refuses a mismatched model before a cache, plan or checkpoint exists.

``check_data_inputs``: the tokenizer loads; its ids fit the target's embedding (``len(tokenizer) ≤ V``);
``0 < draft.draft_vocab_size ≤ V``; a ``draft.vocab_map_path`` fits V and Vd.

``check_run_inputs`` adds: the colocated rules that need the target config
(:func:`~specforge_core.capture.target_info.validate_colocated`: context headroom, plain logits, TP
heads); capture layer ids inside the target; a ``draft.config_path`` whose ``target_hidden_size``,
``vocab_size`` and ``draft_vocab_size`` match the target and the run.
"""

from dataclasses import dataclass
from typing import Any

from specforge_core.capture.target_info import load_target_config, text_config
from specforge_core.errors import ModelError


@dataclass
class CheckedInputs:
    """What preflight loaded: reuse it instead of loading again."""

    tokenizer: Any
    target_config: Any | None  # None when the run names no target (tokenizer only)
    vocab_size: int  # V: rows of the target's embedding
    draft_config: Any | None = None


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


def check_data_inputs(cfg) -> CheckedInputs:
    """Preflight of ``python -m specforge_core.prepare``; see the module docstring."""
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.data.vocab import check_vocab_sizes, load_vocab_map

    tokenizer = load_tokenizer(cfg)
    target_config = text_config(load_target_config(cfg)) if cfg.model.target else None
    V = int(target_config.vocab_size) if target_config is not None else len(tokenizer)
    check_tokenizer_fits(cfg, tokenizer, V)
    check_vocab_sizes(V, cfg.draft.draft_vocab_size)
    if cfg.draft.vocab_map_path:
        load_vocab_map(cfg.draft.vocab_map_path, V, cfg.draft.draft_vocab_size)
    return CheckedInputs(tokenizer=tokenizer, target_config=target_config, vocab_size=V)


def check_run_inputs(cfg) -> CheckedInputs:
    """Preflight of ``python -m specforge_core.train``; see the module docstring."""
    from specforge_core.capture.target_info import resolve_capture_layers, validate_colocated
    from specforge_core.drafts.eagle3.config import load_draft_config

    inputs = check_data_inputs(cfg)
    if inputs.target_config is None:
        raise ModelError("no target model", where="model.target", fix="set model.target to a Hugging Face directory")
    validate_colocated(cfg, inputs.target_config)
    draft_config = load_draft_config(cfg.draft.config_path) if cfg.draft.config_path else None
    resolve_capture_layers(cfg, inputs.target_config, draft_config)
    if draft_config is not None:
        _check_draft_config(cfg, draft_config, inputs.target_config, inputs.vocab_size)
    inputs.draft_config = draft_config
    return inputs


def _check_draft_config(cfg, draft_config, target_config, V: int) -> None:
    where = f"draft.config_path ({cfg.draft.config_path})"
    wanted = {
        "target_hidden_size": (int(target_config.hidden_size), "the target's hidden_size"),
        "vocab_size": (V, "the target's vocab_size"),
        "draft_vocab_size": (cfg.draft.draft_vocab_size, "draft.draft_vocab_size"),
    }
    problems = [f"{field}={getattr(draft_config, field, None)} but {what} is {value}"
                for field, (value, what) in wanted.items() if getattr(draft_config, field, None) != value]
    if problems:
        raise ModelError(
            "the draft config does not fit this target and run: " + "; ".join(problems), where=where,
            fix="use a draft config made for this target (or remove draft.config_path to generate one), "
            "and set draft.draft_vocab_size to its draft_vocab_size",
        )
