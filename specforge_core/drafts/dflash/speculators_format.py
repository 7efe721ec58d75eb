"""A DFlash-family draft in speculators' own layout (speculators 0.9.0): ``speculators_model_type``
``dflash`` or ``dflash2`` here, ``dspark`` through ``drafts/dspark/speculators_format.py``, which
writes with :func:`export_block_speculators`.

    export_dflash_speculators(draft, "drafts/demo-dflash-speculators", target_dir="models/target")
    SpeculatorModel.from_pretrained("drafts/demo-dflash-speculators")   # speculators' DFlashDraftModel

``config.json`` is speculators' config of the family: ``transformer_layer_config`` (the draft's
Qwen3 config), ``draft_vocab_size`` = the target's vocabulary (no draft vocabulary),
``block_size``, ``mask_token_id``, ``sample_from_anchor`` and the family's own fields (DFlash2's
convolution and selector, DSpark's heads) at the top level, ``aux_hidden_state_layer_ids`` in
vLLM's numbering (our capture id k, the output of decoder layer k, is vLLM's k + 1, the residual
stream entering layer k + 1), and ``speculators_config`` naming the verifier and a greedy proposal
of the block's drafts (``B - 1``; ``B`` when the anchor's slot drafts too). ``model.safetensors``
holds the draft's tensors under their own names, which are speculators'; the target's embedding,
head and final norm are read from the verifier when speculators loads it.
"""

from pathlib import Path
from typing import Callable

from specforge_core.drafts.dflash.draft_config import dflash2_of, dflash_config_to_dict
from specforge_core.drafts.dflash.serving import DTYPES, check_serving_state
from specforge_core.drafts.speculators_layout import (SPECULATORS_VERSION, export_state, target_architectures,
                                                      write_layout)
from specforge_core.errors import ModelError

# our config keys that speculators keeps outside transformer_layer_config (or not at all)
_NOT_LAYER_KEYS = ("dflash_config", "dspark_config", "block_size", "num_target_layers", "architectures")


def block_speculators_config(config, *, model_type: str, architecture: str, layer: dict, fields: dict,
                             verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                             dtype: str) -> dict:
    """The speculators ``config.json`` of a DFlash-family draft config: ``layer`` its JSON form
    (the family's codec), ``fields`` what the family adds at the top level."""
    layer = {k: v for k, v in layer.items() if k not in (*_NOT_LAYER_KEYS, *fields)}
    layer.update(torch_dtype=dtype, dtype=dtype)
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.vocab_size,
        "block_size": int(config.block_size),
        "aux_hidden_state_layer_ids": [k + 1 for k in config.dflash_config["target_layer_ids"]],
        "mask_token_id": int(config.dflash_config["mask_token_id"]),
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        **fields,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def dflash_speculators_config(config, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                              dtype: str) -> dict:
    """The speculators ``config.json`` of a DFlash (``dflash``) or DFlash2 (``dflash2``) draft config."""
    extra = dflash2_of(config)
    model_type, architecture = ("dflash", "DFlashDraftModel") if extra is None else ("dflash2", "DFlash2DraftModel")
    return block_speculators_config(config, model_type=model_type, architecture=architecture,
                                    layer=dflash_config_to_dict(config), fields=dict(extra or {}), verifier=verifier,
                                    verifier_architectures=verifier_architectures,
                                    speculative_tokens=speculative_tokens, dtype=dtype)


def export_block_speculators(model, out_dir: str | Path, *, target_dir: str | Path, describe: Callable[..., dict],
                             check_state: Callable, verifier: str | None = None, speculative_tokens: int | None = None,
                             dtype: str = "keep") -> Path:
    """Write the speculators layout of a DFlash-family ``model`` into ``out_dir`` atomically
    (absent, empty or a previous export): ``describe`` makes its config (as
    :func:`dflash_speculators_config`), ``check_state`` checks its key set. ``verifier``: written
    as the verifier's name or path (default ``target_dir``); ``speculative_tokens``: default the
    block's drafts. Raises ModelError before writing anything when the weights are not the
    draft's key set or mix dtypes, CheckpointError when ``out_dir`` holds other files."""
    drafts = model.block_size - (0 if getattr(model, "sample_from_anchor", False) else 1)
    tokens = drafts if speculative_tokens is None else speculative_tokens
    if not 1 <= tokens <= drafts:
        raise ModelError(f"speculative_tokens={tokens}", where="--speculative-tokens",
                         fix=f"give 1..{drafts}, the drafts one block of this draft proposes")
    architectures = target_architectures(Path(target_dir))
    state, weight_dtype = export_state(model, dtype, DTYPES, check_state)
    config = describe(model.config, verifier=str(target_dir) if verifier is None else verifier,
                      verifier_architectures=architectures, speculative_tokens=tokens,
                      dtype=str(weight_dtype).removeprefix("torch."))
    return write_layout(Path(out_dir), state, config)


def export_dflash_speculators(model, out_dir: str | Path, *, target_dir: str | Path, verifier: str | None = None,
                              speculative_tokens: int | None = None, dtype: str = "keep") -> Path:
    """:func:`export_block_speculators` of a DFlash or DFlash2 draft."""
    return export_block_speculators(model, out_dir, target_dir=target_dir, describe=dflash_speculators_config,
                                    check_state=check_serving_state, verifier=verifier,
                                    speculative_tokens=speculative_tokens, dtype=dtype)
