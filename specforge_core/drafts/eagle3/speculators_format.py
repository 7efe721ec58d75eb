"""The EAGLE3 draft in vLLM's native ``speculators`` layout (checked against speculators 0.9.0).

    export_speculators(model, "drafts/demo-vllm", target_dir="models/target")   # config.json + model.safetensors
    vllm serve drafts/demo-vllm        # the config names the verifier and the speculative tokens

``config.json`` is a speculators ``Eagle3SpeculatorConfig``:

- ``speculators_model_type: eagle3`` (how speculators and vLLM recognise the format),
  ``architectures: [Eagle3DraftModel]`` (what speculators' own ``save_pretrained`` writes);
- ``speculators_config``: algorithm ``eagle3``, one ``greedy`` proposal method whose
  ``speculative_tokens`` vLLM takes as ``num_speculative_tokens``, and the ``verifier``'s name or
  path and architectures (speculators loads the verifier's config and head from there);
- ``transformer_layer_config``: the draft's decoder layer as a Llama config (one layer, the target
  vocabulary, ``head_dim`` written out, RoPE as trained): vLLM builds the draft model from it;
- ``draft_vocab_size``, ``target_hidden_size``, EAGLE-3.1's ``fc_norm`` and ``norm_output`` as
  trained (the same meaning in speculators as here: per-layer norms before ``fc``, the post-norm
  hidden carried to the next step); ``norm_before_residual: false`` (our residual is the un-normed
  hidden; vLLM assumes true when the field is absent) and ``norm_before_fc: false``;
- ``eagle_aux_hidden_state_layer_ids`` at the top level, in vLLM's numbering: our capture id k is
  the output of decoder layer k, vLLM's id j the residual stream entering layer j, so j = k + 1
  (``vllm_layer_ids``); vLLM reads this field as it is and uses its own default without it.

``model.safetensors`` holds the serving tensors with ``midlayer.*`` renamed ``layers.0.*``, ``d2t``
and ``t2d`` unchanged, and a copy of the target's input embedding as ``embed_tokens.weight`` (as
speculators writes it; vLLM shares the target's when the copy is equal, and speculators 0.9.0's
loader leaves a missing embedding uninitialised under transformers 5). docs/export.md.
"""

from pathlib import Path

from specforge_core.drafts.eagle3.draft_config import capture_layer_ids_of, serving_config_dict, vllm_layer_ids
from specforge_core.drafts.eagle3.model import EMBEDDING_KEY, Eagle3DraftModel, read_target_embedding
from specforge_core.drafts.eagle3.serving import DTYPES, check_serving_state
from specforge_core.drafts.speculators_layout import (SPECULATORS_VERSION, export_state, target_architectures,
                                                      write_layout)
from specforge_core.errors import ModelError

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
# Fields of the exported draft config that make up the decoder layer's config.
_LAYER_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range", "pad_token_id",
    "bos_token_id", "eos_token_id", "rope_parameters", "rope_theta", "rope_scaling",
)


def speculators_key(key: str) -> str:
    """A serving key's name in the speculators checkpoint (``midlayer.`` becomes ``layers.0.``)."""
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


def speculators_config(config, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                       dtype: str) -> dict:
    """The speculators ``config.json`` of a draft config (a ``LlamaConfig``), weights in ``dtype``."""
    ids = capture_layer_ids_of(config)
    if ids is None:
        raise ModelError("the draft config records no capture layer ids", where="draft config: eagle_config",
                         fix="export a checkpoint whose draft_config.json has "
                         "eagle_config.eagle_aux_hidden_state_layer_ids (every checkpoint this trainer writes has)")
    served = serving_config_dict(config, dtype=dtype)
    layer = {k: served[k] for k in _LAYER_FIELDS if k in served}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, attention_bias=False,
                 mlp_bias=False, tie_word_embeddings=False, torch_dtype=dtype, dtype=dtype)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": served["draft_vocab_size"],
        "target_hidden_size": served["target_hidden_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(served.get("fc_norm", False)),
        "norm_output": bool(served.get("norm_output", False)),
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(ids),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def export_speculators(model: Eagle3DraftModel, out_dir: str | Path, *, target_dir: str | Path,
                       verifier: str | None = None, speculative_tokens: int = 3, dtype: str = "keep") -> Path:
    """Write the speculators layout of ``model`` into ``out_dir`` (atomically; ``out_dir`` must be
    absent, empty or a previous export).

    ``target_dir``: the local target directory the draft was trained on (its input embedding is
    copied in, its ``architectures`` recorded); ``verifier``: the name or path written as
    ``speculators_config.verifier.name_or_path`` (default ``target_dir``; a hub id when the server
    loads the target from there); ``speculative_tokens``: vLLM's default ``num_speculative_tokens``.
    Raises ModelError before writing anything when the weights are not exactly the serving key set,
    the embedding does not fit, or the target's config is unreadable.
    """
    if speculative_tokens < 1:
        raise ModelError(f"speculative_tokens={speculative_tokens}", where="--speculative-tokens",
                         fix="give the number of draft tokens per verify pass, at least 1")
    target_dir = Path(target_dir)
    architectures = target_architectures(target_dir)
    state, weight_dtype = export_state(model, dtype, DTYPES, check_serving_state)
    embedding = read_target_embedding(target_dir)
    expected = (model.config.vocab_size, model.config.hidden_size)
    if tuple(embedding.shape) != expected:
        raise ModelError(f"the target's embedding is {list(embedding.shape)}, the draft needs {list(expected)}",
                         where=f"{target_dir}: model.embed_tokens.weight",
                         fix="give --target the target this draft was trained on")
    tensors = {speculators_key(k): t for k, t in state.items()}
    tensors[EMBEDDING_KEY] = embedding.to(weight_dtype).contiguous()
    config = speculators_config(model.config, verifier=str(target_dir) if verifier is None else verifier,
                                verifier_architectures=architectures, speculative_tokens=speculative_tokens,
                                dtype=str(weight_dtype).removeprefix("torch."))
    return write_layout(Path(out_dir), tensors, config)
