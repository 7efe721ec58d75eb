"""The run configuration: one pydantic model tree, loaded from YAML, with dotted overrides.

    python -m specforge_core.config --config examples/tiny-cpu.yaml            # print resolved
    python -m specforge_core.config --config C.yaml training.learning_rate=5e-5
    python -m specforge_core.config --schema                                   # JSON schema

Sections: ``model`` (the target), ``data``, ``draft``, ``training``, ``capture``,
``deployment``, ``output``, ``validation``. Unknown keys and keys given twice are rejected
everywhere; every error names the dotted field and the fix, and never echoes storage options.
Rules that need the target's own config (context length, layer count) are checked where the
target is loaded (``specforge_core.capture.target_info.validate_colocated``), not here; rules of
one draft family are its own (``specforge_core.drafts.check_config``, which every command and the
flow run on a loaded config): this module holds types, ranges and rules every family shares.
"""

import difflib
import json
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from specforge_core.errors import ConfigError
from specforge_core.run.topology import Topology


class ConfigDeprecationWarning(UserWarning):
    """A config field was renamed or moved; the old spelling still loads (shown to users by default)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The target model whose drafts we train."""

    target: str = Field(
        "", description="Target model: a local Hugging Face directory (config.json + weights)."
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside `target`, if loading from GGUF.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to `target`.")
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own (needed if it has none)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Target weights dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint (off by default).")
    capture_layer_ids: list[int] | None = Field(
        None,
        description="EAGLE3: target layers whose outputs feed the draft (3 distinct ids, output-of-layer "
        "convention); default [1, N//2-1, N-4].",
    )


# Template variables the renderer sets itself (data/tokenize.py); data.chat_template_kwargs may not set them.
CHAT_TEMPLATE_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


class DataConfig(_Section):
    """Conversations in, tokenized prompt cache out."""

    train_files: list[str] = Field(
        default_factory=list, description="JSONL / JSON-array files at any fsspec URL."
    )
    eval_files: list[str] = Field(default_factory=list, description="Held-out prompts (never trained on).")
    eval_holdout: int = Field(
        0, ge=0, description="Rows split off the training data for evaluation when no eval_files are given."
    )
    format: Literal["auto", "conversations", "sharegpt", "messages", "text", "tokenized"] = Field(
        "auto", description="Row shape; auto detects it per file from the first row."
    )
    max_length: int = Field(2048, gt=1, description="Right-truncate tokenized rows to this many tokens.")
    train_only_last_turn: bool = Field(False, description="Supervise only the last assistant turn.")
    supervise: Literal["assistant", "all"] = Field(
        "assistant", description="Which training tokens carry the loss. assistant: the assistant turns "
        "(what the target generates). all: every token, prompts included: the teacher's distribution is "
        "the target at a prompt position as well, so each captured row gives more training positions for "
        "the same capture (rows still need data.min_loss_tokens assistant tokens; eval prompts are unchanged)."
    )
    min_loss_tokens: int = Field(1, ge=1, description="Drop rows with fewer supervised tokens.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="error: stop at the first bad row; skip: drop and count bad rows."
    )
    max_rows: int | None = Field(None, gt=0, description="Use at most this many source rows.")
    cache_dir: str = Field("cache", description="Where prompt caches and vocab maps are stored.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options (credentials are never logged)."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables for the chat template, e.g. {enable_thinking: false} "
        "for Qwen3; used alike for training data, regenerated answers and evaluation prompts."
    )

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_supervision(self) -> "DataConfig":
        if self.supervise == "all" and self.train_only_last_turn:
            raise ValueError("data.supervise=all supervises every token, so data.train_only_last_turn=true has "
                             "no effect; set one of them")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_renderers_own(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(v) & set(CHAT_TEMPLATE_RESERVED))
        if owned:
            raise ValueError(f"sets {', '.join(owned)}, which the renderer passes itself; remove "
                             f"{'them' if len(owned) > 1 else 'it'} (other keys reach the template unchanged)")
        return v


class DFlashSection(_Section):
    """The DFlash family's fields (``draft.family: dflash``; docs/dflash.md)."""

    block_size: int = Field(
        16, description="Tokens per block: the anchor + block_size-1 drafts proposed in one forward "
        "(SGLang --speculative-num-draft-tokens)."
    )
    num_layers: int = Field(1, ge=1, description="Draft decoder layers.")
    target_layer_ids: list[int] | None = Field(
        None, description="Target layers the draft reads (output-of-layer ids); default: num_layers ids spread "
        "over [1, N-3] (SpecForge's build_target_layer_ids)."
    )
    mask_token_id: int | None = Field(
        None, description="Embedding row used as MASK; default: the tokenizer's mask token, else the first "
        "unused embedding row."
    )
    num_anchors: int = Field(512, ge=1, description="Blocks sampled per sample per step (fewer if it has fewer "
                             "supervised positions).")
    loss_decay_gamma: float | None = Field(7.0, gt=0, description="Slot k weighs exp(-(k-1)/gamma); null: no decay.")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="Per draft layer; default: all full_attention (bidirectional within the block)."
    )
    sliding_window: int | None = Field(None, gt=0, description="Window of sliding_attention layers.")
    dflash2: bool = Field(False, description="DFlash2: add block-local dynamic convolutions around every sublayer "
                          "and a low-rank candidate selector (speculators' dflash2; the fields below).")
    conv_kernel_size: int = Field(2, ge=1, description="DFlash2: causal taps of each in-block convolution.")
    conv_group_size: int = Field(16, ge=1, description="DFlash2: hidden channels sharing one dynamic kernel "
                                 "(must divide hidden_size).")
    selector_rank: int = Field(256, ge=1, description="DFlash2: rank of the candidate selector's factorisation.")
    selector_top_k: int = Field(16, ge=1, description="DFlash2: unary candidates the selector reranks per slot.")
    selector_loss_alpha: float = Field(1.0, ge=0, description="DFlash2: weight of the selector's cross-entropy "
                                       "next to the unary one.")
    sliding_window_non_causal: bool = Field(
        True, description="DFlash2: bidirectional attention inside the block on sliding layers; only false is "
        "implemented for sliding layers (full-attention layers are always bidirectional in the block)."
    )

    @field_validator("block_size")
    @classmethod
    def _block(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be at least 2 (one anchor and one draft token), got {v}; the usual sizes are 8 and 16")
        return v


class DSparkSection(DFlashSection):
    """The DSpark family's fields (``draft.family: dspark``; docs/dspark.md): DFlash's backbone
    fields, then its heads and loss. Defaults are speculators 0.9.0's DSpark trainer defaults."""

    block_size: int = Field(8, description="Tokens per block: the anchor and B-1 masks; all B draft with "
                            "sample_from_anchor.")
    num_layers: int = Field(5, ge=1, description="Draft decoder layers.")
    loss_decay_gamma: float = Field(4.0, gt=0, description="Slot k weighs exp(-(k-s)/gamma), s the first drafting slot.")
    markov_rank: int = Field(256, ge=0, description="Rank of the Markov logit bias; 0 disables the head.")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field("vanilla", description="Markov head variant.")
    enable_confidence_head: bool = Field(True, description="Predict each slot's acceptance probability.")
    confidence_head_with_markov: bool = Field(
        True, description="Feed the Markov previous-token embedding to the confidence head (needs markov_rank > 0)."
    )
    sample_from_anchor: bool = Field(True, description="The anchor slot drafts too (slot k predicts token a+k+1).")
    loss_terms: dict[Literal["kl_div", "tv", "ce"], float] = Field(
        default_factory=lambda: {"kl_div": 1.0}, description="Distillation terms and their weights."
    )
    per_position_loss_weight: Literal["fixed-exp-decay", "dpace"] = Field(
        "fixed-exp-decay", description="Slot weights: the gamma decay, or D-PACE (needs loss_terms {ce: 1.0})."
    )
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="D-PACE confidence smoothing.")
    confidence_head_alpha: float = Field(1.0, ge=0, description="Weight of the confidence head's BCE term.")
    confidence_threshold: float | None = Field(
        None, ge=0, lt=1, description="Decoding (validation, evaluate): each chain stops before the slot where the "
        "running product of the confidence head's predicted acceptance falls below this; none: chains of the fixed "
        "length validation.num_steps. Needs enable_confidence_head."
    )


