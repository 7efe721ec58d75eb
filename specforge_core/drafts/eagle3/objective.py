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

The speed machinery lives beside this module, each piece tested equal to the plain torch it
replaces: ``fast/unroll_plan.py`` (which rows each step computes), ``drafts/vocab/soft_target_ce.py``
(the soft CE, overlap and argmax; Triton kernels in ``drafts/vocab/kernels.py``), ``rows.py`` (row
subsets with gathered gradients), ``attention.py`` and ``flash.py`` (the TTT attention).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from specforge_core.capture.base import host_masks_of
from specforge_core.drafts.eagle3.attention import TTTAttention
from specforge_core.drafts.eagle3.fast.unroll_plan import UnrollPlan
from specforge_core.drafts.eagle3.metric_sums import metric_sums
from specforge_core.drafts.vocab.soft_target_ce import soft_target_terms
from specforge_core.drafts.vocab.teacher import compute_teacher
from specforge_core.errors import ModelError

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
        plan = UnrollPlan.build(attn, lm, seq, ttt_length, device=ids.device, host=host_masks_of(batch, b, t))
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
        step_tokens = plan.tokens_by_step(draft.project_tokens(F.pad(ids.flatten(), (0, b))[plan.token_index]),
                                          compile=compile)
    attention = TTTAttention(attn, seq, backend, real_rows=plan.real, spans=plan.spans, compile=compile)
    keys, values, key_rows, scored = [], [], [], []

    carried = None
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
        if k == 0:
            with record_function("eagle3.fc"):
                start = draft.project_hidden(aux.flatten(0, 1)[plan.real][None])
            hidden = draft.next_hidden(step_tokens[0], start, step_pos, attend, queries=plan.queries0)
        else:
            hidden = draft.next_hidden(step_tokens[k], carried, step_pos, attend)
        carried, here = plan.carried_and_scored(hidden, k, compile=compile)  # the rows step k+1 carries on; those with a step-k target
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
        placed = [plan.place(x, b, t) for x in (loss, correct.float(), accept, pm.float())]
    valid = plan.valid.float()
    return [StepTerms(loss=placed[0][k], correct=placed[1][k], valid=valid[k], accept=placed[2][k],
                      in_draft=placed[3][k]) for k in range(ttt_length)]


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
