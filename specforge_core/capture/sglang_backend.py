"""The ``sglang`` capture backend: an in-process SGLang engine per rank, one TP group per island.

    engine = ModelRunnerEngine.start(args, layer_ids, place=place, device=dev, islands=topology.islands())
    engine = FakeSGLangEngine.start(args, layer_ids, place=place, device=cpu, islands=...)   # CPU tests
    backend = SGLangCaptureBackend(engine, target_config, embed, lm_head)

This module holds no SGLang code. It speaks to an engine through :class:`CaptureEngine`, the
contract that the real engine (``sglang_engine.py``, the one version-pinned SGLang seam) and the
fake (``fixtures/fake_sglang.py``) both honour:

- ``start`` is called by every rank of the world at the same point (SGLang builds every island's
  process groups collectively); ``islands`` lists each island's ranks, ``place`` is this rank's;
- ``capture(input_ids, local)`` is called by every TP peer of an island with the same TP-wide
  rows, in lockstep (a collective over the island's TP group: :func:`check_lockstep` makes peers
  that disagree fail instead of hanging in the target's all-reduce);
- it refuses, before any target work, what SGLang cannot run (:func:`check_engine_request`: a
  row longer than the context, more rows or tokens than the pools hold; :func:`check_engine_pools`
  at start: pools SGLang shrank below one TP-wide batch) and a layer id SGLang would silently skip
  (:func:`check_layer_ids`);
- it returns a :class:`PackedCapture` of the rows in ``local`` only, packed without padding
  (``aux [Σℓ, K·Ht]`` in the order of ``layer_ids``, ``last [Σℓ, Ht]``, ``lengths``), in the row
  order of ``local``;
- the tensors may be views into the engine's TP-wide output buffer: this backend copies them
  into a padded (or, with ``request.token_budget``, packed) :class:`CapturedBatch`, so that buffer
  is released when ``capture`` returns.

Engine arguments, resolved once from the run config, with two views of one object:

    args = SGLangEngineArgs.resolve(cfg, topology)   # the run's Topology (run/topology.py)
    args.kwargs()   # {"model_path": ..., "tp_size": 2, ...}   → ServerArgs(**kwargs) in-process
    args.argv()     # ["--model-path", ..., "--tp-size", "2"]  → python -m sglang.launch_server ...

Both views come from the same ordered field list, so they cannot disagree: a ``True`` flag is a
bare ``--flag``, a ``False`` flag is left out (SGLang's default for every boolean set here), lists
become repeated values and ``None`` is left out of both.

What is resolved for the in-process capture engine (one engine per island, extend-only):
``tp_size = capture.tp_size`` (one engine per target island), ``pp_size = 1``,
``max_running_requests = tp_size × batch_size`` and ``max_total_tokens = that × max_length``
(one TP-wide batch at a time) unless ``capture.sglang`` sets them, ``context_length =
data.max_length`` unless set, ``chunked_prefill_size = -1`` (the whole batch in one extend),
``disable_cuda_graph`` (extend only, varying shapes), ``enable_return_hidden_states``,
``skip_tokenizer_init`` (we pass token ids). ``capture.sglang.extra`` adds further ``ServerArgs``
fields verbatim; it may not set a field resolved here (``config.SGLANG_RESOLVED_FIELDS``; config
validation names the clash).

The head weights come from the checkpoint (``target_info.load_target_head``), not from the
engine, whose LM head is sharded across the TP group.
"""

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specforge_core.capture.base import CapturedBatch, TargetRequest
from specforge_core.capture.packing import layout_for
from specforge_core.capture.target_info import text_config
from specforge_core.errors import CaptureError
from specforge_core.run.topology import Topology


@dataclass
class PackedCapture:
    """An engine's output for this rank's rows: token-packed, no padding."""

    aux: torch.Tensor  # [Σ lengths, K·Ht]
    last: torch.Tensor  # [Σ lengths, Ht]
    lengths: list[int]


