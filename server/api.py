"""The transport-free API: request -> function -> response.

Nothing here knows about Quart or hypercorn. An :class:`ApiRequest` (method,
path parameters, query, headers, body bytes) goes through :meth:`Api.handle`,
which authenticates, parses and validates, calls the route's handler over the
:class:`~loop.runtime.Runtime`, and returns an :class:`ApiResponse` (JSON, or a
byte stream for SSE). Later fronts (MCP, A2A, ACP) call the same handlers, so
the submit path (Idempotency-Key -> submission id -> one durable transaction
before any "yes") exists once.

:data:`ROUTES` is the single route table: the Quart app registers exactly these
routes and the OpenAPI document is generated from them, so the two cannot
disagree about which routes exist, their parameters or their schemas.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import trio

from . import sse
from .auth import STREAM_TOKEN_SECONDS, Authenticator, Principal
from .errors import ApiError, error_body, from_exception
from loop import check_limits

from .limits import (
    MAX_USAGE_LIMITS,
    MAX_CONVERSATION_ID,
    MAX_IDEMPOTENCY_KEY,
    MAX_ID,
    MAX_PAGE,
    DEFAULT_PAGE,
    MAX_MESSAGE_BYTES,
    MAX_MESSAGE_PARTS,
    MAX_REASON,
    MAX_ATTACHMENT_BYTES,
    MAX_FILENAME,
    MAX_INSTRUCTIONS,
    MAX_PROJECT_NAME,
    MAX_REQUEST_BYTES,
)

log = logging.getLogger(__name__)

__all__ = ["Api", "ApiRequest", "ApiResponse", "Route", "ROUTES", "SSE_MEDIA_TYPE"]

SSE_MEDIA_TYPE = "text/event-stream"
JSON_MEDIA_TYPE = "application/json"
_IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
_MEDIA_TYPE_RE = re.compile(r"^[!-~]+/[!-~]+$")
#: Ids in URLs (conversations, runs, calls, projects, attachments, agents): URL-safe ASCII, starting with a letter
#: or digit so that no client normalises one away ("." and ".." path segments) or encodes it differently.
ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:~-]*$"
_ID_RE = re.compile(ID_PATTERN)


@dataclass
class ApiRequest:
    method: str
    params: Mapping[str, str]            # path parameters
    query: Mapping[str, str]             # first value of each query parameter
    headers: Mapping[str, str]           # lower-cased names
    body: bytes = b""


@dataclass
class ApiResponse:
    status: int
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None  # an SSE body instead of JSON
    raw: bytes | None = None                    # pre-encoded body (errors, attachment content)
    content_type: str | None = None             # for raw bodies that are not JSON

    def body_bytes(self) -> bytes:
        if self.status == 204:
            return b""
        if self.raw is not None:
            return self.raw
        return json.dumps(self.json, separators=(",", ":"), ensure_ascii=False, default=str).encode()

    @property
    def media_type(self) -> str:
        if self.stream is not None:
            return SSE_MEDIA_TYPE
        return self.content_type or JSON_MEDIA_TYPE


def error_response(e: ApiError) -> ApiResponse:
    return ApiResponse(e.status, headers=dict(e.headers), raw=e.body())


# ---------------------------------------------------------------------------- the route table

PUBLIC, BEARER, BEARER_OR_STREAM = "public", "bearer", "bearer_or_stream"


@dataclass(frozen=True)
class Route:
    name: str            # handler method on Api, and the OpenAPI operationId
    method: str
    path: str            # OpenAPI template: /v1/runs/{run_id}
    auth: str
    summary: str
    request: Mapping[str, Any] | None = None   # JSON schema of the body (None: no body)
    body_required: bool = True
    responses: Mapping[int, tuple[str, Mapping[str, Any] | None]] = field(default_factory=dict)
    query: tuple[tuple[str, Mapping[str, Any], str], ...] = ()
    headers: tuple[tuple[str, Mapping[str, Any], str], ...] = ()
    errors: tuple[int, ...] = ()
    sse: bool = False
    binary: bool = False  # success body is the resource's own bytes (its media type), not JSON


def _str(max_len: int, min_len: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_len, "maxLength": max_len}


def _id(max_len: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_len, "pattern": ID_PATTERN}


CURSOR_SCHEMA = {"type": "string", "pattern": "^[0-9a-f]{24}$", "description": "an opaque journal position"}
EVENT_SCHEMA = {
    "type": "object",
    "required": ["cursor", "type", "data", "ts"],
    "properties": {"cursor": CURSOR_SCHEMA, "type": {"type": "string"}, "data": {}, "ts": {"type": "number"}},
}
RUN_SCHEMA = {
    "type": "object",
    "required": ["run_id", "conversation_id", "status", "attempt"],
    "properties": {
        "run_id": {"type": "string"},
        "conversation_id": {"type": "string"},
        "status": {"type": "string", "enum": ["queued", "running", "parked", "completed", "failed", "cancelled"]},
        "attempt": {"type": "integer"},
        "agent": {"type": ["string", "null"]},
        "submission_id": {"type": ["string", "null"]},
        "created": {"type": ["number", "null"]},
        "outcome": {"type": ["object", "null"]},
        "pending_approvals": {"type": "array", "items": {"type": "string"}},
        "cancel_requested": {"type": "boolean"},
    },
}
ACK_SCHEMA = {
    "type": "object",
    "required": ["submission_id", "run_id", "conversation_id", "status", "duplicate"],
    "properties": {
        "submission_id": {"type": "string"},
        "run_id": {"type": "string"},
        "cursor": {"anyOf": [CURSOR_SCHEMA, {"type": "null"}]},
        "conversation_id": {"type": "string"},
        "status": {"type": "string"},
        "duplicate": {"type": "boolean"},
        "outcome": {"type": ["object", "null"]},
    },
}
USER_MESSAGE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["role", "content"],
    "description": f"a user message; its text is at most {MAX_MESSAGE_BYTES} UTF-8 bytes in all",
    "properties": {
        "role": {"const": "user"},
        "content": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGE_PARTS, "items": {
            "type": "object", "additionalProperties": False, "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
    },
}
LIMITS_SCHEMA = {
    "type": "object", "maxProperties": MAX_USAGE_LIMITS,
    "description": "the run's usage ceilings: max_<usage field> -> a non-negative integer, e.g. "
                   "max_total_tokens or max_cost_micros (micro-units of currency, priced by the server's "
                   "pricing; a cost ceiling on a model without a price is refused, 422 missing_price); "
                   "a model call that would pass one is refused and the run fails usage_limit",
    "propertyNames": {"pattern": "^max_[a-z][a-z0-9_]{0,62}$"},
    "additionalProperties": {"type": ["integer", "null"], "minimum": 0},
}
PROJECT_SCHEMA = {
    "type": "object", "required": ["project_id", "name", "created", "agents"],
    "properties": {"project_id": {"type": "string"}, "name": {"type": "string"}, "created": {"type": "number"},
                   "agents": {"type": "object", "additionalProperties": {"type": "object"}}},
}
AGENT_OVERRIDES_SCHEMA = {
    "type": "object", "additionalProperties": False, "minProperties": 1,
    "description": "per-owner overrides of the served agent, applied when a run in this project renders it",
    "properties": {"instructions": {"type": "string", "maxLength": MAX_INSTRUCTIONS},
                   "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000}},
}
ATTACHMENT_SCHEMA = {
    "type": "object", "required": ["attachment_id", "state", "media_type", "size", "sha256", "created"],
    "properties": {"attachment_id": {"type": "string"}, "state": {"type": "string"},
                   "media_type": {"type": "string"}, "filename": {"type": ["string", "null"]},
                   "size": {"type": ["integer", "null"]}, "sha256": {"type": ["string", "null"]},
                   "created": {"type": "number"}},
}

ROUTES: tuple[Route, ...] = (
    Route("healthz", "GET", "/healthz", PUBLIC, "Liveness: the process is up.",
          responses={200: ("alive", {"type": "object", "required": ["status"],
                                     "properties": {"status": {"const": "ok"}}})}),
    Route("readyz", "GET", "/readyz", PUBLIC, "Readiness: the store answers a read.",
          responses={200: ("ready", {"type": "object", "required": ["status"],
                                     "properties": {"status": {"const": "ready"}}})},
          errors=(503,)),
    Route("openapi", "GET", "/openapi.json", PUBLIC, "This OpenAPI 3.1 document.",
          responses={200: ("the document", {"type": "object"})}),
    Route("list_conversations", "GET", "/v1/conversations", BEARER, "The caller's conversations.",
          responses={200: ("conversation ids", {
              "type": "object", "required": ["conversations"],
              "properties": {"conversations": {"type": "array", "items": {"type": "string"}}}})}),
    Route("submit_message", "POST", "/v1/conversations/{conversation_id}/messages", BEARER,
          "Submit a user message: durably accepted (202) before any answer; Idempotency-Key is the submission id.",
          request={
              "type": "object", "additionalProperties": False, "required": ["message"],
              "properties": {
                  "message": {"oneOf": [{"type": "string", "minLength": 1}, USER_MESSAGE_SCHEMA]},
                  "result_schema": {"type": "object"},
                  "project_id": _id(MAX_ID),
                  "limits": LIMITS_SCHEMA,
              },
          },
          headers=(("Idempotency-Key", {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY,
                                        "pattern": "^[!-~]+$"},
                    "the submission id; retries with the same key and body return the same run"),),
          responses={202: ("accepted: the run is queued durably", ACK_SCHEMA),
                     200: ("this submission already settled: its outcome", ACK_SCHEMA)},
          errors=(400, 404, 409, 413, 415)),
    Route("list_messages", "GET", "/v1/conversations/{conversation_id}/messages", BEARER,
          "A page of the conversation's transcript.",
          query=(("start", {"type": "integer", "minimum": 0}, "first message index"),
                 ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "page size")),
          responses={200: ("messages", {
              "type": "object", "required": ["messages", "start", "next"],
              "properties": {"messages": {"type": "array", "items": {"type": "object"}},
                             "start": {"type": "integer"}, "next": {"type": ["integer", "null"]}}})},
          errors=(400, 404)),
    Route("fork_conversation", "POST", "/v1/conversations/{conversation_id}/fork", BEARER,
          "A new conversation holding messages [0, at) of this one.",
          request={"type": "object", "additionalProperties": False, "required": ["at"],
                   "properties": {"at": {"type": "integer", "minimum": 0},
                                  "conversation_id": _id(MAX_CONVERSATION_ID)}},
          responses={201: ("the fork", {"type": "object", "required": ["conversation_id", "forked_from", "at"],
                                        "properties": {"conversation_id": {"type": "string"},
                                                       "forked_from": {"type": "string"},
                                                       "at": {"type": "integer"}}})},
          errors=(400, 404, 409, 413, 415, 422)),
    Route("list_events", "GET", "/v1/conversations/{conversation_id}/events", BEARER_OR_STREAM,
          "The conversation's event journal after a cursor: a JSON page, or with Accept: text/event-stream an "
          "SSE stream (replay, then live; each id the event position; Last-Event-ID resumes; ?token= accepts a "
          "stream token here only).",
          query=(("after", {"type": "string", "pattern": "^([0-9a-f]{24})?$"},
                  "resume strictly after this position (empty or absent: from the oldest retained)"),
                 ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "page size (JSON only)"),
                 ("token", {"type": "string"}, "a stream token (SSE only)")),
          headers=(("Last-Event-ID", {"type": "string", "pattern": "^([0-9a-f]{24})?$"},
                    "SSE reconnect position (wins over ?after; empty means none)"),),
          responses={200: ("a page of events (JSON) or an event stream", {
              "type": "object", "required": ["events", "next_cursor", "first_retained", "behind", "more"],
              "properties": {"events": {"type": "array", "items": EVENT_SCHEMA},
                             "next_cursor": {"anyOf": [CURSOR_SCHEMA, {"type": "null"}]},
                             "first_retained": {"anyOf": [CURSOR_SCHEMA, {"type": "null"}]},
                             "behind": {"type": "boolean"}, "more": {"type": "boolean"}}})},
          errors=(400, 404), sse=True),
    Route("list_runs", "GET", "/v1/conversations/{conversation_id}/runs", BEARER,
          "The conversation's runs, oldest first.",
          responses={200: ("runs", {"type": "object", "required": ["runs"],
                                    "properties": {"runs": {"type": "array", "items": RUN_SCHEMA}}})},
          errors=(400, 404)),
    Route("get_run", "GET", "/v1/runs/{run_id}", BEARER, "A run's state, attempts and outcome.",
          responses={200: ("the run", RUN_SCHEMA)}, errors=(400, 404)),
    Route("cancel_run", "POST", "/v1/runs/{run_id}/cancel", BEARER,
          "Durably request cancellation (a queued or parked run settles cancelled at once).",
          responses={202: ("cancel recorded", RUN_SCHEMA)}, errors=(400, 404)),
    Route("resolve_approval", "POST", "/v1/runs/{run_id}/approvals/{call_id}", BEARER,
          "Approve or deny a parked tool call.",
          request={"type": "object", "additionalProperties": False, "required": ["allow"],
                   "properties": {"allow": {"type": "boolean"}, "reason": _str(MAX_REASON, 0)}},
          responses={200: ("decision recorded", {
              "type": "object", "required": ["run_id", "call_id", "allow"],
              "properties": {"run_id": {"type": "string"}, "call_id": {"type": "string"},
                             "allow": {"type": "boolean"}}})},
          errors=(400, 404, 409, 413, 415)),
    Route("create_project", "POST", "/v1/projects", BEARER, "Create a project (a named container of conversations).",
          request={"type": "object", "additionalProperties": False, "required": ["name"],
                   "properties": {"name": _str(MAX_PROJECT_NAME), "project_id": _id(MAX_ID)}},
          responses={201: ("the project", PROJECT_SCHEMA)}, errors=(400, 413, 415)),
    Route("list_projects", "GET", "/v1/projects", BEARER, "The caller's projects.",
          responses={200: ("projects", {"type": "object", "required": ["projects"],
                                        "properties": {"projects": {"type": "array", "items": PROJECT_SCHEMA}}})}),
    Route("get_project", "GET", "/v1/projects/{project_id}", BEARER, "A project and its agent overrides.",
          responses={200: ("the project", PROJECT_SCHEMA)}, errors=(400, 404)),
    Route("delete_project", "DELETE", "/v1/projects/{project_id}", BEARER,
          "Delete a project (its conversations stay).", responses={204: ("deleted", None)}, errors=(400, 404)),
    Route("list_project_conversations", "GET", "/v1/projects/{project_id}/conversations", BEARER,
          "Conversations filed under the project (by submitting with its project_id).",
          responses={200: ("conversation ids", {
              "type": "object", "required": ["conversations"],
              "properties": {"conversations": {"type": "array", "items": {"type": "string"}}}})},
          errors=(400, 404)),
    Route("set_agent_overrides", "PUT", "/v1/projects/{project_id}/agents/{agent}", BEARER,
          "Set this owner's overrides of an agent for runs in the project (never changes the shared agent).",
          request=AGENT_OVERRIDES_SCHEMA, responses={200: ("the project", PROJECT_SCHEMA)},
          errors=(400, 404, 413, 415)),
    Route("delete_agent_overrides", "DELETE", "/v1/projects/{project_id}/agents/{agent}", BEARER,
          "Remove this owner's overrides of an agent in the project.",
          responses={200: ("the project", PROJECT_SCHEMA)}, errors=(400, 404)),
    Route("create_attachment", "POST", "/v1/attachments", BEARER,
          f"Upload an attachment as base64 JSON (at most {MAX_ATTACHMENT_BYTES} decoded bytes; the request itself "
          f"at most {MAX_REQUEST_BYTES} bytes).",
          request={"type": "object", "additionalProperties": False, "required": ["data", "media_type"],
                   "properties": {"data": {"type": "string", "contentEncoding": "base64"},
                                  "media_type": {"type": "string", "minLength": 1, "maxLength": 255,
                                                 "pattern": "^[!-~]+/[!-~]+$"},
                                  "filename": _str(MAX_FILENAME),
                                  "attachment_id": _id(MAX_ID)}},
          responses={201: ("stored (ready)", ATTACHMENT_SCHEMA)}, errors=(400, 409, 413, 415, 422)),
    Route("get_attachment", "GET", "/v1/attachments/{attachment_id}", BEARER, "An attachment's metadata.",
          responses={200: ("metadata", ATTACHMENT_SCHEMA)}, errors=(400, 404)),
    Route("get_attachment_content", "GET", "/v1/attachments/{attachment_id}/content", BEARER,
          "An attachment's bytes, with its media type.",
          responses={200: ("the bytes", None)}, errors=(400, 404, 409), binary=True),
    Route("delete_attachment", "DELETE", "/v1/attachments/{attachment_id}", BEARER, "Delete an attachment.",
          responses={204: ("deleted", None)}, errors=(400, 404)),
    Route("create_stream_token", "POST", "/v1/stream-tokens", BEARER,
          "A signed token for ?token= on the SSE route: bound to the caller (and optionally one "
          "conversation), valid 10 minutes.",
          request={"type": "object", "additionalProperties": False,
                   "properties": {"conversation_id": _id(MAX_CONVERSATION_ID)}},
          body_required=False,
          responses={201: ("the token", {"type": "object", "required": ["token", "expires_at", "expires_in"],
                                         "properties": {"token": {"type": "string"},
                                                        "expires_at": {"type": "number"},
                                                        "expires_in": {"type": "integer"}}})},
          errors=(400, 413, 415)),
)

ROUTES_BY_NAME = {r.name: r for r in ROUTES}
assert len(ROUTES_BY_NAME) == len(ROUTES)


# ---------------------------------------------------------------------------- validation helpers


def _bad(message: str) -> ApiError:
    return ApiError("invalid_request", message)


def _check_id(name: str, value: str, max_len: int) -> str:
    # Ids are only lookup keys (tuple-encoded, so any characters are safe); a strange one is simply not found.
    if not isinstance(value, str) or not value or len(value) > max_len or not _ID_RE.match(value):
        raise _bad(f"{name} must be 1..{max_len} characters matching {ID_PATTERN}")
    return value


def _int_param(query: Mapping[str, str], name: str, default: int, lo: int, hi: int | None = None) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise _bad(f"query parameter {name} must be an integer") from None
    if v < lo or (hi is not None and v > hi):
        raise _bad(f"query parameter {name} must be in {lo}..{hi if hi is not None else 'inf'}")
    return v


def _object(body: Any, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    extra = set(body) - allowed
    if extra:
        raise _bad(f"unknown field(s): {', '.join(sorted(extra))}")
    missing = required - set(body)
    if missing:
        raise _bad(f"missing field(s): {', '.join(sorted(missing))}")
    return body


def _body_id(name: str, value: Any) -> str:
    """An id given in a body (it will appear in URLs, so no '/')."""
    if not isinstance(value, str):
        raise _bad(f"{name} must be a string")
    return _check_id(name, value, MAX_ID)


def _user_message(message: Any) -> str | dict[str, Any]:
    """A string, or a user message {"role": "user", "content": [{"type": "text", "text"}...]}; size-capped."""
    if isinstance(message, str):
        if not message:
            raise _bad("message must not be empty")
        size = len(message.encode("utf-8"))
    elif isinstance(message, dict):
        _object(message, {"role", "content"}, {"role", "content"})
        content = message["content"]
        if message["role"] != "user":
            raise _bad("message.role must be 'user'")
        if not isinstance(content, list) or not 0 < len(content) <= MAX_MESSAGE_PARTS:
            raise _bad(f"message.content must be a list of 1..{MAX_MESSAGE_PARTS} parts")
        size = 0
        for part in content:
            if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text" \
                    or not isinstance(part["text"], str):
                raise _bad('each message part must be {"type": "text", "text": STRING}')
            size += len(part["text"].encode("utf-8"))
        message = {"role": "user", "content": [{"type": "text", "text": p["text"]} for p in content]}
    else:
        raise _bad("message must be a string or a user message object")
    if size > MAX_MESSAGE_BYTES:
        raise ApiError("payload_too_large",
                       f"message text of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte message limit "
                       f"by {size - MAX_MESSAGE_BYTES} bytes",
                       extra={"limit": "message", "limit_bytes": MAX_MESSAGE_BYTES,
                              "over_by_bytes": size - MAX_MESSAGE_BYTES})
    return message


def _is_cursor(value: str) -> bool:
    return len(value) == 24 and all(c in "0123456789abcdef" for c in value)


def run_json(info: Any) -> dict[str, Any]:
    return {
        "run_id": info.run_id,
        "conversation_id": info.conversation,
        "status": info.status,
        "attempt": info.attempt,
        "agent": info.agent,
        "submission_id": info.submission_id,
        "created": info.created,
        "outcome": dict(info.outcome) if info.outcome is not None else None,
        "pending_approvals": list(info.pending_approvals),
        "cancel_requested": bool(getattr(info, "cancel_requested", False)),
    }


def _jsonable(value: Any) -> Any:
    """CBOR-decoded records may hold bytes/tuples; JSON them predictably."""
    return json.loads(json.dumps(value, default=lambda o: o.hex() if isinstance(o, (bytes, bytearray)) else str(o)))


# ---------------------------------------------------------------------------- the API


class Api:
    """Handlers for :data:`ROUTES` over one :class:`~loop.runtime.Runtime`."""

    def __init__(self, runtime: Any, authenticator: Authenticator, *, agent: Any,
                 hubs: sse.Hubs | None = None, openapi: Callable[[], Mapping[str, Any]] | None = None,
                 heartbeat: float = sse.HEARTBEAT_SECONDS) -> None:
        self.rt = runtime
        self.auth = authenticator
        self.agent = agent
        self.hubs = hubs
        self._openapi = openapi
        self.heartbeat = heartbeat
        self.ready = True
        from sessions.attachments import Attachments
        from sessions.projects import Projects

        root = runtime.store.root
        now = runtime.clock.now
        self.projects = Projects(runtime.db, root, clock=now)
        self.attachments = Attachments(runtime.db, root, clock=now)
        self._variants: dict[str, Any] = {}

    # -- the one entry point ---------------------------------------------------

    async def handle(self, route: Route, req: ApiRequest) -> ApiResponse:
        """Authenticate, parse, run the handler; every failure becomes a JSON error, never a traceback."""
        try:
            principal = self._authenticate(route, req)
            body = self._parse_body(route, req)
            handler: Callable[..., Awaitable[ApiResponse]] = getattr(self, route.name)
            return await handler(principal, req, body)
        except Exception as e:  # noqa: BLE001 - the one place errors become responses
            api_error = from_exception(e)
            if api_error is None:
                log.exception("%s %s failed", req.method, route.path)
                api_error = ApiError("internal", "internal error")
            return error_response(api_error)

    def _authenticate(self, route: Route, req: ApiRequest) -> Principal | None:
        if route.auth == PUBLIC:
            return None
        if route.auth == BEARER_OR_STREAM and wants_sse(req.headers) and "token" in req.query \
                and "authorization" not in req.headers:
            return self.auth.verify_stream_token(req.query["token"], req.params.get("conversation_id", ""))
        principal = self.auth.authenticate(req.headers.get("authorization"))
        return principal

    def _parse_body(self, route: Route, req: ApiRequest) -> Any:
        if route.request is None:
            return None  # a body on a body-less route is ignored (already read off the wire)
        if not req.body.strip():
            if route.body_required:
                raise _bad("a JSON request body is required")
            return {}
        ctype = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != JSON_MEDIA_TYPE and not (ctype.startswith("application/") and ctype.endswith("+json")):
            raise ApiError("unsupported_media_type", "the request body must be application/json")
        try:
            value = json.loads(req.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ApiError("invalid_json", "the request body is not valid JSON") from None
        try:
            # JSON may spell unpaired surrogates (\\udb70) that no UTF-8 store can hold: refuse them here
            # rather than fail at the storage layer after acknowledging.
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError("invalid_json", "the request body contains unpaired UTF-16 surrogates") from None
        return value

    # -- public ----------------------------------------------------------------

    async def healthz(self, principal: None, req: ApiRequest, body: None) -> ApiResponse:
        return ApiResponse(200, {"status": "ok"})

    async def readyz(self, principal: None, req: ApiRequest, body: None) -> ApiResponse:
        if not self.ready or (self.hubs is not None and self.hubs.closing):
            raise ApiError("not_ready", "shutting down")
        try:
            with trio.fail_after(2):
                await self.rt.db.transact(lambda tr: tr.get(b"\x00surefoot/readyz"))  # read-only: idempotent
        except Exception:  # noqa: BLE001 - any failure means "not ready", with no detail to the client
            log.warning("readiness check failed", exc_info=True)
            raise ApiError("not_ready", "the store is not answering") from None
        return ApiResponse(200, {"status": "ready"})

    async def openapi(self, principal: None, req: ApiRequest, body: None) -> ApiResponse:
        assert self._openapi is not None
        return ApiResponse(200, self._openapi())

    # -- conversations ---------------------------------------------------------

    async def _conversation_exists(self, owner: str, conv: str) -> bool:
        try:
            await self.rt.read_events(conv, None, limit=1, owner=owner)
            return True
        except Exception as e:  # noqa: BLE001
            err = from_exception(e)
            if err is None or err.code != "not_found":
                raise
        return bool(await self.rt.store.transcripts.exists(owner, conv))

    async def _require_conversation(self, owner: str, conv: str) -> None:
        if not await self._conversation_exists(owner, conv):
            raise ApiError("not_found", "not found")

    async def list_conversations(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        convs = await self.rt.conversations(owner=principal.owner)
        return ApiResponse(200, {"conversations": list(convs)})

    async def submit_message(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        conv = _check_id("conversation_id", req.params["conversation_id"], MAX_CONVERSATION_ID)
        body = _object(body, {"message", "result_schema", "project_id", "limits"}, {"message"})
        message = _user_message(body["message"])
        limits = None
        if "limits" in body:
            raw = body["limits"]
            if isinstance(raw, dict):  # JSON Schema's integers include 5.0 (a JSON number is just a number)
                raw = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in raw.items()}
            try:
                limits = check_limits(raw)
            except ValueError as e:
                raise _bad(str(e)) from None
        project_id = None
        agent = self.agent
        if "project_id" in body:
            project_id = _body_id("project_id", body["project_id"])
            agent = await self._agent_for_project(principal.owner, project_id)
        schema = body.get("result_schema")
        if "result_schema" in body and not isinstance(schema, dict):
            raise _bad("result_schema must be a JSON schema object")
        key = req.headers.get("idempotency-key")
        if key is None:
            key = uuid.uuid4().hex
        elif not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and _IDEMPOTENCY_KEY_RE.match(key)):
            raise _bad(f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY} printable ASCII characters, no spaces")
        ack = await self.rt.submit(agent, conv, message, submission_id=key, result_schema=schema,
                                   owner=principal.owner, limits=limits or None)
        if project_id is not None:
            await self.projects.add_session(principal.owner, project_id, conv)  # idempotent
        if ack.duplicate:
            # The ledger's request hash covers the delivery, not the conversation: the same key
            # reused for another conversation is a different request too.
            info = await self.rt.get_run(ack.run_id, owner=principal.owner)
            if info.conversation != conv:
                raise ApiError("idempotency_conflict", "this Idempotency-Key was already used with a different request")
        payload = {
            "submission_id": ack.submission_id,
            "run_id": ack.run_id,
            "cursor": ack.cursor,
            "conversation_id": conv,
            "status": ack.status,
            "duplicate": bool(ack.duplicate),
            "outcome": _jsonable(dict(ack.outcome)) if ack.outcome is not None else None,
        }
        headers = {"Idempotency-Key": key, "Location": f"/v1/runs/{ack.run_id}"}
        return ApiResponse(200 if ack.outcome is not None else 202, payload, headers)

    async def list_messages(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        conv = _check_id("conversation_id", req.params["conversation_id"], MAX_CONVERSATION_ID)
        start = _int_param(req.query, "start", 0, 0)
        limit = _int_param(req.query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
        messages = await self.rt.transcript(conv, start=start, owner=principal.owner)
        if not messages:
            await self._require_conversation(principal.owner, conv)
        page = messages[:limit]
        nxt = start + limit if len(messages) > limit else None
        return ApiResponse(200, {"messages": _jsonable(page), "start": start, "next": nxt})

    async def fork_conversation(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        conv = _check_id("conversation_id", req.params["conversation_id"], MAX_CONVERSATION_ID)
        body = _object(body, {"at", "conversation_id"}, {"at"})
        at = body["at"]
        if isinstance(at, float) and at.is_integer():
            at = int(at)  # JSON Schema's integer includes 3.0
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            raise _bad("at must be a non-negative integer")
        new = body.get("conversation_id")
        if "conversation_id" in body:
            if not isinstance(new, str):
                raise _bad("conversation_id must be a string")
            _check_id("conversation_id", new, MAX_CONVERSATION_ID)
        if not await self.rt.store.transcripts.exists(principal.owner, conv):
            await self._require_conversation(principal.owner, conv)
            raise ApiError("unprocessable", f"the conversation has no messages to fork (at={at})")
        length = await self.rt.store.transcripts.head(principal.owner, conv)
        if at > length:
            raise ApiError("unprocessable", f"at={at} is past the end of the transcript ({length} messages)")
        new_id = await self.rt.fork(conv, at, new_conversation=new, owner=principal.owner)
        return ApiResponse(201, {"conversation_id": new_id, "forked_from": conv, "at": at},
                           {"Location": f"/v1/conversations/{new_id}/messages"})

    async def list_events(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        conv = _check_id("conversation_id", req.params["conversation_id"], MAX_CONVERSATION_ID)
        owner = principal.owner
        after = req.query.get("after") or None
        last_id = req.headers.get("last-event-id", "").strip()
        if last_id:
            after = last_id  # an EventSource reconnect: wins over the original URL's ?after
        if after is not None and not _is_cursor(after):
            raise ApiError("invalid_cursor", "not a cursor this server issued")
        if wants_sse(req.headers):
            # 404 (foreign or missing) before the stream starts, with the JSON error body.
            await self.rt.read_events(conv, after, limit=1, owner=owner)
            assert self.hubs is not None, "SSE needs the server's hub nursery"
            if self.hubs.closing:
                raise ApiError("not_ready", "shutting down")

            async def read_page(cursor: str | None, limit: int) -> Any:
                return await self.rt.read_events(conv, cursor, limit=limit, owner=owner)

            body_iter = sse.stream(self.hubs, owner, conv, after, read_page, heartbeat=self.heartbeat)
            return ApiResponse(200, stream=body_iter, headers={
                "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        limit = _int_param(req.query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
        page = await self.rt.read_events(conv, after, limit=limit, owner=owner)
        return ApiResponse(200, {
            "events": [_jsonable(sse.event_json(e)) for e in page.events],
            "next_cursor": page.next_cursor,
            "first_retained": page.first_retained,
            "behind": bool(page.behind),
            "more": bool(page.more),
        })

    async def list_runs(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        conv = _check_id("conversation_id", req.params["conversation_id"], MAX_CONVERSATION_ID)
        runs = await self.rt.runs(conv, owner=principal.owner)
        if not runs:
            await self._require_conversation(principal.owner, conv)
        return ApiResponse(200, {"runs": [_jsonable(run_json(r)) for r in runs]})

    # -- runs ------------------------------------------------------------------

    async def get_run(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        run_id = _check_id("run_id", req.params["run_id"], MAX_ID)
        info = await self.rt.get_run(run_id, owner=principal.owner)
        return ApiResponse(200, _jsonable(run_json(info)))

    async def cancel_run(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        run_id = _check_id("run_id", req.params["run_id"], MAX_ID)
        info = await self.rt.cancel(run_id, owner=principal.owner)
        return ApiResponse(202, _jsonable(run_json(info)))

    async def resolve_approval(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        run_id = _check_id("run_id", req.params["run_id"], MAX_ID)
        call_id = _check_id("call_id", req.params["call_id"], MAX_ID)
        body = _object(body, {"allow", "reason"}, {"allow"})
        allow = body["allow"]
        if not isinstance(allow, bool):
            raise _bad("allow must be true or false")
        reason = body.get("reason")
        if "reason" in body and (not isinstance(reason, str) or len(reason) > MAX_REASON):
            raise _bad(f"reason must be a string of at most {MAX_REASON} characters")
        await self.rt.approve(run_id, call_id, allow, reason, owner=principal.owner)
        return ApiResponse(200, {"run_id": run_id, "call_id": call_id, "allow": allow})

    # -- projects and per-owner agent configuration ---------------------------

    async def _agent_for_project(self, owner: str, project_id: str) -> Any:
        """The served agent as this owner configured it for the project (a derived agent, never the shared one)."""
        overrides = await self.projects.agent_overrides(owner, project_id, self.agent.name)
        if not overrides:
            return self.agent
        digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:16]
        name = f"{self.agent.name}~{digest}"
        variant = self._variants.get(name)
        if variant is None:
            changes: dict[str, Any] = {"name": name}
            if "instructions" in overrides:
                changes["instructions"] = overrides["instructions"]
            if "max_tokens" in overrides:
                changes["max_tokens"] = overrides["max_tokens"]
            variant = dataclasses.replace(self.agent, **changes)
            self._variants[name] = variant
        return variant

    @staticmethod
    def _project_json(info: Any) -> dict[str, Any]:
        return _jsonable({"project_id": info.id, "name": info.name, "created": info.created,
                          "agents": dict(info.agents)})

    async def create_project(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        body = _object(body, {"name", "project_id"}, {"name"})
        name = body["name"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_PROJECT_NAME:
            raise _bad(f"name must be 1..{MAX_PROJECT_NAME} characters")
        pid = _body_id("project_id", body["project_id"]) if "project_id" in body else None
        info = await self.projects.create(principal.owner, name, project_id=pid)
        return ApiResponse(201, self._project_json(info), {"Location": f"/v1/projects/{info.id}"})

    async def list_projects(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        return ApiResponse(200, {"projects": [self._project_json(p) for p in await self.projects.list(principal.owner)]})

    async def get_project(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        pid = _check_id("project_id", req.params["project_id"], MAX_ID)
        return ApiResponse(200, self._project_json(await self.projects.get(principal.owner, pid)))

    async def delete_project(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        pid = _check_id("project_id", req.params["project_id"], MAX_ID)
        await self.projects.delete(principal.owner, pid)
        return ApiResponse(204)

    async def list_project_conversations(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        pid = _check_id("project_id", req.params["project_id"], MAX_ID)
        return ApiResponse(200, {"conversations": list(await self.projects.sessions(principal.owner, pid))})

    async def set_agent_overrides(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        pid = _check_id("project_id", req.params["project_id"], MAX_ID)
        agent = _check_id("agent", req.params["agent"], MAX_ID)
        body = _object(body, {"instructions", "max_tokens"})
        if not body:
            raise _bad("give at least one of: instructions, max_tokens")
        if "instructions" in body and (not isinstance(body["instructions"], str)
                                       or len(body["instructions"]) > MAX_INSTRUCTIONS):
            raise _bad(f"instructions must be a string of at most {MAX_INSTRUCTIONS} characters")
        if "max_tokens" in body:
            mt = body["max_tokens"]
            if isinstance(mt, float) and mt.is_integer():
                body["max_tokens"] = mt = int(mt)
            if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= 1_000_000:
                raise _bad("max_tokens must be an integer in 1..1000000")
        info = await self.projects.set_agent_overrides(principal.owner, pid, agent, body)
        return ApiResponse(200, self._project_json(info))

    async def delete_agent_overrides(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        pid = _check_id("project_id", req.params["project_id"], MAX_ID)
        agent = _check_id("agent", req.params["agent"], MAX_ID)
        info = await self.projects.set_agent_overrides(principal.owner, pid, agent, None)
        return ApiResponse(200, self._project_json(info))

    # -- attachments -----------------------------------------------------------

    @staticmethod
    def _attachment_json(info: Any) -> dict[str, Any]:
        return {"attachment_id": info.id, "state": info.state, "media_type": info.media_type,
                "filename": info.filename, "size": info.size, "sha256": info.sha256, "created": info.created}

    async def create_attachment(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        body = _object(body, {"data", "media_type", "filename", "attachment_id"}, {"data", "media_type"})
        data, media_type = body["data"], body["media_type"]
        if not isinstance(data, str):
            raise _bad("data must be a base64 string")
        if not isinstance(media_type, str) or len(media_type) > 255 or not _MEDIA_TYPE_RE.match(media_type):
            raise _bad("media_type must be a type/subtype of printable ASCII")
        filename = body.get("filename")
        if "filename" in body and (not isinstance(filename, str) or not 0 < len(filename) <= MAX_FILENAME):
            raise _bad(f"filename must be 1..{MAX_FILENAME} characters")
        aid = _body_id("attachment_id", body["attachment_id"]) if "attachment_id" in body else None
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError("unprocessable", "data is not valid base64") from None
        if len(raw) > MAX_ATTACHMENT_BYTES:
            over = len(raw) - MAX_ATTACHMENT_BYTES
            raise ApiError("payload_too_large",
                           f"attachment of {len(raw)} decoded bytes exceeds the {MAX_ATTACHMENT_BYTES}-byte "
                           f"attachment limit by {over} bytes",
                           extra={"limit": "attachment", "limit_bytes": MAX_ATTACHMENT_BYTES, "over_by_bytes": over})
        info = await self.attachments.upload(principal.owner, raw, media_type=media_type, filename=filename,
                                             attachment_id=aid)
        if info.sha256 != hashlib.sha256(raw).hexdigest():
            raise ApiError("idempotency_conflict", "this attachment_id already holds different content")
        return ApiResponse(201, self._attachment_json(info), {"Location": f"/v1/attachments/{info.id}"})

    async def get_attachment(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        aid = _check_id("attachment_id", req.params["attachment_id"], MAX_ID)
        return ApiResponse(200, self._attachment_json(await self.attachments.get(principal.owner, aid)))

    async def get_attachment_content(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        aid = _check_id("attachment_id", req.params["attachment_id"], MAX_ID)
        info = await self.attachments.get(principal.owner, aid)
        data = await self.attachments.read(principal.owner, aid)
        return ApiResponse(200, raw=data, content_type=info.media_type,
                           headers={"X-Content-Type-Options": "nosniff",
                                    "Content-Disposition": "attachment"})

    async def delete_attachment(self, principal: Principal, req: ApiRequest, body: None) -> ApiResponse:
        aid = _check_id("attachment_id", req.params["attachment_id"], MAX_ID)
        await self.attachments.delete(principal.owner, aid)
        return ApiResponse(204)

    # -- stream tokens ---------------------------------------------------------

    async def create_stream_token(self, principal: Principal, req: ApiRequest, body: Any) -> ApiResponse:
        body = _object(body, {"conversation_id"})
        conv = body.get("conversation_id")
        if "conversation_id" in body:
            if not isinstance(conv, str):
                raise _bad("conversation_id must be a string")
            _check_id("conversation_id", conv, MAX_CONVERSATION_ID)
        if principal.via == "stream-token":
            raise ApiError("unauthorized", "a stream token cannot mint stream tokens")
        token, expires_at = self.auth.issue_stream_token(principal, conv)
        return ApiResponse(201, {"token": token, "expires_at": expires_at,
                                 "expires_in": STREAM_TOKEN_SECONDS})


def wants_sse(headers: Mapping[str, str]) -> bool:
    return SSE_MEDIA_TYPE in headers.get("accept", "").lower()


__all__ += ["wants_sse", "error_body", "run_json"]
