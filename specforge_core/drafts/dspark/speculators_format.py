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
The writer is DFlash's (``drafts/dflash/speculators_format.py``).
"""

from pathlib import Path

from specforge_core.drafts.dflash.speculators_format import block_speculators_config, export_block_speculators
from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.files import check_dspark_state
from specforge_core.drafts.dspark.settings import dspark_config_to_dict, dspark_fields


def speculators_config(config, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                       dtype: str) -> dict:
    """The speculators ``config.json`` of a DSpark draft config."""
    return block_speculators_config(config, model_type="dspark", architecture="DSparkDraftModel",
                                    layer=dspark_config_to_dict(config), fields=dspark_fields(config),
                                    verifier=verifier, verifier_architectures=verifier_architectures,
                                    speculative_tokens=speculative_tokens, dtype=dtype)


def export_dspark_speculators(model: DSparkDraftModel, out_dir: str | Path, *, target_dir: str | Path,
                              verifier: str | None = None, speculative_tokens: int | None = None,
                              dtype: str = "keep") -> Path:
    """Write the speculators layout of ``model`` into ``out_dir`` atomically (absent, empty or a
    previous export). ``verifier``: written as the verifier's name or path (default
    ``target_dir``); ``speculative_tokens``: default the block's drafts (``B`` or ``B - 1``).
    Raises ModelError before writing anything when the weights are not the draft's key set."""
    return export_block_speculators(model, out_dir, target_dir=target_dir, describe=speculators_config,
                                    check_state=check_dspark_state, verifier=verifier,
                                    speculative_tokens=speculative_tokens, dtype=dtype)
