"""A local HTTP/1.1 server speaking Anthropic's and OpenAI's streaming wire formats.

The only thing the test-suite fakes is a hosted model provider (team rules),
and it fakes it at the wire: a plain trio socket server on a loopback port,
so the real httpx client, the real SSE parser and the real error
classification run against bytes shaped exactly like the providers' own.

Each request takes the next scripted response from a FIFO (``enqueue``);
the dialect follows the path (``/v1/messages`` -> Anthropic,
``.../chat/completions`` -> OpenAI).  Every request is recorded (method,
path, headers, JSON body) for assertions.

Scripted responses:

* :class:`FakeReply` — text and tool calls streamed as SSE, with usage and
  a stop reason (tool-call arguments split into several deltas, as real
  servers do);
* :class:`FakeError` — an HTTP error status with the dialect's error body
  and optional headers (429 + retry-after, 529 overloaded, 500, 400 prompt
  too long...);
* :class:`FakeBreak` — a stream that sends ``after`` events of a reply and
  then drops the connection without the terminating chunk;
* :class:`FakeStreamError` — Anthropic's in-stream ``error`` event (or an
  OpenAI ``data: {"error": ...}`` chunk) after ``after`` events;
* :class:`FakeHang` — no answer at all: the request is read and recorded, then the
  server waits (a caller that dies mid-call).

A reply honours the request's ``max_tokens`` (or OpenAI's ``max_completion_tokens``) as the
real APIs do (see :func:`capped_reply`): a reply whose ``output_tokens`` exceed it is cut there and
ends with ``stop_reason`` ``max_tokens`` (Anthropic) / ``finish_reason`` ``length``
(OpenAI), reporting exactly ``max_tokens`` output tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Sequence, Union

import trio

__all__ = [
    "FakeReply",
    "FakeError",
    "FakeBreak",
    "FakeStreamError",
    "FakeHang",
    "FakeProviderServer",
    "RecordedRequest",
    "anthropic_events",
    "openai_events",
    "overloaded",
    "rate_limited",
    "server_error",
    "prompt_too_long",
    "context_length_exceeded",
    "capped_reply",
    "unsupported_max_tokens",
]

MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass
class FakeReply:
    text: str = ""
    # (id, name, arguments): a dict, or the arguments' JSON text as streamed (possibly cut short)
    tool_calls: Sequence[tuple[str, str, dict[str, Any] | str]] = ()
    input_tokens: int = 11
    output_tokens: int = 7
    # Prompt-cache figures, as each dialect reports them: Anthropic's cache_read_input_tokens /
    # cache_creation_input_tokens beside (not inside) input_tokens; OpenAI's
    # prompt_tokens_details.cached_tokens *inside* prompt_tokens (no cache writes reported).
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    stop_reason: str | None = None  # default: dialect's own for text / tool calls
    chunk: int = 5  # characters per text delta
    model: str = "fake-model"


@dataclass
class FakeError:
    status: int
    body: Any = None  # dict (JSON) / bytes / str; None: a dialect-shaped default
    headers: dict[str, str] = field(default_factory=dict)
    error_type: str | None = None
    message: str | None = None


@dataclass
class FakeBreak:
    reply: FakeReply
    after: int  # SSE events sent before the connection drops


@dataclass
class FakeStreamError:
    reply: FakeReply
    after: int
    error_type: str = "overloaded_error"
    message: str = "Overloaded"


@dataclass
class FakeHang:
    """Never answered: ``received`` is set once the request is read (and recorded)."""

    received: trio.Event = field(default_factory=trio.Event)


Scripted = Union[FakeReply, FakeError, FakeBreak, FakeStreamError, FakeHang]


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


def overloaded() -> FakeError:
    return FakeError(529, error_type="overloaded_error", message="Overloaded")


def rate_limited(retry_after: str | None = "3") -> FakeError:
    return FakeError(
        429,
        headers={"retry-after": retry_after} if retry_after is not None else {},
        error_type="rate_limit_error",
        message="Number of request tokens has exceeded your per-minute rate limit",
    )


def server_error(status: int = 500) -> FakeError:
    return FakeError(status, error_type="api_error", message="Internal server error")


def prompt_too_long() -> FakeError:
    return FakeError(400, error_type="invalid_request_error", message="prompt is too long: 210000 tokens > 200000 maximum")


def context_length_exceeded() -> FakeError:
    return FakeError(
        400,
        body={
            "error": {
                "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
    )


def unsupported_max_tokens() -> FakeError:
    """OpenAI's answer to ``max_tokens`` sent to a reasoning model."""
    return FakeError(400, body={"error": {
        "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
                   "Use 'max_completion_tokens' instead.",
        "type": "invalid_request_error", "param": "max_tokens", "code": "unsupported_parameter"}})


