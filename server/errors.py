"""The server's errors: one small hierarchy, one JSON shape, stable codes.

Every error leaves the server as ``{"error": {"code": CODE, "message": TEXT}}``
with the status below. Codes are part of the API (clients branch on them);
messages are for people and may change. Nothing else ever reaches a client:
an unexpected exception is logged with its traceback and answered 500
``internal`` without details.

Errors from the layers below are mapped in :func:`from_exception`, by class
name along the MRO, because the ledger's classes are moving from the loop's
interim module into ``ledger/`` while this is written; the names are the
stable part of their contract.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

log = logging.getLogger(__name__)

__all__ = ["ApiError", "error_body", "from_exception", "CODES"]

#: Every code the API answers with, and its status. The OpenAPI document lists them.
CODES: dict[str, int] = {
    "invalid_json": 400,
    "invalid_request": 400,
    "invalid_cursor": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "not_acceptable": 406,
    "idempotency_conflict": 409,
    "conflict": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "unprocessable": 422,
    "missing_price": 422,
    "internal": 500,
    "auth_not_configured": 503,
    "not_ready": 503,
}


class ApiError(Exception):
    """An answer that is an error. ``headers`` are added to the response."""

    def __init__(self, code: str, message: str, *, status: int | None = None,
                 headers: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status if status is not None else CODES[code]
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> bytes:
        return error_body(self.code, self.message, self.extra)


def error_body(code: str, message: str, extra: Mapping[str, Any] | None = None) -> bytes:
    err: dict[str, Any] = {"code": code, "message": message}
    if extra:
        err.update(extra)
    return json.dumps({"error": err}, separators=(",", ":")).encode()


#: Lower-layer exception class names -> (code, fixed message or None to use str(e)).
#: NotFound's message is fixed so a foreign resource answers byte for byte like a missing one.
_BY_NAME: dict[str, tuple[str, str | None]] = {
    "NotFound": ("not_found", "not found"),
    "RunNotFound": ("not_found", "not found"),
    "SubmissionConflict": ("idempotency_conflict",
                           "this Idempotency-Key was already used with a different request"),
    "ApprovalError": ("conflict", None),
    "ConversationBusy": ("conflict", None),
    "SessionConflict": ("conflict", None),
    "InvalidState": ("conflict", None),
    "InvalidCursor": ("invalid_cursor", "not a cursor this server issued"),
    "InvalidOwner": ("invalid_request", None),
    "TooLarge": ("payload_too_large", None),
    # a cost ceiling on a model this server has no price for (loop.pricing): well-formed, not runnable
    "MissingPrice": ("missing_price", None),
}


def from_exception(e: BaseException) -> ApiError | None:
    """The API error for a lower layer's refusal, or None when ``e`` is not one (a bug: 500)."""
    if isinstance(e, ApiError):
        return e
    for cls in type(e).__mro__:
        hit = _BY_NAME.get(cls.__name__)
        if hit is not None:
            code, message = hit
            return ApiError(code, message if message is not None else str(e))
    return None
