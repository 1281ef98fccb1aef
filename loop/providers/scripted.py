"""Deterministic models: ``ScriptedModel`` for tests and simulation, ``EchoModel`` offline.

A script is a list of *items*, one per model call, or a function from the
call's messages to an item.  Items:

* :class:`Reply` — text and/or tool calls, with usage and a stop reason;
* :class:`Fail` — an error raised before any output (transient with a
  retry-after, context overflow, permanent...);
* :class:`BreakAfter` — a reply whose stream breaks after ``after`` output
  events (the "stream broken after output" case).

Tool-call ids derive from the position in the context
(``call_<n messages>_<i>``), so a script replayed after a restart produces the
same ids and an id is unique within a transcript.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Sequence, Union

import trio

from ..errors import (
    ContextOverflowError,
    PermanentProviderError,
    ProviderError,
    TransientProviderError,
)
from ..messages import Message, text_of
from .base import STOP_END, STOP_TOOL_USE, Finish, StreamEvent, TextDelta, ToolCallDelta, ToolCallStart, ToolSpec, Usage

__all__ = [
    "Reply",
    "Fail",
    "BreakAfter",
    "ScriptItem",
    "ScriptedModel",
    "EchoModel",
    "reply",
    "tool_call",
    "transient",
    "overflow",
    "permanent",
    "broken",
    "estimate_tokens",
]

# The default text chunk size of scripted streams (characters per delta).
DEFAULT_CHUNK = 16

assert DEFAULT_CHUNK > 0


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token), used where no tokenizer exists."""
    return max(1, (len(text) + 3) // 4) if text else 0


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: Sequence[Mapping[str, Any]] = ()  # {"name", "arguments", optional "id"}
    usage: Usage | None = None
    stop_reason: str | None = None


@dataclass(frozen=True)
class Fail:
    error: ProviderError


@dataclass(frozen=True)
class BreakAfter:
    reply: Reply
    after: int = 1  # output events streamed before the break
    error: ProviderError = field(
        default_factory=lambda: TransientProviderError("connection reset mid-stream", error_type="connection_error")
    )


ScriptItem = Union[Reply, Fail, BreakAfter, str]


def reply(text: str = "", *calls: Mapping[str, Any], usage: Usage | None = None, stop_reason: str | None = None) -> Reply:
    return Reply(text, tuple(calls), usage, stop_reason)


def tool_call(name: str, arguments: Mapping[str, Any] | None = None, *, id: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "arguments": dict(arguments or {})}
    if id is not None:
        d["id"] = id
    return d


def transient(message: str = "overloaded", *, status: int = 529, retry_after: float | None = None) -> Fail:
    return Fail(TransientProviderError(message, status=status, retry_after=retry_after, provider="scripted"))


def overflow(message: str = "prompt is too long") -> Fail:
    return Fail(ContextOverflowError(message, status=400, provider="scripted"))


def permanent(message: str = "invalid request", *, status: int = 400) -> Fail:
    return Fail(PermanentProviderError(message, status=status, provider="scripted"))


def broken(text: str, after: int = 1) -> BreakAfter:
    return BreakAfter(Reply(text), after)


def _context_tokens(system: str, messages: Sequence[Message]) -> int:
    n = estimate_tokens(system)
    for m in messages:
        n += estimate_tokens(text_of(m))
        for p in m.get("content") or ():
            if p.get("type") == "tool_call":
                n += estimate_tokens(json.dumps(p.get("arguments") or {}))
            elif p.get("type") == "tool_result":
                n += estimate_tokens(p.get("content") or "")
    return n


async def _stream_reply(
    r: Reply,
    *,
    system: str,
    messages: Sequence[Message],
    chunk: int,
    delay: float,
    break_after: int | None = None,
    break_error: ProviderError | None = None,
) -> AsyncIterator[StreamEvent]:
    emitted = 0
    paced = bool(delay) or break_after is not None  # (else an event needs no tick at all)

    async def tick() -> None:
        nonlocal emitted
        emitted += 1
        if delay:
            await trio.sleep(delay)
        if break_after is not None and emitted >= break_after:
            assert break_error is not None
            raise break_error

    for i in range(0, len(r.text), chunk):
        yield TextDelta(r.text[i : i + chunk], 0)
        if paced:
            await tick()
    for i, tc in enumerate(r.tool_calls):
        call_id = tc.get("id") or f"call_{len(messages)}_{i}"
        yield ToolCallStart(i + 1, call_id, tc["name"])
        if paced:
            await tick()
        yield ToolCallDelta(i + 1, json.dumps(tc.get("arguments") or {}))
        if paced:
            await tick()
    if break_after is not None:
        assert break_error is not None
        raise break_error
    usage = r.usage or Usage(_context_tokens(system, messages), estimate_tokens(r.text) + 8 * len(r.tool_calls))
    yield Finish(r.stop_reason or (STOP_TOOL_USE if r.tool_calls else STOP_END), usage)


async def _fail(error: BaseException) -> AsyncIterator[StreamEvent]:
    """A stream that fails before any output (after a schedule point, as a network call would)."""
    await trio.lowlevel.checkpoint()
    raise error
    yield  # an async generator  # pragma: no cover


class ScriptedModel:
    """Plays a script, one item per call.  ``calls`` records what each call was sent."""

    def __init__(
        self,
        script: Sequence[ScriptItem] | Callable[[Sequence[Message], Sequence[ToolSpec]], ScriptItem],
        *,
        name: str = "scripted",
        chunk: int = DEFAULT_CHUNK,
        delay: float = 0.0,
        record: bool = True,
    ) -> None:
        assert chunk > 0 and delay >= 0
        self._script = script
        self.name = name
        self.chunk = chunk
        self.delay = delay
        # What each call was sent, for tests; ``record=False`` keeps nothing (a long-running
        # benchmark would otherwise hold every context it ever sent).
        self.record = record
        self.calls: list[dict[str, Any]] = []
        self.n_calls = 0

    def _next(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> ScriptItem:
        if callable(self._script):
            return self._script(messages, tools)
        n = self.n_calls - 1
        if n >= len(self._script):
            raise PermanentProviderError(f"script exhausted after {len(self._script)} calls", provider=self.name)
        return self._script[n]

    def stream(
        self,
        *,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        # Not a generator itself: it picks the script item and returns the stream that plays
        # it (one async-generator layer per call, not two).
        self.n_calls += 1
        if self.record:
            self.calls.append({"system": system, "messages": list(messages), "tools": list(tools)})
        try:
            item = self._next(messages, tools)
        except Exception as e:  # noqa: BLE001 — raised from the stream, where stream_model classifies it
            return _fail(e)
        if isinstance(item, str):
            item = Reply(item)
        if isinstance(item, Fail):
            return _fail(item.error)
        if isinstance(item, BreakAfter):
            return _stream_reply(
                item.reply,
                system=system,
                messages=messages,
                chunk=self.chunk,
                delay=self.delay,
                break_after=item.after,
                break_error=item.error,
            )
        return _stream_reply(item, system=system, messages=messages, chunk=self.chunk, delay=self.delay)

    async def aclose(self) -> None:
        pass


class EchoModel:
    """The offline default: answers deterministically from the conversation.

    * After tool results: a final answer listing them.
    * A user message ``/TOOL {json args}`` (or ``/TOOL text`` for a tool with
      one string parameter) naming one of the agent's tools: that tool call.
    * Otherwise: ``"You said: <the last user message>"``.

    So ``surefoot run "hello"`` works with no key and no network, and tools,
    approvals and recovery can be tried from the command line.
    """

    name = "echo"

    def __init__(self, *, chunk: int = 8, delay: float = 0.0) -> None:
        self.chunk = chunk
        self.delay = delay

    def respond(self, system: str, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> Reply:
        last = next((m for m in reversed(messages) if m.get("role") in ("user", "tool")), None)
        if last is None:
            return Reply("Hello! (echo model: no message yet)")
        if last.get("role") == "tool":
            results = [p for p in last.get("content") or () if p.get("type") == "tool_result"]
            lines = [
                f"{p.get('name')}: {'error: ' if p.get('is_error') else ''}{p.get('content', '')}" for p in results
            ]
            return Reply("Tool results:\n" + "\n".join(lines))
        text = text_of(last).strip()
        if text.startswith("/") and tools:
            name, _, rest = text[1:].partition(" ")
            spec = next((t for t in tools if t.name == name), None)
            if spec is not None:
                rest = rest.strip()
                args: Any
                try:
                    args = json.loads(rest) if rest else {}
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    props = list((spec.parameters.get("properties") or {}).keys())
                    args = {props[0]: rest} if len(props) == 1 else {"_raw": rest}
                return Reply(f"Calling {name}.", ({"name": name, "arguments": args},))
        return Reply(f"You said: {text}")

    async def stream(
        self,
        *,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        r = self.respond(system, messages, tools)
        async for ev in _stream_reply(r, system=system, messages=messages, chunk=self.chunk, delay=self.delay):
            yield ev

    async def aclose(self) -> None:
        pass
