"""The dry run sizes a DSpark draft for a real recipe target without a tokenizer: the unresolved
mask token is named under draft.dspark, the final hidden is captured, the heads are counted."""

import json

from tests.runtime.test_dry_run import ROOT, TARGET_CONFIGS, recipe_args, run_dry, targets  # noqa: F401


def test_dry_run_sizes_a_dspark_draft(targets, capsys):  # noqa: F811
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"  # the H200 recipe: sized for its card, on any machine
    args = ["--gpu-gib", "140", *recipe_args(recipe, targets, "draft.family=dspark", "draft.dspark.num_layers=1")]
    code, lines, err = run_dry(capsys, "--rows", "1000", *args)
    assert code == 0, err
    report = json.loads(lines[-1])
    assert [u.split(":")[0] for u in report["unresolved"]] == ["draft.dspark.mask_token_id"]
    q = TARGET_CONFIGS["qwen3-8b"]
    assert report["memory"]["parts_bytes"]["features"] == 12 * 4096 * 2 * q["hidden_size"] * 2  # K=1 + last hidden
    heads = q["vocab_size"] * 256 * 2 + (q["hidden_size"] + 256 + 1)
    code, lines, _ = run_dry(capsys, "--rows", "1000", *args, "draft.dspark.markov_rank=0",
                             "draft.dspark.enable_confidence_head=false")
    assert code == 0
    assert report["draft"]["trainable_params"] - json.loads(lines[-1])["draft"]["trainable_params"] == heads
