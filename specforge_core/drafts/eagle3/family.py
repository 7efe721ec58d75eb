"""EAGLE3 behind the draft-family seam (``specforge_core/drafts/__init__.py``).

One decoder layer over the target's token embedding and three captured target layers, a
reduced draft vocabulary (d2t/t2d), trained by the unrolled training-time-test objective
(``objective.py``) against the target's own next-token distribution; exported in the layout
SGLang's and vLLM's EAGLE3 loaders read (``serving.py``) and in vLLM's native speculators
layout (``speculators_format.py``); decoded by chained or tree draft steps (``decoding.py``). The run config's ``draft.*`` fields (``draft_vocab_size``, ``fc_norm``, ``norm_output``,
``attention_backend``, ``config_path``, ``init_from``, ``lm_head_init``) and ``training.ttt_length`` /
``training.ploss_decay`` are this family's.
"""

from functools import partial
from pathlib import Path

from specforge_core.capture.target_info import resolve_capture_layers, text_config
from specforge_core.drafts.eagle3 import draft_config as configs
from specforge_core.drafts.eagle3 import serving
from specforge_core.drafts.eagle3.metric_sums import summarize_metrics
from specforge_core.drafts.eagle3.model import Eagle3DraftModel
from specforge_core.drafts.eagle3.objective import eagle3_loss
from specforge_core.errors import ConfigError, ModelError


