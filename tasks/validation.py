"""The validate stage: export the trained draft, measure acceptance before and after, publish the report.

    report = validate(config, vocab_map, trained, run_dir=str(run_dir))

Writes into ``<run_dir>``:

    draft/                    the trained draft for SGLang/vLLM (config.json + model.safetensors)
    report/report.md          before/after (and promoted) measured acceptance lengths, then the measured-vs-
                              simulated validation report of specforge_core.evaluate; links curves.png
    report/curves.png         loss, per-position accuracy, simulated and measured acceptance length
    report/validation-*.md    the evaluator's own report for each draft measured
    report/benchmarks-*.md    with validation.benchmarks: the benchmark table of the trained draft, and of
                              the promoted one when validation.promote_on compares on it

"Before" is the draft training started from: the warm-start draft (``draft.init_from``), or for a
cold start an untrained draft of the same config and vocab map (it measures about 1.0: its tokens
are almost never accepted). With ``validation.promoted_dir`` holding a draft, that draft is measured
too, on the same prompts, for the promotion decision. With ``validation.benchmarks`` the trained
draft's benchmark table is measured as well (``evaluate_benchmarks``; the promoted draft's too when
``validation.promote_on`` names the benchmark promotion compares). The markdown artifact
``validation-report`` carries the report, the benchmark tables and the plot inlined (the UI cannot
open files of the worker's disk).
"""

import base64
import json
from pathlib import Path

import torch
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from specforge_core.config import RunConfig
from specforge_core.data.vocab import load_vocab_map
from specforge_core.decoding.evaluation import evaluate, evaluate_benchmarks
from specforge_core.drafts import load_draft, validation_num_steps
from specforge_core.io import atomic_write_text
from specforge_core.run.directory import RunDir
from tasks.caching import StageOutput
from tasks.curves import plot_curves
from tasks.train_stage import trainer_config


def untrained_draft(family, trained, vocab_map: StageOutput | None, seed: int, out_dir: Path) -> Path:
    """Export a freshly initialised draft with the trained draft's config (and the run's vocab map)."""
    torch.manual_seed(seed)
    model = family.new_draft(trained.config)
    if family.uses_vocab_map:
        vm = load_vocab_map(vocab_map.path, trained.config.vocab_size, trained.config.draft_vocab_size)
        model.set_vocab_map(vm.d2t, vm.t2d)
    return family.export(model, out_dir)


def _row(label: str, path: str | None, result: dict | None) -> str:
    if result is None:
        return f"| {label} | `{path}` | n/a | n/a |"
    per_position = ", ".join("n/a" if p is None else f"{p:.2f}" for p in result["per_position_acceptance"])
    return f"| {label} | `{path}` | **{result['acceptance_length']:.3f}** | {per_position} |"


def render_summary(rows: dict[str, tuple[str, dict | None]], config: RunConfig, plot_link: str,
                   family: str = "eagle3") -> str:
    v = config.validation
    lines = [
        "# colocated-train: validation", "", f"Draft family: **{family}**.", "",
        f"Measured by speculative decoding of {v.num_prompts} held-out prompts with the target "
        f"(greedy, {validation_num_steps(config)} draft tokens per verify pass, up to {v.max_new_tokens} new tokens each).", "",
        "| draft | directory | measured acceptance length | per-position acceptance |", "|---|---|---|---|",
        *(_row(label, path, result) for label, (path, result) in rows.items()), "",
        f"![loss and acceptance curves]({plot_link})", "",
        "Measured acceptance length: tokens each target forward (verify pass) emits, 1.0 without a draft. "
        "Left: training loss. Middle: per-position draft accuracy on training data. Right: the simulated "
        "acceptance length (from those accuracies) as a curve, the measured ones as points.", "",
    ]
    return "\n".join(lines)


