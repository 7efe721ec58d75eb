"""bench/gpu_families.py's documented CPU smoke run: both sides step, and their first-step losses
agree, which is what makes the timed comparison one of the same computation. The suite runs it for
DSpark, whose reference side exercises everything the bench shares between families; the other
families' losses equal speculators' in their own parity tests (tests/drafts/), and
``--families dflash2,dflash,eagle31`` runs them here by hand.

The tolerance: on a CPU both sides compute in fp32 from the same weights, the same batch and the
same anchors (the row's every candidate), so what is left is the order of fp32 sums (measured
≈ 2e-8); 1e-5 relative, as the parity tests use, is far above that and far below a real
difference (one anchor block more on one side moved the DSpark loss by 4e-3)."""

import json
import math

import pytest

from tests.bench_scripts import load_bench

pytest.importorskip("speculators")
# 2 processes, each importing torch, transformers and speculators: 15-25 s
pytestmark = pytest.mark.slow


def test_both_sides_step_and_their_first_losses_agree(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # each side sets it, as a training rank does
    bench = load_bench("gpu_families")
    argv = ["--shape", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--families", "dspark",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    (row,) = json.loads((tmp_path / "families.json").read_text())
    for side in ("ours", "reference"):
        assert row[side]["tokens_per_s"] > 0 and math.isfinite(row[side]["tokens_per_s"]), row[side]
        assert row[side]["first_loss"] and all(math.isfinite(v) for v in row[side]["first_loss"].values())
        assert row[side]["omp_wait_policy"] == "PASSIVE" and row[side]["intra_op_threads"] >= 1
        # the same steps, one by one or back to back: within a loose factor of each other on a CPU
        assert 0.2 < row[side]["back_to_back_step_s"] / row[side]["step_s"] < 5, row[side]
        windows = row[side]["back_to_back_windows_s"]
        assert len(windows) == bench.BACK_TO_BACK_WINDOWS and row[side]["back_to_back_step_s"] == sorted(windows)[1]
        pauses = row[side]["gc_full_collections"]
        assert pauses["count"] >= 0 and pauses["seconds"] >= 0, pauses
    assert math.isfinite(row["ours_over_reference"])
    assert row["ours_over_reference_back_to_back"] == pytest.approx(
        row["reference"]["back_to_back_step_s"] / row["ours"]["back_to_back_step_s"])
    assert row["first_loss_rel_diff"] <= 1e-5, (row["ours"]["first_loss"], row["reference"]["first_loss"])


def test_the_full_collection_count_takes_generation_2_only_with_its_seconds():
    import gc

    pauses = load_bench("gpu_families").FullCollections()
    gc.callbacks.append(pauses.record)
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses.record)
    assert pauses.count == 1 and pauses.seconds > 0
    assert pauses.as_dict() == {"count": 1, "seconds": round(pauses.seconds, 4)}