class Eagle3Family:
    name = "eagle3"
    architectures = (configs.DRAFT_ARCHITECTURE,)
    uses_vocab_map = True
    captures_last_hidden = True
    loss_is_sum = False

    # ---- configuration ---------------------------------------------------------------------------

    def check_config(self, cfg) -> None:
        """The run config's draft fields are EAGLE3's (``draft.dflash.*`` is not read); the capture
        layers it names, if any, are 3 distinct layers (their range is checked against the target)."""
        ids = cfg.model.capture_layer_ids
        if ids is not None and not configs.three_distinct_layer_ids(ids):
            raise ConfigError(
                f"needs exactly 3 distinct non-negative layer ids, got {ids}",
                where="model.capture_layer_ids",
                fix="remove it to use the default [1, N//2-1, N-4], or give 3 distinct layer ids (low, middle, high)",
            )

    def capture_layer_ids(self, cfg, target_config, draft_config=None) -> tuple[int, ...]:
        return resolve_capture_layers(cfg, target_config, draft_config)

    def given_draft_config(self, cfg):
        return configs.load_draft_config(cfg.draft.config_path) if cfg.draft.config_path else None

    def check_draft_config(self, cfg, draft_config, target_config, vocab_size: int) -> None:
        wanted = {
            "target_hidden_size": (int(text_config(target_config).hidden_size), "the target's hidden_size"),
            "vocab_size": (vocab_size, "the target's vocab_size"),
            "draft_vocab_size": (cfg.draft.draft_vocab_size, "draft.draft_vocab_size"),
        }
        got = {field: getattr(draft_config, field, None) for field in wanted}
        for flag in configs.EAGLE31_FLAGS:  # recorded only when on
            wanted[flag] = (getattr(cfg.draft, flag), f"draft.{flag}")
            got[flag] = bool(getattr(draft_config, flag, False))
        problems = [f"{field}={got[field]} but {what} is {value}"
                    for field, (value, what) in wanted.items() if got[field] != value]
        if problems:
            raise ModelError(
                "the draft config does not fit this target and run: " + "; ".join(problems),
                where=f"draft.config_path ({cfg.draft.config_path})",
                fix="use a draft config made for this target (or remove draft.config_path to generate one), "
                "and set draft.draft_vocab_size to its draft_vocab_size (and draft.fc_norm, draft.norm_output "
                "to its fc_norm, norm_output)",
            )

    def draft_config(self, cfg, target_config, layer_ids, *, tokenizer=None):
        given = self.given_draft_config(cfg)
        if given is not None:
            return given
        return configs.draft_config_from_target(target_config, cfg.draft.draft_vocab_size, list(layer_ids),
                                                fc_norm=cfg.draft.fc_norm, norm_output=cfg.draft.norm_output)

    def tokenizer_token_ids(self, cfg) -> tuple[str, ...]:
        return ()  # the draft config needs no token id from the tokenizer

    def default_num_steps(self, cfg) -> int:
        return 3  # chain drafting's usual depth (SGLang --speculative-num-steps 3)

    def activation_bytes(self, cfg, draft_config, *, tokens: int, samples: int) -> int:
        """What one micro-step of ``tokens`` positions keeps for backward, at most: every TTT step
        on every position, each saving its layer's activations (``8H + 2·kv + 3I`` values: norm
        inputs, the 2H concat, q/k/v, attention and MLP inputs, gate/up/act), the final norm's and
        lm_head's inputs (``2H``), and ``4·Vd`` bytes for the head's output (the soft
        cross-entropy keeps the step's logits in fp32, not the compute dtype's copy); plus the
        teacher itself (fp32 ``[Vd]``) and ``fc``'s output once. With ``training.compile`` the
        fused norms and MLP keep ``I + 4H`` values fewer per step; with
        ``training.activation_checkpointing`` the MLP block keeps only its inputs instead (``2H +
        3I`` values fewer per step, compiled or not). Held against the peaks measured at the Qwen3-8B
        shape (docs/long-context.md; ``tests/drafts/eagle3/test_recompute.py``)."""
        c = 2 if cfg.training.param_dtype == "bfloat16" else 4  # bytes per value of the compute dtype
        h, i, vd = draft_config.hidden_size, draft_config.intermediate_size, draft_config.draft_vocab_size
        kv = draft_config.num_key_value_heads * (draft_config.head_dim or h // draft_config.num_attention_heads)
        layer = 10 * h + 2 * kv + 3 * i
        if cfg.training.activation_checkpointing:
            layer -= 2 * h + 3 * i  # compiled or not: what compiling saves lies inside the block
        elif cfg.training.compile:
            layer -= i + 4 * h
        per_step = layer * c + 4 * vd
        return tokens * (cfg.training.ttt_length * per_step + 4 * vd + h * c)

    def contract_fields(self, cfg) -> dict:
        # training.ttt_length and training.ploss_decay are in the trainer's own optimisation fields;
        # feature noise only when set, so checkpoints from before the option still resume
        return {"feature_noise": cfg.training.feature_noise} if cfg.training.feature_noise else {}

    def serving_config(self, config) -> dict:
        return configs.serving_config_dict(config)

    def trained_layer_ids(self, config) -> list[int] | None:
        return configs.capture_layer_ids_of(config)

    # ---- model and training ----------------------------------------------------------------------

    def new_draft(self, config) -> Eagle3DraftModel:
        # attach_target copies the target's embedding in: no random draw for it
        return Eagle3DraftModel(config, init_embedding=False)

    def warm_start(self, directory, config) -> Eagle3DraftModel:
        return serving.warm_start_draft(directory, config)

    def attach_target(self, cfg, draft, backend, vocab, *, fresh: bool) -> None:
        draft.load_embedding(backend.embed_weight)
        draft.set_vocab_map(vocab.d2t, vocab.t2d)
        if fresh and cfg.draft.lm_head_init == "target":
            draft.load_lm_head_from_target(backend.lm_head_weight)

    def objective(self, cfg, backend):
        return partial(
            eagle3_loss,
            lm_head_weight=backend.lm_head_weight,
            ttt_length=cfg.training.ttt_length,
            decay=cfg.training.ploss_decay,
            backend=cfg.draft.attention_backend,
            vocab_chunk=cfg.capture.teacher_chunk_size,
            feature_noise=cfg.training.feature_noise,
            compile=cfg.training.compile,
        )

    def summarize(self, cfg, sums: dict) -> dict:
        return summarize_metrics(sums, decay=cfg.training.ploss_decay)

    # ---- files -------------------------------------------------------------------------------------

    def save_checkpoint_files(self, draft, directory: Path, state_dict=None) -> None:
        serving.save_draft_checkpoint_files(draft, directory, state_dict)

    def load_checkpoint_files(self, directory: Path) -> Eagle3DraftModel:
        return serving.load_draft_from_files(directory)

    def export(self, draft, out_dir: Path, dtype: str = "keep") -> Path:
        return serving.export_draft(draft, out_dir, dtype=dtype)

    def load_export(self, directory: Path) -> Eagle3DraftModel:
        return serving.load_exported_draft(directory)

    def export_speculators(self, draft, out_dir: Path, *, target_dir, verifier=None, speculative_tokens: int = 3,
                           dtype: str = "keep") -> Path:
        from specforge_core.drafts.eagle3.speculators_format import export_speculators

        return export_speculators(draft, out_dir, target_dir=target_dir, verifier=verifier,
                                  speculative_tokens=speculative_tokens, dtype=dtype)

    # ---- decoding ----------------------------------------------------------------------------------

    def prepare_for_decoding(self, draft, target_model):
        draft.cast_params(target_model.dtype)
        draft.load_embedding(target_model.get_input_embeddings().weight.detach().cpu())
        return draft.to(target_model.device).eval()

    def drafter(self, draft, target_model, cfg=None):
        from specforge_core.drafts.eagle3.drafter import DraftRunner

        return DraftRunner(draft)


FAMILY = Eagle3Family()
