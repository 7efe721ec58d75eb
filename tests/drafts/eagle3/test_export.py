"""Export: exactly the serving keys and config fields, refusal on bad keys, bit-identical reload,
warm start keeping the exported vocab map."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from specforge_core.errors import CheckpointError, ModelError
from specforge_core.drafts.eagle3.serving import (
    export_draft,
    load_draft_from_files,
    load_exported_draft,
    save_draft_checkpoint_files,
    serving_keys,
    warm_start_draft,
)
from specforge_core.drafts.eagle3.draft_config import draft_config_from_dict
from specforge_core.export import main
from specforge_core.drafts.eagle3 import eagle3_loss
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}


def saved_keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def run_dir_with_checkpoint(tmp_path, draft, step="step-00000012"):
    step_dir = tmp_path / "run" / "checkpoints" / step
    save_draft_checkpoint_files(draft, step_dir)
    (tmp_path / "run" / "checkpoints" / "latest").write_text(step + "\n")
    return tmp_path / "run"


@pytest.mark.parametrize("fc_norm", [False, True])
def test_export_writes_exactly_the_serving_keys_and_no_embedding(tmp_path, fc_norm):
    draft = tiny_draft(fc_norm=fc_norm, norm_output=fc_norm)
    out = export_draft(draft, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = saved_keys(out / "model.safetensors")
    assert set(tensors) == set(serving_keys(draft.config))
    assert not any("embed" in k for k in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"], draft.d2t) and torch.equal(tensors["t2d"], draft.t2d)


def test_export_config_has_the_serving_fields(tmp_path):
    draft = tiny_draft(rope_parameters=dict(YARN))
    out = export_draft(draft, tmp_path / "out", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, 24, 12)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's numbering: one higher
    assert config["rope_parameters"] == YARN and config["rope_theta"] == 1e6
    assert config["rope_scaling"] == {k: v for k, v in YARN.items() if k != "rope_theta"}
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert (config["head_dim"], config["num_key_value_heads"], config["target_hidden_size"]) == (8, 2, 24)
    assert AutoConfig.from_pretrained(out).rope_parameters == YARN  # what transformers-based loaders read


def test_the_top_level_ids_follow_the_trained_ids_never_a_stale_copy(tmp_path):
    draft = tiny_draft()
    draft.config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}
    draft.config.eagle_aux_hidden_state_layer_ids = [9, 9, 9]  # e.g. read back from an older export
    config = json.loads((export_draft(draft, tmp_path / "out") / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert load_exported_draft(tmp_path / "out").config.eagle_config == config["eagle_config"]


@pytest.mark.parametrize("eagle_config", [None, {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}])
def test_a_draft_config_whose_vllm_ids_disagree_with_the_trained_ones_is_refused(tmp_path, eagle_config):
    config = json.loads((export_draft(tiny_draft(), tmp_path / "out") / "config.json").read_text())
    config["eagle_config"] = eagle_config  # the top-level ids stay [2, 4, 5]
    with pytest.raises(ModelError, match="eagle_aux_hidden_state_layer_ids") as e:
        draft_config_from_dict(config, where="draft.json")
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]" in e.value.fix


def test_export_refuses_a_missing_key_and_writes_nothing(tmp_path):
    draft = tiny_draft()
    state = draft.draft_state_dict()
    del state["midlayer.hidden_norm.weight"]
    with pytest.raises(ModelError, match="missing midlayer.hidden_norm.weight"):
        save_draft_checkpoint_files(draft, tmp_path / "ckpt", state_dict=state)
    assert not (tmp_path / "ckpt" / "draft.safetensors").exists()


def test_export_refuses_an_unexpected_or_misshapen_key(tmp_path):
    draft = tiny_draft()
    bad = dict(draft.draft_state_dict(), **{"model.fc.weight": draft.fc.weight})
    with pytest.raises(ModelError, match="unexpected model.fc.weight"):
        save_draft_checkpoint_files(draft, tmp_path / "a", state_dict=bad)
    draft.lm_head.weight.data = torch.zeros(5, 24)
    with pytest.raises(ModelError, match="lm_head.weight is float"):
        export_draft(draft, tmp_path / "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("dtype", ["keep", "bfloat16"])
def test_reloaded_export_gives_bit_identical_outputs(tmp_path, dtype):
    draft = tiny_draft(seed=3, rope_parameters=dict(YARN))
    out = export_draft(draft, tmp_path / "out", dtype=dtype)
    if dtype != "keep":
        draft.cast_params(torch.bfloat16)
    reloaded = load_exported_draft(out)
    reloaded.load_embedding(draft.embed_tokens.weight)
    batch = random_batch(seed=3, lengths=[8, 5], T=8, target_hidden=24)
    W = target_head(3, 24)
    with torch.no_grad():
        a, sums_a = eagle3_loss(draft, batch, W, ttt_length=3)
        b, sums_b = eagle3_loss(reloaded, batch, W, ttt_length=3)
        ids, hidden, pos = batch["input_ids"], draft.project_hidden(batch["aux_hidden"]), torch.arange(8)[None]
        step_a, step_b = draft.step(ids, hidden, pos)[0], reloaded.step(ids, hidden, pos)[0]
    assert torch.equal(a, b) and all(torch.equal(sums_a[k], sums_b[k]) for k in sums_a)
    assert torch.equal(step_a, step_b)


def test_cli_exports_the_latest_checkpoint_of_a_run_dir(tmp_path, capsys):
    draft = tiny_draft(seed=5)
    run = run_dir_with_checkpoint(tmp_path, draft)
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "served")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["checkpoint"].endswith("step-00000012") and summary["capture_layer_ids"] == [1, 3, 4]
    reloaded = load_exported_draft(tmp_path / "served")
    for key, value in draft.draft_state_dict().items():
        assert torch.equal(reloaded.draft_state_dict()[key], value), key


def test_an_eagle31_export_records_both_options_and_reloads_bit_identically(tmp_path):
    draft = tiny_draft(seed=5, fc_norm=True, norm_output=True)
    out = export_draft(draft, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(saved_keys(out / "model.safetensors"))
    back = load_exported_draft(out)
    back.load_embedding(draft.embed_tokens.weight)
    h, ids, pos = torch.randn(1, 3, 24), torch.randint(0, 24, (1, 3)), torch.arange(3)[None]
    assert back.norm_output and torch.equal(back.step(ids, h, pos)[0], draft.step(ids, h, pos)[0])


def test_checkpoint_files_round_trip(tmp_path):
    draft = tiny_draft(seed=6, fc_norm=True, norm_output=True)
    save_draft_checkpoint_files(draft, tmp_path / "step")
    back = load_draft_from_files(tmp_path / "step")
    assert back.config.to_dict() == draft.config.to_dict() | {"dtype": back.config.dtype}
    assert all(torch.equal(back.draft_state_dict()[k], v) for k, v in draft.draft_state_dict().items())


def test_cli_reports_a_path_that_is_no_checkpoint(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "checkpoints/latest" in capsys.readouterr().err


def test_export_refuses_an_out_dir_holding_other_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="other files"):
        export_draft(tiny_draft(), tmp_path / "out")


def test_warm_start_keeps_the_exported_vocab_map_and_refuses_another(tmp_path):
    draft = tiny_draft(seed=7)
    out = export_draft(draft, tmp_path / "out")
    warm = warm_start_draft(out, config=draft.config)
    assert torch.equal(warm.d2t, draft.d2t) and torch.equal(warm.t2d, draft.t2d)
    warm.set_vocab_map(draft.d2t, draft.t2d)  # the same map is fine
    other = tiny_draft(seed=8)
    with pytest.raises(ModelError, match="warm-started"):
        warm.set_vocab_map(other.d2t, other.t2d)


def test_warm_start_refuses_a_draft_made_for_other_settings(tmp_path):
    out = export_draft(tiny_draft(seed=7), tmp_path / "out")
    with pytest.raises(ModelError, match="fc_norm"):
        warm_start_draft(out, config=tiny_draft(fc_norm=True).config)
    with pytest.raises(ModelError, match="norm_output: run True"):
        warm_start_draft(out, config=tiny_draft(norm_output=True).config)
