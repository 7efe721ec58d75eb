"""The colocated training runtime: what runs on every rank under torchrun.

``rollout`` — :class:`~specforge_core.runtime.rollout.RolloutStream`, the pull-through capture
stream (one TP-wide target batch per trainer request). The trainer, checkpoints and metrics live
beside it (see docs/architecture.md).
"""
