"""Measure a draft's acceptance length by real speculative decoding on held-out prompts.

    result = evaluate(cfg, "runs/tiny", num_steps=3, max_new_tokens=128, num_prompts=32)

``draft_path`` is a run directory (its newest checkpoint), a checkpoint step directory, or an
exported SGLang/vLLM directory. Prompts are the first ``num_prompts`` rows of the prompt cache's
``eval`` split (``data.eval_files`` or ``data.eval_holdout``: never trained on). Returns the
measured numbers (docs/validation.md defines them) and writes a markdown report (default
``<output.dir>/validation.md``) with the simulated acceptance length from the run's training
metrics beside the measured one. ``python -m specforge_core.evaluate`` and the flow's validate
task call :func:`evaluate`.
"""

from pathlib import Path

from specforge_core.decoding.measure import measure_acceptance
from specforge_core.decoding.report import render_report, simulated_acceptance
from specforge_core.decoding.verifier import load_target, stop_token_ids
from specforge_core.errors import DataError, ModelError
from specforge_core.io import atomic_write_text
from specforge_core.run.directory import RunDir
from specforge_core.runtime.checkpoint import checkpoint_step


def load_draft(path: str | Path, model):
    """``(family, draft)``: the draft at ``path`` (export, checkpoint step or run directory), ready
    to decode beside ``model`` (its device and dtype, the target's embedding where it uses one)."""
    from specforge_core.drafts import load_draft as load_files

    family, draft = load_files(path)
    return family, family.prepare_for_decoding(draft, model)


def capture_layers_for(cfg, model, family, draft) -> list[int]:
    """The capture layers to feed ``draft``; refuses ids that differ from those it was trained on."""
    ids = list(family.capture_layer_ids(cfg, model.config, draft.config))
    trained = family.trained_layer_ids(draft.config)
    if trained is not None and list(trained) != ids:
        raise ModelError(
            f"model.capture_layer_ids {ids} differ from the layers the draft was trained on {list(trained)}",
            where="model.capture_layer_ids",
            fix="remove model.capture_layer_ids (the draft's own ids are used) or evaluate the matching draft",
        )
    return ids


def held_out_prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` prompts of the prompt cache's eval split (built if missing)."""
    from specforge_core.data.prompt_cache import ensure_prompt_cache

    split = ensure_prompt_cache(cfg, tokenizer).eval
    prompts = [list(map(int, p)) for p in split.select(range(min(n, len(split))))["prompt_ids"] if len(p)]
    if not prompts:
        raise DataError(
            "the prompt cache has no held-out prompts to evaluate on",
            where="data.eval_files / data.eval_holdout",
            fix="set data.eval_holdout (e.g. 32) or give data.eval_files",
        )
    return prompts


def evaluate(cfg, draft_path: str | Path, *, num_steps: int | None = None, max_new_tokens: int | None = None,
             num_prompts: int | None = None, report_path: str | Path | None = None,
             run_dir: str | Path | None = None, batch_size: int = 8, check_lossless: bool = False) -> dict:
    """Measure the draft at ``draft_path``; write the report; return the measured numbers.

    Defaults come from ``cfg.validation`` (num_steps, max_new_tokens, num_prompts); training
    metrics are read from ``run_dir`` (default ``output.dir``).
    """
    from specforge_core.data.tokenize import ChatRenderer

    v = cfg.validation
    num_steps = cfg.validation_num_steps if num_steps is None else num_steps
    max_new_tokens = v.max_new_tokens if max_new_tokens is None else max_new_tokens
    num_prompts = v.num_prompts if num_prompts is None else num_prompts
    run_dir = RunDir(run_dir or cfg.output.dir)
    report_path = Path(report_path or RunDir(cfg.output.dir).evaluation_report)

    model, tok = load_target(cfg)
    family, draft = load_draft(draft_path, model)
    capture_ids = capture_layers_for(cfg, model, family, draft)
    prompts = held_out_prompts(cfg, tok, num_prompts)
    stops = stop_token_ids(model, tok, ChatRenderer(tok).end_of_turn)
    measured = measure_acceptance(model, family.drafter(draft, model), prompts, stop_ids=stops, capture_layer_ids=capture_ids,
                                  num_steps=num_steps, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  check_lossless=check_lossless)
    # a checkpoint's own training figures, not the run's last line (which may be later)
    simulated = simulated_acceptance(run_dir.metrics_file().last(at_step=checkpoint_step(draft_path)), num_steps)
    meta = {"draft": str(draft_path), "draft family": family.name, "target": cfg.model.target,
            "capture layers": capture_ids, "max new tokens": max_new_tokens,
            "training metrics": str(run_dir.metrics)}
    atomic_write_text(report_path, render_report(measured, simulated, meta))
    return {**measured, "max_new_tokens": max_new_tokens,
            "simulated_acceptance_length": simulated["acceptance_length"] if simulated else None,
            "report": str(report_path)}
