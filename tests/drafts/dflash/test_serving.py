"""The DFlash serving directory (dflash-facts §5.1): exact key set without prefixes, the config
fields SGLang/vLLM read, refusal of a wrong state before anything is written, bit-identical
reload, and warm starts that refuse a draft made for other settings."""

import json

import pytest
import torch
from safetensors import safe_open

from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
from specforge_core.drafts.dflash.serving import (
    check_serving_state,
    export_dflash,
    load_exported_dflash,
    warm_start_dflash,
)
from specforge_core.drafts.dflash.model import DFlashDraftModel, dense_attend
from specforge_core.errors import CheckpointError, ModelError
from tests.drafts.dflash.fixtures import target_config, tiny_draft

LAYERS = ["sliding_attention", "full_attention"]
PER_LAYER = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj"]


def _draft():
    return tiny_draft(seed=4, block_size=4, num_layers=2, layer_types=LAYERS, sliding_window=6)


def _outputs(draft):
    """The draft's output on fixed inputs: 2 rows, 7 context rows, one block, mixed layers."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 7, 2 * 64, generator=g)
    embeds = torch.randn(2, 4, 64, generator=g)
    masks = {t: torch.rand(2, 4, 11, generator=g) < 0.7 for t in LAYERS}
    for m in masks.values():
        m[..., 7:] = True
    with torch.no_grad():
        return draft(embeds, torch.arange(7, 11).expand(2, 4), dense_attend(masks), target_hidden=feats,
                     context_positions=torch.arange(7).expand(2, 7))


def test_export_writes_exactly_the_serving_keys_and_config(tmp_path):
    draft = _draft()
    out = export_dflash(draft, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_tensor("fc.weight").shape) == (64, 2 * 64)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}.weight" for i in range(2) for name in PER_LAYER}
    assert keys == expected
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 6 and config["vocab_size"] == 256
    assert config["layer_types"] == LAYERS and config["sliding_window"] == 6 and config["use_sliding_window"]
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 255}
    assert config["torch_dtype"] == "float32" and "auto_map" not in config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reload_gives_bit_identical_outputs(tmp_path, dtype):
    draft = _draft().cast_params(dtype)
    out = export_dflash(draft, tmp_path / "export")
    again = load_exported_dflash(out)
    assert next(again.parameters()).dtype == dtype
    assert torch.equal(_outputs(draft), _outputs(again))


def test_export_casts_on_request(tmp_path):
    out = export_dflash(_draft(), tmp_path / "export", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert next(load_exported_dflash(out).parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda s: s.pop("layers.1.self_attn.k_norm.weight"), "missing layers.1.self_attn.k_norm.weight"),
        (lambda s: s.update({"model.norm.weight": s["norm.weight"]}), "unexpected model.norm.weight"),
        (lambda s: s.update({"embed_tokens.weight": torch.zeros(256, 64)}), "unexpected embed_tokens.weight"),
        (lambda s: s.update({"fc.weight": torch.zeros(64, 3 * 64)}), "fc.weight is torch.float32[64, 192]"),
    ],
    ids=["missing", "prefixed", "embedding", "fc-shape"],
)
def test_a_wrong_state_is_refused_naming_the_key_and_nothing_is_written(tmp_path, edit, named):
    draft = _draft()
    state = draft.draft_state_dict()
    edit(state)
    with pytest.raises(ModelError, match=named.replace("[", r"\[")):
        export_dflash(draft, tmp_path / "export", state_dict=state)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ModelError, match=named.replace("[", r"\[")):
        check_serving_state(state, draft.config, where="x")


def test_export_refuses_a_directory_holding_other_files(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError):
        export_dflash(_draft(), tmp_path / "export")
    assert (tmp_path / "export" / "notes.txt").exists()


def test_export_replaces_a_previous_export(tmp_path):
    first = export_dflash(tiny_draft(seed=1), tmp_path / "export")
    second = export_dflash(_draft(), tmp_path / "export")
    assert first == second and load_exported_dflash(second).config.num_hidden_layers == 2


def test_warm_start_keeps_the_weights_and_refuses_other_settings(tmp_path):
    draft = _draft()
    out = export_dflash(draft, tmp_path / "export")
    warm = warm_start_dflash(out, draft.config)
    assert all(torch.equal(a, b) for a, b in zip(warm.draft_state_dict().values(), draft.draft_state_dict().values()))
    other = dflash_config_from_target(target_config(), block_size=8, num_layers=2, target_layer_ids=[1, 3],
                                      mask_token_id=254, layer_types=LAYERS, sliding_window=8)
    with pytest.raises(ModelError) as err:
        warm_start_dflash(out, other)
    assert err.value.where == "draft.init_from"
    for named in ("block_size", "sliding_window", "dflash_config.mask_token_id"):
        assert named in err.value.problem
    assert isinstance(warm, DFlashDraftModel)
