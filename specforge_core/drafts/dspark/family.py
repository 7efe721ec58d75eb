"""DSpark behind the draft-family seam (``specforge_core/drafts/__init__.py``).

A DFlash draft (block drafting, target layers injected as keys/values) with a low-rank Markov
logit bias that lets each slot condition on the token before it, and a confidence head that
predicts each slot's acceptance probability, from which a decoder schedules the draft length
(``architecture.py``). Trained by distillation on the target's own next-token distributions
(hence the final hidden is captured) plus a BCE fit of the confidence to the analytical
acceptance rate (``objective.py``); files and export in ``files.py``, decoding in
``drafting.py``. The run config's ``draft.dspark`` section holds its fields (docs/dspark.md).
Everything not DSpark's own is DFlash's (``DFlashFamily``).
"""

from specforge_core.capture.target_info import text_config
from specforge_core.drafts.dflash import draft_config as dflash_configs
from specforge_core.drafts.dflash.family import DFlashFamily, batch_generator, block_mask_bytes
from specforge_core.drafts.dspark import files, settings
from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.objective import ObjectiveSettings, dspark_loss, summarize_dspark_metrics
from specforge_core.errors import ConfigError, ModelError


def objective_settings(section) -> ObjectiveSettings:
    """The objective's settings from a ``draft.dspark`` section."""
    return ObjectiveSettings(
        loss_terms=dict(section.loss_terms), gamma=section.loss_decay_gamma,
        per_position_loss_weight=section.per_position_loss_weight, dpace_alpha=section.dpace_alpha,
        confidence_head_alpha=section.confidence_head_alpha,
    )


