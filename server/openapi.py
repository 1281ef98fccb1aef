"""The OpenAPI 3.1 document, generated from :data:`server.api.ROUTES`.

Generated rather than written so it cannot drift from the real routes: every
route, path parameter, query parameter, header, body schema, success response
and error status comes from the same table the app registers.
"""

from __future__ import annotations

import re
from typing import Any

from .api import ID_PATTERN, BEARER, BEARER_OR_STREAM, PUBLIC, ROUTES, Route
from .errors import CODES
from .limits import MAX_ATTACHMENT_BYTES, MAX_CONVERSATION_ID, MAX_ID, MAX_REQUEST_BYTES

__all__ = ["build_openapi", "API_VERSION"]

API_VERSION = "1.0.0"

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string", "enum": sorted(CODES)}, "message": {"type": "string"}},
        }
    },
}

_ERROR_TEXT = {
    400: "malformed JSON, a schema violation or a bad parameter",
    401: "missing or invalid credentials",
    404: "not found (a resource of another owner answers exactly the same)",
    409: "conflict (an Idempotency-Key reused with a different request, or a state that forbids this)",
    413: f"request body over {MAX_REQUEST_BYTES} bytes (or an attachment over {MAX_ATTACHMENT_BYTES} decoded "
         "bytes); the message says which limit and by how much",
    415: "the body is not application/json",
    422: "well-formed but not applicable (e.g. a fork point past the end)",
    503: "authentication is not configured, or the server is not ready",
}


def _operation(route: Route) -> dict[str, Any]:
    params: list[dict[str, Any]] = []
    for name in re.findall(r"{(\w+)}", route.path):
        max_len = MAX_CONVERSATION_ID if name == "conversation_id" else MAX_ID
        schema = {"type": "string", "minLength": 1, "maxLength": max_len, "pattern": ID_PATTERN}
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    for name, schema, desc in route.query:
        params.append({"name": name, "in": "query", "required": False, "schema": dict(schema), "description": desc})
    for name, schema, desc in route.headers:
        params.append({"name": name, "in": "header", "required": False, "schema": dict(schema), "description": desc})
    op: dict[str, Any] = {"operationId": route.name, "summary": route.summary}
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {"required": route.body_required,
                             "content": {"application/json": {"schema": dict(route.request)}}}
    responses: dict[str, Any] = {}
    for status, (desc, schema) in sorted(route.responses.items()):
        if status == 204:
            responses[str(status)] = {"description": desc}
            continue
        if route.binary:
            responses[str(status)] = {"description": desc,
                                      "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}}
            continue
        content: dict[str, Any] = {"application/json": {"schema": schema or {}}}
        if route.sse:
            content["text/event-stream"] = {"schema": {
                "type": "string",
                "description": "SSE: each frame's id is the event position, event its type, data the JSON event; "
                               "': heartbeat' comments; a 'cursor.behind' frame (no id) when the cursor fell "
                               "behind retention, with first_retained",
            }}
        responses[str(status)] = {"description": desc, "content": content}
    errors = set(route.errors)
    if route.auth != PUBLIC:
        errors |= {401, 503}
    for status in sorted(errors):
        responses[str(status)] = {"description": _ERROR_TEXT.get(status, "error"),
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op["responses"] = responses
    if route.auth == PUBLIC:
        op["security"] = []
    elif route.auth == BEARER_OR_STREAM:
        op["security"] = [{"bearer": []}, {"streamToken": []}]
    else:
        assert route.auth == BEARER
        op["security"] = [{"bearer": []}]
    return op


def build_openapi() -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "surefoot",
            "version": API_VERSION,
            "description": "The surefoot thread API: durable submissions (Idempotency-Key = submission id), "
                           "runs, transcripts and a resumable event stream. Errors are "
                           '{"error": {"code", "message"}} with stable codes.',
        },
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "the SUREFOOT_TOKEN client token, or a JWT in --auth jwt mode"},
                "streamToken": {"type": "apiKey", "in": "query", "name": "token",
                                "description": "a stream token from POST /v1/stream-tokens; SSE route only"},
            },
        },
        "security": [{"bearer": []}],
    }