def _args_text(args: dict[str, Any] | str) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def _sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def _split(s: str, n: int) -> list[str]:
    return [s[i : i + n] for i in range(0, len(s), n)] or [""]


def anthropic_events(r: FakeReply) -> list[bytes]:
    """The SSE events of one streamed Messages API response, as Anthropic sends them."""
    ev = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_fake01",
                    "type": "message",
                    "role": "assistant",
                    "model": r.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": r.input_tokens, "output_tokens": 1,
                              **({"cache_read_input_tokens": r.cache_read_tokens} if r.cache_read_tokens else {}),
                              **({"cache_creation_input_tokens": r.cache_write_tokens} if r.cache_write_tokens else {})},
                },
            },
        ),
        _sse("ping", {"type": "ping"}),
    ]
    idx = 0
    if r.text:
        ev.append(_sse("content_block_start", {"type": "content_block_start", "index": idx, "content_block": {"type": "text", "text": ""}}))
        for piece in _split(r.text, r.chunk):
            ev.append(
                _sse("content_block_delta", {"type": "content_block_delta", "index": idx, "delta": {"type": "text_delta", "text": piece}})
            )
        ev.append(_sse("content_block_stop", {"type": "content_block_stop", "index": idx}))
        idx += 1
    for call_id, name, args in r.tool_calls:
        ev.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": idx, "content_block": {"type": "tool_use", "id": call_id, "name": name, "input": {}}},
            )
        )
        ev.append(
            _sse("content_block_delta", {"type": "content_block_delta", "index": idx, "delta": {"type": "input_json_delta", "partial_json": ""}})
        )
        for piece in _split(_args_text(args), 4):
            ev.append(
                _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": idx, "delta": {"type": "input_json_delta", "partial_json": piece}},
                )
            )
        ev.append(_sse("content_block_stop", {"type": "content_block_stop", "index": idx}))
        idx += 1
    stop = r.stop_reason or ("tool_use" if r.tool_calls else "end_turn")
    ev.append(
        _sse(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": r.output_tokens}},
        )
    )
    ev.append(_sse("message_stop", {"type": "message_stop"}))
    return ev


