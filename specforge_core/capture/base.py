"""What every capture backend takes and returns: one TP-wide request in, this rank's batch out.

A :class:`TargetRequest` is one island's TP-wide batch (``tp_size × batch_size`` token rows) plus
the row range this rank keeps. A backend runs the target over the whole request — every TP peer
takes part in the same forward — and returns a :class:`CapturedBatch` holding **only** this rank's
rows, in freshly allocated tensors: nothing it returns is a view of the TP-wide capture, so that
allocation is freed as soon as the backend returns.

The captured batch, on the backend's device (``B`` local rows right-padded to ``T``, the longest
local row):

| field | shape, dtype | meaning |
|---|---|---|
| ``input_ids`` | ``[B,T]`` long | token ids (pad = 0) |
| ``attention_mask`` | ``[B,T]`` long | 1 = real token |
| ``loss_mask`` | ``[B,T]`` long | 1 = supervised (assistant) token |
| ``aux_hidden`` | ``[B,T,K·Ht]`` target dtype | the K capture layers' outputs, concatenated in the family's order |
| ``last_hidden`` | ``[B,T,Ht]`` target dtype, or None | post-final-norm target hidden (EAGLE3's teacher input); None for a family that needs none (DFlash) |
| ``position_ids``, ``seq_ids`` | ``[B,T]`` long or None | packed rows only: position within the sample, sample index (-1 = pad) |

With ``request.token_budget`` set, ``B`` counts packed rows, each holding several of this rank's
samples back to back (``capture/packing.py``); otherwise one sample per row. Hidden states at
padded positions are zero. Tensors are ordinary (not inference-mode) tensors,
so the draft's autograd can save them.

``host_masks`` (:class:`HostMasks`, or None) holds the same masks as the host laid them out, on the
CPU: a step that plans on the host (EAGLE3's unroll) reads them there instead of copying the
device's back, which would make the host wait for every kernel queued before it. The capture's
own copies to the device go through pinned memory without blocking (:func:`to_device`), so the
host can launch the next capture while the device still runs the previous step.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch

from specforge_core.errors import ModelError


@dataclass(frozen=True)
class TargetRequest:
    """One island's TP-wide target batch, and the rows of it this rank keeps."""

    input_ids: tuple[tuple[int, ...], ...]
    loss_mask: tuple[tuple[int, ...], ...]
    local: slice
    task_ids: tuple[str, ...] = ()
    token_budget: int | None = None  # pack the local samples into rows of at most this many tokens

    @classmethod
    def from_rows(
        cls, input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]], local: slice,
        task_ids: Sequence[str] = (), token_budget: int | None = None,
    ) -> "TargetRequest":
        return cls(
            tuple(tuple(r) for r in input_ids), tuple(tuple(r) for r in loss_mask), local, tuple(task_ids), token_budget
        )

    @property
    def num_samples(self) -> int:
        """Samples in the batch: one per task id (packed rows hold several); rows without task ids."""
        return len(self.task_ids) if self.task_ids else len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        """Real tokens in the whole TP-wide batch (what the target computes)."""
        return sum(len(r) for r in self.input_ids)

    @property
    def local_lengths(self) -> list[int]:
        return [len(r) for r in self.input_ids[self.local]]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """The CPU tensor ``t`` on ``device``. To CUDA through pinned memory and without blocking: a copy
    from pageable memory synchronises the stream, so the host would wait for every kernel queued
    before it (the pinned buffer is kept until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class HostMasks:
    """A captured batch's masks on the CPU, as the capture laid them out (``[B,T]`` each, the device
    fields' values): ``attention_mask`` and ``loss_mask`` long, ``seq_ids`` long or None (unpacked)."""

    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor | None = None


