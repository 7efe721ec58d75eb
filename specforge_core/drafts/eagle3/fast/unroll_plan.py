"""Which rows each unrolled EAGLE3 step computes, worked out on the host once per batch.

    plan = UnrollPlan.build(attention_mask, loss_mask, seq_ids, ttt_length, device=ids.device, host=host_masks)
    plan.rows[k], plan.carry[k], plan.here[k], plan.label, plan.placed, ...

The objective's unroll is the plain one over every ``[B, T]`` position, restricted to the rows
that reach a term (``objective.ttt_unroll``'s doc); this plan lists those rows and where their
terms go. Every index equals its definition below (tests/drafts/eagle3/test_unroll_plan.py); the
unroll on them equals the float64 reference (tests/drafts/eagle3/test_reference.py).
"""

from dataclasses import dataclass

import numpy as np
import torch

from specforge_core.drafts.eagle3.flash import SampleSpans
from specforge_core.drafts.eagle3.rows import take_parts, take_rows


@dataclass
class UnrollPlan:
    """Which rows each unrolled step computes and where its terms go, for one batch (all index
    tensors on the batch's device, long, ascending where they are rows):

    - ``valid`` ``[K, B, T]`` bool: position t has a step-k target (``objective``'s doc:
      ``lm[t+k]``, tokens t and t+k+1 real and in the same sample);
    - ``real``: the flattened real tokens (step 0's inputs: every one is a key);
    - ``rows[k]``: the positions whose step-k output is computed (:func:`_unroll_rows`), or None;
    - ``queries0``: ``rows[0]``'s indices among ``real``; ``carry[k]`` (k ≥ 1): ``rows[k]``'s
      indices among ``rows[k-1]`` (where the carried hidden comes from);
    - ``here[k]``: the indices among ``rows[k]`` with a step-k target (the scored rows);
    - ``carry_slot[k]`` (k ≥ 1) and ``here_slot[k]``: per row of ``rows[k-1]`` its index in
      ``carry[k]``, per row of ``rows[k]`` its index in ``here[k]``, or -1 (the slot maps of
      ``rows.take_parts``: each of step k's rows is carried to step k+1, scored at step k, or both);
    - ``label``: the teacher row of every scored row, step after step (index t+k: the
      distribution at t+k+1), and ``placed`` its position in ``[K, B, T]`` flattened (k·B·T plus
      the row's flattened position): the terms of all steps are computed at once on these rows;
    - ``teacher_index``: the flattened indices i some step reads (the teacher at position i+1);
    - ``same[k]`` (k ≥ 1): for each step j = 1..k, ``rows[k]``'s indices among ``rows[j]`` (where
      the keys step j made at the queries' own positions are; ``[]`` at step 0);
    - ``spans`` (host ints): each sample's first index among ``real`` (a sample is a run of real
      tokens of one row and seq id), then ``real``'s size: the attention's variable-length layout;
    - ``token_index``: the tokens some step embeds, as indices into the flattened ids followed by
      one 0 per row (step k's inputs at position t embed ``ids[t+1+k]``, or their row's 0 past
      its end); ``token_rows[k]``: each of step k's inputs' index among them, without repeats
      (only step 0 reads past a row's end, at its last position), and ``token_slot[k]`` its slot
      map (per token, its index in ``token_rows[k]`` or -1: ``rows.take_parts`` of all steps).

    Built on the host and sent to the device in one copy: the sizes are data-dependent, and
    working them out on the device would make the host wait for it at every step. Its input is
    the batch's host masks where the capture kept them (``host``: CPU ``attention_mask``,
    ``loss_mask`` and ``seq_ids``, as ``capture.base.HostMasks`` holds them), so the host need not
    wait at all and can build the plan while the device still runs the previous step; otherwise
    one device-to-host copy of the three masks (which waits for the device).
    """

    valid: torch.Tensor
    real: torch.Tensor
    rows: list
    queries0: torch.Tensor
    carry: list
    here: list
    carry_slot: list
    here_slot: list
    label: torch.Tensor
    placed: torch.Tensor
    teacher_index: torch.Tensor
    same: list
    spans: list
    token_index: torch.Tensor
    token_rows: list
    token_slot: list

    @classmethod
    def build(cls, attn, lm, seq, ttt_length: int, *, device, host=None) -> "UnrollPlan":
        b, t = attn.shape
        if host is None:
            host = torch.stack([attn.long(), lm.long(), seq.long()]).cpu().numpy()
        else:
            seq_h = torch.zeros(b, t, dtype=torch.long) if host.seq_ids is None else host.seq_ids.long()
            host = torch.stack([host.attention_mask.long(), host.loss_mask.long(), seq_h]).numpy()
        # numpy: a few hundred index operations on arrays of B·T elements; as torch CPU ops their
        # dispatch alone would keep the device idle for much of the step
        valid = _valid_masks(host[0] != 0, host[1] != 0, host[2], ttt_length)
        indices = _host_indices(valid, host[0], ttt_length, b, t)
        spans = SampleSpans.of_rows(indices["real"], host[2].reshape(-1)[indices["real"]], t).bounds
        return cls(valid=_to_device(torch.from_numpy(np.stack(valid)), device), spans=spans,
                   **_one_copy(indices, device))

    def tokens_by_step(self, tokens, *, compile: bool = True) -> dict:
        """Each running step's tokens (step → ``ProjectedTokens``) from ``tokens``, the projection
        of the ids ``token_index`` names, taken at once (``ProjectedTokens.for_steps``; ``compile``:
        ``training.compile``, for its gradient's gather)."""
        runs = [k for k, rows in enumerate(self.rows) if rows is not None]
        return dict(zip(runs, tokens.for_steps([self.token_rows[k] for k in runs], [self.token_slot[k] for k in runs],
                                               compile=compile)))

    def carried_and_scored(self, hidden: torch.Tensor, k: int, *, compile: bool = True) -> tuple:
        """Step k's outputs ``hidden [1, rows[k], H]`` split into the rows step k+1 carries on
        (None where step k+1 does not run) and the rows scored at step k: ``index_select``s
        whose gradients are gathered back (``rows.take_parts``, compiled as ``compile`` says)."""
        if k + 1 < len(self.rows) and self.rows[k + 1] is not None:
            return take_parts(hidden, 1, [self.carry[k + 1], self.here[k]], [self.carry_slot[k + 1], self.here_slot[k]],
                              compile=compile)
        if self.here[k].numel() == hidden.shape[1]:  # every row has a step-k target (the last step's)
            return None, hidden
        return None, take_rows(hidden, 1, self.here[k])

    def place(self, values: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """``[K, B, T]`` zeros with the scored rows' ``values`` (``label``'s order) at their positions."""
        k = len(self.rows)
        return values.new_zeros(k * b * t).index_copy(0, self.placed, values).view(k, b, t)


def _host_indices(valid: list, attn: np.ndarray, ttt_length: int, b: int, t: int) -> dict:
    """Every index field of :class:`UnrollPlan` (its doc), as host arrays by name."""
    rows = _unroll_rows(valid)
    flat_valid = [v.reshape(-1) for v in valid]
    read = np.zeros(b * t, dtype=bool)
    for k, v in enumerate(flat_valid):
        read[np.flatnonzero(v) + k] = True
    teacher_index = np.flatnonzero(read)
    teacher_slot = _host_slots(teacher_index, b * t)
    real = np.flatnonzero(attn)
    carry, here, label, placed = [None] * ttt_length, [None] * ttt_length, [], []
    carry_slot, here_slot = [None] * ttt_length, [None] * ttt_length
    slots = [None if r is None else _host_slots(r, b * t) for r in rows]
    token_index, token_rows = _token_rows([real if k == 0 else r for k, r in enumerate(rows)], t, b * t)
    token_slot = [None if r is None else _host_slots(r, token_index.size) for r in token_rows]
    same = [[] for _ in range(ttt_length)]
    for k in range(ttt_length):
        if rows[k] is None:
            continue
        if k:
            carry[k] = slots[k - 1][rows[k]]
            carry_slot[k] = _host_slots(carry[k], rows[k - 1].size)
            same[k] = [slots[j][rows[k]] for j in range(1, k + 1)]
        here[k] = np.flatnonzero(flat_valid[k][rows[k]])
        here_slot[k] = _host_slots(here[k], rows[k].size)
        scored = rows[k][here[k]]
        placed.append(scored + k * b * t)
        label.append(teacher_slot[scored + k])
    return dict(real=real, rows=rows, queries0=np.searchsorted(real, rows[0]), carry=carry, here=here,
                carry_slot=carry_slot, here_slot=here_slot, label=np.concatenate(label),
                placed=np.concatenate(placed), teacher_index=teacher_index, same=same,
                token_index=token_index, token_rows=token_rows, token_slot=token_slot)


def _one_copy(fields: dict, device) -> dict:
    """``fields`` (name → an array, or lists of arrays and Nones, nested) with every array a
    long tensor on ``device``: views of one host-to-device copy of them all."""
    arrays = []

    def collect(value):
        if isinstance(value, list):
            for item in value:
                collect(item)
        elif value is not None:
            arrays.append(value)

    collect(list(fields.values()))
    packed = _to_device(torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)), device)
    views = iter(packed.split([a.size for a in arrays]))

    def rebuild(value):
        if isinstance(value, list):
            return [rebuild(item) for item in value]
        return None if value is None else next(views)

    return {name: rebuild(value) for name, value in fields.items()}


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _token_rows(inputs: list, t: int, size: int) -> tuple[np.ndarray, list]:
    """The tokens the steps embed (``UnrollPlan.token_index``) and each step's index among them
    (``token_rows``; None where the step does not run), from each step's flattened input rows:
    step k at position p embeds the id at p+1+k, or its row's pad at ``size + p // t`` past the
    row's end (a pad per row keeps each step's indices distinct)."""
    reads = [None if x is None else np.where(x % t + 1 + k < t, x + 1 + k, size + x // t)
             for k, x in enumerate(inputs)]
    read = np.zeros(size + size // t, dtype=bool)  # a mask, not np.unique: one pass, no sort
    for r in reads:
        if r is not None:
            read[r] = True
    index = np.flatnonzero(read)
    slot = _host_slots(index, read.size)
    return index, [None if r is None else slot[r] for r in reads]


def _host_slots(rows: np.ndarray, size: int) -> np.ndarray:
    """``[size]``: the index of each flattened position among ``rows`` (-1 if absent)."""
    slot = np.full(size, -1, dtype=np.int64)
    slot[rows] = np.arange(rows.size)
    return slot


def _valid_masks(attn: np.ndarray, lm: np.ndarray, seq: np.ndarray, ttt_length: int) -> list[np.ndarray]:
    """``valid[k] [B,T]`` (host, bool): position t has a step-k target: ``lm[t+k]``, tokens t and
    t+k+1 real and in the same sample."""
    b, t = attn.shape
    out = []
    for k in range(ttt_length):
        n = max(t - 1 - k, 0)
        v = np.zeros((b, t), dtype=bool)
        v[:, :n] = lm[:, k : k + n] & attn[:, :n] & attn[:, k + 1 : k + 1 + n] & (seq[:, :n] == seq[:, k + 1 : k + 1 + n])
        out.append(v)
    return out


def _unroll_rows(valid: list[np.ndarray]) -> list[np.ndarray | None]:
    """Flattened positions whose step-k output is computed, ascending; None where nothing is left.

    Step k needs position t iff some step j ≥ k has a target there (its hidden is carried along
    the same position), so each step's rows are a subset of the previous step's. (Step 0 also
    makes keys on every real token: they are the keys of their sample's later positions.)
    """
    needed = np.zeros_like(valid[0])
    rows: list[np.ndarray | None] = [None] * len(valid)
    for k in range(len(valid) - 1, -1, -1):
        needed = needed | valid[k]
        rows[k] = np.flatnonzero(needed)
    # Trailing steps without targets are skipped; step 0 always runs (the loss keeps its graph).
    for k in range(len(valid) - 1, 0, -1):
        if rows[k].size:
            break
        rows[k] = None
    return rows
