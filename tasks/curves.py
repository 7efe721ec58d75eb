"""The validation plot: loss, per-position accuracy and acceptance length over training, as one PNG.

    plot_curves(run_dir / "metrics.jsonl", run_dir / "report" / "curves.png", num_steps=3,
                measured={"before": 1.0, "after": 1.42})

Reads the trainer's metrics.jsonl (one JSON object per log interval with ``step``, ``loss`` and
``acc_0..acc_{K-1}``); the simulated acceptance length per logged step is
``1 + Σ_{i<k} Π_{j≤i} acc_j`` (k = validation.num_steps), and the measured acceptance lengths
(speculative decoding of held-out prompts) are drawn as points at the first and last step. Where
the run decoded held-out prompts while it trained (``training.heldout.interval``), their
acceptance length is a second curve beside the simulated one, and each position's conditional
acceptance (``heldout_accept_rate_i``) is drawn dashed beside that position's training ``acc_i``:
the train/serve gap. ``x="train_seconds"`` puts the training clock on the x axis instead of steps.
Headless (Agg backend): no display needed.
"""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specforge_core.decoding.report import chain_acceptance_length  # noqa: E402
from specforge_core.run.metrics_file import metrics_rows  # noqa: E402

ACC = re.compile(r"^acc_(\d+)$")
X_LABELS = {"step": "optimizer step", "train_seconds": "training wall time (s)"}


def plot_curves(metrics_path: Path, out: Path, *, num_steps: int, measured: dict[str, float | None],
                x: str = "step") -> Path:
    """Write the PNG to ``out`` and return it. ``measured``: label → acceptance length (None: skip);
    "before" is drawn at the first logged step, every other label at the last one. ``x``: a key of
    ``X_LABELS``, the records' field to plot against."""
    # After a resume the steps between the checkpoint and the crash are logged twice: keep the last.
    by_step = {r["step"]: r for r in metrics_rows(Path(metrics_path), max_rows=100_000) if r.get("step") is not None}
    rows = [by_step[s] for s in sorted(by_step) if by_step[s].get(x) is not None]
    steps = [r[x] for r in rows]
    positions = sorted({int(m.group(1)) for r in rows for k in r if (m := ACC.match(k))})
    decoded = [r for r in rows if r.get("heldout_acceptance_length") is not None]
    xlabel = X_LABELS[x]

    fig, (ax_loss, ax_acc, ax_len) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(steps, [r.get("loss") for r in rows], marker=".", color="tab:red")
    ax_loss.set(title="training loss (Σ 0.8^k L_k)", xlabel=xlabel, ylabel="loss")

    for k in positions:
        line, = ax_acc.plot(steps, [r.get(f"acc_{k}") for r in rows], marker=".", label=f"acc_{k}")
        if k < num_steps and any(r.get(f"heldout_accept_rate_{k}") is not None for r in decoded):
            ax_acc.plot([r[x] for r in decoded], [r.get(f"heldout_accept_rate_{k}") for r in decoded],
                        marker="x", linestyle="--", color=line.get_color(), label=f"held-out P(d{k + 1} | earlier)")
    ax_acc.set(title="draft accuracy per position: training, held-out", xlabel=xlabel, ylabel="accuracy",
               ylim=(0, 1))
    if positions:
        ax_acc.legend(fontsize="small")

    simulated = []
    for r in rows:
        accs = [r.get(f"acc_{k}") for k in positions]
        simulated.append(chain_acceptance_length(accs, num_steps) if None not in accs and accs else None)
    ax_len.plot(steps, simulated, marker=".", color="tab:blue", label=f"simulated from training accuracies (k={num_steps})")
    if decoded:
        ax_len.plot([r[x] for r in decoded], [r["heldout_acceptance_length"] for r in decoded], marker="x",
                    color="tab:green", label=f"measured while training (held-out, k={num_steps})")
    for label, value in measured.items():
        if value is None or not steps:
            continue
        at = steps[0] if label == "before" else steps[-1]
        ax_len.scatter([at], [value], s=80, zorder=3, label=f"measured {label}: {value:.3f}")
    ax_len.set(title="acceptance length", xlabel=xlabel, ylabel="tokens per verify pass")
    ax_len.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax_len.legend(fontsize="small")

    for ax in (ax_loss, ax_acc, ax_len):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
