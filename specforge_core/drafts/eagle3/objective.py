"""The EAGLE3 objective: one-token shift, K unrolled training-time-test steps, 0.8^k-weighted loss.

    loss, sums = eagle3_loss(draft, batch, lm_head_weight, ttt_length=7, decay=0.8)
    loss.backward()
    summarize_metrics(all_reduce_metric_sums(sums), decay=0.8)   # acc_k, ploss_k, ...

``batch`` is a captured batch (mapping or object): ``input_ids [B,T]``, ``attention_mask [B,T]``,
``loss_mask [B,T]``, ``aux_hidden [B,T,3·Ht]``, ``last_hidden [B,T,Ht]``, optional
``position_ids`` / ``seq_ids`` ``[B,T]`` for packed rows. The exact math (SpecForge's ``OnlineEagle3Model``, which this must equal):

- shift: at position t, step 0 embeds ``ids[t+1]`` on top of ``fc(aux[t])`` and learns the target
  distribution at position t+1. Step k embeds ``ids[t+1+k]``, uses RoPE position ``pos[t]+k``,
  and learns the target distribution at t+k+1 under the loss mask ``lm[t+k]``.
- a position counts at step k (``valid``) iff ``lm[t+k]``, tokens t and t+k+1 are real, and t and
  t+k+1 belong to the same sample. For unpacked right-padded rows this is exactly the reference
  rule (mask shifted by k, last real position's mask zeroed); for packed rows it is what makes
  each sample's numbers equal its unpacked numbers.
- ``pm`` = valid and the target's full-vocab argmax is a draft token; the soft cross-entropy
  against the renormalised draft-vocab target counts where ``pm``.
- ``L_k = Σ_{b,t} pm·CE / (B·T)`` (masked positions count in the denominator);
  ``loss = Σ_k decay^k L_k``. Gradients flow through the carried hidden across all steps.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from specforge_core.drafts.eagle3.attention import TTTAttention
from specforge_core.drafts.eagle3.flash import SampleSpans
from specforge_core.drafts.eagle3.metric_sums import metric_sums
from specforge_core.drafts.eagle3 import vocab_kernels
from specforge_core.drafts.eagle3.rows import take_parts, take_rows
from specforge_core.drafts.eagle3.teacher import compute_teacher, softmax_from_lse
from specforge_core.errors import ModelError
from specforge_core.system.compile import fused

REQUIRED_FIELDS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden", "last_hidden")


@dataclass
class StepTerms:
    """Per-position terms of one unrolled step, each ``[B, T]`` (zero where the step has no target).

    ``loss`` (with grad): pm-weighted soft CE; ``correct``/``valid``: acc numerator/denominator;
    ``accept``/``in_draft``: acceptance-rate numerator (pm-weighted Σ min(p, q)) / denominator (pm).
    """

    loss: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    accept: torch.Tensor
    in_draft: torch.Tensor


def _soft_ce_and_overlap(logits, teacher_logits, teacher_lse, label, weight, log_mass):
    """Per row: ``weight``·soft CE against the teacher's softmax on row ``label``
    (``exp(teacher_logits[label] - teacher_lse[label])``), ``Σ_v min(q_draft, p_target)`` with
    ``p_target`` that softmax times ``exp(log_mass)`` (fp32 from the logits' own dtype), the
    draft's argmax, and what the backward needs besides the logits: their logsumexp and the
    target's sum (compiled, one pass over the logits serves all of them)."""
    target = _target(teacher_logits, teacher_lse, label)
    lse = torch.logsumexp(logits.float(), dim=-1)
    log_q = logits.float() - lse[..., None]
    loss = -(target * log_q).sum(dim=-1)
    loss = torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
    overlap = torch.minimum(log_q.exp(), target * log_mass.exp()[..., None]).sum(dim=-1)
    return loss, overlap, logits.argmax(dim=-1), lse, target.sum(dim=-1)


def _target(teacher_logits, teacher_lse, label):
    """The teacher's softmax on the rows ``label``."""
    return softmax_from_lse(teacher_logits[label], teacher_lse[label])


def _ce_grad_from_probs(q, target, target_sum, weight, grad, dtype):
    """d(weight·CE)/d(logits) given the draft's fp32 softmax ``q`` and ``target``'s row sums."""
    coef = torch.where(weight > 0, grad * weight, torch.zeros_like(grad))[..., None]
    return (coef * (q * target_sum[..., None] - target)).to(dtype)


def _ce_grad(logits, lse, teacher_logits, teacher_lse, label, target_sum, weight, grad):
    """The same from the logits and the logsumexp the forward saved: one element-wise pass that
    reads the logits and the teacher's rows once each (no reduction to redo)."""
    target = _target(teacher_logits, teacher_lse, label)
    q = (logits.float() - lse[..., None]).exp()
    return _ce_grad_from_probs(q, target, target_sum, weight, grad, logits.dtype)


class _SoftTargetTerms(torch.autograd.Function):
    """Per row, in fp32: the soft CE ``-Σ_v target·log_softmax(logits)`` times ``weight`` (with a
    gradient to ``logits``), the overlap ``Σ_v min(q_draft, p_target)`` (none) and the draft's
    argmax (none), where ``target`` is the teacher's softmax on rows ``label`` (the teacher rows of
    the scored positions), made from its draft-vocab logits and their logsumexp as it is read.

    ``recompute`` (the default on CUDA): kernels that gather the teacher rows as they read them
    (``vocab_kernels``'s on CUDA with Triton, else :func:`_soft_ce_and_overlap` and
    :func:`_ce_grad`, compiled with ``training.compile``); saves the logits in their own dtype with their logsumexp and the target's row
    sums, and the backward is one element-wise pass (half the activation memory in bf16 of a
    saved fp32 softmax, and no copy of the teacher's rows). Otherwise (eager, memory
    bound): one log-softmax serves the loss, the overlap and the backward, which gets the fp32
    softmax saved; rows go in blocks of about ``EAGER_BLOCK`` values, so each temporary stays
    small (on 2 CPU cores, 5,040 rows of 8,192 in one pass took 0.5-1.8 s, in 720-row pieces
    0.3-0.4 s).
    """

    @staticmethod
    def forward(ctx, logits, teacher_logits, teacher_lse, label, weight, log_mass, recompute, compile):
        ctx.logits_dtype = logits.dtype
        ctx.recompute, ctx.compile = recompute, compile
        if recompute:
            soft_ce = vocab_kernels.soft_ce_forward if vocab_kernels.usable(logits, teacher_logits) \
                else fused(_soft_ce_and_overlap, logits.device, compile)
            loss, overlap, argmax, lse, target_sum = soft_ce(logits, teacher_logits, teacher_lse, label, weight, log_mass)
            ctx.save_for_backward(logits, lse, teacher_logits, teacher_lse, label, target_sum, weight)
        else:
            q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            target, loss, overlap = torch.empty_like(q), q.new_empty(q.shape[:-1]), q.new_empty(q.shape[:-1])
            for rows in _row_blocks(logits):
                target[rows] = _target(teacher_logits, teacher_lse, label[rows])
                log_q = torch.log_softmax(logits[rows].float(), dim=-1)
                terms = -(target[rows] * log_q).sum(dim=-1)
                loss[rows] = torch.where(weight[rows] > 0, terms * weight[rows], torch.zeros_like(terms))
                q[rows] = log_q.exp_()
                overlap[rows] = torch.minimum(q[rows], target[rows] * log_mass[rows].exp()[..., None]).sum(dim=-1)
            argmax = logits.argmax(dim=-1)
            ctx.save_for_backward(q, target, target.sum(dim=-1), weight)
        ctx.mark_non_differentiable(overlap, argmax)
        return loss, overlap, argmax

    @staticmethod
    def backward(ctx, grad, _overlap, _argmax):
        if ctx.recompute:
            logits, *saved = ctx.saved_tensors
            ce_grad = vocab_kernels.soft_ce_backward if vocab_kernels.usable(logits, saved[1]) \
                else fused(_ce_grad, logits.device, ctx.compile)
            dlogits = ce_grad(logits, *saved, grad)
        else:
            q, target, target_sum, weight = ctx.saved_tensors
            dlogits = torch.empty(q.shape, dtype=ctx.logits_dtype, device=q.device)
            for rows in _row_blocks(q):
                dlogits[rows] = _ce_grad_from_probs(q[rows], target[rows], target_sum[rows], weight[rows], grad[rows],
                                                    ctx.logits_dtype)
        return dlogits, None, None, None, None, None, None, None


EAGER_BLOCK = 1 << 22  # values per block of rows in the eager soft CE: 16 MB per fp32 temporary


def _row_blocks(x: torch.Tensor) -> list[slice]:
    """Slices of the rows of ``x [N, Vd]`` of about ``EAGER_BLOCK`` values each."""
    rows = max(1, EAGER_BLOCK // x.shape[-1])
    return [slice(r, r + rows) for r in range(0, x.shape[0], rows)]


def soft_target_terms(
    logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, label: torch.Tensor,
    weight: torch.Tensor, log_mass: torch.Tensor, *, recompute: bool | None = None, compile: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise weighted soft cross-entropy against ``p = softmax(teacher_logits)[label]`` (given as
    the teacher's draft-vocab logits, in the head's dtype, and their fp32 logsumexp
    ``teacher_lse``; computed in fp32, gradient to ``logits`` only), the overlap
    ``Σ_v min(softmax(logits), p·exp(log_mass))`` (defined where ``weight > 0``: the Triton path
    leaves zeros elsewhere) and ``logits.argmax(-1)`` (no gradients). ``recompute`` (default: on CUDA) picks how the backward
    gets the softmax (:class:`_SoftTargetTerms`); both give the same gradient. ``compile``
    (``training.compile``): its passes compiled on CUDA, forward and backward."""
    recompute = logits.is_cuda if recompute is None else recompute
    return _SoftTargetTerms.apply(logits, teacher_logits, teacher_lse, label, weight, log_mass, recompute, compile)


def noisy_features(aux: torch.Tensor, layers: int, scale: float) -> torch.Tensor:
    """``aux`` ``[B, T, layers·H]`` plus uniform noise ``U(-scale, scale)`` times each layer's
    per-token RMS (EAGLE-1's feature noise, made relative: a deep layer's states are far larger
    than the first's). A new tensor from the global RNG (checkpointed per rank); padding, whose
    features are zeros, stays zero."""
    x = aux.float().unflatten(-1, (layers, -1))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = (torch.rand(x.shape, device=x.device) * 2 - 1) * (scale * rms)
    return (x + noise).flatten(-2).to(aux.dtype)


def ttt_unroll(
    draft, batch, lm_head_weight: torch.Tensor, *, ttt_length: int = 7, backend: str = "auto", vocab_chunk: int = 32768,
    feature_noise: float = 0.0, compile: bool = True,
) -> list[StepTerms]:
    """Run the K-step unroll and return the per-position terms of every step (see module doc).

    Only what reaches a term is computed: step k on the positions whose chain still has a target
    at step k or later (step 0 also makes keys and values on every real token: they are the keys
    of their sample's later positions), the teacher on the indices some step reads. Padding and
    unsupervised positions cost nothing beyond the step-0 keys; the terms equal those of the full
    ``[B, T]`` unroll. A batch may carry its teacher already made (``batch.teacher``:
    ``compute_teacher`` of every flattened position of ``last_hidden``, as a capture that runs the
    target's head would make it); the unroll then reads its rows instead of running the head.
    Which rows each step computes is worked out on the host from one copy of the
    batch's masks (:class:`UnrollPlan`), so the device never waits for the host inside the unroll.
    The steps' logits are made after the last step, for the rows of all steps at once; the
    terms of skipped steps are zeros. The terms are views of ``[K, B, T]`` tensors. ``compile``
    (``training.compile``): the fused passes (teacher, merge, row gradients, soft CE) compiled on
    CUDA; it reaches each of them as an argument.
    """
    ids, attn, lm, aux, last, pos, seq = _read_batch(batch, lm_head_weight)
    b, t = ids.shape
    if feature_noise:
        aux = noisy_features(aux, aux.shape[-1] // last.shape[-1], feature_noise)
    # record_function ranges name the stages in a torch.profiler trace (bench/gpu_train.py --profile)
    with record_function("eagle3.plan"):
        plan = UnrollPlan.build(attn, lm, seq, ttt_length, device=ids.device, host=_host_masks(batch, b, t))
    with record_function("eagle3.teacher"):
        given = _given_teacher(batch, b, t, draft.draft_vocab_size)
        if given is not None:
            teacher = given.take(plan.teacher_index + 1)
        else:
            teacher = compute_teacher(last.flatten(0, 1)[plan.teacher_index + 1], lm_head_weight, draft.t2d,
                                      vocab_chunk=vocab_chunk, compile=compile)
    target_ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)
    # step k's token at position t is ids[t+1+k] (0 past the row's end, one pad per row): each is
    # embedded and projected once for all steps (model.Eagle3DecoderLayer's doc)
    with record_function("eagle3.tokens"):
        tokens = draft.project_tokens(F.pad(ids.flatten(), (0, b))[plan.token_index])
        runs = [k for k in range(ttt_length) if plan.rows[k] is not None]
        step_tokens = dict(zip(runs, tokens.for_steps([plan.token_rows[k] for k in runs],
                                                      [plan.token_slot[k] for k in runs], compile=compile)))
    attention = TTTAttention(attn, seq, backend, real_rows=plan.real, spans=plan.spans, compile=compile)
    keys, values, key_rows, scored = [], [], [], []

    hidden = carried = None
    for k in range(ttt_length):
        idx = plan.rows[k]
        if idx is None:  # no target at this step or later
            continue
        # Step 0 makes keys on every real token; its outputs, like every later step's, are idx.
        inputs = plan.real if k == 0 else idx

        def attend(q, key, value, idx=idx, inputs=inputs):  # this step's keys join the earlier ones
            keys.append(key)
            values.append(value)
            key_rows.append(inputs)
            with record_function("eagle3.attention"):  # step 0's keys (flash, flex or sdpa) + the same-position merge
                return attention(q, idx, keys, values, key_rows, same_at=plan.same[k])

        step_pos = (pos + k).flatten()[inputs][None]
        reads = dict(tokens=step_tokens[k])
        if k == 0:
            hidden = draft.next_hidden(None, step_pos, attend, aux_hidden=aux.flatten(0, 1)[plan.real][None],
                                       queries=plan.queries0, **reads)
        else:
            hidden = draft.next_hidden(None, step_pos, attend, hidden=carried, **reads)
        if k + 1 < ttt_length and plan.rows[k + 1] is not None:  # the rows step k+1 carries on, and the scored ones
            carried, here = take_parts(hidden, 1, [plan.carry[k + 1], plan.here[k]],
                                       [plan.carry_slot[k + 1], plan.here_slot[k]], compile=compile)
        elif plan.here[k].numel() == hidden.shape[1]:  # every row has a step-k target (the last step's)
            here = hidden
        else:
            here = take_rows(hidden, 1, plan.here[k])  # the rows with a step-k target
        scored.append(here)

    # Every step's scored rows through the head and the loss at once: the logits feed nothing but
    # the loss, so one matmul (one weight gradient, not seven to add up) and one pass each way
    # serve all steps.
    with record_function("eagle3.lm_head"):
        logits = draft.compute_logits(torch.cat(scored, dim=1)).squeeze(0)  # a view both ways
    label = plan.label  # the teacher row of each scored row: index t+k, the distribution at t+k+1
    with record_function("eagle3.loss_terms"):
        pm = teacher.in_draft[label]
        loss, overlap, argmax = soft_target_terms(logits, teacher.logits, teacher.lse, label, pm.float(),
                                                  teacher.log_mass[label], compile=compile)
        with torch.no_grad():
            correct = target_ids[argmax] == teacher.argmax[label]
            accept = torch.where(pm, overlap, torch.zeros_like(overlap))
        # each term at its step's [B, T] position, all steps in one [K, B, T] tensor
        placed = [_place(x, plan.placed, ttt_length, b, t) for x in (loss, correct.float(), accept, pm.float())]
    valid = plan.valid.float()
    return [StepTerms(loss=placed[0][k], correct=placed[1][k], valid=valid[k], accept=placed[2][k],
                      in_draft=placed[3][k]) for k in range(ttt_length)]


@dataclass
class UnrollPlan:
    """Which rows each unrolled step computes and where its terms go, for one batch (all index
    tensors on the batch's device, long, ascending where they are rows):

    - ``valid`` ``[K, B, T]`` bool: position t has a step-k target (:func:`_valid_masks`);
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
        # dispatch alone cost 12-70 ms of host time per step, all of it with the device idle
        valid = _valid_masks(host[0] != 0, host[1] != 0, host[2], ttt_length)
        rows = _unroll_rows(valid)
        flat_valid = [v.reshape(-1) for v in valid]
        read = np.zeros(b * t, dtype=bool)
        for k, v in enumerate(flat_valid):
            read[np.flatnonzero(v) + k] = True
        teacher_index = np.flatnonzero(read)
        teacher_slot = _host_slots(teacher_index, b * t)
        real = np.flatnonzero(host[0])
        queries0 = np.searchsorted(real, rows[0])
        spans = SampleSpans.of_rows(real, host[2].reshape(-1)[real], t).bounds
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
        # one host-to-device copy of every index, then views of it
        parts = [real, queries0, teacher_index, token_index, np.concatenate(label), np.concatenate(placed),
                 *(x for group in (rows, carry, here, token_rows, carry_slot, here_slot, token_slot)
                   for x in group if x is not None),
                 *(x for at in same for x in at)]
        sizes = [p.size for p in parts]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
        valid_h = torch.from_numpy(np.stack(valid))
        if torch.device(device).type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
            valid_d = valid_h.pin_memory().to(device, non_blocking=True)
        else:
            valid_d = valid_h.to(device)
        views = iter(packed.split(sizes))
        real_d, queries0_d, teacher_index_d, token_index_d, label_d, placed_d = (next(views) for _ in range(6))
        groups = [[None if x is None else next(views) for x in group]
                  for group in (rows, carry, here, token_rows, carry_slot, here_slot, token_slot)]
        same_d = [[next(views) for _ in at] for at in same]
        return cls(valid_d, real_d, groups[0], queries0_d, groups[1], groups[2], groups[4], groups[5], label_d,
                   placed_d, teacher_index_d, same_d, spans, token_index_d, groups[3], groups[6])


def _token_rows(inputs: list, t: int, size: int) -> tuple[np.ndarray, list]:
    """The tokens the steps embed (``UnrollPlan.token_index``) and each step's index among them
    (``token_rows``; None where the step does not run), from each step's flattened input rows:
    step k at position p embeds the id at p+1+k, or its row's pad at ``size + p // t`` past the
    row's end (a pad per row keeps each step's indices distinct)."""
    reads = [None if x is None else np.where(x % t + 1 + k < t, x + 1 + k, size + x // t)
             for k, x in enumerate(inputs)]
    read = np.zeros(size + size // t, dtype=bool)  # a mask, not np.unique: plan 2.5 -> 1.3 ms at 1x4096
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
    """``valid[k] [B,T]`` (host, bool): position t has a step-k target (module doc): ``lm[t+k]``,
    tokens t and t+k+1 real and in the same sample."""
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


def _place(values: torch.Tensor, placed: torch.Tensor, k: int, b: int, t: int) -> torch.Tensor:
    """``[K, B, T]`` zeros with ``values`` at the flattened positions ``placed``."""
    return values.new_zeros(k * b * t).index_copy(0, placed, values).view(k, b, t)


def eagle3_loss(
    draft,
    batch,
    lm_head_weight: torch.Tensor,
    *,
    ttt_length: int = 7,
    decay: float = 0.8,
    backend: str = "auto",
    vocab_chunk: int = 32768,
    feature_noise: float = 0.0,
    compile: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, sums)``: the scalar ``Σ_k decay^k L_k`` and the summable metric numerators and
    denominators (``metrics.metric_sums``; reduce across ranks by summing). ``feature_noise`` > 0
    trains on noisy features (:func:`noisy_features`); the teacher is never perturbed. ``compile``:
    ``training.compile`` (:func:`ttt_unroll`)."""
    steps = ttt_unroll(
        draft, batch, lm_head_weight, ttt_length=ttt_length, backend=backend, vocab_chunk=vocab_chunk,
        feature_noise=feature_noise, compile=compile,
    )
    b, t = steps[0].loss.shape
    loss = sum(decay**k * s.loss.sum() for k, s in enumerate(steps)) / (b * t)
    return loss, metric_sums(steps, positions=b * t)


def _field(batch, name):
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)


def _given_teacher(batch, b: int, t: int, vd: int):
    """The batch's precomputed teacher (None where it has none), checked against its ``[B, T]``
    and the draft vocabulary."""
    given = _field(batch, "teacher")
    if given is None:
        return None
    if tuple(given.logits.shape) != (b * t, vd) or given.lse.shape[0] != b * t:
        raise ModelError(
            f"the batch's teacher has logits {tuple(given.logits.shape)}, expected {(b * t, vd)}: "
            "one row per flattened position, the draft vocabulary's columns",
            where="captured batch: teacher",
            fix="make it with compute_teacher(last_hidden.flatten(0, 1), lm_head_weight, draft.t2d), or leave it out",
        )
    return given


def _host_masks(batch, b: int, t: int):
    """The batch's host masks (None where it has none), checked against its ``[B,T]``."""
    host = _field(batch, "host_masks")
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


def _read_batch(batch, lm_head_weight):
    missing = [f for f in REQUIRED_FIELDS if _field(batch, f) is None]
    if missing:
        raise ModelError(
            f"captured batch lacks {missing}",
            where="captured batch",
            fix="capture all of " + ", ".join(REQUIRED_FIELDS),
        )
    ids = _field(batch, "input_ids").long()
    b, t = ids.shape
    attn = _field(batch, "attention_mask").bool()
    lm = _field(batch, "loss_mask").bool()
    aux, last = _field(batch, "aux_hidden"), _field(batch, "last_hidden")
    pos = _field(batch, "position_ids")
    pos = torch.arange(t, device=ids.device).expand(b, t) if pos is None else pos.long()
    seq = _field(batch, "seq_ids")
    seq = torch.zeros_like(ids) if seq is None else seq.long()
    for name, value in (("attention_mask", attn), ("loss_mask", lm), ("position_ids", pos), ("seq_ids", seq)):
        if tuple(value.shape) != (b, t):
            raise ModelError(
                f"{name} shape {tuple(value.shape)} != input_ids {(b, t)}", where=f"captured batch: {name}"
            )
    for name, value in (("aux_hidden", aux), ("last_hidden", last)):
        if tuple(value.shape[:2]) != (b, t):
            raise ModelError(
                f"{name} shape {tuple(value.shape)} does not start with {(b, t)}", where=f"captured batch: {name}"
            )
    if last.shape[-1] != lm_head_weight.shape[-1]:
        raise ModelError(
            f"last_hidden width {last.shape[-1]} != target head width {lm_head_weight.shape[-1]}",
            where="captured batch: last_hidden",
            fix="pass the lm_head weight of the target that produced the batch",
        )
    return ids, attn, lm, aux, last, pos, seq
