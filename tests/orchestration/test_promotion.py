"""tasks/promote.py: the promotion rule and the swap of the promoted directory."""

import json

from tasks.promotion import RECORD, install_draft, promoted_record, promotion_decision


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
