"""Draft configs generated from Llama / Qwen2 / Qwen3 / Mistral targets, or read from JSON."""

import pytest
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specforge_core.errors import ModelError
from specforge_core.drafts.eagle3.draft_config import (
    check_capture_layer_ids,
    default_capture_layer_ids,
    draft_config_from_dict,
    draft_config_from_target,
    serving_config_dict,
)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_default_capture_ids_follow_the_eagle3_convention():
    assert default_capture_layer_ids(8) == [1, 3, 4]
    assert default_capture_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M
    assert default_capture_layer_ids(36) == [1, 17, 32]  # Qwen3-8B


def test_default_capture_ids_of_a_too_shallow_target_raise_a_model_error_naming_the_fix():
    with pytest.raises(ModelError, match="model.capture_layer_ids") as err:
        check_capture_layer_ids(None, 6)
    assert "fix:" in str(err.value)


@pytest.mark.parametrize("ids", [[1, 2, 8], [1, 1, 2], [0, 1], [-1, 2, 3]])
def test_capture_ids_out_of_range_repeated_or_not_three_are_refused(ids):
    with pytest.raises(ModelError):
        check_capture_layer_ids(ids, 8)


def test_llama_target_gives_a_one_layer_draft_with_its_shapes_and_llama3_rope():
    target = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                         rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE))
    cfg = draft_config_from_target(target, draft_vocab_size=300)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (1, 256, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 32)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size) == (1000, 300, 256)
    assert cfg.rope_parameters == LLAMA3_ROPE
    assert cfg.eagle_config == {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    assert cfg.architectures == ["LlamaForCausalLMEagle3"] and cfg.tie_word_embeddings is False
    assert not getattr(cfg, "fc_norm", False)


def test_qwen3_target_keeps_its_explicit_head_dim_and_theta():
    target = Qwen3Config(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e6)
    cfg = draft_config_from_target(target, draft_vocab_size=100, capture_layer_ids=[0, 3, 7], fc_norm=True)
    assert cfg.head_dim == 64 and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 7] and cfg.fc_norm is True


def test_qwen2_target_with_yarn_scaling_in_legacy_fields():
    target = Qwen2Config(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=131072,
                         rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    cfg = draft_config_from_target(target, draft_vocab_size=400)
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["rope_theta"] == 1e6
    assert cfg.rope_parameters["factor"] == 4.0 and cfg.head_dim == 16
    assert cfg.attention_bias is False  # Qwen2's q/k/v biases are not part of the draft


def test_mistral_target():
    target = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=1, sliding_window=4096)
    cfg = draft_config_from_target(target, draft_vocab_size=32)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (1, 16, 320)


def test_real_target_configs_from_disk(tiny_target_dir, tiny_qwen3_dir):
    for path in (tiny_target_dir, tiny_qwen3_dir):
        target = AutoConfig.from_pretrained(path)
        cfg = draft_config_from_target(target, draft_vocab_size=64)
        assert cfg.vocab_size == target.vocab_size and cfg.head_dim == target.head_dim


def test_draft_vocab_larger_than_the_target_vocab_is_refused():
    with pytest.raises(ModelError, match="draft.draft_vocab_size"):
        draft_config_from_target(LlamaConfig(vocab_size=100, num_hidden_layers=8), draft_vocab_size=101)


def test_rope_types_the_draft_cannot_reproduce_are_refused():
    target = LlamaConfig(vocab_size=100, num_hidden_layers=8, hidden_size=64, num_attention_heads=4,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                          "long_factor": [1.0] * 8, "original_max_position_embeddings": 1024})
    with pytest.raises(ModelError, match="RoPE type 'longrope'"):
        draft_config_from_target(target, draft_vocab_size=10)


def test_serving_config_carries_both_rope_forms_and_reloads_to_the_same_config():
    target = LlamaConfig(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_hidden_layers=8,
                         max_position_embeddings=16384, rope_parameters=dict(LLAMA3_ROPE))
    cfg = draft_config_from_target(target, draft_vocab_size=300)
    data = serving_config_dict(cfg, dtype="bfloat16")
    assert data["rope_parameters"] == LLAMA3_ROPE and data["rope_theta"] == 500000.0
    assert data["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert data["torch_dtype"] == "bfloat16" and data["num_aux_hidden_states"] == 3
    back = draft_config_from_dict(data)
    assert back.to_dict() | {"dtype": None} == cfg.to_dict() | {"dtype": None}
    legacy_only = {k: v for k, v in data.items() if k != "rope_parameters"}
    assert draft_config_from_dict(legacy_only).rope_parameters == LLAMA3_ROPE


def test_default_rope_is_written_with_a_null_rope_scaling():
    cfg = draft_config_from_target(LlamaConfig(vocab_size=100, num_hidden_layers=8, rope_theta=1e6), 50)
    data = serving_config_dict(cfg)
    assert data["rope_scaling"] is None and data["rope_theta"] == 1e6


@pytest.mark.parametrize("field,value", [("norm_before_fc", True), ("attention_bias", True),
                                         ("num_hidden_layers", 2)])
def test_json_configs_asking_for_variants_we_do_not_implement_are_refused(field, value):
    data = serving_config_dict(draft_config_from_target(LlamaConfig(vocab_size=100, num_hidden_layers=8), 50))
    with pytest.raises(ModelError, match=field):
        draft_config_from_dict(data | {field: value})


def test_json_config_defaults_draft_vocab_and_target_width():
    cfg = draft_config_from_dict({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 90, "intermediate_size": 32})
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.num_hidden_layers) == (90, 64, 1)


def _small():
    return LlamaConfig(vocab_size=100, num_hidden_layers=8)


def test_eagle31_options_are_recorded_only_when_on_and_reload():
    plain = serving_config_dict(draft_config_from_target(_small(), 50))
    assert "fc_norm" not in plain and "norm_output" not in plain
    on = serving_config_dict(draft_config_from_target(_small(), 50, fc_norm=True, norm_output=True))
    assert on["fc_norm"] is True and on["norm_output"] is True
    assert serving_config_dict(draft_config_from_dict(on)) == on


def test_options_spelled_out_as_false_keep_the_config_of_plain_eagle3():
    plain = serving_config_dict(draft_config_from_target(_small(), 50))
    spelled = draft_config_from_dict(plain | {"fc_norm": False, "norm_output": False})
    assert serving_config_dict(spelled) == plain  # same identity: a resume across them is allowed


def test_fc_norm_with_norm_before_fc_is_refused_naming_both_and_the_fix():
    data = serving_config_dict(draft_config_from_target(_small(), 50, fc_norm=True))
    with pytest.raises(ModelError, match="mutually exclusive") as err:
        draft_config_from_dict(data | {"norm_before_fc": True})
    assert "fc_norm, norm_before_fc" in str(err.value) and "remove norm_before_fc" in str(err.value)


def test_a_non_boolean_option_is_refused():
    data = serving_config_dict(draft_config_from_target(_small(), 50))
    with pytest.raises(ModelError, match="norm_output"):
        draft_config_from_dict(data | {"norm_output": "yes"})


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_each_eagle31_option_changes_the_identity_a_resume_checks(flag):
    from specforge_core.loop.trainer import config_identity

    plain = serving_config_dict(draft_config_from_target(_small(), 50))
    on = serving_config_dict(draft_config_from_target(_small(), 50, **{flag: True}))
    assert config_identity(plain) != config_identity(on)
