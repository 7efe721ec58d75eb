"""DSpark drafts (speculators 0.9.0's ``dspark``; DeepSeek's DSpark): a DFlash backbone with a
low-rank Markov logit bias and a confidence head that schedules the draft length.

Config (``settings``), model (``architecture``), objective, files and export (``files``,
``speculators_format``), decoding (``drafting``); the family seam in ``family``.
"""
