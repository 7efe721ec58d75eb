"""The validation report: simulated acceptance from training metrics beside the measured one."""

import json

import pytest

from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.report import chain_acceptance_length, render_report, simulated_acceptance
from specforge_core.run.metrics_file import MetricsFile
from specforge_core.loop.checkpoint import checkpoint_step
from specforge_core.decoding.speculative import Generation


def last_metrics(run_dir, at_step=None):
    return MetricsFile(run_dir / "metrics.jsonl").last(at_step=at_step)


def _measured(num_steps=3):
    stats = AcceptanceStats(num_steps)
    stats.add(Generation(tokens=list(range(8)), num_steps=num_steps, accepted=[3, 0, 1], emitted=[4, 1, 2]))
    return {**stats.summary(), "seconds": 1.0, "tokens_per_s": 8.0, "lossless": True}


def test_chain_length_multiplies_accuracies_along_the_chain():
    assert chain_acceptance_length([0.5, 0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_simulated_uses_the_last_metrics_line(tmp_path):
    lines = [{"step": 1, "acc_0": 0.1, "acc_1": 0.1}, {"step": 2, "acc_0": 0.3, "acc_1": 0.2, "acc_2": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "acc')
    sim = simulated_acceptance(last_metrics(tmp_path), num_steps=2)
    assert sim["step"] == 2 and sim["acc"] == [0.3, 0.2, 0.1]
    assert sim["acceptance_length"] == pytest.approx(1 + 0.3 + 0.06)
    assert sim["acceptance_length_all_steps"] == pytest.approx(1 + 0.3 + 0.06 + 0.006)


def test_an_earlier_checkpoint_gets_the_metrics_logged_at_or_before_its_step(tmp_path):
    lines = [{"step": s, "acc_0": s / 100} for s in (5, 10, 15, 20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    at = checkpoint_step(tmp_path / "checkpoints" / "step-00000012")
    assert at == 12 and last_metrics(tmp_path, at_step=at)["step"] == 10
    assert checkpoint_step(tmp_path / "exported-draft") is None
    assert last_metrics(tmp_path, at_step=None)["step"] == 20
    assert last_metrics(tmp_path, at_step=4) is None


def test_no_metrics_file_means_no_simulated_figure(tmp_path):
    assert simulated_acceptance(last_metrics(tmp_path), num_steps=3) is None


def test_report_puts_simulated_and_measured_side_by_side():
    sim = simulated_acceptance({"step": 9, "acc_0": 0.5, "acc_1": 0.4, "acc_2": 0.3}, 3)
    text = render_report(_measured(), sim, {"draft": "d"})
    row = next(line for line in text.splitlines() if line.startswith("| acceptance length"))
    assert f"{sim['acceptance_length']:.3f}" in row and f"{7 / 3:.3f}" in row
    assert "| position 2: acc_1 vs P(d2 \\| d1) | 0.400 | 0.500 |" in text


def test_report_without_training_metrics_shows_na():
    text = render_report(_measured(), None, {"draft": "d"})
    row = next(line for line in text.splitlines() if line.startswith("| acceptance length"))
    assert "| n/a |" in row
