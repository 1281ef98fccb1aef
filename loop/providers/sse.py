"""Server-sent events, parsed per the WHATWG rules the providers follow.

Both Anthropic (named events) and OpenAI-compatible servers (``data:`` only,
terminated by ``[DONE]``) stream SSE.  The parser is fed decoded lines, so
it is independent of the HTTP client and unit-testable on strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator

__all__ = ["SSEEvent", "SSEParser", "aiter_sse", "MAX_SSE_EVENT_BYTES"]

# One event's data may not exceed this (a runaway server must not eat memory).
MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024

assert MAX_SSE_EVENT_BYTES > 0


@dataclass(frozen=True)
class SSEEvent:
    event: str  # "message" when the server named none
    data: str
    id: str | None = None


class SSEParser:
    """Feed lines (without their terminators); collect complete events."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._size = 0
        self._id: str | None = None

    def feed(self, line: str) -> SSEEvent | None:
        line = line.rstrip("\r\n")
        if line == "":
            if not self._data and not self._event:
                return None
            ev = SSEEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._size = "", [], 0
            return ev
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._size += len(value) + 1
            if self._size > MAX_SSE_EVENT_BYTES:
                raise ValueError(f"SSE event larger than {MAX_SSE_EVENT_BYTES} bytes")
            self._data.append(value)
        elif name == "id":
            self._id = value
        # "retry" and unknown fields are ignored, as the spec says.
        return None

    def flush(self) -> SSEEvent | None:
        """An event left unterminated at end of stream (some servers omit the blank line)."""
        return self.feed("")

    def parse_all(self, lines: Iterable[str]) -> Iterator[SSEEvent]:
        for line in lines:
            ev = self.feed(line)
            if ev is not None:
                yield ev
        ev = self.flush()
        if ev is not None:
            yield ev


async def aiter_sse(lines: AsyncIterable[str]) -> AsyncIterator[SSEEvent]:
    parser = SSEParser()
    async for line in lines:
        ev = parser.feed(line)
        if ev is not None:
            yield ev
    ev = parser.flush()
    if ev is not None:
        yield ev
