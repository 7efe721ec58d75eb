"""The ``sglang`` capture backend: an in-process SGLang engine per rank, one TP group per island.

    engine = ModelRunnerEngine.start(args, layer_ids, tp_rank=..., gpu_id=...)   # GPU nodes
    engine = FakeSGLangEngine(model_dir, layer_ids, tp_rank=..., tp_size=...)    # CPU tests
    backend = SGLangCaptureBackend(engine, target_config, embed, lm_head)

This module holds no SGLang code. It speaks to an engine through :class:`CaptureEngine`, the
contract that the real engine (``sglang_engine.py``, the one version-pinned SGLang seam) and the
fake (``fake_engine.py``) both honour:

- ``capture(input_ids, local)`` is called by every TP peer of an island with the same TP-wide
  rows (it is a collective over the island's TP group);
- it returns a :class:`PackedCapture` of the rows in ``local`` only, packed without padding
  (``aux [Σℓ, 3·Ht]``, ``last [Σℓ, Ht]``, ``lengths``), in the row order of ``local``;
- the tensors may be views into the engine's TP-wide output buffer: this backend copies them
  into a padded (or, with ``request.token_budget``, packed) :class:`CapturedBatch`, so that buffer
  is released when ``capture`` returns.

The head weights come from the checkpoint (``target.load_target_head``), not from the engine,
whose LM head is sharded across the TP group.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specforge_core.capture.base import CapturedBatch, TargetRequest
from specforge_core.capture.packing import layout_for
from specforge_core.capture.target_info import text_config
from specforge_core.errors import CaptureError


@dataclass
class PackedCapture:
    """An engine's output for this rank's rows: token-packed, no padding."""

    aux: torch.Tensor  # [Σ lengths, 3·Ht]
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