class CaptureEngine(Protocol):
    """What the sglang backend needs from an engine (real SGLang or the fake)."""

    layer_ids: tuple[int, ...]
    tp_rank: int
    tp_size: int
    device: torch.device

    def capture(self, input_ids: Sequence[Sequence[int]], local: slice) -> PackedCapture: ...

    def shutdown(self) -> None: ...


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, *, where: str = "capture layer ids") -> None:
    """SGLang captures the input of layer ``id + 1`` (= the output of layer ``id``), in ascending layer
    order, duplicates merged; ``id + 1 == num_layers`` never fires and is dropped without a word.
    So: distinct ids in ``[0, num_layers - 2]``."""
    ids = list(layer_ids)
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers - 2:
        raise CaptureError(
            f"layer ids {ids} cannot be captured by SGLang for a {num_layers}-layer target: it captures layer "
            f"inputs, so ids must be distinct and in [0, {num_layers - 2}] (the last layer's output is the final "
            "hidden, never an aux state)",
            where=where,
            fix=f"choose capture layers below {num_layers - 1} (model.capture_layer_ids, draft.dflash.target_layer_ids)",
        )


def check_engine_request(input_ids: Sequence[Sequence[int]], *, context_len: int, max_rows: int, max_tokens: int,
                         where: str) -> None:
    """Refuse a TP-wide batch SGLang's pools cannot hold: SGLang itself checks rows and tokens only
    after allocating some, and never checks a row against the context (its write kernel would
    run past the request table)."""
    lengths = [len(r) for r in input_ids]
    if not lengths or min(lengths) < 1:
        raise CaptureError("an empty row in the capture request", where=where, fix="drop empty samples from the data")
    if max(lengths) > context_len:
        raise CaptureError(
            f"a row of {max(lengths)} tokens exceeds the engine's context of {context_len}", where=where,
            fix="raise capture.sglang.context_length to at least data.max_length (or remove it)",
        )
    if len(lengths) > max_rows:
        raise CaptureError(
            f"{len(lengths)} rows exceed the engine's {max_rows} request slots", where=where,
            fix=f"raise capture.sglang.max_running_requests to ≥ {len(lengths)} (or remove it), "
            "or capture.sglang.mem_fraction_static if SGLang shrank it",
        )
    if sum(lengths) > max_tokens:
        raise CaptureError(
            f"{sum(lengths)} tokens exceed the engine's KV pool of {max_tokens}", where=where,
            fix=f"raise capture.sglang.max_total_tokens to ≥ {sum(lengths)} (or remove it), "
            "or capture.sglang.mem_fraction_static if SGLang shrank it",
        )


def check_engine_pools(*, rows: int, tokens: int, need_rows: int, need_tokens: int, where: str) -> None:
    """Refuse an engine whose request slots (``rows``) or KV pool (``tokens``) cannot hold one TP-wide
    batch of ``need_rows`` rows / ``need_tokens`` tokens: SGLang only warns when memory makes it
    shrink them below ``max_running_requests`` / ``max_total_tokens``, and the first capture would
    then fail. The seam calls this with the pools SGLang sized; the dry run with the sizes SGLang's
    rule predicts."""
    if rows < need_rows or tokens < need_tokens:
        raise CaptureError(
            f"the engine's pools hold {rows} requests / {tokens} tokens; one TP-wide batch needs "
            f"{need_rows} / {need_tokens}",
            where=where,
            fix="raise capture.sglang.mem_fraction_static, or lower training.batch_size / data.max_length",
        )


def request_digest(input_ids: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, r)) for r in input_ids]).encode()).hexdigest()[:16]


