"""Measure a draft's acceptance length by real speculative decoding: held-out prompts, or benchmarks.

    result = evaluate(cfg, "runs/tiny", num_steps=3, max_new_tokens=128, num_prompts=32)
    table = evaluate_benchmarks(cfg, "runs/tiny", benchmarks=["mt-bench", "humaneval", "sharegpt"])

``draft_path`` is a run directory (its newest checkpoint), a checkpoint step directory, or an
exported SGLang/vLLM directory. Prompts are the first ``num_prompts`` rows of the prompt cache's
``eval`` split (``data.eval_files`` or ``data.eval_holdout``: never trained on). Returns the
measured numbers (docs/validation.md defines them) and writes a markdown report (default
``<output.dir>/validation.md``) with the simulated acceptance length from the run's training
metrics beside the measured one. :func:`evaluate_benchmarks` measures the benchmark table
(``decoding.benchmark``) of prompt sets from ``data.benchmarks.load_prompt_set`` at each decoding
setting and writes it as markdown (default ``<output.dir>/benchmarks.md``). Both reports show the
``data.chat_template_kwargs`` the prompts were rendered with, and warn when the draft was trained
with others. ``python -m specforge_core.evaluate`` and the flow's validate task call them.
"""

import json
from pathlib import Path

from specforge_core.decoding.benchmark import DecodingSetting, check_settings, run_benchmark
from specforge_core.decoding.measure import measure_acceptance
from specforge_core.decoding.report import render_benchmark_report, render_report, simulated_acceptance
from specforge_core.decoding.verifier import DecodingTarget, load_target, stop_token_ids
from specforge_core.errors import ConfigError, DataError, ModelError, SpecForgeError
from specforge_core.io import atomic_write_text
from specforge_core.run.directory import RunDir
from specforge_core.run.manifest import RunManifest
from specforge_core.loop.checkpoint import TRAIN_STATE, checkpoint_step, resolve_checkpoint_dir


def load_draft_for_decoding(path: str | Path, model):
    """``(family, draft)``: the draft at ``path`` (export, checkpoint step or run directory), ready
    to decode beside ``model`` (its device and dtype, the target's embedding where it uses one)."""
    from specforge_core.drafts import load_draft

    family, draft = load_draft(path)
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


def trained_template_kwargs(draft_path: str | Path, run_dir: str | Path) -> tuple[dict | None, str | None]:
    """``(data.chat_template_kwargs, file)`` the draft was trained with: from the checkpoint's
    train_state.json (a step or run directory), else from ``run_dir``'s run.json; ``(None, None)``
    when neither records a config (an export on its own). A config recorded before the option
    existed reads as ``{}``, which is what that run rendered with."""
    config = source = None
    path = Path(draft_path)
    if not (path / "config.json").is_file():  # not an export: a checkpoint step or a run directory
        try:
            source = resolve_checkpoint_dir(path) / TRAIN_STATE
            config = json.loads(source.read_text(encoding="utf-8"))["config"]
        except (SpecForgeError, OSError, ValueError, KeyError):
            config = None
    if config is None and (source := RunDir(run_dir).manifest).is_file():
        try:
            config = RunManifest.load(source).config
        except SpecForgeError:
            config = None
    if config is None:
        return None, None
    return dict((config.get("data") or {}).get("chat_template_kwargs") or {}), str(source)


def template_kwargs_facts(cfg, draft_path, run_dir) -> tuple[dict, list[str]]:
    """Report lines on the template variables (evaluation's and training's) and the mismatch warning."""
    used = dict(cfg.data.chat_template_kwargs)
    trained, source = trained_template_kwargs(draft_path, run_dir)
    facts = {"chat template kwargs": json.dumps(used),
             "chat template kwargs in training": json.dumps(trained) + f" ({source})" if source else "not recorded"}
    warnings = []
    if trained is not None and trained != used:
        warnings.append(f"the prompts are rendered with data.chat_template_kwargs {json.dumps(used)}, but the draft "
                        f"was trained with {json.dumps(trained)} ({source}): the figures measure prompts unlike "
                        "its training data; set data.chat_template_kwargs to the training value")
    return facts, warnings