class DSparkFamily(DFlashFamily):
    name = "dspark"
    architectures = (settings.ARCHITECTURE,)
    captures_last_hidden = True  # the teacher: the target's next-token distributions

    # ---- configuration ---------------------------------------------------------------------------

    def check_config(self, cfg) -> None:
        """DFlash's refusals, then how ``draft.dspark``'s heads and loss fit together: a threshold
        needs the confidence head, that head's Markov input the Markov head
        (``settings.check_dspark_fields``, as for a draft config file), D-PACE the ``ce`` term alone."""
        super().check_config(cfg)
        d = cfg.draft.dspark
        if d.confidence_threshold is not None and not d.enable_confidence_head:
            raise ConfigError("confidence_threshold schedules chains from the confidence head, which is off",
                              where="draft.dspark.confidence_threshold",
                              fix="set draft.dspark.enable_confidence_head: true or remove confidence_threshold")
        settings.check_dspark_fields({name: getattr(d, name) for name in settings.DEFAULTS})
        if d.per_position_loss_weight == "dpace" and set(d.loss_terms) != {"ce"}:
            raise ConfigError("per_position_loss_weight=dpace weighs slots by their cross-entropy",
                              where="draft.dspark.per_position_loss_weight",
                              fix="set draft.dspark.loss_terms: {ce: 1.0} (speculators' rule) or use fixed-exp-decay")
        if not d.loss_terms:
            raise ConfigError("loss_terms is empty", where="draft.dspark.loss_terms",
                              fix="give at least one of kl_div, tv, ce with a weight")

    def capture_layer_ids(self, cfg, target_config, draft_config=None) -> tuple[int, ...]:
        n = int(text_config(target_config).num_hidden_layers)
        d = cfg.draft.dspark
        if draft_config is not None:
            ids, where = dflash_configs.target_layer_ids_of(draft_config), "draft config dflash_config.target_layer_ids"
        elif d.target_layer_ids is not None:
            ids, where = list(d.target_layer_ids), "draft.dspark.target_layer_ids"
        else:
            ids, where = dflash_configs.build_target_layer_ids(n, d.num_layers), f"default for {n} layers"
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n - 1:
            raise ModelError(
                f"target layer ids {ids} must be distinct ids in [0, {n - 1}) for a {n}-layer target "
                "(the last layer's output is the final hidden, which SGLang cannot capture as a layer)",
                where=where,
                fix=f"set draft.dspark.target_layer_ids to distinct ids below {n - 1}, or remove it for the default",
            )
        return tuple(ids)

    def given_draft_config(self, cfg):
        return settings.load_dspark_config(cfg.draft.config_path) if cfg.draft.config_path else None

    def draft_config(self, cfg, target_config, layer_ids, *, tokenizer=None):
        given = self.given_draft_config(cfg)
        if given is not None:
            return given
        d = cfg.draft.dspark
        vocab = int(text_config(target_config).vocab_size)
        mask = dflash_configs.resolve_mask_token_id(d.mask_token_id, tokenizer, vocab)
        return settings.dspark_config_from_target(
            target_config, block_size=d.block_size, num_layers=d.num_layers, target_layer_ids=list(layer_ids),
            mask_token_id=mask, layer_types=d.layer_types, sliding_window=d.sliding_window,
            markov_rank=d.markov_rank, markov_head_type=d.markov_head_type,
            enable_confidence_head=d.enable_confidence_head,
            confidence_head_with_markov=d.confidence_head_with_markov, sample_from_anchor=d.sample_from_anchor,
        )

    def tokenizer_token_ids(self, cfg) -> tuple[str, ...]:
        given = cfg.draft.dspark.mask_token_id is not None or cfg.draft.config_path
        return () if given else ("draft.dspark.mask_token_id",)

    def default_num_steps(self, cfg) -> int:
        d = cfg.draft.dspark  # one block: every slot drafts with sample_from_anchor, else all but the anchor
        return d.block_size - (0 if d.sample_from_anchor else 1)

    def activation_bytes(self, cfg, draft_config, *, tokens: int, samples: int) -> int:
        """DFlash's estimate, with every block query also holding full-vocabulary rows at the
        loss's peak, or the block mask's transient if that is larger (``block_mask_bytes``). With
        the default ``kl_div`` alone the loss runs fused on CUDA (``objective.slot_terms``): the
        draft logits, the teacher's and the Markov bias or the logits' gradient, in the compute
        dtype (``4·V`` values a query, one spare). Any other term reads fp32 copies: the draft and
        teacher logits, their log-softmaxes, the teacher's probabilities and the rate's softmaxes
        (``8·V`` fp32 values; 32 bytes per query per vocabulary row measured on a CPU)."""
        d = cfg.draft.dspark
        queries = samples * min(d.num_anchors, -(-tokens // samples)) * draft_config.block_size
        c = 2 if cfg.training.param_dtype == "bfloat16" else 4
        h, i, layers = draft_config.hidden_size, draft_config.intermediate_size, draft_config.num_hidden_layers
        kv = draft_config.num_key_value_heads * draft_config.head_dim
        vocab_bytes = 4 * c if set(d.loss_terms) == {"kl_div"} else 8 * 4
        per_query = (layers * (8 * h + 2 * kv + 3 * i) + 2 * h) * c + vocab_bytes * draft_config.vocab_size
        forward = queries * per_query + tokens * (2 * h + layers * 2 * kv) * c
        return max(forward, block_mask_bytes(cfg, num_anchors=d.num_anchors, block_size=draft_config.block_size,
                                             tokens=tokens, samples=samples))

    def contract_fields(self, cfg) -> dict:
        d = cfg.draft.dspark
        return {"dspark.num_anchors": d.num_anchors, "dspark.loss_decay_gamma": d.loss_decay_gamma,
                "dspark.loss_terms": dict(d.loss_terms), "dspark.per_position_loss_weight": d.per_position_loss_weight,
                "dspark.dpace_alpha": d.dpace_alpha, "dspark.confidence_head_alpha": d.confidence_head_alpha}

    def serving_config(self, config) -> dict:
        return settings.dspark_config_to_dict(config)

    # ---- model and training ----------------------------------------------------------------------

    def new_draft(self, config) -> DSparkDraftModel:
        return DSparkDraftModel(config)

    def warm_start(self, directory, config) -> DSparkDraftModel:
        return files.warm_start_dspark(directory, config)

    def objective(self, cfg, backend):
        d, seed = cfg.draft.dspark, cfg.training.seed
        embed, head = backend.embed_weight, backend.lm_head_weight
        objective = objective_settings(d)
        objective.check()

        def loss(draft, batch):
            return dspark_loss(draft, batch, embed_weight=embed, lm_head_weight=head, num_anchors=d.num_anchors,
                               settings=objective, generator=batch_generator(seed, getattr(batch, "task_ids", ())),
                               backend=cfg.draft.attention_backend)

        return loss

    def summarize(self, cfg, sums: dict) -> dict:
        return summarize_dspark_metrics(sums, tuple(cfg.draft.dspark.loss_terms))

    # ---- files -------------------------------------------------------------------------------------

    def save_checkpoint_files(self, draft, directory, state_dict=None) -> None:
        files.save_dspark_checkpoint_files(draft, directory, state_dict)

    def load_checkpoint_files(self, directory) -> DSparkDraftModel:
        return files.load_dspark_from_files(directory)

    def export(self, draft, out_dir, dtype: str = "keep"):
        return files.export_dspark(draft, out_dir, dtype=dtype)

    def load_export(self, directory) -> DSparkDraftModel:
        return files.load_exported_dspark(directory)

    def export_speculators(self, draft, out_dir, *, target_dir, verifier=None, speculative_tokens=None,
                           dtype: str = "keep"):
        from specforge_core.drafts.dspark.speculators_format import export_dspark_speculators

        return export_dspark_speculators(draft, out_dir, target_dir=target_dir, verifier=verifier,
                                         speculative_tokens=speculative_tokens, dtype=dtype)

    # ---- decoding ----------------------------------------------------------------------------------

    def drafter(self, draft, target_model, cfg=None):
        """The evaluator's drafter; ``cfg.draft.dspark.confidence_threshold`` (when given) schedules
        each chain's length from the confidence head, else chains have the fixed length asked."""
        from specforge_core.drafts.dspark.drafting import DSparkDrafter

        threshold = None if cfg is None else cfg.draft.dspark.confidence_threshold
        return DSparkDrafter(draft, embed_weight=target_model.get_input_embeddings().weight,
                             lm_head_weight=target_model.get_output_embeddings().weight, confidence_threshold=threshold)


FAMILY = DSparkFamily()
