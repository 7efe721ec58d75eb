"""Errors meant for people: each says what was wrong, where, and what to do about it.

Every error the library raises on bad input derives from :class:`SpecForgeError`, so entry
points can print the message alone (no traceback) and exit non-zero.
"""


class SpecForgeError(Exception):
    """Base class: ``where`` names the file/row/field, ``fix`` says what to do."""

    def __init__(self, problem: str, *, where: str | None = None, fix: str | None = None):
        self.problem = problem
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.where}: {self.problem}" if self.where else self.problem
        return f"{head}\n  fix: {self.fix}" if self.fix else head


class ConfigError(SpecForgeError):
    """The run configuration is invalid (unknown key, wrong type, contradiction)."""


class DataError(SpecForgeError):
    """A data file or row is malformed (names file:line)."""


class ModelError(SpecForgeError):
    """A target or draft model does not fit the run (sizes, vocab, capture layers)."""


class ResumeError(SpecForgeError):
    """A checkpoint cannot be resumed by this run (names every differing value)."""


class CaptureError(SpecForgeError):
    """Target capture failed or returned a partial batch."""


class CheckpointError(SpecForgeError):
    """A checkpoint is missing, torn or corrupt."""
