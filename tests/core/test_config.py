"""The run config: YAML in, unknown keys rejected, dotted overrides, schema, readable errors."""

import json
import subprocess
import sys

import pytest

from specforge_core.config import RunConfig, dump_config, json_schema, load_config
from specforge_core.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_load_without_a_file():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.training.ttt_length == 7 and cfg.deployment.mode == "local_colocated"


def test_yaml_sections_are_read(tmp_path):
    cfg = load_config(write(tmp_path, "training:\n  learning_rate: 3.0e-4\ndata:\n  max_length: 384\n"))
    assert cfg.training.learning_rate == 3e-4
    assert cfg.data.max_length == 384


def test_dotted_override_wins_over_file(tmp_path):
    cfg = load_config(write(tmp_path, "training:\n  learning_rate: 3.0e-4\n"), ["training.learning_rate=5e-5"])
    assert cfg.training.learning_rate == 5e-5


def test_override_parses_lists_and_bools():
    cfg = load_config(None, ["model.capture_layer_ids=[1, 3, 5]", "training.compile=true"])
    assert cfg.model.capture_layer_ids == [1, 3, 5]
    assert cfg.training.compile is True


def test_unknown_key_is_rejected_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "training:\n  lerning_rate: 1.0e-4\n"))
    msg = str(e.value)
    assert "training.lerning_rate: unknown key" in msg
    assert "did you mean 'learning_rate'" in msg
    assert str(tmp_path / "c.yaml") in msg


def test_unknown_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="trainig: unknown key; did you mean 'training'"):
        load_config(write(tmp_path, "trainig: {}\n"))


def test_wrong_type_names_the_field_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.batch_size=many"])
    assert "training.batch_size" in str(e.value) and "'many'" in str(e.value)


def test_bad_override_syntax_says_how_to_write_it():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["training.learning_rate"])


def test_sequence_parallelism_is_refused_for_colocated():
    with pytest.raises(ConfigError, match=r"training.sp_size=2.*set training.sp_size=1"):
        load_config(None, ["training.sp_size=2"])


def test_tp_size_must_divide_world():
    with pytest.raises(ConfigError, match="capture.tp_size=2 must divide the world size"):
        load_config(None, ["capture.tp_size=2", "deployment.nproc_per_node=3"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_storage_options_are_redacted_in_dumps():
    cfg = load_config(None, ["data.storage_options={key: secret123}"])
    assert "secret123" not in json.dumps(dump_config(cfg))


def test_schema_lists_every_section():
    props = json_schema()["properties"]
    assert {"model", "data", "draft", "training", "capture", "deployment", "output", "validation"} <= set(props)


def test_cli_prints_schema_and_rejects_bad_config(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specforge_core.config", "--schema"], capture_output=True, text=True)
    assert out.returncode == 0 and "RunConfig" in out.stdout
    bad = write(tmp_path, "model:\n  dtyp: float32\n")
    out = subprocess.run([sys.executable, "-m", "specforge_core.config", "--config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "model.dtyp: unknown key" in out.stderr


def test_the_old_training_tp_size_still_loads_as_capture_tp_size_with_a_warning():
    from specforge_core.config import ConfigDeprecationWarning

    with pytest.warns(ConfigDeprecationWarning, match="training.tp_size is deprecated.*capture.tp_size"):
        cfg = load_config(None, ["training.tp_size=2", "deployment.nproc_per_node=4"])
    assert cfg.capture.tp_size == 2 and "tp_size" not in cfg.training.model_dump()


def test_old_and_new_tp_size_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="training.tp_size=2 and capture.tp_size=1 disagree"):
        load_config(None, ["training.tp_size=2", "capture.tp_size=1", "deployment.nproc_per_node=4"])


def test_chat_template_kwargs_may_not_set_what_the_renderer_sets():
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: sets add_generation_prompt"):
        load_config(None, ["data.chat_template_kwargs={add_generation_prompt: true, enable_thinking: false}"])
    cfg = load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}


def test_promote_on_must_name_a_measured_benchmark():
    with pytest.raises(ConfigError, match=r"validation.promote_on: 'mt-bench' is not one of validation.benchmarks \['humaneval'\]"):
        load_config(None, ["validation.benchmarks=[humaneval]", "validation.promote_on=mt-bench"])
    cfg = load_config(None, ["validation.benchmarks=[mt-bench, humaneval]", "validation.promote_on=mt-bench"])
    assert [(s.steps, s.topk, s.draft_tokens) for s in cfg.validation.settings] == [(3, 1, 4), (7, 1, 8)]
