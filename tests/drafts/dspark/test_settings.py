"""DSpark draft configs and the run config's draft.dspark section: defaults, round trips, refusals."""

import pytest

from specforge_core.config import DSparkSection, load_config
from specforge_core.drafts import check_config, get_family
from specforge_core.drafts.dspark.objective import ObjectiveSettings
from specforge_core.drafts.dspark.settings import (
    dspark_config_from_dict,
    dspark_config_from_target,
    dspark_config_to_dict,
    dspark_fields,
    load_dspark_config,
    save_dspark_config,
)
from specforge_core.errors import ConfigError, ModelError
from tests.drafts.dflash.fixtures import MASK, target_config


def _config(**fields):
    return dspark_config_from_target(target_config(), mask_token_id=MASK, target_layer_ids=[1, 3], **fields)


def test_defaults_are_speculators():
    from speculators.models.dspark import DSparkSpeculatorConfig

    ours = dspark_fields(_config())
    theirs = DSparkSpeculatorConfig.model_fields
    assert all(ours[name] == theirs[name].default for name in ours)
    section = DSparkSection()
    assert (section.block_size, section.loss_decay_gamma, section.confidence_head_alpha) == (8, 4.0, 1.0)
    assert ObjectiveSettings().per_position_loss_weight == section.per_position_loss_weight == "fixed-exp-decay"


def test_config_round_trips_through_json(tmp_path):
    config = _config(markov_rank=16, markov_head_type="rnn", sample_from_anchor=False)
    save_dspark_config(config, tmp_path / "c.json")
    again = load_dspark_config(tmp_path / "c.json")
    assert dspark_config_to_dict(again) == dspark_config_to_dict(config)
    assert again.architectures == ["Qwen3DSparkModel"] and dspark_fields(again)["markov_head_type"] == "rnn"


@pytest.mark.parametrize("fields, where", [
    ({"markov_rank": -1}, "draft.dspark.markov_rank"),
    ({"markov_head_type": "lstm"}, "draft.dspark.markov_head_type"),
    ({"markov_rank": 0}, "draft.dspark.confidence_head_with_markov"),
    ({"sample_from_anchor": "yes"}, "draft.dspark.sample_from_anchor"),
])
def test_invalid_fields_are_refused_naming_the_field(fields, where):
    with pytest.raises(ConfigError) as info:
        _config(**fields)
    assert info.value.where == where


def test_a_dflash_config_is_not_a_dspark_config():
    data = dspark_config_to_dict(_config())
    del data["dspark_config"]
    with pytest.raises(ModelError, match="dspark_config"):
        dspark_config_from_dict(data)


@pytest.mark.parametrize("overrides, where, message", [
    (["markov_rank=0"], "draft.dspark.confidence_head_with_markov", "markov_rank is 0"),
    (["per_position_loss_weight=dpace"], "draft.dspark.per_position_loss_weight", "loss_terms: {ce: 1.0}"),
    (["loss_terms={}"], "draft.dspark.loss_terms", "loss_terms is empty"),
    (["confidence_threshold=0.5", "enable_confidence_head=false"], "draft.dspark.confidence_threshold",
     "from the confidence head, which is off"),
])
def test_the_family_refuses_inconsistent_section_fields(overrides, where, message):
    cfg = load_config(None, ["draft.family=dspark", *(f"draft.dspark.{o}" for o in overrides)])  # the config takes them
    with pytest.raises(ConfigError, match=message) as info:
        check_config(cfg)
    assert info.value.where == where


def test_objective_settings_refuse_unknown_terms():
    with pytest.raises(ConfigError) as info:
        ObjectiveSettings(loss_terms={"jsd": 1.0}).check()
    assert info.value.where == "draft.dspark.loss_terms"


def test_the_family_is_registered():
    family = get_family("dspark")
    assert family.architectures == ("Qwen3DSparkModel",) and family.captures_last_hidden
