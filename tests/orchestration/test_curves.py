"""The validation plot: training curves, and the held-out decodes made while training beside them."""

import json

import matplotlib.pyplot as plt
import pytest

from tasks import curves


def write_metrics(path, with_heldout: bool):
    rows = []
    for step in range(1, 7):
        row = {"step": step, "total_steps": 6, "loss": 10.0 / step, "train_seconds": 2.5 * step,
               **{f"acc_{k}": 0.1 * step / (k + 1) for k in range(4)}}
        if with_heldout and step % 3 == 0:
            row |= {"heldout_acceptance_length": 1.0 + 0.1 * step,
                    **{f"heldout_accept_rate_{k}": 0.05 * step for k in range(3)}}
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_curves drew, kept open for the test to read."""
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    for fig in figures:
        close(fig)


def lines(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}


def test_held_out_decodes_are_drawn_beside_the_training_curves(tmp_path, drawn):
    write_metrics(tmp_path / "metrics.jsonl", with_heldout=True)
    out = curves.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", num_steps=3, measured={})
    assert out.stat().st_size > 0
    drawn_lines = lines(drawn[0])
    assert drawn_lines["measured while training (held-out, k=3)"] == ([3, 6], [pytest.approx(1.3), pytest.approx(1.6)])
    assert drawn_lines["held-out P(d1 | earlier)"][0] == [3, 6]
    assert "held-out P(d4 | earlier)" not in drawn_lines  # k = 3 positions are decoded


def test_without_held_out_decodes_only_the_training_curves_are_drawn(tmp_path, drawn):
    write_metrics(tmp_path / "metrics.jsonl", with_heldout=False)
    curves.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", num_steps=3, measured={"after": 1.2})
    assert not [label for label in lines(drawn[0]) if "held-out" in label]


def test_the_training_clock_can_be_the_x_axis(tmp_path, drawn):
    write_metrics(tmp_path / "metrics.jsonl", with_heldout=True)
    curves.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", num_steps=3, measured={},
                       x="train_seconds")
    assert lines(drawn[0])["measured while training (held-out, k=3)"][0] == [7.5, 15.0]
    assert drawn[0].axes[2].get_xlabel() == "training wall time (s)"
