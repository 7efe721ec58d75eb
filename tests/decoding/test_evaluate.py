"""The evaluate CLI: loads a draft (run dir, checkpoint, export), decodes held-out prompts, reports."""

import json

import pytest
import torch
from transformers import AutoConfig

from specforge_core.config import config_from_dict
from specforge_core.errors import DataError, ModelError
from specforge_core.decoding.evaluation import evaluate
from specforge_core.evaluate import main
from specforge_core.drafts.eagle3.serving import export_draft, save_draft_checkpoint_files
from specforge_core.drafts.eagle3.draft_config import draft_config_from_target
from specforge_core.drafts.eagle3.model import Eagle3DraftModel

QUESTIONS = ["what is the capital of France", "tell me a story", "hi", "name three rivers",
             "why is water good", "how do I write python code", "what time is it", "who are you"]


@pytest.fixture(scope="module")
def run(tiny_target_dir, tmp_path_factory):
    """A run directory with one checkpoint of a random draft, its export, and training metrics."""
    root = tmp_path_factory.mktemp("eval-run")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": q},
                                                          {"role": "assistant", "content": "the answer is ten."}]})
                            + "\n" for q in QUESTIONS))
    torch.manual_seed(0)
    draft = Eagle3DraftModel(draft_config_from_target(AutoConfig.from_pretrained(tiny_target_dir), 512))
    run_dir = root / "run"
    save_draft_checkpoint_files(draft, run_dir / "checkpoints" / "step-00000004")
    (run_dir / "checkpoints" / "latest").write_text("step-00000004\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "acc_0": 0.5, "acc_1": 0.4, "acc_2": 0.2}) + "\n")
    export_draft(draft, root / "export")
    cfg = {"model": {"target": str(tiny_target_dir)},
           "data": {"train_files": [str(data)], "eval_holdout": 3, "max_length": 128,
                    "cache_dir": str(root / "cache")},
           "output": {"dir": str(run_dir)}}
    return root, cfg


def test_cli_prints_one_json_line_and_writes_the_report(run, tmp_path, capsys):
    root, cfg = run
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(cfg))
    report = tmp_path / "report.md"
    code = main(["--config", str(cfg_path), "--draft", str(root / "run"), "--num-steps", "2",
                 "--max-new-tokens", "8", "--prompts", "2", "--report", str(report), "--check-lossless"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1
    result = json.loads(lines[0])
    assert result["prompts"] == 2 and result["num_steps"] == 2 and result["lossless"] is True
    assert result["simulated_acceptance_length"] == pytest.approx(1 + 0.5 + 0.2)
    assert "| acceptance length (k=2) | 1.700 |" in report.read_text()


def test_an_exported_draft_measures_the_same_as_its_checkpoint(run, tmp_path):
    root, cfg = run
    cfg = config_from_dict(cfg)
    a = evaluate(cfg, root / "run", num_steps=3, max_new_tokens=12, num_prompts=3, report_path=tmp_path / "a.md")
    b = evaluate(cfg, root / "export", num_steps=3, max_new_tokens=12, num_prompts=3, report_path=tmp_path / "b.md")
    for key in ("generated_tokens", "verify_passes", "acceptance_length", "per_position_acceptance"):
        assert a[key] == b[key]


def test_the_report_defaults_to_the_run_directory(run):
    root, cfg = run
    result = evaluate(config_from_dict(cfg), root / "run", num_steps=1, max_new_tokens=4, num_prompts=1)
    assert result["report"] == str(root / "run" / "validation.md") and (root / "run" / "validation.md").is_file()


def test_capture_layers_other_than_the_drafts_are_refused(run):
    root, cfg = run
    cfg = config_from_dict({**cfg, "model": {**cfg["model"], "capture_layer_ids": [0, 2, 5]}})
    with pytest.raises(ModelError, match="capture_layer_ids"):
        evaluate(cfg, root / "export", num_prompts=1, max_new_tokens=2)


def test_no_held_out_prompts_is_an_error_naming_the_fix(run):
    root, cfg = run
    cfg = config_from_dict({**cfg, "data": {**cfg["data"], "eval_holdout": 0}})
    with pytest.raises(DataError, match="eval_holdout"):
        evaluate(cfg, root / "export", num_prompts=1, max_new_tokens=2)
