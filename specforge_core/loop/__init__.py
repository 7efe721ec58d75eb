"""The family-agnostic training loop every rank runs: trainer, optimizer, schedule, rollout
stream, checkpoints, metrics, time budget and the run lock.

It knows no draft family: the launch floor (``specforge_core.launch``) hands it the objective,
the metric function and the checkpoint writer of one.
"""
