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
from urllib.parse import parse_qsl

import trio

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .api import ROUTES, Api, ApiRequest, ApiResponse, Route, error_response
from .errors import ApiError
from .limits import MAX_REQUEST_BYTES
from .wire import DirectWriter, open_direct_writer

log = logging.getLogger(__name__)

__all__ = ["create_app", "create_asgi", "FastRoutes", "quart_path"]

#: Live SSE frames are written to the socket by the hub where the connection allows it (server.wire).
#: False keeps every frame on hypercorn's ASGI send path (for comparison; same bytes on the wire).
DIRECT_SSE_WRITES = True
#: Seconds allowed to receive a request body (Quart's default is 60 s; bodies here are <= 256 KiB).
BODY_TIMEOUT_SECONDS = 30


def quart_path(openapi_path: str) -> str:
    """``/v1/runs/{run_id}`` -> ``/v1/runs/<run_id>`` (the default converter: any characters but '/')."""
    return openapi_path.replace("{", "<").replace("}", ">")


def _declared_oversize(content_length: str | None, limit: int) -> int | None:
    """The declared body size if it exceeds ``limit`` (refuse before reading), else None."""
    if content_length is None:
        return None
    try:
        n = int(content_length)
    except ValueError:
        return None
    return n if n > limit else None


async def _read_body(limit: int) -> tuple[bytes, int | None]:
    """The request body, or (partial, size) when it exceeds ``limit`` (size may be a lower bound)."""
    n = _declared_oversize(request.headers.get("content-length"), limit)
    if n is not None:
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
                    err = _oversize_error(oversize)
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


# ---------------------------------------------------------------------------- the raw ASGI hot paths

#: Routes served by :class:`FastRoutes` without Quart: the two that run per event or per submission.
_FAST_PATHS = {
    ("POST", "messages"): "submit_message",
    ("GET", "events"): "list_events",
}
_CONVERSATION_PREFIX = "/v1/conversations/"


class FastRoutes:
    """An ASGI front that serves the hot routes directly and hands everything else to Quart.

    Why: profiling put most of the per-frame SSE cost and a large share of the per-submission
    cost in Quart's request/response machinery (request and Response objects, Werkzeug header
    structures, the body wrapper, one context push per request, one Quart await per SSE chunk).
    For ``POST .../messages`` and ``GET .../events`` this class builds the same
    :class:`~server.api.ApiRequest` from the ASGI scope, reads the body under the same rules
    (bounded, always before answering, ``Connection: close`` with a 413), calls the same
    :meth:`Api.handle`, and writes each pre-encoded SSE chunk as one ASGI ``send``. Any other
    path — including the same path with an extra segment or a trailing slash — goes to Quart,
    so routing, 404s and 405s stay Quart's.
    """

    def __init__(self, app: QuartTrio, api: Api) -> None:
        self.app = app
        self.api = api
        self._routes = {k: next(r for r in ROUTES if r.name == name) for k, name in _FAST_PATHS.items()}

    def _match(self, scope: dict[str, Any]) -> tuple[Route, str] | None:
        path: str = scope["path"]
        if not path.startswith(_CONVERSATION_PREFIX) or scope.get("root_path"):
            return None
        rest = path[len(_CONVERSATION_PREFIX):]
        conv, sep, tail = rest.partition("/")
        if not conv or not sep:
            return None
        route = self._routes.get((scope["method"], tail))
        return (route, conv) if route is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hit = self._match(scope)
        if hit is None:
            return await self.app(scope, receive, send)
        route, conv = hit
        await self._serve(route, conv, scope, receive, send)

    async def _serve(self, route: Route, conv: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        query: dict[str, str] = {}
        if scope.get("query_string"):
            for k, v in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
                query.setdefault(k, v)  # the first value of each, as request.args.get gives
        req = ApiRequest(route.method, {"conversation_id": conv}, query, headers)
        body, oversize, disconnected = await _receive_body(receive, headers, MAX_REQUEST_BYTES)
        if disconnected:
            return
        if oversize is not None:
            try:
                self.api._authenticate(route, req)
                err = _oversize_error(oversize)
            except ApiError as e:
                err = e
            resp = error_response(err)
            resp.headers["Connection"] = "close"
            return await _send_plain(send, resp)
        req.body = body
        try:
            resp = await self.api.handle(route, req)
        except Exception:  # noqa: BLE001 - handle() maps errors itself; this is the last resort
            log.exception("unhandled error")
            resp = error_response(ApiError("internal", "internal error"))
        if resp.stream is None:
            return await _send_plain(send, resp)
        await _send_stream(send, receive, resp)


async def _receive_body(receive: Any, headers: dict[str, str], limit: int) -> tuple[bytes, int | None, bool]:
    """(body, oversize or None, client disconnected). Over the limit: stop reading, report the size."""
    n = _declared_oversize(headers.get("content-length"), limit)
    if n is not None:
        return b"", n, False
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", None, True
        chunk = message.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:
                return b"", total, False
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks) if len(chunks) != 1 else chunks[0], None, False


def _oversize_error(oversize: int) -> ApiError:
    return ApiError(
        "payload_too_large",
        f"request body of {oversize} bytes exceeds the {MAX_REQUEST_BYTES}-byte request limit "
        f"by {oversize - MAX_REQUEST_BYTES} bytes",
        extra={"limit": "request", "limit_bytes": MAX_REQUEST_BYTES,
               "over_by_bytes": oversize - MAX_REQUEST_BYTES},
    )


def _raw_headers(resp: ApiResponse, content_type: str) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type.encode("latin-1"))]
    for k, v in resp.headers.items():
        out.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
    return out


async def _send_plain(send: Any, resp: ApiResponse) -> None:
    body = resp.body_bytes()
    headers = _raw_headers(resp, resp.media_type)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_stream(send: Any, receive: Any, resp: ApiResponse) -> None:
    """The SSE body: each chunk the stream yields (already encoded, already batched) is one send.

    Where the connection allows it (hypercorn's HTTP/1.1 over plain TCP, see :mod:`server.wire`)
    the stream also gets a direct writer, and live frames then bypass ``send`` altogether.
    A watcher ends the stream when the client goes away, so its hub subscription is released
    at once rather than at the next failed write.
    """
    assert resp.stream is not None
    body = resp.stream
    writer: DirectWriter | None = None

    async def watch_disconnect(scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": _raw_headers(resp, "text/event-stream; charset=utf-8")})
            attach = getattr(body, "attach", None)
            if attach is not None and DIRECT_SSE_WRITES:
                writer = open_direct_writer(send)
                if writer is not None:
                    attach(writer)
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()  # the generator's finally unsubscribes from the hub
        if writer is not None:
            writer.close()


def create_asgi(api: Api) -> FastRoutes:
    """What `surefoot serve` hands hypercorn: :func:`create_app` behind :class:`FastRoutes`."""
    return FastRoutes(create_app(api), api)
