"""The loop's errors, and the classification of provider failures.

Promise 8 of DESIGN.md: provider failures are *retried, not recorded*.  That
needs one decision made in one place — is this failure worth another try? —
so every provider funnels what went wrong (an HTTP status with its body and
headers, a transport exception, an error event inside a stream) through
:func:`classify_http` / :func:`classify_exception`, and the loop only ever
sees one of four kinds:

* :class:`TransientProviderError` — 429, 408, 409, 5xx, 529, connection
  errors.  Retried with backoff, honouring ``retry_after``.
* :class:`ContextOverflowError` — the prompt did not fit (Anthropic's 400
  "prompt is too long", OpenAI's ``context_length_exceeded``).  One
  compaction, then another try.
* :class:`PermanentProviderError` — everything else (bad request, auth...).
  Appended to the transcript; the run fails.
* :class:`StreamBrokenError` — any failure *after* output was streamed.  Never
  retried: a retry would duplicate what the client already saw, so the step
  fails honestly.  It keeps the underlying classified error as ``cause``.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any, Mapping

__all__ = [
    "LoopError",
    "ProviderError",
    "TransientProviderError",
    "ContextOverflowError",
    "PermanentProviderError",
    "StreamBrokenError",
    "ToolSchemaError",
    "ModelSpecError",
    "RunFailed",
    "MissingPrice",
    "ResultSchemaError",
    "classify_http",
    "classify_exception",
    "parse_retry_after",
    "TRANSIENT_STATUSES",
    "MAX_RETRY_AFTER_S",
]

# Statuses worth another try (DESIGN.md promise 8).  529 is Anthropic's
# "overloaded"; every other 5xx is included by range in ``_is_transient``.
TRANSIENT_STATUSES = frozenset({408, 409, 429, 529})
# A server asking us to wait longer than this is treated as asking for this
# long: one bad header must not park a run for a day.
MAX_RETRY_AFTER_S = 600.0
# Bytes of an error body kept in the error message (enough for a diagnosis,
# small enough for a transcript entry).
ERROR_BODY_EXCERPT = 2_000

assert MAX_RETRY_AFTER_S > 0 and ERROR_BODY_EXCERPT > 0


class LoopError(Exception):
    """Root of everything the loop raises on purpose."""


class ProviderError(LoopError):
    """A model provider call failed.  ``kind`` is the classification."""

    kind: str = "provider"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        provider: str | None = None,
        error_type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.provider = provider
        self.error_type = error_type
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        """A CBOR/JSON-friendly record (what the transcript and journal store)."""
        d: dict[str, Any] = {"type": self.kind, "message": self.message}
        if self.status is not None:
            d["status"] = self.status
        if self.provider is not None:
            d["provider"] = self.provider
        if self.error_type is not None:
            d["provider_error"] = self.error_type
        if self.retry_after is not None:
            d["retry_after"] = self.retry_after
        return d

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, retry_after={self.retry_after})"


class TransientProviderError(ProviderError):
    """Worth another try (after ``retry_after`` seconds when the server said so)."""

    kind = "transient"


class ContextOverflowError(ProviderError):
    """The prompt exceeded the model's context window: compact, then retry once."""

    kind = "overflow"


class PermanentProviderError(ProviderError):
    """Not worth another try; recorded in the transcript and the run fails."""

    kind = "permanent"


class StreamBrokenError(ProviderError):
    """The call failed after output had streamed; never retried (no duplicates)."""

    kind = "stream_broken"

    def __init__(self, message: str, *, cause: ProviderError | None = None, **kw: Any) -> None:
        if cause is not None:
            kw.setdefault("status", cause.status)
            kw.setdefault("provider", cause.provider)
            kw.setdefault("error_type", cause.error_type)
        super().__init__(message, **kw)
        self.cause = cause

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.cause is not None:
            d["cause"] = self.cause.to_dict()
        return d


class ToolSchemaError(LoopError):
    """A tool's signature cannot be expressed as a JSON schema (say which parameter)."""


class ModelSpecError(LoopError):
    """A model spec string (``echo``, ``anthropic:M``, ``openai:M@URL``) is malformed."""


class MissingPrice(LoopError, ValueError):
    """A run with a cost ceiling (``max_cost_micros``) names a model this runtime has no
    price for: refused rather than run with a ceiling nothing enforces (see loop.pricing)."""