def check_lockstep(group, input_ids: Sequence[Sequence[int]], *, where: str) -> None:
    """Every TP peer must capture the same TP-wide rows at the same time: compare a digest over the
    island's (CPU) process group. Peers that disagree fail here, naming each peer's digest,
    instead of hanging or computing garbage in the target's TP all-reduce."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return
    mine = request_digest(input_ids)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    if len(set(seen)) != 1:
        raise CaptureError(
            f"the island's TP peers were asked to capture different batches (digests {seen})", where=where,
            fix="every TP peer of an island must take the same TP-wide batch from the plan (a bug: report it)",
        )


class SGLangCaptureBackend:
    """A :class:`~specforge_core.capture.base.CaptureBackend` over an injected :class:`CaptureEngine`."""

    name = "sglang"

    def __init__(self, engine: CaptureEngine, target_config, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, *, keep_last_hidden: bool = True):
        self.engine = engine
        self.target_config = target_config
        self.layer_ids = tuple(engine.layer_ids)
        self.hidden_size: int = text_config(target_config).hidden_size
        self.device = engine.device
        self.keep_last_hidden = keep_last_hidden
        self._embed = embed_weight.requires_grad_(False)
        self._lm_head = lm_head_weight.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._embed

    @property
    def vocab_size(self) -> int:
        return self._lm_head.shape[0]

    def capture(self, request: TargetRequest) -> CapturedBatch:
        """One TP-wide engine capture; lay this rank's flat rows out as padded (or packed) copies."""
        packed = self.engine.capture(request.input_ids, request.local)
        want = request.local_lengths
        width = len(self.layer_ids) * self.hidden_size
        if (
            packed.lengths != want
            or packed.aux.shape != (sum(want), width)
            or packed.last.shape != (sum(want), self.hidden_size)
        ):
            raise CaptureError(
                f"the engine returned a partial capture: row lengths {packed.lengths}, aux "
                f"{tuple(packed.aux.shape)}, last {tuple(packed.last.shape)} for requested rows {want} "
                f"(aux width {width}, hidden {self.hidden_size})",
                where=f"sglang engine, tp_rank {self.engine.tp_rank}",
                fix="check the engine log for dropped or truncated requests (context_length, max_total_tokens)",
            )
        # Packed or not, the layout gathers the flat rows into fresh tensors, so the engine's
        # TP-wide buffer is released when this returns.
        return layout_for(request).captured_batch([packed.aux], packed.last if self.keep_last_hidden else None,
                                                  request)

    def close(self) -> None:
        self.engine.shutdown()

@dataclass(frozen=True)
class SGLangEngineArgs:
    """Ordered ``(ServerArgs field, value)`` pairs; build with :meth:`resolve`."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def resolve(cls, cfg, topology: Topology) -> "SGLangEngineArgs":
        """The engine arguments of a validated :class:`~specforge_core.config.RunConfig` for one
        island of the run's ``topology``."""
        s, t = cfg.capture.sglang, cfg.training
        island_batch = topology.island_batch_size
        resolved: dict[str, Any] = {
            "model_path": cfg.model.target,
            # SGLang runs on GPUs only, where the run's "auto" means bfloat16.
            "dtype": "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype,
            "trust_remote_code": cfg.model.trust_remote_code,
            "skip_tokenizer_init": True,
            "tp_size": topology.tp_size,
            "pp_size": 1,
            "dp_size": s.dp_size,
            "ep_size": s.ep_size,
            "mem_fraction_static": s.mem_fraction_static,
            "attention_backend": s.attention_backend,
            "context_length": s.context_length or cfg.data.max_length,
            "max_running_requests": s.max_running_requests or island_batch,
            "max_total_tokens": s.max_total_tokens or island_batch * cfg.data.max_length,
            "chunked_prefill_size": -1,
            "disable_cuda_graph": True,
            "page_size": 1,  # one KV slot per token: what the capture's allocation assumes
            "sampling_backend": "pytorch",  # nothing is sampled; avoids loading flashinfer's sampler
            "disable_radix_cache": s.disable_radix_cache,
            "enable_return_hidden_states": True,
            "random_seed": t.seed,
        }
        resolved.update(s.extra)
        return cls(tuple(resolved.items()))

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.items).get(name, default)

    def kwargs(self) -> dict[str, Any]:
        """In-process view: keyword arguments of ``sglang.srt.server_args.ServerArgs``."""
        return {k: v for k, v in self.items if v is not None}

    def argv(self) -> list[str]:
        """CLI view: arguments of ``python -m sglang.launch_server`` (same values as kwargs)."""
        out: list[str] = []
        for name, value in self.items:
            flag = "--" + name.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(str, value)]
            elif isinstance(value, dict):
                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out
