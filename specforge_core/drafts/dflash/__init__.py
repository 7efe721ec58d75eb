"""DFlash block-diffusion drafts (as SpecForge, SGLang and vLLM implement them): config, model, objective, export, decoding.

One clean anchor token plus B-1 MASK tokens are denoised in one draft forward, conditioned on the
target's captured layers injected as keys/values into every draft layer.
"""

from specforge_core.drafts.dflash.draft_config import (
    build_target_layer_ids,
    check_dflash_config,
    check_fits_target,
    dflash_config_from_dict,
    dflash_config_from_target,
    load_dflash_config,
    resolve_mask_token_id,
    save_dflash_config,
)
from specforge_core.drafts.dflash.drafter import DFlashDrafter
from specforge_core.drafts.dflash.serving import (
    check_serving_state,
    export_dflash,
    load_exported_dflash,
    warm_start_dflash,
)
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.drafts.dflash.inputs import anchor_generator
from specforge_core.drafts.dflash.objective import dflash_loss, summarize_dflash_metrics

__all__ = [
    "DFlashDraftModel",
    "DFlashDrafter",
    "anchor_generator",
    "build_target_layer_ids",
    "check_dflash_config",
    "check_fits_target",
    "check_serving_state",
    "dflash_config_from_dict",
    "dflash_config_from_target",
    "dflash_loss",
    "export_dflash",
    "load_dflash_config",
    "load_exported_dflash",
    "resolve_mask_token_id",
    "save_dflash_config",
    "summarize_dflash_metrics",
    "warm_start_dflash",
]
