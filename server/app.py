"""The Quart (quart-trio) transport over :mod:`server.api`.

All this module does is move bytes: it reads the request body (bounded), builds
an :class:`~server.api.ApiRequest`, calls :meth:`Api.handle`, and writes the
:class:`~server.api.ApiResponse` (JSON, or an SSE stream with no response
timeout). Two transport rules live here because they are about the wire:

* The body is always read (up to the cap) *before* any answer, including an
  early 401: replying before a POST body is consumed can leave a kept-alive
  hypercorn connection hanging on the next request.
* A body over :data:`~server.limits.MAX_REQUEST_BYTES` is not drained: the
  answer (413, or 401 if the credentials were bad anyway) carries
  ``Connection: close``.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .api import ROUTES, Api, ApiRequest, ApiResponse, Route, error_response
from .errors import ApiError
from .limits import MAX_REQUEST_BYTES

log = logging.getLogger(__name__)

__all__ = ["create_app", "quart_path"]

#: Seconds allowed to receive a request body (Quart's default is 60 s; bodies here are <= 256 KiB).
BODY_TIMEOUT_SECONDS = 30


def quart_path(openapi_path: str) -> str:
    """``/v1/runs/{run_id}`` -> ``/v1/runs/<run_id>`` (the default converter: any characters but '/')."""
    return openapi_path.replace("{", "<").replace("}", ">")


async def _read_body(limit: int) -> tuple[bytes, int | None]:
    """The request body, or (partial, size) when it exceeds ``limit`` (size may be a lower bound)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            n = -1
        if n > limit:
            return b"", n
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.body:
        total += len(chunk)
        if total > limit:
            return b"", total
        chunks.append(chunk)
    return b"".join(chunks), None


def _to_quart(resp: ApiResponse) -> Response:
    if resp.stream is not None:
        r = Response(resp.stream, status=resp.status, headers=resp.headers, mimetype="text/event-stream")
        r.timeout = None  # an SSE stream lives as long as its client (Quart's RESPONSE_TIMEOUT is 60 s)
        return r
    return Response(resp.body_bytes(), status=resp.status, headers=resp.headers, content_type=resp.media_type)


def create_app(api: Api) -> QuartTrio:
    """The Quart app serving :data:`~server.api.ROUTES` through ``api``."""
    app = QuartTrio("surefoot")
    app.config.update(
        RESPONSE_TIMEOUT=None,         # per-route below; SSE streams must not be cut at 60 s
        BODY_TIMEOUT=BODY_TIMEOUT_SECONDS,
        MAX_CONTENT_LENGTH=None,       # enforced by _read_body with a 413 that says by how much
        PROPAGATE_EXCEPTIONS=False,
    )
    app.extensions["surefoot_api"] = api

    def make_view(route: Route) -> Any:
        async def view(**params: str) -> Response:
            headers = {k.lower(): v for k, v in request.headers.items()}
            req = ApiRequest(route.method, params, {k: request.args.get(k, "") for k in request.args}, headers)
            body, oversize = await _read_body(MAX_REQUEST_BYTES)
            if oversize is not None:
                try:
                    api._authenticate(route, req)
                    err = ApiError(
                        "payload_too_large",
                        f"request body of {oversize} bytes exceeds the {MAX_REQUEST_BYTES}-byte request limit "
                        f"by {oversize - MAX_REQUEST_BYTES} bytes",
                        extra={"limit": "request", "limit_bytes": MAX_REQUEST_BYTES,
                               "over_by_bytes": oversize - MAX_REQUEST_BYTES},
                    )
                except ApiError as e:
                    err = e
                resp = error_response(err)
                resp.headers["Connection"] = "close"
                return _to_quart(resp)
            req.body = body
            resp = await api.handle(route, req)
            out = _to_quart(resp)
            if resp.stream is None:
                out.timeout = 60
            return out

        view.__name__ = route.name
        return view

    for route in ROUTES:
        app.add_url_rule(quart_path(route.path), route.name, make_view(route), methods=[route.method],
                         provide_automatic_options=False)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        # Unknown paths and wrong methods: the same JSON shape as everything else. Routing failed
        # before any view read the body, so drain it here (the kept-alive connection pitfall).
        try:
            _, oversize = await _read_body(MAX_REQUEST_BYTES)
        except Exception:  # noqa: BLE001 - a broken body: just close the connection after answering
            oversize = -1
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
                415: "unsupported_media_type", 400: "invalid_request"}.get(e.code or 500, "internal")
        status = e.code or 500
        message = "not found" if status == 404 else (e.description or e.name or "error")
        err = ApiError(code, message if status != 500 else "internal error", status=status)
        out = _to_quart(error_response(err))
        if oversize is not None:
            out.headers["Connection"] = "close"
        if status == 405 and getattr(e, "valid_methods", None):
            out.headers["Allow"] = ", ".join(e.valid_methods)  # type: ignore[attr-defined]
        return out

    @app.errorhandler(Exception)
    async def unexpected(e: Exception) -> Response:
        log.exception("unhandled error")
        return _to_quart(error_response(ApiError("internal", "internal error")))

    return app
