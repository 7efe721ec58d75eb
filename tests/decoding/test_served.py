"""validation.engine: sglang: the export served by SGLang's engine (here the CPU stand-in that
honours its contract), its acceptance length beside ours on the same prompts and stop tokens."""

import pytest
import torch
from transformers import AutoConfig

from fixtures.fake_sglang import FakeSGLangGenerator
from specforge_core.config import config_from_dict
from specforge_core.decoding.evaluation import evaluate
from specforge_core.decoding.served import compare_served, speculative_arguments
from specforge_core.drafts import get_family
from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.errors import ConfigError
from specforge_core.export import main as export
from tests.decoding.test_evaluate import run  # noqa: F401  (the module's fixture)

BLOCK = 4
DFLASH2 = {"selector_top_k": 4, "selector_rank": 8, "conv_group_size": 16, "conv_kernel_size": 2}



@pytest.fixture
def exported(run):
    """test_evaluate's run: a random EAGLE3 draft's export and a config over the tiny target."""
    root, cfg = run
    return root, config_from_dict({**cfg, "validation": {"engine": "sglang"}})


def test_the_served_figure_stands_beside_ours_on_the_same_prompts(exported, tmp_path):
    root, cfg = exported
    started = []

    def engine(**kwargs):
        started.append(kwargs)
        return FakeSGLangGenerator(**kwargs)

    report = tmp_path / "report.md"
    result = evaluate(cfg, root / "export", num_steps=2, max_new_tokens=8, num_prompts=3, report_path=report,
                      served=True, engine_factory=engine)
    [kwargs] = started
    assert kwargs["speculative_algorithm"] == "EAGLE3" and kwargs["speculative_num_steps"] == 2
    assert kwargs["speculative_eagle_topk"] == 1 and kwargs["speculative_num_draft_tokens"] == 3
    assert kwargs["speculative_draft_model_path"] == str(root / "export") and kwargs["skip_tokenizer_init"]
    served = result["served"]
    assert served["requests"] == result["prompts"] == 3
    assert served["verify_passes"] == result["verify_passes"]  # one engine, one evaluator: the same decode
    assert served["acceptance_length"] == pytest.approx(result["acceptance_length"])
    assert served["ratio"] == pytest.approx(1.0) and served["within_5_percent"] is True
    assert "## Served by SGLang" in report.read_text()


def test_figures_more_than_five_percent_apart_say_why():
    assert compare_served(2.0, 1.92)["within_5_percent"] is True
    apart = compare_served(2.0, 1.8)
    assert apart["within_5_percent"] is False and "bf16" in apart["note"]
    assert compare_served(None, 1.5)["ratio"] is None


@pytest.mark.parametrize("family, overrides", [("dspark", {}), ("dflash", {"dflash2": True})])
def test_a_family_sglang_cannot_serve_is_refused_before_training(family, overrides):
    from specforge_core.drafts import check_config

    cfg = config_from_dict({"draft": {"family": family, family: overrides} if overrides else {"family": family},
                            "validation": {"engine": "sglang"}})
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert err.value.where == "validation.engine"


def _dflash_export(tmp_path, target_dir, fields=None) -> str:
    config = dflash_config_from_target(AutoConfig.from_pretrained(target_dir), block_size=BLOCK, num_layers=1,
                                       target_layer_ids=[1, 4], mask_token_id=3, dflash2_fields=fields)
    torch.manual_seed(0)
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    get_family("dflash").save_checkpoint_files(DFlashDraftModel(config), step)
    (step.parent / "latest").write_text(step.name + "\n")
    out = tmp_path / "draft"
    assert export(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    return str(out)


def test_a_dflash_export_is_served_as_dflash_with_its_block_as_the_verify_window(tmp_path, tiny_target_dir):
    draft = _dflash_export(tmp_path, tiny_target_dir)
    assert speculative_arguments(draft) == (
        {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": BLOCK}, BLOCK - 1)
    for k in (2, BLOCK):  # SGLang drafts the whole block: ours must too, or the two measure different decodes
        with pytest.raises(ConfigError, match="whole block") as err:
            speculative_arguments(draft, k)
        assert err.value.where == "validation.num_steps"


def test_a_dflash_run_asking_sglang_for_fewer_draft_tokens_than_its_block_is_refused_before_training():
    from specforge_core.drafts import check_config

    base = {"draft": {"family": "dflash", "dflash": {"block_size": 8}}, "validation": {"engine": "sglang"}}
    check_config(config_from_dict(base))
    check_config(config_from_dict({**base, "validation": {"engine": "sglang", "num_steps": 7}}))
    with pytest.raises(ConfigError) as err:
        check_config(config_from_dict({**base, "validation": {"engine": "sglang", "num_steps": 3}}))
    assert err.value.where == "validation.num_steps"


def test_a_dflash2_export_is_refused_naming_what_sglang_serves(tmp_path, tiny_target_dir):
    with pytest.raises(ConfigError, match="SGLang 0.5.14 serves EAGLE3") as err:
        speculative_arguments(_dflash_export(tmp_path, tiny_target_dir, DFLASH2))
    assert err.value.where == "validation.engine"
