"""The validation reports: simulated acceptance (training metrics) beside measured acceptance, and
the benchmark table (``render_benchmark_report``: a row per benchmark and decoding setting).

Simulated acceptance length for a chain of k draft tokens, from training accuracies acc_j
(the bonus token counts, as in SGLang's acceptance length): ``1 + Σ_{i<k} Π_{j≤i} acc_j``. Training
accuracies are measured on training data and are not conditional on the earlier draft tokens
being accepted, so the measured figure on held-out prompts is usually lower; the report puts
both side by side so the gap is visible.
"""

import math


# The trainer's own simulated figure, whichever name it is logged under (with the bonus token first).
_TRAINER_SIMULATED_KEYS = (
    "simulated_accept_length_with_bonus", "simulated_acceptance_length", "simulated_accept_length",
)


def chain_acceptance_length(accs: list[float], num_steps: int) -> float:
    """``1 + Σ_{i<k} Π_{j≤i} acc_j`` for k = min(num_steps, len(accs))."""
    total, run = 1.0, 1.0
    for acc in accs[:num_steps]:
        run *= acc
        total += run
    return total


def simulated_acceptance(metrics: dict | None, num_steps: int) -> dict | None:
    """Per-step training accuracies and the simulated acceptance length (None without metrics)."""
    if not metrics:
        return None
    accs = []
    while f"acc_{len(accs)}" in metrics:
        accs.append(float(metrics[f"acc_{len(accs)}"]))
    if not accs:
        return None
    return {
        "step": metrics.get("step"),
        "acc": accs,
        "acceptance_length": chain_acceptance_length(accs, num_steps),
        "acceptance_length_all_steps": chain_acceptance_length(accs, len(accs)),
        "trainer_reported": next(
            ((key, metrics[key]) for key in _TRAINER_SIMULATED_KEYS if metrics.get(key) is not None), None
        ),
    }


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _warning_lines(warnings) -> list[str]:
    return [line for w in warnings for line in (f"> **Warning:** {w}", "")]


def render_report(measured: dict, simulated: dict | None, meta: dict, warnings: list[str] = ()) -> str:
    """Markdown: what was measured, how, and the simulated-vs-measured table."""
    k = measured["num_steps"]
    sim_acc = (simulated or {}).get("acc", [])
    sim_len = (simulated or {}).get("acceptance_length")
    saved = measured["target_forwards_saved_fraction"]
    lines = [
        "# Draft validation: measured acceptance",
        "",
        *(f"- {name}: `{value}`" for name, value in meta.items()),
        f"- held-out prompts: {measured['prompts']}, draft tokens per round: {k}, "
        f"generated tokens: {measured['generated_tokens']}",
        "",
        *_warning_lines(warnings),
        "## Simulated (training metrics) vs measured (speculative decoding)",
        "",
        "| figure | simulated | measured |",
        "|---|---|---|",
        f"| acceptance length (k={k}) | {_fmt(sim_len)} "
        f"| **{_fmt(measured['acceptance_length'])}** |",
    ]
    for i in range(k):
        sim = sim_acc[i] if i < len(sim_acc) else None
        cond = "P(d1)" if i == 0 else f"P(d{i + 1} \\| d1)" if i == 1 else f"P(d{i + 1} \\| d1..d{i})"
        lines.append(f"| position {i + 1}: acc_{i} vs {cond} | {_fmt(sim)} "
                     f"| {_fmt(measured['per_position_acceptance'][i])} |")
    lines += [
        f"| mean accepted draft tokens per verify | {_fmt(sim_len - 1 if sim_len is not None else None)} "
        f"| {_fmt(measured['mean_accepted_draft_tokens'])} |",
        "",
        "Simulated = 1 + Σ_{i<k} Π_{j≤i} acc_j from the last line of the run's metrics.jsonl"
        + (f" (step {simulated['step']}; all {len(sim_acc)} trained steps: "
           f"{_fmt(simulated['acceptance_length_all_steps'])}"
           + (f"; the trainer's own {simulated['trainer_reported'][0]}: {_fmt(simulated['trainer_reported'][1])}"
              if simulated["trainer_reported"] else "") + ")"
           if simulated else " (no training metrics: n/a)")
        + ". Training accuracies are unconditional and measured on training data; the measured "
        "per-position rates are conditional on the earlier draft tokens being accepted.",
        "",
        "## Target work",
        "",
        "| figure | value |",
        "|---|---|",
        f"| target forward passes (prefill + verify) | {measured['target_forwards']} |",
        f"| target forward passes plain greedy would need | {measured['greedy_target_forwards']} |",
        f"| target forward passes saved | {measured['target_forwards_saved']} "
        f"({_fmt(100 * saved if saved is not None else None, 1)}%) |",
        f"| tokens per target forward (incl. prefill) | {_fmt(measured['tokens_per_target_forward'])} |",
        f"| prompts ended on end-of-turn | {measured['stopped_on_end_of_turn']} of {measured['prompts']} |",
        f"| wall time (speculative) | {_fmt(measured['seconds'], 1)} s, {_fmt(measured['tokens_per_s'], 1)} tokens/s |",
        f"| output equals the target's greedy output | {_fmt(measured['lossless'])} |",
        "",
        "Acceptance length = tokens emitted by verify passes / verify passes (SGLang's convention: "
        "bonus token included, 1.0 without speculation; the prefill's first token is not counted).",
        "",
    ]
    return "\n".join(lines)


