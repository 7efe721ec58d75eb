"""Full-vocabulary loss pieces the families share: the target's distribution without ``[N, V]``
fp32 logits, and the soft-target cross-entropy against it.

- ``teacher``: the target head's logits in vocabulary chunks, kept in the head's dtype, with their
  logsumexp, argmax and the mass on a draft vocabulary (:func:`teacher.compute_teacher`);
- ``soft_target_ce``: per row, the soft cross-entropy, the overlap ``Σ min(q, p)`` and the argmax,
  three implementations of :func:`soft_target_ce.soft_target_terms_plain` chosen in one place;
- ``kernels``: the Triton kernels of both (CUDA).

Each fast piece is tested equal to its plain torch form (tests/drafts/vocab/). EAGLE3's unroll
and DSpark's distillation loss read them; neither folder imports the other.
"""
