"""The provider protocol: a model call streamed as a small set of events.

A provider turns ``(system, messages, tools)`` into an async iterator of
:data:`StreamEvent` values and raises only :class:`loop.errors.ProviderError`
subclasses.  Every provider speaks the same five events, whatever its wire
format, so the loop (journal coalescing, tool dispatch, usage) is written once:

* :class:`TextDelta` — a piece of assistant text.
* :class:`ToolCallStart` — a tool call began (id and name known).
* :class:`ToolCallDelta` — a piece of that call's JSON arguments.
* :class:`Finish` — the call ended: stop reason and usage.

and, only from a model that reasons visibly (Anthropic's extended thinking):

* :class:`ThinkingDelta` — a piece of a reasoning block's text.
* :class:`ThinkingSignature` — the opaque signature that closes a reasoning block.
* :class:`RedactedThinking` — a whole reasoning block the provider encrypted.

Reasoning is kept in the assistant message as ``thinking`` / ``redacted_thinking``
parts, in stream order, because a provider may require them back verbatim on the
next request (Anthropic answers 400 otherwise when tools are in use); providers
that have no such notion ignore these parts.

:func:`stream_model` wraps a provider's stream and enforces the one rule the
retry policy relies on: an error raised *after* any output event becomes a
:class:`StreamBrokenError` (never retried, because the output was seen).
:class:`ResponseBuilder` folds events into the assistant message the loop
persists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Protocol, Sequence, Union, runtime_checkable

from ..errors import PermanentProviderError, ProviderError, StreamBrokenError, classify_exception
from ..messages import Message

__all__ = [
    "Usage",
    "TextDelta",
    "ToolCallStart",
    "ToolCallDelta",
    "Finish",
    "ThinkingDelta",
    "ThinkingSignature",
    "RedactedThinking",
    "StreamEvent",
    "ToolSpec",
    "Provider",
    "ResponseBuilder",
    "stream_model",
    "output_cap",
    "capped_call_options",
    "STOP_END",
    "STOP_TOOL_USE",
    "STOP_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
]

STOP_END = "end_turn"
STOP_TOOL_USE = "tool_use"
STOP_MAX_TOKENS = "max_tokens"
# Output tokens asked for when the agent does not say (Anthropic requires a value).
DEFAULT_MAX_TOKENS = 4096

assert DEFAULT_MAX_TOKENS > 0


@dataclass(frozen=True)
class Usage:
    """One call's usage, normalised across providers: ``input_tokens`` are the *uncached*
    input tokens; ``cache_read_tokens`` / ``cache_write_tokens`` are prompt-cache reads and
    writes, billed apart (see loop.pricing, whose Price fields carry these names)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, int]:
        d = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self.cache_read_tokens:
            d["cache_read_tokens"] = self.cache_read_tokens
        if self.cache_write_tokens:
            d["cache_write_tokens"] = self.cache_write_tokens
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Usage":
        d = d or {}
        return cls(
            int(d.get("input_tokens", 0)),
            int(d.get("output_tokens", 0)),
            int(d.get("cache_read_tokens", 0)),
            int(d.get("cache_write_tokens", 0)),
        )

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
        )


@dataclass(frozen=True)
class TextDelta:
    text: str
    index: int = 0


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the JSON arguments text


@dataclass(frozen=True)
class Finish:
    stop_reason: str
    usage: Usage = field(default_factory=Usage)
    raw_stop_reason: str | None = None


@dataclass(frozen=True)
class ThinkingDelta:
    """A piece of the text of reasoning block ``index`` (consecutive pieces extend it)."""

    text: str
    index: int = 0


@dataclass(frozen=True)
class ThinkingSignature:
    """The signature of reasoning block ``index``: opaque, sent back unmodified."""

    index: int
    signature: str


@dataclass(frozen=True)
class RedactedThinking:
    """A reasoning block the provider encrypted (``data`` opaque, sent back unmodified)."""

    index: int
    data: str


StreamEvent = Union[TextDelta, ToolCallStart, ToolCallDelta, Finish, ThinkingDelta, ThinkingSignature, RedactedThinking]


