"""A DSpark draft in speculators' own layout (``speculators_model_type: dspark``; speculators 0.9.0).

    export_dspark_speculators(draft, "drafts/demo-dspark-speculators", target_dir="models/target")
    SpeculatorModel.from_pretrained("drafts/demo-dspark-speculators")   # speculators' DSparkDraftModel

``config.json`` is a speculators ``DSparkSpeculatorConfig``: ``architectures: [DSparkDraftModel]``,
``transformer_layer_config`` (the draft's Qwen3 config), ``draft_vocab_size`` = the target's
vocabulary (no draft vocabulary), ``block_size``, ``mask_token_id``, ``sample_from_anchor`` and the
heads' fields, ``aux_hidden_state_layer_ids`` in vLLM's numbering (our capture id k, the output
of decoder layer k, is vLLM's k + 1, the residual stream entering layer k + 1), and
``speculators_config`` naming the verifier and a greedy proposal of ``B`` tokens
(``sample_from_anchor``) or ``B - 1``. ``model.safetensors`` holds the draft's tensors under their
own names, which are speculators' (the backbone's and ``markov_head.*``, ``confidence_head.*``);
the target's embedding, head and final norm are read from the verifier when speculators loads it.
"""

from pathlib import Path

from safetensors.torch import save

from specforge_core.drafts.dflash.serving import DTYPES
from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.files import check_dspark_state
from specforge_core.drafts.dspark.settings import dspark_config_to_dict, dspark_fields
from specforge_core.drafts.speculators_layout import SPECULATORS_VERSION, target_architectures
from specforge_core.errors import CheckpointError, ModelError
from specforge_core.io import atomic_write_bytes, atomic_write_json, staged_directory

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def speculators_config(config, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                       dtype: str) -> dict:
    """The speculators ``config.json`` of a DSpark draft config."""
    layer = dspark_config_to_dict(config)
    for key in ("dspark_config", "dflash_config", "block_size", "num_target_layers", "architectures",
                *dspark_fields(config)):
        layer.pop(key)
    layer.update(torch_dtype=dtype, dtype=dtype)
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
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
        **dspark_fields(config),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def export_dspark_speculators(model: DSparkDraftModel, out_dir: str | Path, *, target_dir: str | Path,
                              verifier: str | None = None, speculative_tokens: int | None = None,
                              dtype: str = "keep") -> Path:
    """Write the speculators layout of ``model`` into ``out_dir`` atomically (absent, empty or a
    previous export). ``verifier``: written as the verifier's name or path (default
    ``target_dir``); ``speculative_tokens``: default the block's drafts (``B`` or ``B - 1``).
    Raises ModelError before writing anything when the weights are not the draft's key set."""
    if dtype != "keep" and dtype not in DTYPES:
        raise ModelError(f"unknown export dtype {dtype!r}", where="--dtype", fix=f"use keep or one of {', '.join(DTYPES)}")
    drafts = model.block_size - (0 if model.sample_from_anchor else 1)
    tokens = drafts if speculative_tokens is None else speculative_tokens
    if not 1 <= tokens <= drafts:
        raise ModelError(f"speculative_tokens={tokens}", where="--speculative-tokens",
                         fix=f"give 1..{drafts}, the drafts one block of this draft proposes")
    target_dir, out = Path(target_dir), Path(out_dir)
    architectures = target_architectures(target_dir)
    state = {}
    for key, tensor in model.draft_state_dict().items():
        if dtype != "keep" and tensor.is_floating_point():
            tensor = tensor.to(DTYPES[dtype])
        state[key] = tensor.detach().to("cpu").contiguous()
    check_dspark_state(state, model.config, where="draft weights")
    floats = {t.dtype for t in state.values()}
    if len(floats) != 1:
        raise ModelError(f"draft parameters mix dtypes {sorted(map(str, floats))}", where="draft model",
                         fix="export with --dtype bfloat16 (or float32) to cast them to one dtype")
    config = speculators_config(model.config, verifier=str(target_dir) if verifier is None else verifier,
                                verifier_architectures=architectures, speculative_tokens=tokens,
                                dtype=str(floats.pop()).removeprefix("torch."))
    if out.exists() and not (out.is_dir() and {p.name for p in out.iterdir()} <= {CONFIG_FILE, WEIGHTS_FILE}):
        raise CheckpointError("the export directory holds other files", where=str(out),
                              fix="choose an empty or new --out directory")
    with staged_directory(out, replace=True) as stage:
        atomic_write_bytes(stage / WEIGHTS_FILE, save(state, metadata={"format": "pt"}))
        atomic_write_json(stage / CONFIG_FILE, config, sort_keys=True)
    return out
