"""The exceptions quantdask raises. Each carries the data a caller needs to act on it."""

from __future__ import annotations


class QuantdaskError(Exception):
    """Base class for every error quantdask raises on purpose."""


class SpecError(QuantdaskError, ValueError):
    """A sweep or argument is invalid. Raised before any job runs.

    ``field`` is the dotted path of the offending value (``backends[0].grid.bits``) and the message
    says what is allowed, so a user can fix the file without reading code.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class UnsupportedHere(QuantdaskError):
    """A job cannot run here (backend missing, needs CUDA, ...): it is skipped, not retried."""


class SchemaError(QuantdaskError):
    """A result record does not match the results schema; it is never persisted."""


class RunDirError(QuantdaskError):
    """The run directory cannot be used (not a directory, unreadable results, ...)."""