@dataclass(frozen=True)
class ToolSpec:
    """What a model is told about one tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]


@runtime_checkable
class Provider(Protocol):
    """A model behind some wire format.  ``name`` is the spec it was made from."""

    name: str

    def stream(
        self,
        *,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Stream one model call; raise only ``ProviderError`` subclasses."""
        ...

    async def aclose(self) -> None:
        ...

    # Optional (the loop asks with getattr; see output_cap / capped_call_options below, which
    # give a provider without them the honest default):
    #
    #   def output_cap(self, max_tokens: int | None) -> int | None
    #       The most output tokens one call sent with this per-call ``max_tokens`` may
    #       produce, this provider's own defaults included; None when nothing bounds it.
    #   (``max_tokens`` is the loop's name for a call's output cap; a provider sends it under
    #   its wire's name: OpenAIProvider under ``max_tokens`` or ``max_completion_tokens``.)
    #   def capped_call_options(self, max_tokens: int) -> dict[str, Any] | None
    #       A call the loop must keep under a usage ceiling is sent with a lower
    #       ``max_tokens`` than the provider would use: the extra ``stream`` keywords that
    #       keep such a request valid ({} if none), or None when no valid request fits in
    #       ``max_tokens`` output tokens (the loop then refuses the call: usage_limit).


def output_cap(provider: Any, max_tokens: int | None) -> int | None:
    """The effective output cap of a call to ``provider`` sent with ``max_tokens`` (the
    agent's, None when unset): what the provider itself says, else the explicit value (a
    provider that says nothing sends what it is given and nothing when given nothing)."""
    fn = getattr(provider, "output_cap", None)
    cap = fn(max_tokens) if fn is not None else max_tokens
    assert cap is None or (isinstance(cap, int) and cap > 0), f"output_cap must be None or a positive int, got {cap!r}"
    return cap


def capped_call_options(provider: Any, max_tokens: int) -> dict[str, Any] | None:
    """The extra ``stream`` keywords for a call clamped to ``max_tokens`` output tokens by a
    usage ceiling ({}: none needed), or None when the provider cannot make a valid call that
    small. A provider without the method needs nothing beyond ``max_tokens >= 1``."""
    assert max_tokens >= 1
    fn = getattr(provider, "capped_call_options", None)
    return fn(max_tokens) if fn is not None else {}


def _is_output(ev: StreamEvent) -> bool:
    """Whether ``ev`` is something the caller has seen of the answer (reasoning counts:
    it is journaled and billed, so a retry after it would not be invisible)."""
    if isinstance(ev, (TextDelta, ThinkingDelta)):
        return bool(ev.text)
    return isinstance(ev, (ToolCallStart, ToolCallDelta, ThinkingSignature, RedactedThinking))


async def stream_model(
    provider: Provider,
    *,
    system: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    max_tokens: int | None = None,
    options: Mapping[str, Any] | None = None,
    opened: AsyncIterator[StreamEvent] | None = None,
) -> AsyncIterator[StreamEvent]:
    """``provider.stream`` with errors classified and the after-output rule applied.

    Anything other than a ``ProviderError`` escaping a provider is classified
    (connection errors transient, the rest permanent); any error after the
    first output event becomes a ``StreamBrokenError`` carrying the original.
    A stream that ends without :class:`Finish` is broken too.

    ``options``: extra keywords for ``provider.stream``, as the provider's own
    ``capped_call_options`` gave them (passed only when non-empty, so a provider
    that has no such method never sees a keyword it does not know).

    ``opened``: what the caller's own ``provider.stream(...)`` call (these arguments) returned,
    to look at it before reading it (``loop.calls.call_model``: a stream with ``sync_events``
    cannot wait); an error of that call is the caller's, unclassified, as it is here.
    """
    output = False
    finished = False
    agen = opened if opened is not None else provider.stream(system=system, messages=messages, tools=tools,
                                                             max_tokens=max_tokens, **(options or {}))
    try:
        # A stream whose events need no waiting (the scripted model's unpaced one) offers
        # them as a plain iterator: read without an awaited ``__anext__`` per event.
        events = getattr(agen, "sync_events", None)
        if events is not None:
            for ev in events:
                if isinstance(ev, Finish):
                    finished = True
                elif not output and _is_output(ev):  # (once output, always: no need to ask again)
                    output = True
                yield ev
        else:
            async for ev in agen:
                if isinstance(ev, Finish):
                    finished = True
                elif not output and _is_output(ev):  # (once output, always: no need to ask again)
                    output = True
                yield ev
    except Exception as e:  # noqa: BLE001 — classified in one place, stream_failure
        err = stream_failure(provider, e, output)
        if err is e:
            raise
        raise err from e
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
    if not finished:
        raise stream_unfinished(provider, output)


