"""bench/gpu_sglang_serve.py asks SGLang 0.5.14 for the algorithm of the export it is given: a
DFlash export is served as DFLASH with its block as the verify window, and a draft 0.5.14 cannot
serve (DFlash2) is refused before any engine starts."""

import pytest
import torch
from transformers import AutoConfig

from specforge_core.drafts import get_family
from specforge_core.drafts.dflash.draft_config import dflash_config_from_target
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.export import main as export
from tests.bench_scripts import load_bench

BLOCK = 4
DFLASH2 = {"selector_top_k": 4, "selector_rank": 8, "conv_group_size": 16, "conv_kernel_size": 2}


def _export(tmp_path, target_dir, fields=None):
    config = dflash_config_from_target(AutoConfig.from_pretrained(target_dir), block_size=BLOCK, num_layers=1,
                                       target_layer_ids=[1, 4], mask_token_id=3, dflash2_fields=fields)
    torch.manual_seed(0)
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    get_family("dflash").save_checkpoint_files(DFlashDraftModel(config), step)
    (step.parent / "latest").write_text(step.name + "\n")
    out = tmp_path / "draft"
    assert export(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    return str(out)


def test_a_dflash_export_is_served_as_dflash_with_its_block(tmp_path, tiny_target_dir, capsys):
    bench = load_bench("gpu_sglang_serve")
    draft = _export(tmp_path, tiny_target_dir)
    assert bench.speculative_args(draft, None) == (
        {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": BLOCK}, BLOCK - 1)
    assert bench.speculative_args(draft, 2)[1] == 2
    with pytest.raises(SystemExit, match="at most 3"):
        bench.speculative_args(draft, BLOCK)


def test_a_dflash2_export_is_refused_naming_what_sglang_serves(tmp_path, tiny_target_dir, capsys):
    bench = load_bench("gpu_sglang_serve")
    draft = _export(tmp_path, tiny_target_dir, DFLASH2)
    with pytest.raises(SystemExit, match="SGLang 0.5.14 serves EAGLE3"):
        bench.speculative_args(draft, None)
