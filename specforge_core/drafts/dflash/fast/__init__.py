"""The DFlash objective's speed machinery; ``objective.py`` states the math it computes.

- ``chunked_ce``: the target head's weighted cross-entropy over the vocabulary in row chunks, its
  gradient taken in the same pass (:func:`chunked_ce.target_cross_entropy_plain` is the plain one);
- ``flex_blocks``: the anchor blocks' attention on flex attention kernels (the plain one:
  ``blocks.dense_masks`` with ``model.dense_attend``).

Each piece is tested equal to its plain torch counterpart (tests/drafts/dflash/fast/).
"""
