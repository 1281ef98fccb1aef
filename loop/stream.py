"""Coalescing a model's token stream into journal events.

A model streams hundreds of small deltas; the journal must show them live
(a page reload resumes mid-answer) without a commit per token.  The
:class:`PartCoalescer` turns stream events into ``part.added`` /
``part.updated`` journal items, merging consecutive deltas of one part, and
the runner flushes the pending items in one transaction every
``FLUSH_INTERVAL`` seconds (and in the transaction that persists the
finished message), so a fast answer costs no extra commit at all (nor any
items: its events are only held until a flush may be due, see ``hold``) and a
slow one costs a few per second.  Order is never changed: items are flushed in
the order they were produced.

Reasoning (a model's extended thinking) is journaled too, as parts of kind
``thinking`` whose text rides in a ``thinking`` field (not ``text``), coalesced
like text: a model may think for a minute before its first answer token, and a
client that shows nothing meanwhile looks stuck, so the stream is worth
showing; the separate field keeps clients that only know ``text`` (the CLI)
from printing reasoning as if it were the answer.  A ``redacted_thinking``
block is journaled as a bare ``part.added`` (its data is opaque and useless to
a client), so part numbers stay in step with the message's parts.  Signatures
are not journaled as parts; the persisted message (``message.added``, the
transcript) holds them.
"""

from __future__ import annotations

from typing import Any

from sessions import events as E

from .providers.base import (
    Finish,
    RedactedThinking,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
)

__all__ = ["PartCoalescer", "FLUSH_INTERVAL", "MAX_PENDING_CHARS"]

# Seconds between flushes of streamed parts while a model call is running.
FLUSH_INTERVAL = 0.1
# Flush earlier when this many characters are pending (journal events stay small).
MAX_PENDING_CHARS = 16_000

assert FLUSH_INTERVAL > 0 and 0 < MAX_PENDING_CHARS < 80_000


class PartCoalescer:
    """Pending (type, data) journal items for one model call's stream."""

    # (slots: one per model call, its fields read on every streamed event)
    __slots__ = ("run_id", "call", "pending", "pending_chars", "_part_of_text", "_part_of_call",
                 "_part_of_thinking", "_last_text_index", "_last_part", "parts", "flushes", "held", "held_chars")

    def __init__(self, run_id: str, call_number: int) -> None:
        self.run_id = run_id
        self.call = call_number
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.pending_chars = 0
        self._part_of_text: dict[int, int] = {}
        self._part_of_call: dict[int, int] = {}
        self._part_of_thinking: dict[int, int] = {}
        self._last_text_index: int | None = None
        self._last_part: int | None = None
        self.parts = 0
        self.flushes = 0  # commits of pending items so far (the runner counts them)
        # Events kept raw by :meth:`hold` (None: none held), and their characters.
        self.held: list[StreamEvent] | None = None
        self.held_chars = 0

    def hold(self, ev: StreamEvent) -> int:
        """Keep ``ev`` without making journal items of it yet (:meth:`release` does).

        Until a call's first flush is due, its events need only be kept: an answer that
        ends before then (most do) is journaled whole by ``message.added``, and the part
        items :meth:`add` would have made of its stream are never used. ``held_chars``
        counts what :meth:`add` would count in ``pending_chars`` (never less), so a caller
        that releases once it reaches MAX_PENDING_CHARS flushes no later than before.
        Returns ``held_chars``."""
        if self.held is None:
            self.held = []
        self.held.append(ev)
        if isinstance(ev, (TextDelta, ThinkingDelta)):
            self.held_chars += len(ev.text)
        elif isinstance(ev, ToolCallDelta):
            self.held_chars += len(ev.arguments)
        return self.held_chars

    def release(self) -> None:
        """Make the journal items of the held events, in order, as :meth:`add` of each would
        have; events after this are given to :meth:`add` directly."""
        held, self.held, self.held_chars = self.held, None, 0
        for ev in held or ():
            self.add(ev)

    def add(self, ev: StreamEvent) -> None:
        if isinstance(ev, TextDelta):
            if not ev.text:
                return
            part = self._part_of_text.get(ev.index)
            if part is None or self._last_part != part:
                part = self._new_part({"kind": "text"})
                self._part_of_text[ev.index] = part
            self._delta(part, "text", ev.text)
        elif isinstance(ev, ToolCallStart):
            part = self._new_part({"kind": "tool_call", "id": ev.id, "name": ev.name})
            self._part_of_call[ev.index] = part
        elif isinstance(ev, ToolCallDelta):
            part = self._part_of_call.get(ev.index)
            if part is not None and ev.arguments:
                self._delta(part, "arguments", ev.arguments)
        elif isinstance(ev, Finish):
            pass
        elif isinstance(ev, ThinkingDelta):
            if not ev.text:
                return
            part = self._part_of_thinking.get(ev.index)
            if part is None:
                part = self._new_part({"kind": "thinking"})
                self._part_of_thinking[ev.index] = part
            self._delta(part, "thinking", ev.text)
        elif isinstance(ev, ThinkingSignature):
            # Not journaled, but a block signed before any text (an empty thinking block)
            # still takes its part number, as it takes a part in the message.
            if ev.index not in self._part_of_thinking:
                self._part_of_thinking[ev.index] = self._new_part({"kind": "thinking"})
        elif isinstance(ev, RedactedThinking):
            self._new_part({"kind": "redacted_thinking"})

    def _new_part(self, extra: dict[str, Any]) -> int:
        part = self.parts
        self.parts += 1
        self._last_part = part
        self.pending.append((E.PART_ADDED, {"run_id": self.run_id, "call": self.call, "part": part, **extra}))
        return part

    def _delta(self, part: int, field: str, text: str) -> None:
        self._last_part = part
        self.pending_chars += len(text)
        if self.pending:
            typ, data = self.pending[-1]
            if data.get("part") == part and (typ == E.PART_UPDATED or typ == E.PART_ADDED):
                # merge into the newest pending item of the same part
                data[field] = data.get(field, "") + text
                return
        self.pending.append((E.PART_UPDATED, {"run_id": self.run_id, "call": self.call, "part": part, field: text}))

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        if self.held is not None:
            self.release()
        items, self.pending, self.pending_chars = self.pending, [], 0
        return items

    @property
    def urgent(self) -> bool:
        return self.pending_chars >= MAX_PENDING_CHARS
