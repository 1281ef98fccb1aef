"""Deterministic models: ``ScriptedModel`` for tests and simulation, ``EchoModel`` offline.

A script is a list of *items*, one per model call, or a function from the
call's messages to an item.  Items:

* :class:`Reply` — text and/or tool calls, with usage and a stop reason;
* :class:`Fail` — an error raised before any output (transient with a
  retry-after, context overflow, permanent...);
* :class:`BreakAfter` — a reply whose stream breaks after ``after`` output
  events (the "stream broken after output" case).

A :class:`Reply` may carry reasoning (``reply(..., thinking=[...])``):
:class:`ThinkingBlock` (text and signature) and :class:`RedactedBlock`
(opaque data), streamed exactly as :class:`~loop.providers.AnthropicProvider`
turns Anthropic's extended-thinking stream into events — before the text and
tool calls, block ``k`` of ``n`` at index ``k``, a thinking block as
:class:`ThinkingDelta` pieces then one :class:`ThinkingSignature`, a redacted
block as one :class:`RedactedThinking`, then the text at index ``n`` and the
tool calls after it — so tests and the simulator exercise reasoning (journaled
as ``thinking`` parts, passed back in the assistant turn) offline.  Reasoning
may also come *among* the text and tool calls (``reply(..., interleaved=[(position,
block), ...])``, as Claude 4 models think between tool calls with interleaved
thinking): ``block`` streams after the first ``position`` of the reply's answer
blocks (the text, when there is any, is the first; each tool call one more), and
every block of such a reply is numbered by its place in the stream, as Anthropic
numbers a response's content blocks.
Reasoning is billed as output (as Anthropic bills it): the default usage counts
its characters in ``output_tokens``; the input count of a scripted call leaves
reasoning parts of the context out, as the loop's own context estimate does.

A call's ``max_tokens`` is honoured (by :class:`EchoModel` too) as a provider honours it: a reply whose
default usage would pass it is cut there (reasoning, then text, then tool
calls, in stream order; the part that does not fit is cut at the room left — a
tool call part-way through its arguments JSON — and everything after it
dropped), stops with ``max_tokens`` and reports at most that many output
tokens — so a usage ceiling the loop enforces by lowering ``max_tokens`` holds
with a scripted model too, and the loop meets answers cut as a provider cuts
them.  A reply with an explicit ``usage`` is played as written.

Tool-call ids derive from the position in the context
(``call_<n messages>_<i>``), so a script replayed after a restart produces the
same ids and an id is unique within a transcript.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence, Union

import trio

from ..errors import (
    ContextOverflowError,
    PermanentProviderError,
    ProviderError,
    TransientProviderError,
)
from ..messages import Message, text_of
from .base import (
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_TOOL_USE,
    Finish,
    RedactedThinking,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
)

__all__ = [
    "Reply",
    "Fail",
    "BreakAfter",
    "ThinkingBlock",
    "RedactedBlock",
    "ScriptItem",
    "ScriptedModel",
    "EchoModel",
    "reply",
    "tool_call",
    "thinking",
    "redacted_thinking",
    "transient",
    "overflow",
    "permanent",
    "broken",
    "estimate_tokens",
]

# The default text chunk size of scripted streams (characters per delta).
DEFAULT_CHUNK = 16
# Output tokens a tool call counts for in a scripted reply's default usage.
TOOL_CALL_TOKENS = 8
# Characters per token of the scripted models' estimate (estimate_tokens).
CHARS_PER_TOKEN = 4

assert DEFAULT_CHUNK > 0 and TOOL_CALL_TOKENS > 0 and CHARS_PER_TOKEN > 0


def _args_json(arguments: Mapping[str, Any] | None) -> str:
    """A tool call's arguments as the JSON a provider streams: ``json.dumps`` of them, and
    "{}" (what ``json.dumps({})`` gives) for none, without the call (a no-argument tool's
    call is the common case, twice per scripted call: the stream and the usage estimate)."""
    return json.dumps(arguments) if arguments else "{}"


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token), used where no tokenizer exists."""
    return max(1, (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN) if text else 0


@dataclass(frozen=True)
class ThinkingBlock:
    """A reasoning block: its text (streamed in pieces) and the signature that closes it
    (sent as one event; an empty signature sends none, as the provider does)."""

    text: str
    signature: str


@dataclass(frozen=True)
class RedactedBlock:
    """A reasoning block the provider encrypted: ``data`` arrives whole, in one event."""

    data: str


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: Sequence[Mapping[str, Any]] = ()  # {"name", "arguments", optional "id"}
    usage: Usage | None = None
    stop_reason: str | None = None
    thinking: Sequence[ThinkingBlock | RedactedBlock] = ()  # reasoning, streamed before the text
    # Reasoning among the answer: (position, block) streams ``block`` after the first ``position``
    # answer blocks (the text, when non-empty, then each tool call); ordered by position, stable.
    interleaved: Sequence[tuple[int, ThinkingBlock | RedactedBlock]] = ()


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


def reply(
    text: str = "",
    *calls: Mapping[str, Any],
    usage: Usage | None = None,
    stop_reason: str | None = None,
    thinking: Sequence[ThinkingBlock | RedactedBlock] = (),
    interleaved: Sequence[tuple[int, ThinkingBlock | RedactedBlock]] = (),
) -> Reply:
    """A scripted answer: ``thinking`` streams before the text and tool calls; each
    ``(position, block)`` of ``interleaved`` after the first ``position`` answer blocks (the
    text when non-empty, then each tool call), e.g. ``reply("Let me check.", call_a, call_b,
    interleaved=[(1, thinking(...)), (2, redacted_thinking(...))])`` streams text, thinking,
    tool_use, redacted_thinking, tool_use."""
    for b in list(thinking) + [b for _, b in interleaved]:
        if not isinstance(b, (ThinkingBlock, RedactedBlock)):
            raise TypeError(f"a reasoning block is a ThinkingBlock or a RedactedBlock, not {type(b).__name__}")
    answer_blocks = (1 if text else 0) + len(calls)
    for pos, _ in interleaved:
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= answer_blocks:
            raise ValueError(f"an interleaved position is an int in 0..{answer_blocks} (the answer's blocks), not {pos!r}")
    ordered = tuple(sorted(((pos, b) for pos, b in interleaved), key=lambda x: x[0]))  # (stable)
    return Reply(text, tuple(calls), usage, stop_reason, tuple(thinking), ordered)


def thinking(text: str, signature: str) -> ThinkingBlock:
    """A reasoning block for ``reply(..., thinking=[...])``."""
    return ThinkingBlock(text, signature)


def redacted_thinking(data: str) -> RedactedBlock:
    """An encrypted reasoning block for ``reply(..., thinking=[...])``."""
    return RedactedBlock(data)


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
    """The input tokens of a call: estimate_tokens of the system prompt, of each message's
    text (its text parts concatenated, as text_of), of each tool call's arguments JSON and of
    each tool result. One pass over the parts (every call of every scripted turn walks the
    whole context here)."""
    n = estimate_tokens(system)
    for m in messages:
        text = 0  # characters of text_of(m)
        for p in m.get("content") or ():
            kind = p.get("type")
            if kind == "text":
                text += len(p.get("text", ""))
            elif kind == "tool_call":
                args = p.get("arguments")  # ("{}" for none: one token)
                n += estimate_tokens(json.dumps(args)) if args else 1
            elif kind == "tool_result":
                n += estimate_tokens(p.get("content") or "")
        if text:
            n += (text + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN  # estimate_tokens of text_of(m)
    return n


# A reply's content in stream order: ("reasoning", ThinkingBlock | RedactedBlock), ("text", str)
# or ("call", tool call mapping).
_Block = tuple[str, Any]


def _layout(r: Reply) -> list[_Block]:
    """``r``'s content blocks in the order they stream: its leading reasoning, then the text
    (when non-empty) and the tool calls, with each interleaved reasoning block after the first
    ``position`` of those."""
    answer: list[_Block] = ([("text", r.text)] if r.text else []) + [("call", tc) for tc in r.tool_calls]
    out: list[_Block] = [("reasoning", b) for b in r.thinking]
    if not r.interleaved:
        return out + answer
    among = sorted(r.interleaved, key=lambda x: x[0])  # (a Reply made directly may not be ordered)
    assert all(0 <= pos <= len(answer) for pos, _ in among), "an interleaved position past the answer's blocks"
    k = 0
    for pos in range(len(answer) + 1):
        while k < len(among) and among[k][0] == pos:
            out.append(("reasoning", among[k][1]))
            k += 1
        if pos < len(answer):
            out.append(answer[pos])
    return out


def _stream_reply(
    r: Reply,
    *,
    system: str,
    messages: Sequence[Message],
    chunk: int,
    delay: float,
    break_after: int | None = None,
    break_error: ProviderError | None = None,
    max_tokens: int | None = None,
) -> AsyncIterator[StreamEvent]:
    """The stream of ``r``: its events (:func:`_reply_events`), paced by ``delay`` and broken
    after ``break_after`` output events when asked."""
    events = _reply_events(r, system=system, messages=messages, chunk=chunk, max_tokens=max_tokens)
    if delay or break_after is not None:
        return _paced(events, delay, break_after, break_error)
    return _Unpaced(events)


class _Unpaced:
    """An unpaced stream: its events as they are made, with no schedule point, as an async
    iterator without an async generator's cost (trio registers each async generator it sees
    start, in a weak set, and the caller closes it: two per scripted call of the simulator
    and of every benchmark turn). The events are made lazily, so whatever goes wrong making
    them is raised while the stream is read, where ``stream_model`` classifies it."""

    __slots__ = ("_events",)

    def __init__(self, events: Iterator[StreamEvent]) -> None:
        self._events = events

    @property
    def sync_events(self) -> Iterator[StreamEvent]:
        """The events as a plain iterator (``stream_model`` reads them so: no coroutine a
        event); the same iterator ``__anext__`` reads from."""
        return self._events

    def __aiter__(self) -> "_Unpaced":
        return self

    async def __anext__(self) -> StreamEvent:
        for ev in self._events:
            return ev
        raise StopAsyncIteration


async def _paced(events: Iterator[StreamEvent], delay: float, break_after: int | None,
                 break_error: ProviderError | None) -> AsyncIterator[StreamEvent]:
    """``events`` with a ``delay`` after each output event, broken (``break_error`` raised)
    after ``break_after`` of them, or before the closing Finish when there are fewer."""
    emitted = 0
    for ev in events:
        if isinstance(ev, Finish):
            if break_after is not None:
                assert break_error is not None
                raise break_error
            yield ev
            continue
        yield ev
        emitted += 1
        if delay:
            await trio.sleep(delay)
        if break_after is not None and emitted >= break_after:
            assert break_error is not None
            raise break_error


def _reply_events(
    r: Reply,
    *,
    system: str,
    messages: Sequence[Message],
    chunk: int,
    max_tokens: int | None = None,
) -> Iterator[StreamEvent]:
    """The events of ``r`` in stream order, ending with Finish (a generator: made as read)."""
    if not r.thinking and not r.interleaved and (max_tokens is None or r.usage is not None):
        # The common reply (no reasoning, no cut): its text at index 0, tool call i at i + 1,
        # as the general path below numbers them, without laying out blocks first.
        text, tool_calls = r.text, r.tool_calls
        for i in range(0, len(text), chunk):
            yield TextDelta(text[i : i + chunk], 0)
        for at, block in enumerate(tool_calls, 1):
            yield ToolCallStart(at, block.get("id") or f"call_{len(messages)}_{at - 1}", block["name"])
            args = block["partial_arguments"] if "partial_arguments" in block else _args_json(block.get("arguments"))
            if args:
                yield ToolCallDelta(at, args)
        usage = r.usage or Usage(_context_tokens(system, messages),
                                 estimate_tokens(text) + TOOL_CALL_TOKENS * len(tool_calls))
        yield Finish(r.stop_reason or (STOP_TOOL_USE if tool_calls else STOP_END), usage)
        return
    blocks = _layout(r)
    output: int | None = None
    stop_reason = r.stop_reason
    if max_tokens is not None and r.usage is None and _output_tokens(r) > max_tokens:
        blocks, output = _cut(blocks, max_tokens)
        stop_reason = STOP_MAX_TOKENS
    # With reasoning anywhere, every content block is numbered by its place in the stream, as
    # Anthropic numbers a response's blocks (loop.providers.anthropic passes the block index
    # through as each event's index): reasoning blocks 0..n-1, the text n, the tool calls after
    # it, interleaved reasoning wherever it streams.  Without reasoning the numbering is the
    # scripted model's own (the text at 0, tool call i at i + 1): indexes only pair a delta
    # with its block.
    reasoning = bool(r.thinking or r.interleaved)  # (the reasoning blocks _layout placed)
    calls = 0
    for idx, (kind, block) in enumerate(blocks):
        if kind == "reasoning":
            if isinstance(block, ThinkingBlock):
                for i in range(0, len(block.text), chunk):
                    yield ThinkingDelta(block.text[i : i + chunk], idx)
                if block.signature:
                    yield ThinkingSignature(idx, block.signature)
            else:
                yield RedactedThinking(idx, block.data)
        elif kind == "text":
            at = idx if reasoning else 0
            for i in range(0, len(block), chunk):
                yield TextDelta(block[i : i + chunk], at)
        else:
            at = idx if reasoning else calls + 1
            call_id = block.get("id") or f"call_{len(messages)}_{calls}"
            calls += 1
            yield ToolCallStart(at, call_id, block["name"])
            args = block["partial_arguments"] if "partial_arguments" in block else _args_json(block.get("arguments"))
            if args:  # (a call cut right after its start sends no arguments, as Anthropic's stream)
                yield ToolCallDelta(at, args)
    usage = r.usage or Usage(_context_tokens(system, messages), _output_tokens(r) if output is None else output)
    yield Finish(stop_reason or (STOP_TOOL_USE if r.tool_calls else STOP_END), usage)


def _block_tokens(b: ThinkingBlock | RedactedBlock) -> int:
    return estimate_tokens(b.text if isinstance(b, ThinkingBlock) else b.data)


def _output_tokens(r: Reply) -> int:
    """A reply's default output tokens: its text, TOOL_CALL_TOKENS a tool call, and its
    reasoning (billed as output), interleaved reasoning included."""
    n = estimate_tokens(r.text) + TOOL_CALL_TOKENS * len(r.tool_calls)
    for b in r.thinking:
        n += _block_tokens(b)
    for _, b in r.interleaved:
        n += _block_tokens(b)
    return n


def _cut(blocks: list[_Block], max_tokens: int) -> tuple[list[_Block], int]:
    """A reply's ``blocks`` (stream order) as a provider stops them at ``max_tokens`` output
    tokens, and the output tokens it then reports (at most ``max_tokens``): its content in
    stream order while it fits; what does not is cut at the room left — a thinking block or the
    text shortened (a thinking block cut short has no signature yet), a tool call's arguments
    JSON cut mid-way (as a stream stops inside ``input_json_delta``; its start is sent if any
    room is left), a redacted block (one event) dropped — and nothing after the cut is sent.
    (The stream then stops with ``max_tokens``.)"""
    room = max_tokens
    out: list[_Block] = []
    for kind, b in blocks:
        if kind == "reasoning":
            n = _block_tokens(b)
            if n > room:
                if room and isinstance(b, ThinkingBlock):
                    out.append(("reasoning", ThinkingBlock(b.text[: room * CHARS_PER_TOKEN], "")))
                    room = 0
                break
        elif kind == "text":
            n = estimate_tokens(b)
            if n > room:
                out.append(("text", b[: room * CHARS_PER_TOKEN]))
                room = 0
                break
        else:
            n = TOOL_CALL_TOKENS
            if n > room:
                if room:
                    args = _args_json(b.get("arguments"))
                    out.append(("call", {**b, "partial_arguments": args[: len(args) * room // TOOL_CALL_TOKENS]}))
                    room = 0
                break
        out.append((kind, b))
        room -= n
    return out, max_tokens - room


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
                max_tokens=max_tokens,
            )
        return _stream_reply(item, system=system, messages=messages, chunk=self.chunk, delay=self.delay,
                             max_tokens=max_tokens)

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
        async for ev in _stream_reply(r, system=system, messages=messages, chunk=self.chunk, delay=self.delay,
                                      max_tokens=max_tokens):
            yield ev

    async def aclose(self) -> None:
        pass
