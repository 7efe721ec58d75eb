"""``--format speculators`` of a DFlash and a DFlash2 draft: the directory loads in speculators
0.9.0 as its model of the family, every draft weight ours, every setting its config's; a
misnamed tensor is refused before anything is written."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from specforge_core.drafts import get_family
from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.drafts.dflash.speculators_format import export_dflash_speculators
from specforge_core.errors import ModelError
from specforge_core.export import main

BLOCK = 4
DFLASH2 = {"selector_top_k": 4, "selector_rank": 8, "conv_group_size": 16, "conv_kernel_size": 2}


def _draft(target_dir, dflash2_fields=None) -> DFlashDraftModel:
    config = dflash_config_from_target(AutoConfig.from_pretrained(target_dir), block_size=BLOCK, num_layers=1,
                                       target_layer_ids=[1, 4], mask_token_id=3, dflash2_fields=dflash2_fields)
    draft = DFlashDraftModel(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return draft


@pytest.mark.parametrize("fields", [None, DFLASH2], ids=["dflash", "dflash2"])
def test_speculators_loads_the_export_as_its_model_with_our_weights(tmp_path, tiny_target_dir, capsys, fields):
    from speculators import SpeculatorModel

    draft = _draft(tiny_target_dir, fields)
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    get_family("dflash").save_checkpoint_files(draft, step)
    (step.parent / "latest").write_text(step.name + "\n")
    out = tmp_path / "speculators"
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--format", "speculators",
                 "--target", str(tiny_target_dir)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["vllm_layer_ids"] == [2, 5] and line["speculative_tokens"] == BLOCK - 1
    assert line["keys"] == len(draft.draft_state_dict())

    model = SpeculatorModel.from_pretrained(out)
    kind = "dflash" if fields is None else "dflash2"
    assert model.config.speculators_model_type == kind
    assert type(model).__module__.startswith(f"speculators.models.{kind}.")
    assert (model.config.block_size, model.config.mask_token_id) == (BLOCK, 3)
    assert model.config.aux_hidden_state_layer_ids == [2, 5]
    for name, value in (fields or {}).items():
        assert getattr(model.config, name) == value, name
    loaded = model.state_dict()
    mine = draft.draft_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in mine.items())
    target = load_file(str(tiny_target_dir / "model.safetensors"))
    assert torch.equal(loaded["verifier_lm_head.weight"], target["lm_head.weight"])


def test_a_misnamed_tensor_or_too_many_tokens_is_refused_before_writing(tmp_path, tiny_target_dir, monkeypatch):
    draft = _draft(tiny_target_dir, DFLASH2)
    with pytest.raises(ModelError, match="speculative_tokens=4"):
        export_dflash_speculators(draft, tmp_path / "many", target_dir=tiny_target_dir, speculative_tokens=BLOCK)
    state = draft.draft_state_dict()
    state["candidate_selector.codebook"] = state.pop("candidate_selector.successor_codebook")
    monkeypatch.setattr(draft, "draft_state_dict", lambda: state)
    with pytest.raises(ModelError, match="missing candidate_selector.successor_codebook"):
        export_dflash_speculators(draft, tmp_path / "bad", target_dir=tiny_target_dir)
    assert not (tmp_path / "many").exists() and not (tmp_path / "bad").exists()