class DraftConfig(_Section):
    """The draft model: its family, the EAGLE3 family's fields, and ``draft.dflash`` for DFlash."""

    family: Literal["eagle3", "dflash", "dspark"] = Field(
        "eagle3", description="Draft family: eagle3 (one layer over 3 captured target layers, chain drafting), "
        "dflash (a block of drafts in one forward, context injected as keys/values) or dspark (dflash with a "
        "Markov logit bias and a confidence head)."
    )
    dflash: DFlashSection = Field(default_factory=DFlashSection)
    dspark: DSparkSection = Field(default_factory=DSparkSection)
    config_path: str | None = Field(None, description="Draft config JSON; generated from the target if unset.")
    draft_vocab_size: int = Field(32000, gt=0, description="Draft vocabulary size Vd (≤ target vocab).")
    init_from: str | None = Field(
        None, description="Warm start from an exported draft directory (its vocab map is kept)."
    )
    vocab_map_path: str | None = Field(None, description="Use this d2t/t2d file instead of building one.")
    fc_norm: bool = Field(False, description="EAGLE-3.1: an RMSNorm on each captured layer before fc, so no "
                          "layer dominates the fused input by scale (docs/export.md, EAGLE-3.1).")
    norm_output: bool = Field(False, description="EAGLE-3.1: carry the final-normed hidden to the next draft "
                              "step, against its magnitude drifting with depth (docs/export.md, EAGLE-3.1).")
    lm_head_init: Literal["random", "target"] = Field(
        "random", description="EAGLE3's lm_head at a fresh start: random (normal, as SpecForge) or target "
        "(the target's lm_head rows of the draft vocabulary, then trained). Ignored by a warm start or a resume."
    )
    attention_backend: Literal["auto", "sdpa", "flex", "flash"] = Field(
        "auto", description="auto = flash (FlashAttention kernels) on CUDA in bf16/fp16 (flex in fp32 or for a "
        "head_dim FlashAttention has no kernel for), sdpa on CPU. DFlash drafts: auto (flex on CUDA), sdpa or flex."
    )


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str) -> float:
    """Seconds in a duration written with units: ``45s``, ``30m``, ``2h``, ``1h30m``, ``0.5h``.

    Raises ValueError (the config names the field) for a bare number, another unit, or zero.
    """
    m = _DURATION.match(text.replace(" ", "")) if isinstance(text, str) else None
    if m is None or not any(m.groups()):
        raise ValueError(
            f"{text!r} is not a duration; write it with a unit, h / m / s: e.g. 45s, 30m, 2h or 1h30m"
        )
    hours, minutes, seconds = (float(g) if g else 0.0 for g in m.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise ValueError(f"{text!r} is no time at all; give a positive duration such as 30m, or remove it")
    return total


class HeldOutDecodeConfig(_Section):
    """A small speculative decode of held-out prompts while the draft trains (docs/validation-sharegpt.md)."""

    interval: int = Field(
        0, ge=0, description="Decode every N optimizer steps and at the last one, on rank 0 (0: never). Its "
        "wall time is excluded from training.time_budget and from the steps' timings."
    )
    num_prompts: int = Field(8, ge=1, description="The first N prompts of the prompt cache's eval split.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens decoded per prompt.")


class TrainingConfig(_Section):
    seed: int = 42
    num_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    batch_size: int = Field(1, ge=1, description="Samples per rank per micro-step.")
    accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = Field(0.015, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    ttt_length: int = Field(7, ge=1, le=16, description="Unrolled training-time-test steps K.")
    ploss_decay: float = Field(0.8, gt=0, le=1, description="Weight of step k is decay**k.")
    feature_noise: float = Field(
        0.0, ge=0, le=1, description="EAGLE3: while training, add uniform noise U(-a, a) × each captured "
        "layer's per-token RMS to the draft's input features (EAGLE-1's augmentation against memorising "
        "rows seen in earlier epochs). 0: off, as SpecForge."
    )
    sp_size: int = Field(1, ge=1, description="Sequence parallelism (must be 1 for local_colocated).")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Draft parameter dtype; bfloat16 keeps fp32 master weights."
    )
    token_budget: int | None = Field(
        None, gt=0, description="Pack samples into rows of at most this many tokens (None: pad per batch)."
    )
    compile: bool = Field(
        False, description="torch.compile the hf target's decoder layers, the draft's norms and MLPs and the "
        "draft unroll's memory-bound passes (CUDA only): faster steps after a compile before the first step, "
        "cached in <output.dir>/compile-cache for a resumed run. Off: only flex attention is compiled, where it "
        "is used. Start time and tokens/s either way: docs/performance.md."
    )
    activation_checkpointing: bool = Field(
        False, description="EAGLE3 / EAGLE-3.1: keep only the inputs of each unrolled step's MLP block (o_proj, "
        "post-attention norm, MLP) for backward and recompute it there: less memory per token for long samples, "
        "one more forward of that block per step. What it saves and costs: docs/long-context.md."
    )
    save_interval: int = Field(0, ge=0, description="Checkpoint every N optimizer steps (0: not by steps).")
    save_every_minutes: float = Field(
        30, ge=0, description="Also checkpoint once this much wall time has passed since the start or the "
        "last checkpoint (0: not by time). Every run also checkpoints at its end."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    log_interval: int = Field(10, ge=1)
    resume: Literal["auto", "never", "must"] = Field(
        "auto", description="auto: resume from the latest checkpoint if present."
    )
    time_budget: str | None = Field(
        None, description="Train for this much wall time (45s, 30m, 2h, 1h30m): stop at the first whole "
        "optimizer step that spends it, and run warm-up and decay over the fraction spent instead of the "
        "steps (loop/budget.py). The plan's horizon (num_epochs, max_steps) still caps the run."
    )
    heldout: HeldOutDecodeConfig = Field(default_factory=HeldOutDecodeConfig)

    @field_validator("time_budget", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, str):
            raise ValueError(f"{v!r} has no unit; write it as a duration string: {v}s, {v}m or {v}h")
        parse_duration(v)
        return v

    @property
    def time_budget_s(self) -> float | None:
        """``time_budget`` in seconds (None: the run is bounded by its plan's horizon alone)."""
        return None if self.time_budget is None else parse_duration(self.time_budget)


# ServerArgs fields that capture/sglang_backend.py resolves itself; `capture.sglang.extra` may not set them.
SGLANG_RESOLVED_FIELDS = (
    "model_path", "dtype", "trust_remote_code", "skip_tokenizer_init", "tp_size", "pp_size", "dp_size",
    "ep_size", "mem_fraction_static", "attention_backend", "context_length", "max_running_requests",
    "max_total_tokens", "chunked_prefill_size", "disable_cuda_graph", "page_size", "sampling_backend",
    "disable_radix_cache", "enable_return_hidden_states", "random_seed",
)


class SGLangConfig(_Section):
    """Arguments of the in-process SGLang engine (GPU nodes only)."""

    mem_fraction_static: float = Field(0.4, gt=0, le=1)
    attention_backend: str = "flashinfer"
    context_length: int | None = Field(None, gt=0)
    max_running_requests: int | None = Field(None, gt=0)
    max_total_tokens: int | None = Field(None, gt=0)
    dp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    enable_dp_attention: bool = False
    disable_radix_cache: bool = True
    extra: dict[str, Any] = Field(default_factory=dict, description="Further ServerArgs fields, verbatim.")

    @field_validator("extra")
    @classmethod
    def _extra_does_not_override(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(v) & set(SGLANG_RESOLVED_FIELDS))
        if owned:
            raise ValueError(
                f"sets {', '.join(owned)}, which the run resolves itself; set them through their own "
                "fields (capture.sglang.*, capture.tp_size, data.max_length, model.*) instead"
            )
        return v


class CaptureConfig(_Section):
    backend: Literal["hf", "sglang"] = "hf"
    tp_size: int = Field(
        1, ge=1, description="Target tensor-parallel island width: this many consecutive ranks hold one "
        "target replica and capture one batch together (run/topology.py)."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    teacher_chunk_size: int = Field(32768, gt=0, description="Vocab chunk for the streamed teacher.")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)

    @model_validator(mode="after")
    def _sglang_engine_shape(self) -> "CaptureConfig":
        """One SGLang engine per target island: GPU only, no engine-level data parallelism."""
        if self.backend != "sglang":
            return self
        if self.device == "cpu":
            raise ValueError(
                "capture.device=cpu: the sglang backend runs on GPUs only; "
                "set capture.device to auto or cuda, or use capture.backend=hf"
            )
        if self.sglang.dp_size != 1:
            raise ValueError(
                f"capture.sglang.dp_size={self.sglang.dp_size}: in local_colocated each target island is "
                "one SGLang TP group and islands are the data parallelism; set capture.sglang.dp_size=1 "
                "and add ranks (deployment.nproc_per_node) for more islands"
            )
        if self.sglang.enable_dp_attention:
            raise ValueError(
                "capture.sglang.enable_dp_attention=true needs SGLang data parallelism, which "
                "local_colocated does not use; set capture.sglang.enable_dp_attention=false"
            )
        return self


class DeploymentConfig(_Section):
    mode: Literal["local_colocated"] = "local_colocated"
    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, description="host:port for multi-node c10d rendezvous.")
    launcher: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="Name of a launch prefix the worker's "
        "operator defined (SPECFORGE_LAUNCHER_<NAME> in the worker's environment; docs/deploy.md)."
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class OutputConfig(_Section):
    dir: str = Field("runs/default", description="Run directory: checkpoints, metrics, export, report.")
    on_busy: Literal["fail", "wait"] = Field(
        "fail", description="If another run holds the directory: fail (naming it) or wait."
    )


class BenchmarkSetting(_Section):
    """One row of the benchmark table: SGLang's ``--speculative-num-steps``, ``--speculative-eagle-topk``
    and ``--speculative-num-draft-tokens``."""

    steps: int = Field(ge=1, description="Draft steps per verify round.")
    topk: int = Field(1, ge=1, description="Branches per draft step; 1 = chain drafting.")
    draft_tokens: int = Field(ge=2, description="Tokens the target verifies per round, the pending one included.")

    @model_validator(mode="after")
    def _chain_verifies_every_step(self) -> "BenchmarkSetting":
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(
                f"steps={self.steps}, topk=1, draft_tokens={self.draft_tokens}: a chain verifies the pending "
                f"token and its {self.steps} drafts, so draft_tokens must be {self.steps + 1} (SGLang's rule)"
            )
        return self


class ValidationConfig(_Section):
    enabled: bool = True
    engine: Literal["ours", "sglang"] = Field(
        "ours", description="sglang: SGLang 0.5.14 (GPU) also serves the exported draft on the held-out prompts "
        "and its own acceptance length is reported beside our evaluator's (EAGLE3, EAGLE-3.1 and DFlash drafts; "
        "docs/validation.md)."
    )
    num_steps: int | None = Field(
        None, ge=1, description="Draft tokens proposed per verify round; default: the draft family's own "
        "(the drafts of one block for a block family; each family's page in docs/)."
    )
    max_new_tokens: int = Field(128, ge=1)
    num_prompts: int = Field(32, ge=1)
    promote_margin: float = Field(
        0.0, ge=0, description="Promote a new draft only if acceptance length beats the promoted one by this."
    )
    promoted_dir: str | None = Field(None, description="Where the promoted draft lives (scheduled retraining).")
    benchmarks: list[str] = Field(
        default_factory=list, description="Prompt sets of the benchmark table: mt-bench, humaneval, sharegpt "
        "(its held-out split) or a prompts file; empty: no table (docs/validation.md)."
    )
    settings: list[BenchmarkSetting] = Field(
        default_factory=lambda: [BenchmarkSetting(steps=3, topk=1, draft_tokens=4),
                                 BenchmarkSetting(steps=7, topk=1, draft_tokens=8)],
        min_length=1, description="The table's rows per benchmark (steps, topk, draft tokens).",
    )
    benchmark_prompts: int | None = Field(
        None, ge=1, description="Decode the first N prompts of each benchmark; none: all of them."
    )
    promote_on: str | None = Field(
        None, description="A benchmark of validation.benchmarks: promotion compares its pooled acceptance "
        "length at the first setting instead of the held-out figure."
    )

    @field_validator("promote_on")
    @classmethod
    def _a_measured_benchmark(cls, v: str | None, info: ValidationInfo) -> str | None:
        benchmarks = info.data.get("benchmarks", [])
        if v is not None and v not in benchmarks:
            raise ValueError(f"{v!r} is not one of validation.benchmarks {benchmarks}: add it there, "
                             "or remove promote_on to promote on the held-out figure")
        return v


class RunConfig(_Section):
    """The whole run: what the Prefect form renders and ``--config`` files hold."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    _topology: Topology = PrivateAttr()

    @property
    def topology(self) -> Topology:
        """The run's layout (world from ``deployment.*``), made once by this config's validation:
        what the flow's plan and a rank's launch carry; nothing derives it again."""
        return self._topology

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        """``training.tp_size`` (before 2026-12) is ``capture.tp_size``: still loaded, with a warning."""
        if not isinstance(data, dict) or not isinstance(data.get("training"), dict) or "tp_size" not in data["training"]:
            return data
        data = {**data, "training": dict(data["training"])}
        old = data["training"].pop("tp_size")
        capture = data.get("capture") or {}
        if isinstance(capture, dict):  # anything else is refused by the section's own validation
            capture = dict(capture)
            if "tp_size" in capture and capture["tp_size"] != old:
                raise ValueError(
                    f"training.tp_size={old} and capture.tp_size={capture['tp_size']} disagree; training.tp_size "
                    "is the old name of capture.tp_size: remove it"
                )
            capture.setdefault("tp_size", old)
            data["capture"] = capture
        warnings.warn(
            "training.tp_size is deprecated: the island width is the target's capture layout, "
            "write capture.tp_size instead (the value was moved there)",
            ConfigDeprecationWarning, stacklevel=2,
        )
        return data

    @model_validator(mode="after")
    def _colocated_topology(self) -> "RunConfig":
        t = self.training
        if t.sp_size != 1:
            raise ValueError(
                f"training.sp_size={t.sp_size}: sequence parallelism is not supported in "
                "deployment.mode=local_colocated; set training.sp_size=1"
            )
        try:
            self._topology = Topology.from_config(self)  # the one statement of "tp_size divides the world"
        except ConfigError as e:  # as a field error of the form, with the form's shorter fix
            raise ValueError(f"{e.problem}; change capture.tp_size or deployment.nproc_per_node") from None
        if self.capture.backend == "sglang":
            self._check_sglang_capacity(self._topology)
        return self

    @model_validator(mode="after")
    def _heldout_needs_prompts(self) -> "RunConfig":
        if self.training.heldout.interval and not (self.data.eval_files or self.data.eval_holdout):
            raise ValueError(
                f"training.heldout.interval={self.training.heldout.interval} decodes held-out prompts, but the "
                "config has none; give data.eval_files (or data.eval_holdout: N), or set training.heldout.interval=0"
            )
        return self

    def _check_sglang_capacity(self, topology) -> None:
        """The engine must hold one TP-wide batch: tp_size × batch_size rows of max_length tokens."""
        s, max_len, tp = self.capture.sglang, self.data.max_length, topology.tp_size
        rows = topology.island_batch_size
        if tp % s.ep_size:
            raise ValueError(
                f"capture.sglang.ep_size={s.ep_size} must divide capture.tp_size={tp} "
                "(experts are sharded inside the island's TP group); set capture.sglang.ep_size to a "
                "divisor of capture.tp_size"
            )
        if s.max_running_requests is not None and s.max_running_requests < rows:
            raise ValueError(
                f"capture.sglang.max_running_requests={s.max_running_requests} is below one TP-wide batch "
                f"(capture.tp_size × training.batch_size = {rows}); raise it to ≥ {rows} or remove it"
            )
        if s.max_total_tokens is not None and s.max_total_tokens < rows * max_len:
            raise ValueError(
                f"capture.sglang.max_total_tokens={s.max_total_tokens} cannot hold one TP-wide batch "
                f"({rows} rows × data.max_length {max_len} = {rows * max_len} tokens); "
                f"raise it to ≥ {rows * max_len} or remove it"
            )
        if s.context_length is not None and s.context_length < max_len:
            raise ValueError(
                f"capture.sglang.context_length={s.context_length} is shorter than data.max_length={max_len}; "
                f"raise it to ≥ {max_len} or remove it (default: data.max_length)"
            )


# ---------------------------------------------------------------------------------------------
# Loading


def _closest(name: str, options: list[str]) -> str:
    hit = difflib.get_close_matches(name, options, n=1)
    return f"; did you mean '{hit[0]}'?" if hit else f"; allowed keys: {', '.join(sorted(options))}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for unknown-key hints)."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _explain(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            hint = _closest(str(loc[-1]), list(owner.model_fields)) if owner else ""
            lines.append(f"{dotted}: unknown key{hint}")
        else:
            got = e.get("input")
            secret = loc[:2] == ("data", "storage_options")  # credentials are never echoed
            shown = "" if isinstance(got, dict) or got is None or secret else f" (got {got!r})"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{dotted}: {msg}{shown}")
    return ConfigError(
        "invalid configuration:\n  " + "\n  ".join(lines),
        where=source,
        fix="correct the named fields (python -m specforge_core.config --schema lists them all)",
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merge keys (<<) may be overridden by design
            key = key_node.value
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}': the second value would silently replace the first; "
                    "keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a","b","c"], value parsed as YAML scalar/list)."""
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form section.key=value",
            fix="write e.g. training.learning_rate=5e-5",
        )
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key", fix="write e.g. training.learning_rate=5e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each dotted override set (intermediate dicts created)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"override {item!r}: '{part}' is a value, not a section", fix="check the dotted path"
                )
            node = nxt
        node[path[-1]] = value
    return out


def config_from_dict(data: dict, *, source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise _explain(err, source) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (or JSON) at ``path`` (None: all defaults), then apply dotted overrides."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError("config file not found", where=source, fix="pass an existing YAML file to --config")
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"not valid YAML: {e}", where=source, fix="fix the YAML syntax") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"top level must be a mapping of sections, got {type(loaded).__name__}",
                where=source,
                fix="start the file with sections such as `model:` and `data:`",
            )
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + overrides"
    return config_from_dict(data, source=source)


def dump_config(cfg: RunConfig) -> dict:
    """Plain dict of the config with credentials removed (safe for logs, artifacts, checkpoints)."""
    out = cfg.model_dump(mode="json")
    if out["data"].get("storage_options"):
        out["data"]["storage_options"] = {k: "***" for k in out["data"]["storage_options"]}
    return out


def json_schema() -> dict:
    return RunConfig.model_json_schema()
