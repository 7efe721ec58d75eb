"""The draft-family seam: one registry, families found from their files, EAGLE3 and DFlash behind it."""

import json

import pytest
import torch

from fixtures.tiny import tiny_target_config
from specforge_core.drafts import FAMILIES, family_of_files, get_family, load_draft
from specforge_core.errors import ConfigError, ModelError


def test_every_registered_family_is_found_by_its_name():
    for name in FAMILIES:
        assert get_family(name).name == name


def test_an_unknown_family_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="draft.family") as e:
        get_family("medusa")
    assert "eagle3" in str(e.value) and "dflash" in str(e.value)


@pytest.fixture(params=["eagle3", "dflash"])
def exported(request, tmp_path):
    """A freshly initialised draft of each family for the tiny target, exported."""
    from specforge_core.config import load_config

    family = get_family(request.param)
    target = tiny_target_config(512)
    cfg = load_config(None, ["draft.draft_vocab_size=64", f"draft.family={request.param}", "draft.dflash.block_size=4",
                             "draft.dflash.mask_token_id=500"])
    layer_ids = family.capture_layer_ids(cfg, target)
    config = family.draft_config(cfg, target, layer_ids)
    torch.manual_seed(0)
    draft = family.new_draft(config)
    if family.uses_vocab_map:
        t2d = torch.zeros(512, dtype=torch.bool)
        t2d[:64] = True
        draft.set_vocab_map(torch.zeros(64, dtype=torch.long), t2d)
    return family, draft, family.export(draft, tmp_path / "export")


def test_an_export_names_its_family_and_loads_back_through_the_seam(exported):
    family, draft, out = exported
    assert family_of_files(out) is family
    found, loaded = load_draft(out)
    assert found is family
    want, got = draft.draft_state_dict(), loaded.draft_state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_a_directory_of_no_known_family_is_refused_naming_its_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    with pytest.raises(ModelError, match=r"architectures \['MedusaModel'\] belong to no draft family"):
        family_of_files(tmp_path)


def test_families_declare_what_the_trainer_and_capture_must_provide():
    eagle3, dflash = get_family("eagle3"), get_family("dflash")
    assert (eagle3.uses_vocab_map, eagle3.captures_last_hidden, eagle3.loss_is_sum) == (True, True, False)
    assert (dflash.uses_vocab_map, dflash.captures_last_hidden, dflash.loss_is_sum) == (False, False, True)