def host_masks_of(batch, b: int, t: int) -> HostMasks | None:
    """``batch``'s host masks (a mapping's or an object's ``host_masks``; None where it has none),
    checked to be on the CPU and of the batch's ``[b, t]``: a ModelError names the field if not."""
    host = batch.get("host_masks") if isinstance(batch, dict) else getattr(batch, "host_masks", None)
    if host is None:
        return None
    for name in ("attention_mask", "loss_mask", "seq_ids"):
        value = getattr(host, name)
        if value is not None and (value.device.type != "cpu" or tuple(value.shape) != (b, t)):
            raise ModelError(
                f"host_masks.{name} is {tuple(value.shape)} on {value.device}, expected {(b, t)} on the CPU",
                where=f"captured batch: host_masks.{name}",
                fix="give the host masks as the capture laid them out (CPU, the batch's [B,T]), or none",
            )
    return host


@dataclass
class CapturedBatch:
    """This rank's slice of one captured target batch (see the module docstring for shapes)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None
    task_ids: tuple[str, ...] = ()
    host_masks: HostMasks | None = None
    # The family's teacher, where the capture made it with the target's head (EAGLE3: a
    # drafts.eagle3.teacher.Teacher of every flattened position); the objective makes it otherwise.
    teacher: object | None = None

    @property
    def batch_size(self) -> int:
        """Rows (packed rows count once however many samples they hold: see ``num_samples``)."""
        return self.input_ids.shape[0]

    @property
    def num_samples(self) -> int:
        """Samples in the batch: one per task id (packed rows hold several); rows without task ids."""
        return len(self.task_ids) if self.task_ids else self.batch_size

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in this batch (from the host's masks where the batch has them)."""
        mask = self.attention_mask if self.host_masks is None else self.host_masks.attention_mask
        return int(mask.sum())

    def feature_bytes(self) -> int:
        """Bytes held by every tensor of the batch (what staging it costs)."""
        total = 0
        for f in fields(self):
            value = getattr(self, f.name)
            held = vars(value).values() if f.name == "teacher" and value is not None else (value,)  # its tensors
            total += sum(x.numel() * x.element_size() for x in held if isinstance(x, torch.Tensor))
        return total


@runtime_checkable
class CaptureBackend(Protocol):
    """A target model that captures hidden states on demand. Implemented by ``hf`` and ``sglang``.

    Attributes every backend exposes: ``name``, ``layer_ids`` (the three capture ids, output-of-
    layer convention; three for EAGLE3, K for DFlash), ``target_config`` (the HF config), ``hidden_size`` (Ht), ``vocab_size`` (V),
    ``device``, ``lm_head_weight`` (``[V,Ht]``, frozen; the embedding when tied) and
    ``embed_weight`` (``[V,Ht]``, the target's input embedding the draft copies).
    """

    name: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    device: torch.device

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    @property
    def embed_weight(self) -> torch.Tensor: ...

    def capture(self, request: TargetRequest) -> CapturedBatch:
        """Capture the TP-wide ``request`` and return this rank's rows (``request.local``)."""
        ...

    def close(self) -> None:
        """Release the target (hooks, engine, memory)."""
        ...


def pad_right(rows: Sequence[Sequence[int]], device: torch.device, width: int | None = None) -> torch.Tensor:
    """``[len(rows), width]`` long tensor of the rows right-padded with 0 (width: longest row)."""
    width = max(len(r) for r in rows) if width is None else width
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return to_device(out, device)


def attention_mask_for(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    return to_device((torch.arange(width).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)).long(), device)


def local_inputs(request: TargetRequest, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HostMasks]:
    """``input_ids``, ``attention_mask``, ``loss_mask`` of this rank's rows, padded to their longest,
    on ``device``, and the two masks on the host."""
    rows, masks = request.input_ids[request.local], request.loss_mask[request.local]
    width = max(len(r) for r in rows)
    host = HostMasks(attention_mask_for([len(r) for r in rows], width, "cpu"), pad_right(masks, "cpu", width))
    return pad_right(rows, device, width), to_device(host.attention_mask, device), to_device(host.loss_mask, device), host
