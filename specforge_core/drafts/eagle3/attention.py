"""Attention across the unrolled training-time-test steps (SpecForge's TTT mask, without a dense mask).

A query of step k at position t attends to
  - the step-0 keys at positions s ≤ t of the same sample that are real tokens (``s == t`` always,
    so no row is empty), and
  - the keys produced at steps 1..k at the same position t (including its own step),
with one softmax over all of them. We never build the dense ``[T, T·(k+1)]`` mask of the
concatenated key sequence: the step-0 block gives an output and its log-sum-exp, and the k
same-position scores are merged with it exactly (softmax over a union = LSE-weighted mix).

The unroll computes each step on *rows*: flattened positions ``b·T + t`` of the ``[B, T]`` batch,
ascending. Step 0's rows are the real tokens (every one is a key); step k's rows are a subset of
step k-1's, and the queries of step 0 may be a subset of its keys' rows.
``TTTAttention(attention_mask, seq_ids, backend)(q, q_rows, keys, values, key_rows)`` takes the
queries of the current step and the keys/values of steps 0..k on their rows, rows first
(``[1, rows, heads, hd]``: the layout of the projection and of FlashAttention, so no step
transposes them, nor their gradients).

Three backends, same numbers:

- ``sdpa`` (CPU and GPU): explicit fp32 scores of each sample's queries against that sample's
  step-0 keys only (a loop over samples: no padding, no cross-sample blocks), their log-sum-exp,
  then the merge. Memory grows with the longest sample squared; the reference path.
- ``flex`` (GPU): the rows are laid out on the padded ``[B, T]`` grid and
  ``torch.nn.attention.flex_attention`` (compiled) runs over the step-0 block with a block mask,
  returning its log-sum-exp; then the same merge. No T² tensors.
- ``flash`` (GPU in fp16/bf16; CPU): the step-0 block as variable-length causal attention over the
  real rows on FlashAttention kernels, whose backward is handed the merged output so that the
  gradient through the log-sum-exp comes for free (``flash.py``); then the same merge.

On CPU, flex runs eagerly and only without gradients (torch has no CPU flex backward). ``auto``
picks flash on CUDA (flex where the dtype is fp32: FlashAttention has no fp32 kernel) and sdpa
elsewhere.
"""

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from specforge_core.drafts.eagle3.flash import MergedOutput, SampleSpans, step_zero_flash
from specforge_core.drafts.eagle3.rows import take_rows
from specforge_core.errors import ConfigError
from specforge_core.system.compile import build_block_mask, fused

BACKENDS = ("auto", "sdpa", "flex", "flash")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
_compiled_flex = None


def flash_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashAttention's CUDA kernels take queries of this dtype and head size."""
    return dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None,
                    head_dim: int | None = None) -> str:
    """``auto`` → ``flash`` on CUDA (``flex`` where the queries' ``dtype`` / ``head_dim``, when
    given, are ones FlashAttention has no kernel for: fp32), ``sdpa`` elsewhere; other names are
    checked and returned."""
    if backend not in BACKENDS:
        raise ConfigError(
            f"unknown attention backend {backend!r}",
            where="draft.attention_backend",
            fix=f"use one of {', '.join(BACKENDS)}",
        )
    if backend == "auto":
        if torch.device(device).type != "cuda":
            return "sdpa"
        if dtype is not None and not flash_supports(dtype, head_dim if head_dim is not None else 128):
            return "flex"
        return "flash"
    return backend


