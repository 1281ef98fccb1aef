"""The sessions package's errors: one small hierarchy.

Callers catch :class:`SessionError` for "anything this package refused"; the
server maps :class:`NotFound` to 404, :class:`SessionConflict` to 409,
:class:`InvalidCursor`/:class:`InvalidOwner` to 400 and :class:`TooLarge` to 413.
A foreign record raises exactly the same :class:`NotFound` (same message) as a
missing one, so nothing leaks whether another owner's record exists.
"""

from __future__ import annotations

__all__ = [
    "SessionError",
    "NotFound",
    "SessionConflict",
    "InvalidOwner",
    "InvalidCursor",
    "CursorBehind",
    "TooLarge",
    "InvalidState",
]


class SessionError(Exception):
    """Base class of every error raised by ``sessions``."""


class NotFound(SessionError):
    """The record does not exist *for this owner* (missing and foreign look the same)."""


class SessionConflict(SessionError):
    """A transcript's head moved under the caller (another writer appended first)."""

    def __init__(self, message: str, *, expected: int | None = None, actual: int | None = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class InvalidOwner(SessionError, ValueError):
    """An owner tag part is empty, too long or contains ``/``."""


class InvalidCursor(SessionError, ValueError):
    """A journal cursor string that this runtime never produced."""


class CursorBehind(SessionError):
    """A follower's cursor fell behind retention; ``first_retained`` is where the journal now starts."""

    def __init__(self, first_retained: str | None) -> None:
        super().__init__(f"cursor is behind retention; first retained position is {first_retained!r}")
        self.first_retained = first_retained


class TooLarge(SessionError, ValueError):
    """A write refused before anything was written because it exceeds a limit."""


class InvalidState(SessionError):
    """The record exists but is in a state that does not allow the operation."""
