"""DFlash draft configs: the default target layers, the mask-token resolution order, the fields a
generated config carries, JSON round trips, and a refusal naming the field for every invalid one."""

import json
from types import SimpleNamespace

import pytest

from specforge_core.drafts.dflash.draft_config import (
    build_target_layer_ids,
    check_fits_target,
    dflash_config_from_dict,
    dflash_config_from_target,
    dflash_config_to_dict,
    load_dflash_config,
    resolve_mask_token_id,
    save_dflash_config,
)
from specforge_core.errors import ConfigError, ModelError
from tests.drafts.dflash.fixtures import target_config


@pytest.mark.parametrize(
    "layers, k, ids",
    [(36, 5, [1, 9, 17, 25, 33]), (24, 5, [1, 6, 11, 16, 21]), (64, 5, [1, 16, 31, 46, 61]),
     (32, 5, [1, 8, 15, 22, 29]), (36, 1, [18]), (7, 3, [1, 2, 4])],
)
def test_default_target_layers_spread_over_1_to_L_minus_3_with_python_round(layers, k, ids):
    assert build_target_layer_ids(layers, k) == ids  # (7, 3): 2.5 rounds half to even → 2


def test_too_many_layers_for_a_shallow_target_are_refused():
    with pytest.raises(ConfigError) as err:
        build_target_layer_ids(5, 4)
    assert err.value.where == "draft.dflash.target_layer_ids"


class Tok:
    def __init__(self, size, **ids):
        self.size = size
        for name in ("mask_token_id", "pad_token_id", "eos_token_id", "unk_token_id"):
            setattr(self, name, ids.get(name))

    def __len__(self):
        return self.size


def test_mask_token_resolution_follows_the_documented_order():
    tok = Tok(250, mask_token_id=240, pad_token_id=0, eos_token_id=1)
    assert resolve_mask_token_id(7, tok, 256, draft_config_id=9) == 7
    assert resolve_mask_token_id(None, tok, 256, draft_config_id=9) == 9
    assert resolve_mask_token_id(None, tok, 256) == 240
    assert resolve_mask_token_id(None, Tok(250, pad_token_id=0), 256) == 250  # first unused row
    with pytest.warns(UserWarning, match="pad_token_id"):
        assert resolve_mask_token_id(None, Tok(256, pad_token_id=3, eos_token_id=1), 256) == 3
    with pytest.warns(UserWarning, match="eos_token_id"):
        assert resolve_mask_token_id(None, Tok(256, eos_token_id=1), 256) == 1


@pytest.mark.parametrize(
    "explicit, tok, where, error",
    [
        (256, Tok(250), "draft.dflash.mask_token_id", ConfigError),
        (-1, Tok(250), "draft.dflash.mask_token_id", ConfigError),
        (None, Tok(260, mask_token_id=300), "tokenizer mask_token_id", ModelError),
        (None, Tok(256), "draft.dflash.mask_token_id", ConfigError),  # nothing left to fall back to
    ],
)
def test_a_mask_token_outside_the_target_embedding_is_refused(explicit, tok, where, error):
    with pytest.raises(error) as err:
        resolve_mask_token_id(explicit, tok, 256)
    assert err.value.where == where and err.value.fix


def test_generated_config_carries_the_dflash_fields():
    target = target_config(num_layers=12, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                             "original_max_position_embeddings": 64})
    cfg = dflash_config_from_target(target, block_size=8, num_layers=3, mask_token_id=250,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    sliding_window=32)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["DFlashDraftModel"]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) == (target.hidden_size, target.vocab_size, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.block_size == 8 and cfg.num_target_layers == 12
    assert cfg.dflash_config == {"target_layer_ids": [1, 5, 9], "mask_token_id": 250}
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}  # own RoPE: no target scaling
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.use_sliding_window and cfg.sliding_window == 32 and cfg.hidden_act == "silu"
    assert not cfg.tie_word_embeddings and not cfg.attention_bias


def test_config_round_trips_through_json(tmp_path):
    cfg = dflash_config_from_target(target_config(), block_size=4, num_layers=2, target_layer_ids=[3, 1],
                                    mask_token_id=255)
    save_dflash_config(cfg, tmp_path / "draft.json")
    again = load_dflash_config(tmp_path / "draft.json")
    assert dflash_config_to_dict(again) == dflash_config_to_dict(cfg)
    data = json.loads((tmp_path / "draft.json").read_text())
    assert data["rope_theta"] == 1e6 and data["rope_scaling"] is None and "auto_map" not in data
    data["dflash_config"]["block_size"] = data.pop("block_size")  # newer checkpoints nest it
    assert dflash_config_from_dict(data).block_size == 4


def _generate(**kw):
    args = dict(block_size=4, num_layers=1, mask_token_id=255) | kw
    target = args.pop("target", target_config())
    return dflash_config_from_target(target, **args)


@pytest.mark.parametrize(
    "kwargs, where",
    [
        (dict(block_size=1), "draft.dflash.block_size"),
        (dict(block_size=True), "draft.dflash.block_size"),
        (dict(num_layers=0), "draft.dflash.num_layers"),
        (dict(target_layer_ids=[1, 6]), "draft.dflash.target_layer_ids"),
        (dict(target_layer_ids=[-1]), "draft.dflash.target_layer_ids"),
        (dict(target_layer_ids=[2, 2]), "draft.dflash.target_layer_ids"),
        (dict(target_layer_ids=[]), "draft.dflash.target_layer_ids"),
        (dict(mask_token_id=256), "draft.dflash.mask_token_id"),
        (dict(mask_token_id=None), "draft.dflash.mask_token_id"),
        (dict(layer_types=["full_attention", "full_attention"]), "draft.dflash.layer_types"),
        (dict(layer_types=["chunked_attention"]), "draft.dflash.layer_types"),
        (dict(layer_types=["sliding_attention"]), "draft.dflash.sliding_window"),
        (dict(layer_types=["sliding_attention"], sliding_window=3), "draft.dflash.sliding_window"),
    ],
)
def test_each_invalid_field_is_refused_by_name(kwargs, where):
    with pytest.raises(ConfigError) as err:
        _generate(**kwargs)
    assert err.value.where == where and err.value.fix


@pytest.mark.parametrize(
    "target, problem",
    [
        (target_config(num_attention_heads=6, num_key_value_heads=4), "multiple of num_key_value_heads"),
        (SimpleNamespace(hidden_size=None, num_hidden_layers=6, vocab_size=256, num_attention_heads=4), "hidden_size"),
    ],
)
def test_a_target_the_draft_cannot_take_is_refused(target, problem):
    with pytest.raises(ModelError, match=problem):
        _generate(target=target)


def test_a_draft_json_with_an_unsupported_layout_is_refused(tmp_path):
    data = dflash_config_to_dict(_generate())
    for field, value, problem in (("hidden_act", "gelu", "hidden_act"), ("attention_bias", True, "attention_bias")):
        with pytest.raises(ModelError, match=problem):
            dflash_config_from_dict(dict(data, **{field: value}), where="x.json")


def test_a_draft_made_for_another_target_is_refused():
    cfg = _generate()
    check_fits_target(cfg, target_config())
    with pytest.raises(ModelError, match="hidden_size"):
        check_fits_target(cfg, target_config(hidden_size=128))
    with pytest.raises(ModelError, match="num_target_layers"):
        check_fits_target(cfg, target_config(num_layers=8))