def step_zero_visibility(attention_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T, T]``: query t may see step-0 key s (causal, same sample, real token or itself).

    This is also the block-causal mask a target forward over packed rows needs.
    """
    t = attention_mask.shape[-1]
    idx = torch.arange(t, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    real = attention_mask.bool()[:, None, :] | torch.eye(t, dtype=torch.bool, device=idx.device)
    return causal & same & real


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


class TTTAttention:
    """The attention of one batch's unroll: built once (masks, sample spans), called once per step.

    ``attention_mask [B,T]`` (1 = real token) and ``seq_ids [B,T]`` (sample index of each
    position in a packed row; one value per unpacked row) fix the step-0 pattern. Step 0's rows
    must be exactly the real tokens ``nonzero(attention_mask.flatten())``: give them as ``real_rows``
    where the caller has them (the unroll's plan does), so the device need not report them, and
    likewise the samples as runs of those rows (``spans``: each one's first index among them, then
    their count, as ``UnrollPlan.spans`` has them). ``backend="auto"`` settles on flash or flex at the first
    call, from the queries' dtype.
    """

    def __init__(self, attention_mask: torch.Tensor, seq_ids: torch.Tensor, backend: str = "auto", *,
                 real_rows: torch.Tensor | None = None, spans: list[int] | None = None, compile: bool = True):
        self.requested, self.compile = backend, compile
        self.backend = None if backend == "auto" and attention_mask.is_cuda else resolve_backend(backend, attention_mask.device)
        b, t = attention_mask.shape
        self.shape = (b, t)
        self.masks = (attention_mask.bool(), seq_ids)
        flat = torch.nonzero(self.masks[0].flatten()).flatten() if real_rows is None else real_rows
        self.real_rows = flat
        self.slot0 = _slots(flat, b * t)
        self._spans = None if spans is None else SampleSpans(spans)
        self._grid0 = None  # (step-0 keys, values, their grids): built at the first flex call
        self._block_mask = None

    @property
    def spans(self) -> SampleSpans:
        """The samples as runs of the real rows (see the class doc); worked out from a host copy
        of the masks (the host waits for the device) where the caller gave none."""
        if self._spans is None:
            real = self.real_rows.cpu().numpy()
            self._spans = SampleSpans.of_rows(real, self.masks[1].flatten().cpu().numpy()[real], self.shape[1])
        return self._spans

    @property
    def block_mask(self):
        """flex's block mask of the step-0 pattern (built at first use)."""
        if self._block_mask is None:
            (b, t), (real, seq) = self.shape, self.masks

            def mask_mod(bi, hi, qi, ki):
                return (ki <= qi) & (seq[bi, ki] == seq[bi, qi]) & (real[bi, ki] | (ki == qi))

            # compiled on CUDA: eagerly its mask_mod runs as dozens of small launches over [B, T, T]
            self._block_mask = build_block_mask(mask_mod, compiled=real.is_cuda, B=b, H=None, Q_LEN=t, KV_LEN=t,
                                                device=real.device)
        return self._block_mask

    def __call__(
        self,
        q: torch.Tensor,
        q_rows: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        key_rows: list[torch.Tensor],
        same_at: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``q [1,n,nh,hd]``: the current step's queries on ``q_rows``; ``keys``/``values``: steps
        0..k, ``[1,n_j,nkv,hd]`` on ``key_rows[j]`` (step 0's: the real tokens; step j's must hold
        ``q_rows``). ``same_at`` (optional, steps 1..k): the queries' indices among
        ``key_rows[j]``, where the caller has them (the unroll's plan does); worked out here
        otherwise. Returns the output ``[1,n,nh,hd]`` in ``q``'s dtype."""
        nh, hd = q.shape[2], q.shape[3]
        scale = hd**-0.5
        if self.backend is None:
            self.backend = resolve_backend(self.requested, q.device, q.dtype, hd)
        merged = None
        if self.backend == "sdpa":
            out0, lse0 = self._step_zero_sdpa(q, keys[0], values[0], q_rows, scale)
        elif self.backend == "flex":
            out0, lse0 = self._step_zero_flex(q, keys[0], values[0], q_rows, scale)
        else:
            out0, lse0, merged, at = self._step_zero_flash(q, keys[0], values[0], q_rows, scale, len(keys) > 1)
        if len(keys) == 1:
            return out0.to(q.dtype).view(1, -1, nh, hd)
        # Steps 1..k: the key/value each step made at the query's own position.
        b, t = self.shape
        here = same_at if same_at is not None else [_slots(r, b * t)[q_rows] for r in key_rows[1:]]
        out = fused(_same_position_merge, q.device, self.compile)(q, out0, lse0, keys[1:], values[1:], here, scale)
        out = out.view(1, -1, nh, hd)
        if merged is not None:  # the step-0 block's backward reads it (flash.py)
            merged.hold(out.squeeze(0), at, self.real_rows.numel())
        return out

    def _step_zero_sdpa(self, q, key, value, rows, scale):
        """Each sample's queries against its own step-0 keys: fp32 output ``[1,n,nkv,g,hd]`` and
        log-sum-exp ``[1,n,nkv,g]``."""
        nh, hd = q.shape[2], q.shape[3]
        nkv = key.shape[2]
        qg = q[0].view(-1, nkv, nh // nkv, hd).permute(1, 2, 0, 3)  # [nkv, g, n, hd]
        key, value = key[0].transpose(0, 1)[:, None], value[0].transpose(0, 1)[:, None]  # [nkv, 1, n0, hd]
        at = self.slot0[rows]  # each query's index among the step-0 rows (= its key)
        spans = self.spans.bounds
        bounds = torch.searchsorted(at, torch.tensor(spans, device=at.device)).tolist()
        outs, lses = [], []
        for s, (k0, k1) in enumerate(zip(spans[:-1], spans[1:])):
            q0, q1 = bounds[s], bounds[s + 1]
            if q1 == q0:
                continue
            scores = (qg[:, :, q0:q1] @ key[:, :, k0:k1].transpose(-1, -2)).float() * scale
            causal = torch.arange(k0, k1, device=at.device)[None, :] <= at[q0:q1, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[..., None]).to(q.dtype)
            outs.append((probs @ value[:, :, k0:k1]).float())
            lses.append(lse)
        if not outs:  # no queries (a batch without targets)
            return q.new_zeros(1, 0, nkv, nh // nkv, hd, dtype=torch.float32), q.new_zeros(1, 0, nkv, nh // nkv)
        return (torch.cat(outs, dim=2).permute(2, 0, 1, 3).contiguous()[None],
                torch.cat(lses, dim=2).permute(2, 0, 1).contiguous()[None])

    def _step_zero_flash(self, q, key, value, rows, scale, merging: bool):
        """FlashAttention over the real rows (queries scattered onto them): output ``[1,n,nkv,g,hd]``
        in ``q``'s dtype, fp32 log-sum-exp ``[1,n,nkv,g]``, the box for the merged output (which
        the caller must fill when ``merging``) and the queries' indices among the real rows."""
        nh, hd = q.shape[2], q.shape[3]
        nkv = key.shape[2]
        if q.is_cuda and not flash_supports(q.dtype, hd):
            raise ConfigError(
                f"FlashAttention kernels take fp16/bf16 and a head size that is a multiple of 8 up to 256; "
                f"the draft computes in {q.dtype} with head_dim {hd}",
                where="draft.attention_backend",
                fix="use attention_backend: auto (it picks flex there) or train in bf16",
            )
        n_real = self.real_rows.numel()
        at = self.slot0[rows]
        q_rows = q.squeeze(0)
        if rows.numel() != n_real:
            q_rows = q_rows.new_zeros(n_real, nh, hd).index_copy(0, at, q_rows)
        merged = MergedOutput(expected=merging)
        out, lse = step_zero_flash(q_rows, key.squeeze(0), value.squeeze(0), self.spans, scale, merged)
        if rows.numel() != n_real:
            out, lse = take_rows(out, 0, at), lse.index_select(1, at)
        g = nh // nkv
        return out.view(1, -1, nkv, g, hd), lse.t().view(1, -1, nkv, g), merged, at

    def _step_zero_flex(self, q, key, value, rows, scale):
        """flex attention over the padded grid (rows scattered to ``[B, T]``), gathered back."""
        b, t = self.shape
        nh, hd = q.shape[2], q.shape[3]
        nkv = key.shape[2]
        if q.is_cuda and hd < 16:
            raise ConfigError(
                f"flex attention kernels need head_dim >= 16, the draft has {hd}",
                where="draft.attention_backend",
                fix="use attention_backend: sdpa for this draft",
            )
        # every step attends to the same step-0 keys: laid out on the grid once per batch (one
        # scatter, and one gather in backward, instead of one per step)
        if self._grid0 is None or self._grid0[0] is not key or self._grid0[1] is not value:
            self._grid0 = (key, value, _to_grid(key, self.real_rows, b, t), _to_grid(value, self.real_rows, b, t))
        fn = _flex() if q.is_cuda else flex_attention
        out0, aux = fn(
            _to_grid(q, rows, b, t), self._grid0[2], self._grid0[3],
            block_mask=self.block_mask, scale=scale, enable_gqa=nh != nkv, return_aux=AuxRequest(lse=True),
        )
        g = nh // nkv
        out0 = _from_grid(out0, rows).view(1, -1, nkv, g, hd).float()
        lse0 = _from_grid(aux.lse[..., None], rows).view(1, -1, nkv, g).float()
        return out0, lse0


def _slots(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` long: the index of each flattened position among ``rows`` (-1 if absent)."""
    slot = torch.full((size,), -1, dtype=torch.long, device=rows.device)
    slot[rows] = torch.arange(rows.numel(), device=rows.device)
    return slot


def _to_grid(x: torch.Tensor, rows: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """``[1, n, heads, hd]`` on ``rows`` → ``[B, heads, T, hd]``, zeros elsewhere (a view of
    ``x`` when ``rows`` are every position: ascending and distinct, they are then ``0..B·T-1``)."""
    heads, hd = x.shape[2], x.shape[3]
    if rows.numel() == b * t:
        return x.view(b, t, heads, hd).transpose(1, 2)
    grid = x.new_zeros(b * t, heads, hd).index_copy(0, rows, x.squeeze(0))
    return grid.view(b, t, heads, hd).transpose(1, 2)


def _from_grid(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[B, heads, T, hd]`` → ``[1, n, heads, hd]`` at ``rows`` (every position: a reshape)."""
    b, heads, t, hd = y.shape
    flat = y.transpose(1, 2).reshape(b * t, heads, hd)
    return (flat if rows.numel() == b * t else take_rows(flat, 0, rows))[None]


def _merge(out0: torch.Tensor, lse0: torch.Tensor, diag: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """Softmax over (step-0 keys ∪ same-position keys) from the step-0 output ``out0 [...,hd]``
    and log-sum-exp ``lse0 [...]`` and the same-position scores ``diag [...,k]`` (fp32); ``values``
    broadcast against ``out0``."""
    top = torch.maximum(lse0, diag.amax(dim=-1))
    w0 = torch.exp(lse0 - top)
    wd = torch.exp(diag - top[..., None])
    norm = w0 + wd.sum(dim=-1)
    out = out0 * (w0 / norm)[..., None]
    for j, v in enumerate(values):
        out = out + (wd[..., j] / norm)[..., None] * v.float()
    return out


def _same_position_merge(q, out0, lse0, keys, values, at, scale: float) -> torch.Tensor:
    """The step-0 output ``out0`` / ``lse0`` (fp32 ``[1,n,nkv,g,(hd)]``) merged with the keys and
    values ``[1,n_j,nkv,hd]`` steps 1..k made at each query's own position (``at[j]``: the
    queries' indices among step j's rows); ``q [1,n,nh,hd]``. Returns ``[1,n,nkv,g,hd]`` in
    ``q``'s dtype (cast inside the compiled region, backward included)."""
    nkv, hd = keys[0].shape[2], q.shape[3]
    qf = q.view(1, -1, nkv, q.shape[2] // nkv, hd).float()
    # distinct rows: compiled, the gradient is a store into place, not index_add's atomics
    same_keys = [take_rows(k, 1, i)[:, :, :, None] for k, i in zip(keys, at)]
    same_values = [take_rows(v, 1, i)[:, :, :, None] for v, i in zip(values, at)]
    # fp32 scores of each query against the same-position key of each later step [..., k]
    diag = torch.stack([(qf * k.float()).sum(-1) for k in same_keys], dim=-1) * scale
    return _merge(out0, lse0, diag, same_values).to(q.dtype)
