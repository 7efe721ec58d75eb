"""The target at decode time: a batch of sequences, a KV cache, and the draft's aux states.

``DecodingTarget`` wraps a Hugging Face causal LM for speculative and plain greedy decoding of
several prompts at once (one row each). ``start(prompts)`` prefills them; each
``forward(tokens)`` appends tokens to every row (positions continue per row), returns the target's
greedy choice after every new token and the captured aux states ``[m, 3·Ht]`` per row (the
outputs of the capture layers, concatenated low → high, exactly the features the draft is
trained on). ``forward_tree(trees)`` does the same for a draft tree per row (``decoding.tree``):
one forward under a tree attention mask, each node seeing only the sequence and its ancestors.
``keep_path(row, positions)`` keeps only the accepted ones of a row's last forward;
``keep_rows`` lets finished rows leave the batch. Batching only amortises the weight reads: each
row is decoded as if alone.

Capture-layer convention (SGLang's and SpecForge's): layer id i is the output of decoder layer i,
i.e. Hugging Face ``hidden_states[i + 1]``; ``capture.target_info.resolve_capture_layers`` picks them.
"""

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_core.system.device import resolve_device, resolve_dtype
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
    """What one target forward gives back, per batch row."""

    greedy: list[list[int]]  # per row: the argmax after each new token (prefill: after the last only)
    aux: list[torch.Tensor]  # per row: [m, 3·Ht], the capture layers' outputs concatenated low → high


class DecodingTarget:
    """A frozen HF causal LM decoding a batch of sequences with a ``DynamicCache`` and capture hooks.

    Rows are independent sequences. The cache is never cropped: every forward appends the same
    number of columns to every row, and ``keep_path`` masks a row's rejected columns out of all
    later attention (they stay in the cache as dead columns). Each row's RoPE positions count only
    its live tokens, so a row computes exactly what it would alone, up to float rounding.
    Guarantees: ``lengths[r]`` is row r's number of live tokens; ``forward`` runs the new tokens
    of row r at positions ``lengths[r] .. lengths[r]+m-1`` in one pass; ``forward_tree`` runs node
    i of row r's tree at position ``lengths[r] + depth(i)``, seeing the row's live tokens and the
    node's ancestors. After ``keep_path`` of an accepted path (root first, each node a child of the
    one before), the live columns of the round are exactly that path at consecutive positions: the
    cache holds what a forward of the path alone would have written.
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

    def _hook_for(self, layer_id: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = hidden

        return hook

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, *, last_only: bool, mask: torch.Tensor | None = None):
        """The model on ``ids`` at ``positions``; ``mask``: a 4D additive mask (default: ``live``, causal)."""
        self._captured.clear()
        out = self.model(
            input_ids=ids, attention_mask=self.live if mask is None else mask, position_ids=positions,
            use_cache=True, logits_to_keep=1 if last_only else 0, **{self._cache_arg: self.cache}
        )
        aux = torch.cat([self._captured[i] for i in self.capture_layer_ids], dim=-1)
        self._captured.clear()
        return out.logits.argmax(-1).tolist(), aux

    @torch.inference_mode()
    def start(self, prompts: list[list[int]]) -> TargetStep:
        """Forget everything and prefill ``prompts`` (one row each, left-padded into one forward).

        Returns each row's greedy choice after its prompt and the aux states of its prompt tokens.
        """
        from transformers import DynamicCache

        if not prompts or not all(prompts):
            raise ValueError("cannot decode an empty prompt")
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        self.live = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self.lengths = self.live.sum(-1)
        self.last_width = 0  # tokens the last forward appended (what keep_path chooses from)
        self.cache = DynamicCache(config=self.model.config)
        greedy, aux = self._run(ids, (self.live.cumsum(-1) - 1).clamp(min=0), last_only=True)
        return TargetStep(greedy=greedy, aux=[aux[r, width - len(p) :] for r, p in enumerate(prompts)])

    @torch.inference_mode()
    def forward(self, tokens: list[list[int]]) -> TargetStep:
        """Append ``tokens[r]`` (the same count m for every row) to row r; greedy choice after each
        new token and their aux states."""
        m = len(tokens[0])
        if any(len(t) != m for t in tokens) or len(tokens) != len(self.lengths):
            raise ValueError(f"need {len(self.lengths)} rows of {m} tokens each")
        ids = torch.tensor(tokens, device=self.device)
        positions = self.lengths[:, None] + torch.arange(m, device=self.device)
        self.live = torch.cat([self.live, self.live.new_ones(len(tokens), m)], dim=1)
        self.lengths = self.lengths + m
        self.last_width = m
        greedy, aux = self._run(ids, positions, last_only=False)
        return TargetStep(greedy=greedy, aux=list(aux))

    @torch.inference_mode()
    def forward_tree(self, trees) -> TargetStep:
        """Append row r's draft tree ``trees[r]`` (a ``decoding.tree.DraftTree``; every tree of the
        same size n) in one forward: node i at position ``lengths[r] + depth(i)``, attending to the
        row's live tokens and to its own ancestors. Greedy choice after each node and its aux
        states, in tree order; follow with ``keep_path`` for every row."""
        n = len(trees[0].tokens)
        if any(len(t.tokens) != n for t in trees) or len(trees) != len(self.lengths):
            raise ValueError(f"need {len(self.lengths)} trees of {n} tokens each")
        ids = torch.tensor([list(t.tokens) for t in trees], device=self.device)
        positions = self.lengths[:, None] + torch.tensor([t.depths for t in trees], device=self.device)
        tree = torch.stack([t.ancestor_mask() for t in trees]).to(self.device)
        visible = torch.cat([self.live.bool()[:, None].expand(-1, n, -1), tree], dim=-1)
        dtype = self.model.dtype
        # additive, so that every attention implementation (eager, sdpa) reads it the same way
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill(~visible, torch.finfo(dtype).min)
        self.live = torch.cat([self.live, self.live.new_ones(len(trees), n)], dim=1)
        self.lengths = self.lengths + n
        self.last_width = n
        greedy, aux = self._run(ids, positions, last_only=False, mask=mask[:, None])
        return TargetStep(greedy=greedy, aux=list(aux))

    @torch.inference_mode()
    def keep_path(self, row: int, positions: list[int]) -> None:
        """Keep only ``positions`` (indices into the last forward's tokens) of ``row``: the accepted
        path; later forwards never see the others. For a chain, ``range(a + 1)`` keeps the pending
        token and the first a drafts."""
        if not set(positions) <= set(range(self.last_width)):
            raise ValueError(f"positions {positions} are not all among the last forward's {self.last_width} tokens")
        dead = sorted(set(range(self.last_width)) - set(positions))
        if dead:
            self.live[row, [p - self.last_width for p in dead]] = 0
            self.lengths[row] -= len(dead)

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Continue with only these rows (finished sequences leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.live, self.lengths = self.live[index], self.lengths[index]

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
    """End-of-turn ids: the tokenizer's eos, every eos id of the model's generation config, and the
    chat template's end-of-turn token (``data.tokenize.ChatRenderer.end_of_turn``) when given."""
    return stop_ids_of(model.generation_config, tokenizer, end_of_turn)


def stop_ids_of(generation_config, tokenizer, end_of_turn: str | None = None) -> set[int]:
    """:func:`stop_token_ids` from a generation config (``transformers.GenerationConfig``, or None),
    for a target served by another engine than transformers."""
    ids: set[int] = set()
    if end_of_turn is not None:
        ids.add(tokenizer.convert_tokens_to_ids(end_of_turn))
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
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
