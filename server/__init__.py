"""server — the HTTP front of surefoot (`surefoot serve`) and the `surefoot` command.

Layers, one module per concern:

* :mod:`server.api` — the transport-free API: :class:`~server.api.ApiRequest` ->
  :meth:`Api.handle <server.api.Api.handle>` -> :class:`~server.api.ApiResponse`, over a
  :class:`loop.runtime.Runtime`, and :data:`~server.api.ROUTES`, the one route table.
  Later fronts (MCP, A2A, ACP) call the same handlers, so the submit path exists once.
* :mod:`server.app` — the quart-trio transport: bounded body reading (always before any
  answer), 413s that close the connection, SSE responses with no response timeout; and
  :class:`~server.app.FastRoutes`, the raw ASGI front that serves the two hot routes (submit,
  events/SSE) with the same rules but without Quart's per-request and per-frame work.
* :mod:`server.sse` — SSE framing and :class:`~server.sse.Hubs`: one journal follower per
  conversation shared by every subscriber, frames encoded once, replay-then-live with no gap
  and no duplicate.
* :mod:`server.wire` — the direct SSE write path: on hypercorn's HTTP/1.1 over plain TCP the
  hub writes each live frame (one pre-framed chunk, shared) to every caught-up follower's
  socket itself, with no task switch and no ASGI send per follower; anything else keeps ASGI.
* :mod:`server.auth` — fail-closed identity: a client token, verified JWTs, stream tokens.
* :mod:`server.errors` — ``{"error": {"code", "message"}}`` with stable codes.
* :mod:`server.openapi` — the OpenAPI 3.1 document, generated from the route table.
* :mod:`server.limits` — every limit, asserted.
* :mod:`server.serve` — the process: store, recovery, claim loops, hypercorn, signals.
* :mod:`server.cli` / :mod:`server.kvbench` — the ``surefoot`` command and ``kv-bench``.

The HTTP API (all under ``/v1`` but the probes; ids in URLs match
``^[A-Za-z0-9][A-Za-z0-9._:~-]*$``):

==========================================================  =====================================
``POST /v1/conversations/{id}/messages``                    submit (``Idempotency-Key`` = submission id): 202, or 200 when settled, 409 on a reused key
``GET  /v1/conversations/{id}/messages``                    transcript page (``start``, ``limit``)
``POST /v1/conversations/{id}/fork``                        ``{"at": N}`` -> a new conversation
``GET  /v1/conversations/{id}/events``                      JSON page after ``?after=``; SSE with ``Accept: text/event-stream``
``GET  /v1/conversations/{id}/runs``, ``GET /v1/conversations``
``GET  /v1/runs/{id}``, ``POST /v1/runs/{id}/cancel``, ``POST /v1/runs/{id}/approvals/{call_id}``
``POST/GET /v1/projects``, ``GET/DELETE /v1/projects/{id}``, ``GET /v1/projects/{id}/conversations``
``PUT/DELETE /v1/projects/{id}/agents/{agent}``             per-owner agent overrides
``POST /v1/attachments``, ``GET/DELETE /v1/attachments/{id}``, ``GET /v1/attachments/{id}/content``
``POST /v1/stream-tokens``                                  a 10-minute token for ``?token=`` on the SSE route only
``GET /healthz``, ``GET /readyz``, ``GET /openapi.json``
==========================================================  =====================================
"""