class RunFailed(LoopError):
    """``Runtime.run`` settled a run as failed; ``outcome`` is the settled record."""

    def __init__(self, message: str, outcome: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.outcome = dict(outcome or {})


class ResultSchemaError(LoopError):
    """A final answer did not validate against the run's result schema."""


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``retry-after`` header: delta-seconds or an HTTP date.

    Returns ``None`` when absent or unparseable (the policy's own backoff
    applies then), clamps to ``[0, MAX_RETRY_AFTER_S]``.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _retry_after_from_headers(headers: Mapping[str, str] | None) -> float | None:
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    # OpenAI also sends retry-after-ms; prefer it when present (finer grained).
    ms = lower.get("retry-after-ms")
    if ms is not None:
        try:
            return min(max(float(ms) / 1000.0, 0.0), MAX_RETRY_AFTER_S)
        except ValueError:
            pass
    return parse_retry_after(lower.get("retry-after"))


def _error_fields(body: Any) -> tuple[str | None, str | None, str | None]:
    """(type, code, message) out of an Anthropic or OpenAI error body."""
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None, None, body[:ERROR_BODY_EXCERPT] or None
    if not isinstance(body, Mapping):
        return None, None, None
    err = body.get("error", body)
    if isinstance(err, str):
        return None, None, err
    if not isinstance(err, Mapping):
        return None, None, None
    etype = err.get("type")
    code = err.get("code")
    msg = err.get("message")
    return (
        str(etype) if etype is not None else None,
        str(code) if code is not None else None,
        str(msg)[:ERROR_BODY_EXCERPT] if msg is not None else None,
    )


_OVERFLOW_MARKERS = (
    "prompt is too long",  # Anthropic
    "context_length_exceeded",  # OpenAI code
    "maximum context length",  # OpenAI / vLLM message
    "context window",  # llama.cpp / others ("exceeds the available context window")
    "too many tokens",
)


def _is_overflow(status: int | None, etype: str | None, code: str | None, msg: str | None) -> bool:
    if code == "context_length_exceeded" or etype == "context_length_exceeded":
        return True
    if status not in (None, 400, 413):
        return False
    text = (msg or "").lower()
    return any(m in text for m in _OVERFLOW_MARKERS)


def _is_transient_status(status: int) -> bool:
    return status in TRANSIENT_STATUSES or 500 <= status <= 599


def classify_http(
    status: int | None,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    *,
    provider: str | None = None,
) -> ProviderError:
    """Classify a failed response (or an in-stream ``error`` event: status None).

    In-stream errors carry only a type: Anthropic's ``overloaded_error``,
    ``rate_limit_error`` and ``api_error`` are transient like their statuses.
    """
    etype, code, msg = _error_fields(body)
    message = msg or (f"HTTP {status}" if status is not None else "provider error")
    retry_after = _retry_after_from_headers(headers)
    kw = dict(status=status, provider=provider, error_type=etype or code, retry_after=retry_after)
    if _is_overflow(status, etype, code, msg):
        return ContextOverflowError(message, **kw)
    if status is not None and _is_transient_status(status):
        return TransientProviderError(message, **kw)
    if status is None and etype in ("overloaded_error", "rate_limit_error", "api_error", "timeout_error", "server_error"):
        return TransientProviderError(message, **kw)
    if etype in ("invalid_request_error",) and msg and _is_overflow(400, etype, code, msg):
        return ContextOverflowError(message, **kw)
    return PermanentProviderError(message, **kw)


def classify_exception(exc: BaseException, *, provider: str | None = None) -> ProviderError:
    """Classify a transport failure (httpx / OS level): connection errors are transient.

    A protocol error mid-body (peer closed a chunked stream) also lands here;
    whether it happened *after output* is the caller's business — it wraps
    the result in :class:`StreamBrokenError` then.
    """
    if isinstance(exc, ProviderError):
        return exc
    import httpx  # local: keeps ``loop.errors`` importable without the HTTP stack

    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.TransportError, OSError, ConnectionError)):
        # TransportError covers ConnectError, ReadError, RemoteProtocolError, timeouts.
        return TransientProviderError(message, provider=provider, error_type="connection_error")
    return PermanentProviderError(message, provider=provider, error_type=type(exc).__name__)
