"""The EAGLE3 objective's speed machinery; ``objective.py`` states the math it computes.

- ``unroll_plan``: which rows each unrolled step computes, and where its terms go, worked out on
  the host (the plain unroll computes every position);
- ``soft_target_ce``: the soft CE, overlap and argmax over the draft logits, three
  implementations of :func:`soft_target_ce.soft_target_terms_plain` chosen in one place.

Each piece is tested against its plain form: the plan's indices against their definitions
(tests/drafts/eagle3/test_unroll_plan.py), each soft CE implementation against the plain
function, forward and gradient (tests/drafts/eagle3/fast/test_soft_target_ce.py).
"""
