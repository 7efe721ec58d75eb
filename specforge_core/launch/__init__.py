"""A rank's launch: the one floor that knows every part. It builds the run (``builder``), checks
it from the config files (``preflight``) or without starting a rank (``dry_run``), and runs the
held-out decodes during training (``heldout``); ``python -m specforge_core.train`` is its command.
"""
