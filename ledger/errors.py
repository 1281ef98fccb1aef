"""The ledger's errors: one small hierarchy.

The server maps :class:`NotFound` to 404, :class:`SubmissionConflict` and
:class:`ConversationBusy` to 409, :class:`UsageLimitExceeded` to 402/429-like
refusals (the loop settles the run failed), :class:`LeaseLost` stops a worker.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LedgerError", "NotFound", "SubmissionConflict", "ConversationBusy", "LeaseLost",
    "UsageLimitExceeded", "UsageConflict", "StepNameReused", "InvalidState",
]


class LedgerError(Exception):
    """Base class of every error raised by ``ledger``."""


class NotFound(LedgerError):
    """No such run/submission *for this owner* (foreign looks exactly like missing)."""


class SubmissionConflict(LedgerError):
    """The submission id was used before with a different request (hash or conversation)."""


class ConversationBusy(LedgerError):
    """Policy ``reject``: the conversation already has an active run."""

    def __init__(self, message: str, *, active_run: str | None = None) -> None:
        super().__init__(message)
        self.active_run = active_run


class LeaseLost(LedgerError):
    """The worker's lease on a run was taken over, released or settled: stop working on it."""


class UsageLimitExceeded(LedgerError):
    """A reservation would pass the run's token or cost ceiling."""

    def __init__(self, message: str, *, field: str, used: int, estimate: int, ceiling: int) -> None:
        super().__init__(message)
        self.field = field
        self.used = used
        self.estimate = estimate
        self.ceiling = ceiling


class UsageConflict(LedgerError):
    """The same (run, step) was recorded before with different usage figures."""


class StepNameReused(LedgerError):
    """A durable step name was used twice in one execution of a run."""


class InvalidState(LedgerError):
    """The run is in a state that does not allow the operation."""

    def __init__(self, message: str, *, state: Any = None) -> None:
        super().__init__(message)
        self.state = state
