"""tasks/promote.py: the promotion rule and the swap of the promoted directory."""

import json

from tasks.promotion import RECORD, compared_figure, install_draft, promoted_record, promotion_decision


def test_the_first_draft_is_promoted():
    assert promotion_decision(1.05, None, margin=0.5).promote


def test_a_draft_beating_the_promoted_one_by_more_than_the_margin_is_promoted():
    assert promotion_decision(1.50, 1.40, margin=0.05).promote


def test_a_draft_within_the_margin_is_not_promoted():
    decision = promotion_decision(1.43, 1.40, margin=0.05)
    assert not decision.promote
    assert "keeping the promoted draft" in decision.reason


def test_a_tie_with_zero_margin_is_not_promoted():
    assert not promotion_decision(1.40, 1.40, margin=0.0).promote


def test_installing_replaces_the_promoted_directory_and_records_the_source(tmp_path):
    old, new, promoted = tmp_path / "old", tmp_path / "new", tmp_path / "promoted"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "model.safetensors").write_text(text)
    install_draft(old, promoted, {"acceptance_length": 1.2})
    install_draft(new, promoted, {"acceptance_length": 1.5})
    assert (promoted / "model.safetensors").read_text() == "new"
    assert promoted_record(promoted) == {"acceptance_length": 1.5}
    assert json.loads((promoted / RECORD).read_text())["acceptance_length"] == 1.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old", "promoted"]


def _report(held_out, held_out_promoted, tau, tau_promoted):
    def table(value):
        return None if value is None else {"mt-bench": {"settings": [
            {"steps": 3, "topk": 1, "draft_tokens": 4, "acceptance_length": value},
            {"steps": 7, "topk": 1, "draft_tokens": 8, "acceptance_length": value + 1}]}}
    return {"acceptance_length": held_out, "acceptance_length_promoted": held_out_promoted,
            "benchmarks": table(tau), "benchmarks_promoted": table(tau_promoted)}


def test_promote_on_compares_that_benchmarks_first_setting_not_the_held_out_figure():
    report = _report(held_out=1.9, held_out_promoted=1.5, tau=2.0, tau_promoted=2.4)
    figure = compared_figure(report, promote_on="mt-bench")
    assert (figure.name, figure.new, figure.promoted) == ("measured acceptance length on mt-bench at 3,1,4", 2.0, 2.4)
    assert not promotion_decision(figure.new, figure.promoted, margin=0.0).promote
    held_out = compared_figure(report, promote_on=None)
    assert (held_out.new, held_out.promoted) == (1.9, 1.5)
    assert promotion_decision(held_out.new, held_out.promoted, margin=0.0).promote


def test_without_a_promoted_table_the_first_benchmarked_draft_is_promoted():
    figure = compared_figure(_report(1.2, None, 1.7, None), promote_on="mt-bench")
    assert figure.promoted is None and promotion_decision(figure.new, figure.promoted, margin=0.1).promote


def test_a_draft_without_a_measured_figure_is_not_promoted():
    decision = promotion_decision(None, None, margin=0.0)
    assert not decision.promote and "no measured figure" in decision.reason
