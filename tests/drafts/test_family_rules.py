"""Each family's own rules on the run config sit behind its seam (``DraftFamily.check_config``):
``drafts.check_config`` refuses what the config's family does not read, naming the field and the fix."""

import pytest

from specforge_core.config import load_config
from specforge_core.drafts import check_config, validation_num_steps
from specforge_core.errors import ConfigError

EAGLE3_ONLY = [
    (["model.capture_layer_ids=[1,2,3]"], "model.capture_layer_ids", "target_layer_ids"),
    (["training.feature_noise=0.1"], "training.feature_noise", "remove training.feature_noise"),
    (["draft.attention_backend=flash"], "draft.attention_backend", "use auto, sdpa or flex"),
    (["draft.lm_head_init=target"], "draft.lm_head_init", "remove draft.lm_head_init"),
]


@pytest.mark.parametrize("family", ["dflash", "dspark"])
@pytest.mark.parametrize("overrides, field, fix", EAGLE3_ONLY)
def test_a_dflash_family_draft_refuses_eagle3_settings_naming_the_field_and_the_fix(family, overrides, field, fix):
    cfg = load_config(None, [f"draft.family={family}", *overrides])  # the config alone holds no family rule
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    assert refused.value.where == field and fix in refused.value.fix


@pytest.mark.parametrize("overrides, field, fix", EAGLE3_ONLY)
def test_an_eagle3_draft_takes_its_own_settings(overrides, field, fix):
    cfg = load_config(None, overrides)
    assert check_config(cfg) is cfg


@pytest.mark.parametrize("ids", ["[1, 1, 2]", "[0, 1]", "[1, 2, 3, 4]", "[-1, 2, 3]"])
def test_eagle3_capture_layers_are_three_distinct_layers(ids):
    cfg = load_config(None, [f"model.capture_layer_ids={ids}"])
    with pytest.raises(ConfigError, match="model.capture_layer_ids: needs exactly 3 distinct") as refused:
        check_config(cfg)
    assert "remove it to use the default [1, N//2-1, N-4]" in refused.value.fix


@pytest.mark.parametrize("overrides, steps", [
    ([], 3),
    (["draft.family=dflash", "draft.dflash.block_size=8"], 7),
    (["draft.family=dspark", "draft.dspark.block_size=6"], 6),
    (["draft.family=dspark", "draft.dspark.block_size=6", "draft.dspark.sample_from_anchor=false"], 5),
    (["draft.family=dspark", "validation.num_steps=2"], 2),
])
def test_validation_drafts_the_familys_default_steps_unless_the_config_sets_them(overrides, steps):
    assert validation_num_steps(load_config(None, overrides)) == steps