@task(name="validate", cache_policy=NO_CACHE)
def validate(config: RunConfig, vocab_map: StageOutput | None, trained: StageOutput, run_dir: str) -> dict:
    """Export the draft, measure its acceptance length (and the starting / promoted drafts'), report."""
    logger = get_run_logger()
    run = RunDir(run_dir)
    checkpoint = Path(trained.path)
    family, model = load_draft(checkpoint)
    draft_dir = family.export(model, run.draft)
    logger.info("exported the %s draft for SGLang/vLLM to %s", family.name, draft_dir)
    # The trainer's view: output.dir is the run directory, so the evaluator reads its metrics.
    eval_config = trainer_config(config, run.root, vocab_map)

    def measure(label: str, path: Path, metrics_dir: Path, served: bool = False) -> dict:
        result = evaluate(eval_config, path, report_path=run.validation_report(label), run_dir=metrics_dir,
                          served=served)
        logger.info("measured acceptance length of the %s draft: %.3f tokens per target forward on %d "
                    "held-out prompts (%s)", label, result["acceptance_length"], result["prompts"], path)
        if served:
            s = result["served"]
            figures = ("n/a" if s["acceptance_length"] is None else f"{s['acceptance_length']:.3f}",
                       "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}")
            logger.info("served by SGLang: acceptance length %s, %s × ours%s", *figures,
                        "" if s["within_5_percent"] in (True, None) else f" (more than 5 % apart: {s['note']})")
        return result

    def benchmark(label: str, path: Path, metrics_dir: Path) -> dict:
        result = evaluate_benchmarks(eval_config, path, report_path=run.validation_benchmarks(label),
                                     run_dir=metrics_dir)
        for name, b in result["benchmarks"].items():
            figures = ", ".join("n/a" if s["acceptance_length"] is None else f"{s['acceptance_length']:.3f} at "
                                f"{s['steps']},{s['topk']},{s['draft_tokens']}" for s in b["settings"])
            logger.info("%s draft on %s: measured acceptance length %s (%d prompts, %d requests, %.1f s)", label, name,
                        figures, b["prompts"], b["requests"], b["seconds"])
        return result

    after = measure("trained", draft_dir, run.root, served=config.validation.engine == "sglang")
    warm = bool(config.draft.init_from)
    if warm:
        before_dir = Path(config.draft.init_from)
    else:
        before_dir = untrained_draft(family, model, vocab_map, config.training.seed, run.untrained_draft)
    before = measure("before", before_dir, before_dir)
    rows = {f"before training ({'warm start' if warm else 'untrained'})": (str(before_dir), before),
            "after training": (str(draft_dir), after)}
    promoted = Path(config.validation.promoted_dir) if config.validation.promoted_dir else None
    promoted_result = None
    if promoted is not None and (promoted / "config.json").is_file():
        same = before_dir.resolve() == promoted.resolve()
        promoted_result = before if same else measure("promoted", promoted, promoted)
        rows["currently promoted"] = (str(promoted), promoted_result)

    tables = {}
    if config.validation.benchmarks:
        tables["trained"] = benchmark("trained", draft_dir, run.root)
        if config.validation.promote_on and promoted_result is not None:
            tables["promoted"] = benchmark("promoted", promoted, promoted)

    plot = plot_curves(run.metrics, run.curves, num_steps=validation_num_steps(config),
                       measured={"before": before["acceptance_length"], "after": after["acceptance_length"]})
    summary = render_summary(rows, config, plot.name, family.name)
    evaluator_report = "\n".join(Path(r["report"]).read_text(encoding="utf-8") for r in (*tables.values(), after))
    report = atomic_write_text(run.report, summary + "\n" + evaluator_report)
    inline = "data:image/png;base64," + base64.b64encode(plot.read_bytes()).decode()
    create_markdown_artifact(
        key="validation-report",
        markdown=summary.replace(f"]({plot.name})", f"]({inline})")
        + f"\nFiles: report `{report}`, plot `{plot}`, draft `{draft_dir}`.\n\n" + evaluator_report,
        description="measured acceptance length before/after training (held-out prompts); loss and acceptance curves",
    )
    return {
        "run_dir": str(run.root), "draft_family": family.name, "draft_dir": str(draft_dir), "report": str(report), "plot": str(plot),
        "checkpoint": str(checkpoint),
        "acceptance_length": after["acceptance_length"],
        "acceptance_length_before": before["acceptance_length"],
        "acceptance_length_promoted": None if promoted_result is None else promoted_result["acceptance_length"],
        "simulated_acceptance_length": after.get("simulated_acceptance_length"),
        "served": after.get("served"),
        "measured": json.loads(json.dumps({k: v for k, v in after.items() if k != "report"})),
        "benchmarks": tables["trained"]["benchmarks"] if "trained" in tables else None,
        "benchmarks_promoted": tables["promoted"]["benchmarks"] if "promoted" in tables else None,
    }
