"""DFlash behind the draft-family seam (``specforge_core/drafts/__init__.py``).

A block of ``block_size - 1`` drafts in one forward: Qwen3-style layers over the frozen target
embedding of ``[anchor, MASK, ...]``, conditioned on K captured target layers injected as keys and
values into every layer; trained by same-position cross-entropy over the full target vocabulary
at random anchors (``objective.py``), globally normalised (the loss is a sum: the trainer divides
the gradients by the global ``Σ w``); exported in the layout SGLang (``--speculative-algorithm
DFLASH``) and vLLM (``method: dflash``) load (``serving.py``); decoded one block per verify pass
(``decoding.py``). No draft vocabulary, no final target hidden. The run config's ``draft.dflash``
section holds its fields (docs/dflash.md).
"""

import hashlib
from pathlib import Path

import torch

from specforge_core.capture.target_info import text_config
from specforge_core.drafts.dflash import dflash2
from specforge_core.drafts.dflash import draft_config as configs
from specforge_core.drafts.dflash import serving
from specforge_core.drafts.dflash.model import DFlashDraftModel
from specforge_core.drafts.dflash.objective import dflash_loss, summarize_dflash_metrics
from specforge_core.errors import ConfigError, ModelError


def batch_generator(seed: int, task_ids) -> torch.Generator:
    """The anchors' generator of one batch: a pure function of the run seed and the batch's task ids
    (``island-epoch-slot-prompt``), so a resumed run draws the anchors the uninterrupted one drew,
    every epoch draws new ones, and the same samples packed or not draw the same ones."""
    digest = hashlib.sha256(f"{seed}|{'|'.join(task_ids)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


MASK_BYTES_PER_ELEMENT = 10  # the bool mask and the int64 copy its tile sums make: 10.0 measured on a CPU


def block_mask_bytes(cfg, *, num_anchors: int, block_size: int, tokens: int, samples: int) -> int:
    """The transient of building the flex block mask of a micro-step of at most ``tokens`` tokens
    in ``samples`` samples (``fast/flex_blocks.py``, the attention ``auto`` picks on CUDA), built
    eagerly: an upper bound for the compiled build CUDA runs, which keeps no dense grid. Eager,
    torch's ``create_block_mask`` evaluates the predicate into a dense bool ``[rows, Q, T + Q]`` (Q block
    queries and T context tokens of a row, both padded to flex's 128) and sums its tiles through
    an int64 copy, 10 bytes an element. It grows with the square of the anchors in one row: packed
    (``training.token_budget``), the worst row holds ``min(tokens, token_budget)`` tokens and every
    sample's anchors, ``Q = min(samples × num_anchors, T) × block_size``; unpacked, each sample is
    a row of ``tokens / samples`` tokens. At Qwen3-8B shape, 12 samples × 512 anchors × 16 in one
    16k-token row, this is the end-to-end step's peak (docs/dflash.md, "Memory")."""
    def tiles(n: int) -> int:
        return -(-n // 128) * 128

    if cfg.training.token_budget is None:
        rows, width = samples, -(-tokens // samples)
        queries = min(num_anchors, width) * block_size
    else:
        rows, width = 1, min(tokens, cfg.training.token_budget)
        queries = min(samples * num_anchors, width) * block_size
    return MASK_BYTES_PER_ELEMENT * rows * tiles(queries) * (tiles(width) + tiles(queries))


def dflash2_run_fields(section) -> dict | None:
    """The DFlash2 fields of a run config's ``draft.dflash`` section (None when ``dflash2`` is off)."""
    if not section.dflash2:
        return None
    return {name: getattr(section, name) for name in dflash2.DEFAULTS}


class DFlashFamily:
    name = "dflash"
    architectures = ("DFlashDraftModel", "DFlash2DraftModel")
    uses_vocab_map = False
    captures_last_hidden = False
    loss_is_sum = True

    # ---- configuration ---------------------------------------------------------------------------

    def check_config(self, cfg) -> None:
        """Refuse the fields a DFlash-family draft (DFlash, and DSpark, which inherits this) does not
        read: each means something to EAGLE3 only."""
        if cfg.model.capture_layer_ids is not None:
            ids = f"draft.{cfg.draft.family}.target_layer_ids"
            raise ConfigError(
                f"model.capture_layer_ids picks EAGLE3's three layers; a DFlash-family draft reads {ids}",
                where="model.capture_layer_ids",
                fix=f"move the ids to {ids}, or remove model.capture_layer_ids",
            )
        if cfg.training.feature_noise:
            raise ConfigError(
                f"training.feature_noise={cfg.training.feature_noise} perturbs EAGLE3's captured features; "
                "the DFlash objective does not read it",
                where="training.feature_noise", fix="remove training.feature_noise",
            )
        if cfg.draft.attention_backend == "flash":
            raise ConfigError(
                "draft.attention_backend=flash is EAGLE3's step-0 kernel; a DFlash draft attends with sdpa or flex",
                where="draft.attention_backend", fix="use auto, sdpa or flex",
            )
        if cfg.validation.engine == "sglang" and (cfg.draft.family == "dspark" or cfg.draft.dflash.dflash2):
            kind = "DSpark" if cfg.draft.family == "dspark" else "DFlash2"
            raise ConfigError(
                f"validation.engine=sglang: SGLang 0.5.14 cannot serve a {kind} draft (no such speculative "
                "algorithm, no convolution or selector in its DFlash model)",
                where="validation.engine", fix="set validation.engine: ours (docs/families.md says who serves it)")
        if cfg.validation.engine == "sglang" and cfg.validation.num_steps not in (None, cfg.draft.dflash.block_size - 1):
            block = cfg.draft.dflash.block_size
            raise ConfigError(
                f"validation.num_steps={cfg.validation.num_steps}: SGLang serves a DFlash draft with its whole block, "
                f"{block - 1} draft tokens a verify pass, and the two figures must decode alike",
                where="validation.num_steps", fix=f"leave validation.num_steps unset, or set it to {block - 1}")
        if cfg.training.activation_checkpointing:
            raise ConfigError(
                "training.activation_checkpointing recomputes EAGLE3's unrolled steps; a DFlash-family draft's "
                "block queries are at most num_anchors × block_size per sample, whatever its length",
                where="training.activation_checkpointing",
                fix="remove training.activation_checkpointing (lower num_anchors to lower the draft's memory)",
            )
        if cfg.draft.lm_head_init != "random":
            raise ConfigError(
                f"draft.lm_head_init={cfg.draft.lm_head_init}: a DFlash draft has no lm_head of its own (it "
                "projects through the target's frozen one)",
                where="draft.lm_head_init", fix="remove draft.lm_head_init",
            )

    def capture_layer_ids(self, cfg, target_config, draft_config=None) -> tuple[int, ...]:
        text = text_config(target_config)
        n = int(text.num_hidden_layers)
        if draft_config is not None:
            ids, where = configs.target_layer_ids_of(draft_config), "draft config dflash_config.target_layer_ids"
        elif cfg.draft.dflash.target_layer_ids is not None:
            ids, where = list(cfg.draft.dflash.target_layer_ids), "draft.dflash.target_layer_ids"
        else:
            ids, where = configs.build_target_layer_ids(n, cfg.draft.dflash.num_layers), f"default for {n} layers"
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n - 1:
            raise ModelError(
                f"target layer ids {ids} must be distinct ids in [0, {n - 1}) for a {n}-layer target "
                "(the last layer's output is the final hidden, which SGLang cannot capture as a layer)",
                where=where,
                fix=f"set draft.dflash.target_layer_ids to distinct ids below {n - 1}, or remove it for the default",
            )
        return tuple(ids)

    def given_draft_config(self, cfg):
        return configs.load_dflash_config(cfg.draft.config_path) if cfg.draft.config_path else None

    def check_draft_config(self, cfg, draft_config, target_config, vocab_size: int) -> None:
        configs.check_fits_target(draft_config, target_config, where=f"draft.config_path ({cfg.draft.config_path})")

    def draft_config(self, cfg, target_config, layer_ids, *, tokenizer=None):
        given = self.given_draft_config(cfg)
        if given is not None:
            return given
        d = cfg.draft.dflash
        vocab = int(text_config(target_config).vocab_size)
        mask = configs.resolve_mask_token_id(d.mask_token_id, tokenizer, vocab)
        return configs.dflash_config_from_target(
            target_config, block_size=d.block_size, num_layers=d.num_layers, target_layer_ids=list(layer_ids),
            mask_token_id=mask, layer_types=d.layer_types, sliding_window=d.sliding_window,
            dflash2_fields=dflash2_run_fields(d),
        )

    def tokenizer_token_ids(self, cfg) -> tuple[str, ...]:
        given = cfg.draft.dflash.mask_token_id is not None or cfg.draft.config_path
        return () if given else ("draft.dflash.mask_token_id",)

    def default_num_steps(self, cfg) -> int:
        return cfg.draft.dflash.block_size - 1  # one block: the anchor and its block_size - 1 drafts

    def activation_bytes(self, cfg, draft_config, *, tokens: int, samples: int) -> int:
        """What one micro-step keeps for backward, at most: ``Q = samples × min(num_anchors,
        tokens / samples) × block_size`` block queries, each saving every draft layer's activations
        (``8H + 2·kv + 3I`` values) and its embedding, final norm and head inputs (``2H``); every
        context token's ``fc`` and ``hidden_norm`` outputs (``2H``) and its keys and values in every
        layer (``2·kv`` each); and the target-head cross-entropy's fp32 ``[2048, V]`` chunk with its
        gradient (``fast.chunked_ce.target_cross_entropy``'s torch passes: an upper bound on CUDA,
        where its kernels keep one ``[2048, V]`` chunk in the head's dtype). DFlash2 adds per query four convolutions per
        layer (input, kernels and output: ``4·(2H + 2·K_conv·G)``) and the selector's fp32 scores and
        gathered codebook rows (``top_k · (3·rank + 2)``), plus one fp32 ``[2048, top_k, H]`` chunk
        of candidate head rows. Building the attention's block mask comes first and is freed before
        the forward: the larger of the two is the estimate (:func:`block_mask_bytes`)."""
        c = 2 if cfg.training.param_dtype == "bfloat16" else 4  # bytes per value of the compute dtype
        d = cfg.draft.dflash
        h, i, layers = draft_config.hidden_size, draft_config.intermediate_size, draft_config.num_hidden_layers
        kv = draft_config.num_key_value_heads * draft_config.head_dim
        queries = samples * min(d.num_anchors, -(-tokens // samples)) * draft_config.block_size
        per_query = (layers * (8 * h + 2 * kv + 3 * i) + 2 * h) * c
        per_context = (2 * h + layers * 2 * kv) * c
        total = queries * per_query + tokens * per_context + 2 * 2048 * draft_config.vocab_size * 4
        extra = configs.dflash2_of(draft_config)
        if extra is not None:
            groups, top_k = h // extra["conv_group_size"], extra["selector_top_k"]
            conv = layers * 4 * (2 * h + 2 * extra["conv_kernel_size"] * groups) * c
            selector = top_k * (3 * extra["selector_rank"] + 2) * 4
            total += queries * (conv + selector) + 2048 * top_k * h * 4
        return max(total, block_mask_bytes(cfg, num_anchors=d.num_anchors, block_size=draft_config.block_size,
                                           tokens=tokens, samples=samples))

    def contract_fields(self, cfg) -> dict:
        d = cfg.draft.dflash
        fields = {"dflash.num_anchors": d.num_anchors, "dflash.loss_decay_gamma": d.loss_decay_gamma}
        if d.dflash2:
            fields["dflash.selector_loss_alpha"] = d.selector_loss_alpha
        return fields

    def serving_config(self, config) -> dict:
        return configs.dflash_config_to_dict(config)

    def trained_layer_ids(self, config) -> list[int] | None:
        return configs.target_layer_ids_of(config)

    # ---- model and training ----------------------------------------------------------------------

    def new_draft(self, config) -> DFlashDraftModel:
        return DFlashDraftModel(config)

    def warm_start(self, directory, config) -> DFlashDraftModel:
        return serving.warm_start_dflash(directory, config)

    def attach_target(self, cfg, draft, backend, vocab, *, fresh: bool) -> None:
        """Nothing to copy: the objective reads the target's frozen embedding and head directly."""

    def objective(self, cfg, backend):
        d, seed = cfg.draft.dflash, cfg.training.seed
        embed, head = backend.embed_weight, backend.lm_head_weight
        backend_name = cfg.draft.attention_backend

        def loss(draft, batch):
            return dflash_loss(
                draft, batch, embed_weight=embed, lm_head_weight=head, block_size=draft.config.block_size,
                num_anchors=d.num_anchors, loss_decay_gamma=d.loss_decay_gamma,
                generator=batch_generator(seed, getattr(batch, "task_ids", ())), backend=backend_name,
                selector_loss_alpha=d.selector_loss_alpha,
            )

        return loss

    def summarize(self, cfg, sums: dict) -> dict:
        return summarize_dflash_metrics(sums)

    # ---- files -------------------------------------------------------------------------------------

    def save_checkpoint_files(self, draft, directory: Path, state_dict=None) -> None:
        serving.save_dflash_checkpoint_files(draft, directory, state_dict)

    def load_checkpoint_files(self, directory: Path) -> DFlashDraftModel:
        return serving.load_dflash_from_files(directory)

    def export(self, draft, out_dir: Path, dtype: str = "keep") -> Path:
        return serving.export_dflash(draft, out_dir, dtype=dtype)

    def load_export(self, directory: Path) -> DFlashDraftModel:
        return serving.load_exported_dflash(directory)

    def export_speculators(self, draft, out_dir, *, target_dir, verifier=None, speculative_tokens=None,
                           dtype: str = "keep"):
        from specforge_core.drafts.dflash.speculators_format import export_dflash_speculators

        return export_dflash_speculators(draft, out_dir, target_dir=target_dir, verifier=verifier,
                                         speculative_tokens=speculative_tokens, dtype=dtype)

    # ---- decoding ----------------------------------------------------------------------------------

    def prepare_for_decoding(self, draft, target_model):
        draft.cast_params(target_model.dtype)
        return draft.to(target_model.device).eval()

    def drafter(self, draft, target_model, cfg=None):
        from specforge_core.drafts.dflash.drafter import DFlashDrafter

        return DFlashDrafter(draft, embed_weight=target_model.get_input_embeddings().weight,
                             lm_head_weight=target_model.get_output_embeddings().weight)


FAMILY = DFlashFamily()
