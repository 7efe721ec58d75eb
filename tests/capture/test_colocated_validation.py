"""deployment.mode=local_colocated: each rejection names the field to change.

Pure-config rules run at load (RunConfig validators); rules that need the target's config run in
validate_colocated where the target is loaded. sp_size=1 and tp_size | world are covered in
tests/core/test_config.py.
"""

import pytest
from transformers import LlamaConfig

from specforge_core.capture.target_info import validate_colocated
from specforge_core.config import load_config
from specforge_core.errors import ConfigError, ModelError

SGLANG = ["capture.backend=sglang", "capture.tp_size=2", "deployment.nproc_per_node=4", "training.batch_size=4",
          "data.max_length=1024"]


def rejected(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*SGLANG, *overrides])
    return str(e.value)


def test_a_valid_sglang_colocated_config_loads():
    cfg = load_config(None, [*SGLANG, "capture.sglang.max_running_requests=8", "capture.sglang.max_total_tokens=8192"])
    assert cfg.capture.backend == "sglang"


def test_sglang_on_cpu_is_rejected():
    assert "capture.device=cpu" in rejected("capture.device=cpu")


def test_sglang_data_parallelism_is_rejected():
    assert "set capture.sglang.dp_size=1" in rejected("capture.sglang.dp_size=2")


def test_sglang_dp_attention_is_rejected():
    assert "set capture.sglang.enable_dp_attention=false" in rejected("capture.sglang.enable_dp_attention=true")


def test_expert_parallelism_must_divide_the_island_tp():
    assert "capture.sglang.ep_size=4 must divide capture.tp_size=2" in rejected("capture.sglang.ep_size=4")


def test_max_running_requests_below_one_tp_wide_batch_is_rejected():
    msg = rejected("capture.sglang.max_running_requests=7")
    assert "capture.sglang.max_running_requests=7" in msg and "≥ 8" in msg


def test_max_total_tokens_below_one_tp_wide_batch_is_rejected():
    msg = rejected("capture.sglang.max_total_tokens=8191")
    assert "capture.sglang.max_total_tokens=8191" in msg and "≥ 8192" in msg


def test_engine_context_shorter_than_max_length_is_rejected():
    assert "capture.sglang.context_length=512 is shorter than data.max_length=1024" in rejected(
        "capture.sglang.context_length=512")


def test_extra_may_not_override_a_resolved_engine_field():
    msg = rejected("capture.sglang.extra={tp_size: 8}")
    assert "capture.sglang.extra" in msg and "tp_size" in msg


def test_sglang_capacity_fields_do_not_constrain_the_hf_backend():
    cfg = load_config(None, ["capture.sglang.max_running_requests=1", "training.batch_size=4"])
    assert cfg.capture.backend == "hf"


def target(**kw) -> LlamaConfig:
    args = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, vocab_size=100)
    args.update(kw)
    return LlamaConfig(**args)


def test_max_length_plus_ttt_beyond_the_target_context_is_rejected():
    cfg = load_config(None, ["data.max_length=1020", "training.ttt_length=7"])
    with pytest.raises(ConfigError, match=r"(?s)data.max_length.*1027 positions exceed.*1024.*≤ 1017"):
        validate_colocated(cfg, target())


def test_max_length_plus_ttt_within_the_target_context_passes():
    validate_colocated(load_config(None, ["data.max_length=1017", "training.ttt_length=7"]), target())


def test_engine_context_beyond_the_target_is_rejected():
    cfg = load_config(None, [*SGLANG, "data.max_length=512", "capture.sglang.context_length=4096"])
    with pytest.raises(ConfigError, match="capture.sglang.context_length=4096 exceeds"):
        validate_colocated(cfg, target())


def test_island_tp_must_divide_the_attention_heads():
    cfg = load_config(None, [*SGLANG, "data.max_length=512", "capture.tp_size=4"])
    with pytest.raises(ConfigError, match="capture.tp_size=4 does not divide the target's 6 attention heads"):
        validate_colocated(cfg, target(num_attention_heads=6, hidden_size=96))


def test_targets_with_logit_softcapping_are_refused():
    with pytest.raises(ModelError, match="final_logit_softcapping"):
        validate_colocated(load_config(None, ["data.max_length=512"]), target(final_logit_softcapping=30.0))
