"""Token-budget packing of a captured batch: the samples of one micro-step laid out in few rows.

    layout = RowLayout.packed_rows(lengths, token_budget=16384)    # or RowLayout.unpacked(lengths)
    batch = layout.captured_batch([aux_flat], last_flat, request)

The plan stays sample-based: a micro-step trains exactly the ``training.batch_size`` samples the
plan gives this rank. ``training.token_budget`` only changes how those samples are laid out for the
draft: back to back in rows of at most ``token_budget`` tokens, right-padded to the longest row.
With ``token_budget ≥ batch_size × data.max_length`` every micro-step is one row with no padding;
a smaller budget caps the row length at the price of some padding between rows.

A packed row carries ``position_ids`` (restarting at 0 for every sample) and ``seq_ids`` (the
sample's index among this rank's samples, ``-1`` on padding), from which the objective keeps
attention, targets and the unroll inside each sample. The target itself never sees rows: the
``hf`` backend runs the request as one flat token stream with per-sample causal attention
(``capture/hf.py``), the ``sglang`` engine returns flat per-sample outputs, and this module gathers
the flat outputs into rows. So every sample's captured states are those of the sample run alone.

Rows are balanced: as few rows as fit the budget, each sample (longest first) going to the row
with the fewest tokens that still has room. That keeps the rows nearly equal, so padding to
the longest row wastes little. The layout is a pure function of the lengths and the budget.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specforge_core.capture.base import CapturedBatch, HostMasks, TargetRequest, to_device
from specforge_core.errors import ConfigError


def balanced_rows(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Sample indices of each row: few rows of ≤ ``token_budget`` tokens, nearly equal.

    Starting from the lower bound ⌈Σℓ / budget⌉ rows, each sample (longest first) goes to the
    least-loaded row with room; if one finds no room, try again with one row more. Within a row
    the samples keep their order. Raises ConfigError when one sample alone is longer than the
    budget.
    """
    longest = max(lengths)
    if longest > token_budget:
        raise ConfigError(
            f"a sample of {longest} tokens does not fit training.token_budget={token_budget}",
            where="training.token_budget",
            fix="set training.token_budget ≥ data.max_length",
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows_needed = -(-sum(lengths) // token_budget)
    while True:
        rows: list[list[int]] = [[] for _ in range(rows_needed)]
        load = [0] * rows_needed
        for i in order:
            room = [j for j in range(rows_needed) if load[j] + lengths[i] <= token_budget]
            if not room:
                break
            r = min(room, key=lambda j: (load[j], j))
            rows[r].append(i)
            load[r] += lengths[i]
        else:
            return [sorted(row) for row in rows]
        rows_needed += 1


@dataclass(frozen=True)
class RowLayout:
    """Where each of this rank's samples sits: ``rows[r]`` lists sample indices, back to back.

    ``packed`` is False for the plain layout (one sample per row, no position/seq ids).
    """

    lengths: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    packed: bool

    @classmethod
    def packed_rows(cls, lengths: Sequence[int], token_budget: int) -> "RowLayout":
        rows = balanced_rows(lengths, token_budget)
        return cls(tuple(lengths), tuple(tuple(r) for r in rows), True)

    @classmethod
    def unpacked(cls, lengths: Sequence[int]) -> "RowLayout":
        return cls(tuple(lengths), tuple((i,) for i in range(len(lengths))), False)

    @property
    def width(self) -> int:
        """Row length: the longest row's tokens."""
        return max(sum(self.lengths[i] for i in row) for row in self.rows)

    @property
    def padding_fraction(self) -> float:
        """Share of the ``rows × width`` slots that hold no token."""
        return 1 - sum(self.lengths) / (len(self.rows) * self.width)

    def _row_tensor(self, values: Sequence[Sequence[int]], fill: int) -> torch.Tensor:
        """``[rows, width]`` long CPU tensor of per-sample ``values`` laid out by rows."""
        out = torch.full((len(self.rows), self.width), fill, dtype=torch.long)
        for r, row in enumerate(self.rows):
            if row:
                out[r, : sum(self.lengths[i] for i in row)] = torch.cat(
                    [torch.as_tensor(values[i], dtype=torch.long) for i in row]
                )
        return out

    def flat_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, real)`` ``[rows, width]`` long CPU tensors: each slot's position in the flat
        stream of the samples (sample 0's tokens, then sample 1's, ...; 0 if the slot holds none),
        and whether it holds a token (1/0: the rows' attention mask)."""
        starts = [0]
        for n in self.lengths[:-1]:
            starts.append(starts[-1] + n)
        flat = [range(s, s + n) for s, n in zip(starts, self.lengths)]
        return self._row_tensor(flat, 0), self._row_tensor([[1] * n for n in self.lengths], 0)

    def gather(self, parts: Sequence[torch.Tensor], index: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Flat states ``[Σℓ, H_i]`` (joined along the last dim) → fresh ``[rows, width, ΣH_i]``,
        zero where no token."""
        flat_index = index.flatten()
        out = torch.empty(index.numel(), sum(p.shape[-1] for p in parts), dtype=parts[0].dtype, device=parts[0].device)
        offset = 0
        for part in parts:
            out[:, offset : offset + part.shape[-1]] = part.index_select(0, flat_index)
            offset += part.shape[-1]
        return out.view(*index.shape, -1).masked_fill_(~real.unsqueeze(-1), 0)

    def captured_batch(
        self, aux_parts: Sequence[torch.Tensor], last_flat: torch.Tensor | None, request: TargetRequest
    ) -> CapturedBatch:
        """This rank's samples (``request.local``) in this layout, from their flat capture outputs.

        ``aux_parts`` (the capture layers' ``[Σℓ, Ht]`` outputs, low→high, or one ``[Σℓ, 3·Ht]``)
        and ``last_flat [Σℓ, Ht]`` (None: not kept) hold the local samples back to back, in order;
        the result owns fresh tensors (the flat buffers may be freed).
        """
        ids, masks = request.input_ids[request.local], request.loss_mask[request.local]
        device = aux_parts[0].device
        index, attention = self.flat_index()
        seq = self._row_tensor([[i] * n for i, n in enumerate(self.lengths)], -1) if self.packed else None
        host = HostMasks(attention, self._row_tensor(masks, 0), seq)
        index, attention = to_device(index, device), to_device(attention, device)
        real = attention.bool()
        batch = CapturedBatch(
            input_ids=to_device(self._row_tensor(ids, 0), device),
            attention_mask=attention,
            loss_mask=to_device(host.loss_mask, device),
            aux_hidden=self.gather(aux_parts, index, real),
            last_hidden=None if last_flat is None else self.gather([last_flat], index, real),
            task_ids=request.task_ids[request.local],
            host_masks=host,
        )
        if self.packed:
            batch.position_ids = to_device(self._row_tensor([range(n) for n in self.lengths], 0), device)
            batch.seq_ids = to_device(seq, device)
        return batch


def layout_for(request: TargetRequest) -> RowLayout:
    """The layout of this rank's samples under the request's token budget (None: one per row)."""
    lengths = request.local_lengths
    if request.token_budget is None:
        return RowLayout.unpacked(lengths)
    return RowLayout.packed_rows(lengths, request.token_budget)
