"""The target at decode time: one sequence, a KV cache, and the draft's aux states on every forward.

``DecodingTarget`` wraps a Hugging Face causal LM for speculative decoding and plain greedy
decoding. Each ``forward(tokens)`` appends ``tokens`` to the sequence (positions continue from
the cache), returns the target's greedy choice after every one of them and the captured aux
states ``[len, 3·Ht]`` (the outputs of the capture layers, concatenated low → high, exactly the
features the draft is trained on). ``truncate(n)`` drops rejected positions from the cache.

Capture-layer convention (specforge-facts §16.5): layer id i is the output of decoder layer i,
i.e. Hugging Face ``hidden_states[i + 1]``; ``capture.target.resolve_capture_layers`` picks them.
"""

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_core.capture.target import resolve_device, resolve_dtype
from specforge_core.errors import ModelError


def _decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ModelError(
            f"{type(model).__name__} has no `model.layers`; cannot hook the capture layers",
            where="model.target",
            fix="use a decoder-only causal LM with the usual transformers layout (Llama, Qwen, Mistral...)",
        )
    return layers


@dataclass
class TargetStep:
    """What one target forward over m new tokens gives back."""

    greedy: list[int]  # argmax after each of the m tokens
    aux: torch.Tensor  # [m, 3·Ht], the capture layers' outputs concatenated low → high


class DecodingTarget:
    """A frozen HF causal LM decoding one sequence with a ``DynamicCache`` and capture hooks.

    Guarantees: ``length`` is always the number of cached positions; ``forward`` runs the new
    tokens at positions ``length .. length+m-1`` in one pass; ``truncate`` restores the cache to
    exactly the state after the kept prefix (later forwards see nothing of the dropped tokens).
    """

    def __init__(self, model, capture_layer_ids: list[int]):
        self.model = model.eval()
        layers = _decoder_layers(model)
        self.capture_layer_ids = list(capture_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [
            layers[i].register_forward_hook(self._hook_for(i)) for i in self.capture_layer_ids
        ]
        self.device = next(model.parameters()).device
        # transformers ≥ 5.2x names the cache argument `cache`; earlier versions `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.reset()

    def _hook_for(self, layer_id: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = hidden

        return hook

    def reset(self) -> None:
        """Forget the sequence (a fresh, empty cache)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, tokens: list[int], *, last_only: bool = False) -> TargetStep:
        """Append ``tokens`` to the sequence; greedy choice after each (or only the last), aux states.

        ``last_only`` skips the full-vocabulary logits of all but the last token (prefill).
        """
        m = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + m, device=self.device)
        self._captured.clear()
        out = self.model(
            input_ids=ids, position_ids=positions[None], use_cache=True,
            logits_to_keep=1 if last_only else 0, **{self._cache_arg: self.cache}
        )
        self.length += m
        greedy = out.logits[0].argmax(-1).tolist()
        aux = torch.cat([self._captured[i][0] for i in self.capture_layer_ids], dim=-1)
        self._captured.clear()
        return TargetStep(greedy=greedy, aux=aux)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions (drop rejected draft tokens)."""
        remove = self.length - length
        if remove < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if remove:
            # transformers < 5.2x: crop(max_length); later: crop(-tokens_to_remove).
            if "max_length" in inspect.signature(self.cache.crop).parameters:
                self.cache.crop(length)
            else:
                self.cache.crop(-remove)
        self.length = length

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def load_target(cfg):
    """(model, tokenizer) for ``cfg.model`` on ``cfg.capture.device``, frozen, eval mode."""
    from transformers import AutoModelForCausalLM

    from specforge_core.data.tokenize import load_tokenizer

    m = cfg.model
    if not m.target or not Path(m.target).exists():
        raise ModelError(
            f"target model directory {m.target!r} not found",
            where="model.target",
            fix="point model.target at a local Hugging Face model directory",
        )
    device = resolve_device(cfg.capture.device)
    extra = {"gguf_file": m.gguf_file} if m.gguf_file else {}
    tok = load_tokenizer(cfg)
    model = AutoModelForCausalLM.from_pretrained(
        m.target, dtype=resolve_dtype(m.dtype, device), trust_remote_code=m.trust_remote_code, **extra
    )
    model.to(device).eval().requires_grad_(False)
    return model, tok


def stop_token_ids(model, tokenizer, end_of_turn: str | None = None) -> set[int]:
    """End-of-turn ids: the tokenizer's eos, every eos id of the generation config, and the chat
    template's end-of-turn token (``data.tokenize.ChatRenderer.end_of_turn``) when given."""
    ids: set[int] = set()
    if end_of_turn is not None:
        ids.add(tokenizer.convert_tokens_to_ids(end_of_turn))
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    if not ids:
        raise ModelError(
            "the tokenizer names no end-of-turn (eos) token, so generation could not stop",
            where="model.tokenizer",
            fix="use a chat tokenizer with eos_token set (e.g. <|im_end|> for ChatML)",
        )
    return ids