def evaluate(cfg, draft_path: str | Path, *, num_steps: int | None = None, max_new_tokens: int | None = None,
             num_prompts: int | None = None, report_path: str | Path | None = None,
             run_dir: str | Path | None = None, batch_size: int = 8, check_lossless: bool = False,
             served: bool = False, engine_factory=None) -> dict:
    """Measure the draft at ``draft_path``; write the report; return the measured numbers.

    Defaults come from ``cfg.validation`` (num_steps, max_new_tokens, num_prompts); training
    metrics are read from ``run_dir`` (default ``output.dir``). ``served`` (an export at
    ``draft_path``): SGLang also serves it on the same prompts and stop tokens, and its own
    acceptance length goes beside ours (``decoding/served.py``; ``engine_factory`` stands in for
    ``sglang.Engine``) as ``result["served"]``.
    """
    from specforge_core.data.tokenize import ChatRenderer
    from specforge_core.drafts import validation_num_steps

    v = cfg.validation
    num_steps = validation_num_steps(cfg) if num_steps is None else num_steps
    max_new_tokens = v.max_new_tokens if max_new_tokens is None else max_new_tokens
    num_prompts = v.num_prompts if num_prompts is None else num_prompts
    run_dir = RunDir(run_dir or cfg.output.dir)
    report_path = Path(report_path or RunDir(cfg.output.dir).evaluation_report)

    model, tok = load_target(cfg)
    family, draft = load_draft_for_decoding(draft_path, model)
    capture_ids = capture_layers_for(cfg, model, family, draft)
    prompts = held_out_prompts(cfg, tok, num_prompts)
    stops = stop_token_ids(model, tok, ChatRenderer(tok, template_kwargs=cfg.data.chat_template_kwargs).end_of_turn)
    measured = measure_acceptance(model, family.drafter(draft, model, cfg), prompts, stop_ids=stops, capture_layer_ids=capture_ids,
                                  num_steps=num_steps, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  check_lossless=check_lossless)
    # a checkpoint's own training figures, not the run's last line (which may be later)
    simulated = simulated_acceptance(run_dir.metrics_file().last(at_step=checkpoint_step(draft_path)), num_steps)
    facts, warnings = template_kwargs_facts(cfg, draft_path, run_dir.root)
    meta = {"draft": str(draft_path), "draft family": family.name, "target": cfg.model.target,
            "capture layers": capture_ids, "max new tokens": max_new_tokens,
            "training metrics": str(run_dir.metrics), **facts}
    extra = {}
    text = render_report(measured, simulated, meta, warnings)
    if served:
        import gc

        import torch

        from specforge_core.decoding.served import compare_served, served_acceptance, served_section

        del model, draft  # SGLang sizes its pools from the GPU's free memory: give ours back first
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        figures = served_acceptance(cfg, draft_path, prompts, num_steps=num_steps, max_new_tokens=max_new_tokens,
                                    stop_ids=stops, engine_factory=engine_factory)
        extra["served"] = {**figures, **compare_served(measured["acceptance_length"], figures["acceptance_length"])}
        text += served_section(measured["acceptance_length"], extra["served"])
    atomic_write_text(report_path, text)
    return {**measured, "max_new_tokens": max_new_tokens,
            "simulated_acceptance_length": simulated["acceptance_length"] if simulated else None,
            "warnings": warnings, "report": str(report_path), **extra}


class ChatCodec:
    """Benchmark conversations as the prompt cache renders training rows: the chat template with
    ``data.chat_template_kwargs`` and the generation prompt, tokenized without extra special tokens."""

    def __init__(self, tokenizer, template_kwargs: dict):
        from specforge_core.data.tokenize import ChatRenderer

        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, template_kwargs=template_kwargs)

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.renderer.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer_text(self, tokens: list[int]) -> str:
        """An answer as the next turn's conversation holds it (special tokens, the stop token, dropped)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def evaluate_benchmarks(cfg, draft_path: str | Path, *, benchmarks: list[str] | None = None, settings=None,
                        limit: int | None = None, max_new_tokens: int | None = None, batch_size: int = 8,
                        report_path: str | Path | None = None, run_dir: str | Path | None = None,
                        progress: bool = False) -> dict:
    """The benchmark table of the draft at ``draft_path``: write it, return its figures.

    ``benchmarks`` (default ``validation.benchmarks``): prompt set names or files
    (``load_prompt_set``); ``settings`` (default ``validation.settings``): objects with ``steps``,
    ``topk`` and ``draft_tokens``; ``limit`` (default ``validation.benchmark_prompts``): the first
    N prompts of each set; ``run_dir`` (default ``output.dir``): where the training config is
    recorded, for the template-variable check. Every set is read and every setting checked
    before the target loads. Returns ``{"draft", "draft_family", "target", "max_new_tokens",
    "chat_template_kwargs", "warnings", "benchmarks": {name: BenchmarkRun.summary()}, "report"}``.
    """
    from specforge_core.data.benchmarks import load_prompt_set

    v = cfg.validation
    names = list(v.benchmarks if benchmarks is None else benchmarks)
    if not names:
        raise ConfigError("no benchmarks to measure", where="validation.benchmarks",
                          fix="set validation.benchmarks (or --benchmarks), e.g. mt-bench,humaneval,sharegpt")
    if len(set(names)) < len(names):
        raise ConfigError(f"benchmarks {names} name one twice", where="validation.benchmarks", fix="name each once")
    rows = [DecodingSetting(s.steps, s.topk, s.draft_tokens) for s in (v.settings if settings is None else settings)]
    check_settings(rows)
    max_new_tokens = v.max_new_tokens if max_new_tokens is None else max_new_tokens
    limit = v.benchmark_prompts if limit is None else limit
    run_dir = RunDir(run_dir or cfg.output.dir)
    report_path = Path(report_path or RunDir(cfg.output.dir).benchmark_report)
    prompt_sets = {name: load_prompt_set(name, limit=limit) for name in names}

    model, tok = load_target(cfg)
    family, draft = load_draft_for_decoding(draft_path, model)
    capture_ids = capture_layers_for(cfg, model, family, draft)
    chat = ChatCodec(tok, cfg.data.chat_template_kwargs)
    stops = stop_token_ids(model, tok, chat.renderer.end_of_turn)
    target = DecodingTarget(model, capture_ids)
    drafter = family.drafter(draft, model, cfg)
    try:
        runs = {name: run_benchmark(target, drafter, ps, rows, encode=chat.encode, answer_text=chat.answer_text,
                                    stop_ids=stops, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                    context_length=getattr(model.config, "max_position_embeddings", None),
                                    name=name, progress=progress).summary()
                for name, ps in prompt_sets.items()}
    finally:
        target.close()
    facts, warnings = template_kwargs_facts(cfg, draft_path, run_dir.root)
    result = {"draft": str(draft_path), "draft_family": family.name, "target": cfg.model.target,
              "max_new_tokens": max_new_tokens, "batch_size": batch_size,
              "chat_template_kwargs": dict(cfg.data.chat_template_kwargs), "warnings": warnings,
              "benchmarks": runs}
    atomic_write_text(report_path, render_benchmark_report(result, {**facts, "capture layers": capture_ids}))
    return {**result, "report": str(report_path)}
