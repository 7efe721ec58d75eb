"""The ``hf`` capture backend: a transformers causal LM in this process, CPU or GPU.

    backend = HFCaptureBackend.from_config(cfg, device=torch.device("cpu"))
    batch = backend.capture(request)          # CapturedBatch of this rank's rows

How it captures: forward hooks on ``decoder.layers[i]`` for the three capture ids take each
layer's output (id ``i`` = output of layer ``i`` = HF ``hidden_states[i+1]``); the decoder's own
output is the post-final-norm hidden (``last_hidden``). Only the decoder runs (``model.model``,
never the LM head), under ``torch.inference_mode()`` with ``use_cache=False``, so no ``[B,T,V]``
logits are ever made; the teacher is later computed from ``last_hidden`` and
:attr:`lm_head_weight` (the input embedding when the target ties them).

Two forwards. Unpacked requests (``token_budget`` None) run as right-padded rows with a padding
mask (transformers' ``sdpa``). Packed requests run as ONE flat row of every sample's tokens with
positions restarting per sample and per-sample causal attention (``capture/varlen.py``: FlashAttention
varlen on GPU), so the target computes no padding and no cross-sample attention; the flat outputs
are then laid out in this rank's packed rows (``capture/packing.py``).

Target TP on this backend: transformers has no tensor parallelism that works on CPU/gloo, so with
``capture.tp_size > 1`` every TP peer holds the whole target, runs the same TP-wide forward and
keeps its own rows. That is correct (the peers agree by construction) but costs ``tp_size`` times
the target compute; use the ``sglang`` backend for real target TP on GPUs.
"""

from functools import partial

import torch

from specforge_core.capture import varlen
from specforge_core.capture.base import (
    CapturedBatch,
    TargetRequest,
    attention_mask_for,
    local_inputs,
    pad_right,
    to_device,
)
from specforge_core.capture.packing import layout_for
from specforge_core.capture.target_info import load_target_config, resolve_capture_layers, text_config, validate_colocated
from specforge_core.system.device import resolve_dtype
from specforge_core.system.compile import compile_target
from specforge_core.errors import ModelError


class HFCaptureBackend:
    """Capture from a loaded transformers ``*ForCausalLM``; see the module docstring."""

    name = "hf"

    def __init__(self, model, layer_ids: tuple[int, ...], *, compile: bool = False, keep_last_hidden: bool = True):
        model.eval().requires_grad_(False)
        self.model = model
        self.target_config = model.config
        text = text_config(model.config)
        self.hidden_size: int = text.hidden_size
        self.layer_ids = tuple(layer_ids)
        self.keep_last_hidden = keep_last_hidden  # False: the draft family needs no teacher (DFlash)
        self.device: torch.device = next(model.parameters()).device
        self._decoder = model.get_decoder()
        layers = getattr(self._decoder, "layers", None)
        if layers is None:
            raise ModelError(
                f"{type(model).__name__}'s decoder has no `layers` list to hook",
                where="model.target",
                fix="use a decoder-only causal LM (Llama, Qwen, Mistral, ...) or the sglang backend",
            )
        varlen.install(model)
        if compile and self.device.type == "cuda":
            compile_target(self._decoder)
        self._grabbed: dict[int, torch.Tensor] = {}
        self._hooks = [
            layers[layer].register_forward_hook(partial(self._grab, slot))
            for slot, layer in enumerate(self.layer_ids)
        ]

    @classmethod
    def from_config(cls, cfg, *, device: torch.device, draft_config=None) -> "HFCaptureBackend":
        """Read the target's config, check the run against it, load and hook it."""
        target_config = load_target_config(cfg)
        validate_colocated(cfg, target_config)
        return cls.load(cfg, target_config, resolve_capture_layers(cfg, target_config, draft_config), device=device)

    @classmethod
    def load(cls, cfg, target_config, layer_ids, *, device: torch.device,
             keep_last_hidden: bool = True) -> "HFCaptureBackend":
        """Load ``model.target`` with its (already checked) config, in ``model.dtype``, and hook it."""
        from transformers import AutoModelForCausalLM

        load = dict(trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.gguf_file:
            load["gguf_file"] = cfg.model.gguf_file
        if device.type == "cuda":
            load["device_map"] = str(device)
        dtype = resolve_dtype(cfg.model.dtype, device)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.target, config=target_config, dtype=dtype, **load)
        return cls(model.to(device), layer_ids, compile=cfg.training.compile, keep_last_hidden=keep_last_hidden)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, Ht]`` frozen target head (the input embedding itself when tied)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    def _grab(self, slot: int, module, args, output) -> None:
        self._grabbed[slot] = output[0] if isinstance(output, tuple) else output

    def capture(self, request: TargetRequest) -> CapturedBatch:
        """Run the decoder over the whole TP-wide request; return copies of this rank's rows only."""
        if request.token_budget is not None:
            return self._capture_packed(request)
        lengths = [len(r) for r in request.input_ids]
        width = max(lengths)
        ids = pad_right(request.input_ids, self.device, width)
        attn = attention_mask_for(lengths, width, self.device)
        try:
            with torch.inference_mode():
                last = self._decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
                aux = [self._grabbed[slot] for slot in range(len(self.layer_ids))]
            # Outside inference mode on purpose: these copies are ordinary tensors that the draft's
            # autograd may save, and they hold only this rank's rows trimmed to its longest row,
            # so the TP-wide activations are freed when this function returns.
            rows, local_width = request.local, max(request.local_lengths)
            aux_local = torch.cat([a[rows, :local_width] for a in aux], dim=-1)
            last_local = last[rows, :local_width].clone() if self.keep_last_hidden else None
        finally:
            self._grabbed.clear()
        input_ids, attention_mask, loss_mask, host = local_inputs(request, self.device)
        padding = ~attention_mask.bool().unsqueeze(-1)
        aux_local.masked_fill_(padding, 0)
        if last_local is not None:
            last_local.masked_fill_(padding, 0)
        return CapturedBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            aux_hidden=aux_local,
            last_hidden=last_local,
            task_ids=request.task_ids[rows],
            host_masks=host,
        )

    def _capture_packed(self, request: TargetRequest) -> CapturedBatch:
        """The whole request as one flat row, then this rank's samples gathered into packed rows."""
        lengths = [len(r) for r in request.input_ids]
        flat_ids = torch.as_tensor([t for row in request.input_ids for t in row], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        layout = layout_for(request)
        first = sum(lengths[: request.local.start or 0])
        local = slice(first, first + sum(request.local_lengths))
        try:
            with torch.inference_mode(), varlen.packed_call(lengths, self.device) as packed:
                last = self._decoder(
                    input_ids=to_device(flat_ids, self.device)[None], position_ids=to_device(positions, self.device)[None],
                    use_cache=False, **packed,
                ).last_hidden_state[0, local]
                aux = [self._grabbed[slot][0, local] for slot in range(len(self.layer_ids))]
            # The gathers below run outside inference mode: they make the batch's own ordinary tensors.
            return layout.captured_batch(aux, last if self.keep_last_hidden else None, request)
        finally:
            self._grabbed.clear()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