def stream_failure(provider: Provider, e: Exception, output: bool) -> ProviderError:
    """What a provider stream's failure ``e`` is reported as: a ``ProviderError`` as it is,
    anything else classified (connection errors transient, the rest permanent), and either
    one a ``StreamBrokenError`` carrying it once output was streamed. ``stream_model`` and
    ``loop.calls``' reader of unwaiting streams both report through this."""
    if isinstance(e, ProviderError):
        if output and not isinstance(e, StreamBrokenError):
            return StreamBrokenError(f"stream failed after output: {e.message}", cause=e)
        return e
    err = classify_exception(e, provider=getattr(provider, "name", None))
    if output:
        return StreamBrokenError(f"stream failed after output: {err.message}", cause=err)
    return err


def stream_unfinished(provider: Provider, output: bool) -> ProviderError:
    """The error of a stream that ended without :class:`Finish` (broken once output came)."""
    err = classify_exception(ConnectionError("stream ended without a finish event"), provider=getattr(provider, "name", None))
    if output:
        return StreamBrokenError(f"stream ended early: {err.message}", cause=err)
    return err


class ResponseBuilder:
    """Folds stream events into the assistant message the loop persists."""

    # (slots: one per model call attempt, its fields read on every streamed event)
    __slots__ = ("_parts", "_last_text_index", "_thinking_at", "_call_at", "_args", "finish")

    def __init__(self) -> None:
        self._parts: list[dict[str, Any]] = []  # in stream order
        self._last_text_index: int | None = None
        self._thinking_at: dict[int, dict[str, Any]] | None = None  # reasoning block index -> its part (made on first use)
        self._call_at: dict[int, int] = {}  # tool call index -> part position
        self._args: dict[int, list[str]] = {}
        self.finish: Finish | None = None

    def add(self, ev: StreamEvent) -> None:
        if isinstance(ev, TextDelta):
            # Consecutive deltas of one text block extend it; a text block
            # after a tool call starts a new part (stream order is kept).
            if self._parts and self._parts[-1]["type"] == "text" and self._last_text_index == ev.index:
                self._parts[-1]["text"] += ev.text
            else:
                self._parts.append({"type": "text", "text": ev.text})
                self._last_text_index = ev.index
        elif isinstance(ev, ToolCallStart):
            self._call_at[ev.index] = len(self._parts)
            self._args[ev.index] = []
            self._parts.append({"type": "tool_call", "id": ev.id, "name": ev.name, "arguments": {}})
        elif isinstance(ev, ToolCallDelta):
            if ev.index not in self._args:
                raise PermanentProviderError(f"arguments for unknown tool call index {ev.index}")
            self._args[ev.index].append(ev.arguments)
        elif isinstance(ev, Finish):
            self.finish = ev
        elif isinstance(ev, (ThinkingDelta, ThinkingSignature)):
            part = self._thinking_part(ev.index)
            if isinstance(ev, ThinkingDelta):
                part["thinking"] += ev.text
            else:
                # Latest wins, as in Anthropic's own SDK (one signature_delta closes a block).
                part["signature"] = ev.signature
        elif isinstance(ev, RedactedThinking):
            self._parts.append({"type": "redacted_thinking", "data": ev.data})

    def _thinking_part(self, index: int) -> dict[str, Any]:
        """The ``thinking`` part of reasoning block ``index``, appended (in stream order) on first use."""
        if self._thinking_at is None:
            self._thinking_at = {}
        part = self._thinking_at.get(index)
        if part is None:
            part = {"type": "thinking", "thinking": "", "signature": ""}
            self._thinking_at[index] = part
            self._parts.append(part)
        return part

    @property
    def text(self) -> str:
        return "".join(p["text"] for p in self._parts if p["type"] == "text")

    def message(self) -> Message:
        """The assistant message; tool-call arguments parsed (bad JSON kept as ``_raw``)."""
        parts: list[dict[str, Any]] = []
        for p in self._parts:
            if p["type"] == "text":
                if p["text"]:
                    parts.append(dict(p))
                continue
            if p["type"] != "tool_call":  # reasoning parts, kept whole and in place
                parts.append(dict(p))
                continue
            idx = next(i for i, pos in self._call_at.items() if self._parts[pos] is p)
            raw = "".join(self._args[idx])
            q = dict(p)
            if raw == "{}":  # (a call without arguments, as most providers stream it: no parse)
                q["arguments"] = {}
            elif raw.strip():
                try:
                    args = json.loads(raw)
                except ValueError:
                    args = None
                q["arguments"] = args if isinstance(args, dict) else {"_raw": raw}
            parts.append(q)
        msg: Message = {"role": "assistant", "content": parts}
        if self.finish is not None:
            msg["stop_reason"] = self.finish.stop_reason
            msg["usage"] = self.finish.usage.to_dict()
        return msg