def openai_events(r: FakeReply) -> list[bytes]:
    """The ``data:`` chunks of one streamed Chat Completions response, as OpenAI sends them."""
    base = {"id": "chatcmpl-fake01", "object": "chat.completion.chunk", "created": 1700000000, "model": r.model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(None, {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    ev = [chunk({"role": "assistant", "content": "" if not r.tool_calls or r.text else None})]
    if r.text:
        for piece in _split(r.text, r.chunk):
            ev.append(chunk({"content": piece}))
    for i, (call_id, name, args) in enumerate(r.tool_calls):
        ev.append(
            chunk({"tool_calls": [{"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]})
        )
        for piece in _split(_args_text(args), 4):
            ev.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    stop = r.stop_reason or ("tool_calls" if r.tool_calls else "stop")
    ev.append(chunk({}, stop))
    ev.append(
        _sse(
            None,
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": r.input_tokens + r.cache_read_tokens,
                    "completion_tokens": r.output_tokens,
                    "total_tokens": r.input_tokens + r.cache_read_tokens + r.output_tokens,
                    **({"prompt_tokens_details": {"cached_tokens": r.cache_read_tokens}} if r.cache_read_tokens else {}),
                },
            },
        )
    )
    ev.append(b"data: [DONE]\n\n")
    return ev


def capped_reply(dialect: str, r: FakeReply, body: Any) -> FakeReply:
    """``r`` as a server honouring the request's ``max_tokens`` sends it (OpenAI's newer
    ``max_completion_tokens`` too). Under the cap: unchanged. Over it: the output stops at
    the cap, as the APIs stop generating — the reply's ``output_tokens`` are taken as spread
    evenly over its text and its tool calls' argument JSON, in stream order, so the text keeps
    its share, a tool call the cut falls in is sent with its arguments' JSON cut short (as a
    real stream stops mid ``input_json_delta``), the calls after it are not sent; the stop
    reason says why and usage reports the cap."""
    mt = None
    if isinstance(body, dict):
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
    if not isinstance(mt, int) or r.output_tokens <= mt:
        return r
    args = [_args_text(a) for _, _, a in r.tool_calls]
    keep = (len(r.text) + sum(map(len, args))) * mt // r.output_tokens
    text = r.text[:keep]
    keep -= len(text)
    calls: list[tuple[str, str, dict[str, Any] | str]] = []
    for (call_id, name, _), a in zip(r.tool_calls, args):
        if keep <= 0:
            break
        calls.append((call_id, name, a[:keep]))
        keep -= len(a)
    return replace(r, text=text, tool_calls=tuple(calls), output_tokens=mt,
                   stop_reason="max_tokens" if dialect == "anthropic" else "length")


def _error_body(dialect: str, e: FakeError) -> bytes:
    if e.body is not None:
        if isinstance(e.body, bytes):
            return e.body
        if isinstance(e.body, str):
            return e.body.encode()
        return json.dumps(e.body).encode()
    etype = e.error_type or "api_error"
    msg = e.message or "error"
    if dialect == "anthropic":
        return json.dumps({"type": "error", "error": {"type": etype, "message": msg}}).encode()
    return json.dumps({"error": {"message": msg, "type": etype, "param": None, "code": None}}).encode()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 408: "Request Timeout",
            409: "Conflict", 429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 529: "Overloaded"}


class FakeProviderServer:
    """``async with trio.open_nursery() as n: await n.start(server.serve)`` then ``server.base_url``."""

    def __init__(self) -> None:
        self.script: list[Scripted] = []
        self.requests: list[RecordedRequest] = []
        self.port: int | None = None
        # OpenAI's reasoning models (o-series, gpt-5): a Chat Completions request carrying
        # max_tokens is refused 400 as they refuse it (the script is not consumed).
        self.refuse_max_tokens = False

    def enqueue(self, *responses: Scripted) -> None:
        self.script.extend(responses)

    @property
    def base_url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _read_request(self, stream: trio.SocketStream) -> RecordedRequest | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return None
            buf += data
            assert len(buf) < MAX_REQUEST_BYTES
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            k, v = k.strip().lower(), v.strip()
            # a header sent twice reads as one comma-joined value, as HTTP defines it (so a
            # test sees a duplicated header instead of only its last copy)
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            data = await stream.receive_some(65536)
            if not data:
                return None
            rest += data
        body: Any = rest[:n]
        try:
            body = json.loads(body) if body else None
        except ValueError:
            pass
        return RecordedRequest(method, path, headers, body)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            req = await self._read_request(stream)
            if req is None:
                return
            self.requests.append(req)
            dialect = "anthropic" if req.path.endswith("/v1/messages") else "openai"
            if not self.script:
                await self._send_error(stream, dialect, FakeError(500, message="fake server: no scripted response"))
                return
            if dialect == "openai" and self.refuse_max_tokens and isinstance(req.body, dict) and "max_tokens" in req.body:
                await self._send_error(stream, dialect, unsupported_max_tokens())
                return
            item = self.script.pop(0)
            if isinstance(item, FakeReply):
                item = capped_reply(dialect, item, req.body)
            if isinstance(item, FakeHang):
                item.received.set()
                await trio.sleep_forever()
            if isinstance(item, FakeError):
                await self._send_error(stream, dialect, item)
            elif isinstance(item, FakeReply):
                await self._send_stream(stream, self._events(dialect, item), complete=True)
            elif isinstance(item, FakeBreak):
                await self._send_stream(stream, self._events(dialect, item.reply)[: item.after], complete=False)
            elif isinstance(item, FakeStreamError):
                events = self._events(dialect, item.reply)[: item.after]
                if dialect == "anthropic":
                    events.append(_sse("error", {"type": "error", "error": {"type": item.error_type, "message": item.message}}))
                else:
                    events.append(_sse(None, {"error": {"message": item.message, "type": item.error_type, "code": None}}))
                await self._send_stream(stream, events, complete=True)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    @staticmethod
    def _events(dialect: str, r: FakeReply) -> list[bytes]:
        return anthropic_events(r) if dialect == "anthropic" else openai_events(r)

    async def _send_error(self, stream: trio.SocketStream, dialect: str, e: FakeError) -> None:
        body = _error_body(dialect, e)
        headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close", **e.headers}
        if dialect == "anthropic":
            headers.setdefault("request-id", "req_fake01")
        await stream.send_all(self._head(e.status, headers) + body)

    async def _send_stream(self, stream: trio.SocketStream, events: list[bytes], *, complete: bool) -> None:
        headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "transfer-encoding": "chunked",
            "connection": "close",
        }
        await stream.send_all(self._head(200, headers))
        for ev in events:
            await stream.send_all(b"%x\r\n%s\r\n" % (len(ev), ev))
        if complete:
            await stream.send_all(b"0\r\n\r\n")
        # else: drop the connection mid-body — httpx sees an incomplete chunked read

    @staticmethod
    def _head(status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- extended thinking (Anthropic dialect) ---------------------------------------------

SIG = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds0hnRX5cgl/3uv8tGHrs3S9Q=="
REDACTED = "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpPkNRj2YfWXGmKDxH4mPnZ5sQ7vB5URj"


@dataclass
class ThinkingReply(FakeReply):
    """A reply whose content starts with reasoning blocks: ``("thinking", text, signature)``
    or ``("redacted_thinking", data)``.  ``pause`` seconds pass after the reasoning (a slow
    thinker, so the loop journals parts before the answer ends).

    ``interleaved``: reasoning blocks streamed *among* the reply's content blocks, as Claude 4
    models do with the ``interleaved-thinking-2025-05-14`` beta: ``(position, block)`` puts
    ``block`` after the first ``position`` of the reply's text / tool_use blocks (the text,
    when there is one, is the first of them; each tool call one more), e.g. ``[(1, ("thinking",
    "...", SIG2))]`` with two tool calls and no text streams thinking, tool_use, thinking,
    tool_use.

    A block ``("omitted_thinking", signature)`` is a thinking block as adaptive thinking streams
    it with ``display: "omitted"`` (the Opus 4.7+ default): ``content_block_start`` with empty
    ``thinking``, no ``thinking_delta`` at all, one ``signature_delta``, ``content_block_stop``."""

    thinking: Sequence[tuple[str, ...]] = ()
    pause: float = 0.0
    thinking_chunk: int = 7  # characters per thinking_delta
    interleaved: Sequence[tuple[int, tuple[str, ...]]] = ()


def _reasoning_block_events(idx: int, block: tuple[str, ...], chunk: int) -> list[bytes]:
    """One reasoning block at content index ``idx``, as the Messages API streams it."""
    ev: list[bytes] = []
    if block[0] == "thinking":
        _, text, sig = block
        ev.append(_sse("content_block_start", {"type": "content_block_start", "index": idx,
                                               "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        for piece in _split(text, chunk):
            ev.append(_sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                   "delta": {"type": "thinking_delta", "thinking": piece}}))
        ev.append(_sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": {"type": "signature_delta", "signature": sig}}))
    elif block[0] == "omitted_thinking":
        _, sig = block
        ev.append(_sse("content_block_start", {"type": "content_block_start", "index": idx,
                                               "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        ev.append(_sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": {"type": "signature_delta", "signature": sig}}))
    else:
        _, data = block
        ev.append(_sse("content_block_start", {"type": "content_block_start", "index": idx,
                                               "content_block": {"type": "redacted_thinking", "data": data}}))
    ev.append(_sse("content_block_stop", {"type": "content_block_stop", "index": idx}))
    return ev


def _reindexed(raw: bytes, idx: int) -> bytes:
    name, _, data = raw.decode().partition("\ndata: ")
    d = json.loads(data)
    d["index"] = idx
    return _sse(name.removeprefix("event: "), d)


def thinking_events(r: ThinkingReply) -> list[Any]:
    """The SSE events of a Messages API response with extended thinking, as Anthropic sends
    them: the reasoning blocks first, then the reply's text and tool_use blocks, with any
    ``interleaved`` reasoning blocks among those; every block's index is its place in the
    content, in stream order.  A float in the list is a pause."""
    plain = anthropic_events(r)  # message_start, ping, blocks..., message_delta, message_stop
    head, body, tail = plain[:2], plain[2:-2], plain[-2:]
    groups: list[list[bytes]] = []  # the reply's own content blocks, each its events
    current: int | None = None
    for raw in body:
        i = json.loads(raw.decode().partition("\ndata: ")[2])["index"]
        if i != current:
            groups.append([])
            current = i
        groups[-1].append(raw)
    cut = r.stop_reason == "max_tokens"  # capped_reply dropped blocks: reasoning past them was never streamed
    assert cut or all(0 <= pos <= len(groups) for pos, _ in r.interleaved), "interleaved position past the reply's blocks"
    ev: list[Any] = list(head)
    idx = 0
    for block in r.thinking:
        ev.extend(_reasoning_block_events(idx, block, r.thinking_chunk))
        idx += 1
    if r.pause:
        ev.append(r.pause)
    for pos in range(len(groups) + 1):
        for at, block in r.interleaved:
            if at == pos:
                ev.extend(_reasoning_block_events(idx, block, r.thinking_chunk))
                idx += 1
        if pos < len(groups):
            ev.extend(_reindexed(raw, idx) for raw in groups[pos])
            idx += 1
    ev.extend(tail)
    return ev


def budgeted_thinking_unsupported() -> FakeError:
    """Opus 4.7+'s answer to ``"thinking": {"type": "enabled", ...}`` (as reported verbatim)."""
    return FakeError(400, error_type="invalid_request_error",
                     message='"thinking.type.enabled" is not supported for this model. Use "thinking.type.adaptive" '
                             'and "output_config.effort" to control thinking behavior.')


class ThinkingServer(FakeProviderServer):
    """The fake provider server, also speaking extended thinking (Anthropic dialect)."""

    def _events(self, dialect: str, r: FakeReply) -> list[Any]:  # type: ignore[override]
        if dialect == "anthropic" and isinstance(r, ThinkingReply):
            return thinking_events(r)
        return FakeProviderServer._events(dialect, r)

    async def _send_stream(self, stream: trio.SocketStream, events: list[Any], *, complete: bool) -> None:
        if not any(isinstance(e, float) for e in events):
            await super()._send_stream(stream, events, complete=complete)
            return
        await super()._send_stream(stream, [], complete=False)  # the head only
        for ev in events:  # then the chunked body, pausing where the script says
            if isinstance(ev, float):
                await trio.sleep(ev)
            else:
                await stream.send_all(b"%x\r\n%s\r\n" % (len(ev), ev))
        if complete:
            await stream.send_all(b"0\r\n\r\n")


def lookup_tool(calls: list[str]) -> Any:
    """A ``lookup(city)`` tool that records each city it was called with in ``calls``."""
    from loop import tool

    @tool
    def lookup(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return f"{city}: sunny"

    return lookup


def anthropic_provider(server: Any, model: str = "claude-test", **kw: Any) -> Any:
    """An ``AnthropicProvider`` pointed at ``server`` (a test key, no timeout), with ``kw``."""
    from loop.providers import AnthropicProvider

    return AnthropicProvider(model, base_url=server.base_url, api_key="sk-ant-test", timeout=None, **kw)


def openai_provider(server: Any, model: str = "gpt-test", **kw: Any) -> Any:
    """An ``OpenAIProvider`` pointed at ``server``'s ``/v1`` (a test key, no timeout), with ``kw``."""
    from loop.providers import OpenAIProvider

    return OpenAIProvider(model, base_url=server.base_url + "/v1", api_key="sk-test", timeout=None, **kw)
