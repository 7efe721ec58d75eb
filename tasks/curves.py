"""The validation plot: loss, per-position accuracy and acceptance length over training, as one PNG.

    plot_curves(run_dir / "metrics.jsonl", run_dir / "report" / "curves.png", num_steps=3,
                measured={"before": 1.0, "after": 1.42})

Reads the trainer's metrics.jsonl (one JSON object per log interval with ``step``, ``loss`` and
``acc_0..acc_{K-1}``); the simulated acceptance length per logged step is
``1 + Σ_{i<k} Π_{j≤i} acc_j`` (k = validation.num_steps), and the measured acceptance lengths
(speculative decoding of held-out prompts) are drawn as points at the first and last step.
Headless (Agg backend): no display needed.
"""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specforge_core.decoding.report import chain_acceptance_length  # noqa: E402
from tasks.process_group import metrics_rows  # noqa: E402

ACC = re.compile(r"^acc_(\d+)$")


def plot_curves(metrics_path: Path, out: Path, *, num_steps: int, measured: dict[str, float | None]) -> Path:
    """Write the PNG to ``out`` and return it. ``measured``: label → acceptance length (None: skip);
    "before" is drawn at the first logged step, every other label at the last one."""
    # After a resume the steps between the checkpoint and the crash are logged twice: keep the last.
    by_step = {r["step"]: r for r in metrics_rows(Path(metrics_path), max_rows=100_000) if r.get("step") is not None}
    rows = [by_step[s] for s in sorted(by_step)]
    steps = [r["step"] for r in rows]
    positions = sorted({int(m.group(1)) for r in rows for k in r if (m := ACC.match(k))})

    fig, (ax_loss, ax_acc, ax_len) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(steps, [r.get("loss") for r in rows], marker=".", color="tab:red")
    ax_loss.set(title="training loss (Σ 0.8^k L_k)", xlabel="optimizer step", ylabel="loss")

    for k in positions:
        ax_acc.plot(steps, [r.get(f"acc_{k}") for r in rows], marker=".", label=f"acc_{k}")
    ax_acc.set(title="draft accuracy per TTT position", xlabel="optimizer step", ylabel="accuracy", ylim=(0, 1))
    if positions:
        ax_acc.legend(fontsize="small")

    simulated = []
    for r in rows:
        accs = [r.get(f"acc_{k}") for k in positions]
        simulated.append(chain_acceptance_length(accs, num_steps) if None not in accs and accs else None)
    ax_len.plot(steps, simulated, marker=".", color="tab:blue", label=f"simulated (k={num_steps}, training)")
    for label, value in measured.items():
        if value is None or not steps:
            continue
        x = steps[0] if label == "before" else steps[-1]
        ax_len.scatter([x], [value], s=80, zorder=3, label=f"measured {label}: {value:.3f}")
    ax_len.set(title="acceptance length", xlabel="optimizer step", ylabel="tokens per verify pass")
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
