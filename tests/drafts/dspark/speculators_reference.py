"""speculators 0.9.0's DSpark model run on the CPU with our draft's weights and our anchors.

The installed model runs on the CPU once three things are chosen for it: eager attention (its
default ``simple_flex_attention`` compiles a block mask; ``eager`` builds a float mask instead),
the eager loss functions (its default losses are Triton kernels, CUDA only), and the anchors
(``select_anchors`` draws them with the global RNG; here it returns ours). Weights: the draft's
names are speculators' (identity mapping); the target's embedding, head and final norm fill
``embed_tokens``, ``lm_head``/``verifier_lm_head`` and ``verifier_norm``.
"""

from contextlib import contextmanager
from unittest import mock

import torch



def reference_model(draft, *, embed_weight, lm_head_weight, norm_weight, verifier_dir):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from specforge_core.drafts.dspark.settings import dspark_fields

    layer_config = type(draft.config)(**draft.config.to_dict())
    layer_config._attn_implementation = "eager"
    fields = dspark_fields(draft.config)
    block = draft.block_size
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft.config.vocab_size, block_size=block,
        aux_hidden_state_layer_ids=list(draft.target_layer_ids), mask_token_id=draft.mask_token_id, **fields,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block)],
            verifier=VerifierConfig(name_or_path=str(verifier_dir), architectures=["LlamaForCausalLM"]),
        ),
    )
    model = DSparkDraftModel(config)
    state = dict(draft.state_dict())
    state |= {"embed_tokens.weight": embed_weight, "lm_head.weight": lm_head_weight,
              "verifier_lm_head.weight": lm_head_weight, "verifier_norm.weight": norm_weight}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"t2d", "d2t"}, missing
    return model.eval()


def use_eager_attention(model):
    """A loaded speculators DFlash-family model switched to eager attention and a float mask
    (what ``reference_model`` builds it with), so it runs on the CPU."""
    from speculators.models.attention import create_float_mask

    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    return model


@contextmanager
def recorded(anchors: torch.Tensor):
    """Run the reference with ``anchors`` and record ``compute_metrics``' inputs."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    seen = {}
    original = dspark_core.compute_metrics

    def select(loss_mask, num_anchors, block_size):
        return anchors.clone(), torch.ones(anchors.numel(), dtype=torch.bool)

    def record(logits, targets, confidence_logits, loss_mask, *args, **kwargs):
        seen.update(logits=logits, targets=targets, confidence_logits=confidence_logits, loss_mask=loss_mask)
        return original(logits, targets, confidence_logits, loss_mask, *args, **kwargs)

    with mock.patch.object(dflash_core, "select_anchors", select), \
            mock.patch.object(dspark_core, "compute_metrics", record):
        yield seen


def run_reference(model, anchors, *, aux, input_ids, loss_mask, pre_norm_last, document_ids, position_ids,
                  loss_terms, gamma, per_position_loss_weight="fixed-exp-decay", dpace_alpha=0.5,
                  confidence_head_alpha=1.0, grad=False):
    """``(loss, metrics, recorded inputs of compute_metrics)`` of one packed ``[1, T]`` row
    (``grad``: keep the autograd graph)."""
    from speculators.losses import eager

    loss_config = {name: (getattr(eager, f"{name}_loss"), float(w)) for name, w in loss_terms.items()}
    with recorded(anchors) as seen, torch.set_grad_enabled(grad):
        _, loss, metrics = model(
            hidden_states=aux, input_ids=input_ids, loss_mask=loss_mask, verifier_last_hidden_states=pre_norm_last,
            document_ids=document_ids, position_ids=position_ids, loss_config=loss_config,
            tv_loss_fn=eager.tv_loss, gamma=gamma, max_anchors=anchors.numel(),
            confidence_head_alpha=confidence_head_alpha, per_position_loss_weight=per_position_loss_weight,
            dpace_alpha=dpace_alpha,
        )
    return loss, metrics, dict(seen)
