"""The EAGLE3 objective's speed machinery; ``objective.py`` states the math it computes.

- ``unroll_plan``: which rows each unrolled step computes, and where its terms go, worked out on
  the host (the plain unroll computes every position).

It is tested against its plain form: the plan's indices against their definitions
(tests/drafts/eagle3/test_unroll_plan.py). The soft CE the unroll's steps compute, shared with
DSpark, is ``drafts/vocab/``.
"""