def render_benchmark_report(result: dict, meta: dict) -> str:
    """Markdown: one draft's benchmark table (a row per benchmark and setting) and the time each took.

    ``result`` is ``evaluation.evaluate_benchmarks``'s return value; ``meta`` adds ``name: value``
    lines under the heading."""
    runs = result["benchmarks"]
    settings = [f"{s['steps']},{s['topk']},{s['draft_tokens']}" for s in next(iter(runs.values()))["settings"]]
    lines = [
        f"# Benchmark table: `{result['draft']}`",
        "",
        f"- draft family: `{result['draft_family']}`",
        f"- target: `{result['target']}`",
        *(f"- {name}: `{value}`" for name, value in meta.items()),
        f"- decoding: greedy, up to {result['max_new_tokens']} new tokens per turn, {result['batch_size']} "
        "requests per batch; a setting is steps, topk, draft tokens (SGLang's --speculative-num-steps, "
        "--speculative-eagle-topk, --speculative-num-draft-tokens)",
        "",
        *_warning_lines(result["warnings"]),
        "| benchmark | steps, topk, draft tokens | τ pooled | τ per request | tokens/s speculative "
        "| tokens/s greedy | speedup | outputs ≠ greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        for s in run["settings"]:
            lines.append(
                f"| {name} | {s['steps']}, {s['topk']}, {s['draft_tokens']} | **{_fmt(s['acceptance_length'])}** "
                f"| {_fmt(s['per_request_acceptance_length'])} | {_fmt(s['tokens_per_s'], 1)} "
                f"| {_fmt(run['greedy']['tokens_per_s'], 1)} | {_fmt(s['speedup'], 2)}× "
                f"| {len(s['differing_prompts'])} of {run['prompts']} |")
    lines += [
        "",
        "τ pooled = Σ tokens emitted by verify passes / Σ verify passes over all requests (SGLang's and "
        "vLLM's figure); τ per request = the mean of each request's own ratio (SpecForge's benchmark "
        "runner). Both count the bonus token, not the prefill's first token. A request is one turn; "
        "MT-Bench's second turn follows the target's own first answer. Speedup = speculative / greedy "
        "tokens per second on the same requests with the same decoder and batching. Outputs ≠ greedy: "
        "prompts with a turn whose speculative output differs from plain greedy decoding (0 when lossless).",
        "",
        "## Time per benchmark",
        "",
        "| benchmark | prompts | requests | skipped (too long) | greedy s | "
        + " | ".join(f"{label} s" for label in settings) + " | total s |",
        "|---|---|---|---|---|" + "---|" * len(settings) + "---|",
    ]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['prompts']} | {run['requests']} | {run['skipped_too_long']} "
                     f"| {_fmt(run['greedy']['seconds'], 1)} | "
                     + " | ".join(_fmt(s["seconds"], 1) for s in run["settings"])
                     + f" | {_fmt(run['seconds'], 1)} |")
    lines.append("")
    return "\n".join(lines)
