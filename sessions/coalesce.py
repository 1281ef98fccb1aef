"""Coalescing high-rate deltas (token streaming) into few journal commits.

The loop streams a model's output as ``part.updated`` deltas. Committing each
one would cost a transaction per token; :class:`Coalescer` buffers them and
flushes on size, on count, or when the oldest buffered delta is older than
``max_delay`` (checked as deltas arrive — no background task), merging
*adjacent* deltas of the same part into one event whose text field is the
concatenation. Nothing is reordered: deltas of different parts stay separate
events in arrival order, and every other event of the conversation must go
through :meth:`Coalescer.emit` (or follow :meth:`Coalescer.drain`) in the same
transaction, which writes the buffered deltas first.

Flushes run in their own transaction through ``Journal.emit_many`` (guarded:
a 1021 retry does not duplicate text), after ``guard(tr)`` — pass the loop's
lease check so a worker whose lease was lost cannot stream into the journal.
Call :meth:`Coalescer.flush` when the stream ends.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from . import events as ev
from .codec import dumps
from .journal import EventRef, Journal, MAX_EVENT_BYTES
from .owners import OwnerLike, as_tag

__all__ = ["Coalescer", "DEFAULT_MAX_DELAY", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_DELTAS"]

DEFAULT_MAX_DELAY = 0.05   # seconds a delta may wait for company
DEFAULT_MAX_BYTES = 16_000  # text buffered before a flush
DEFAULT_MAX_DELTAS = 256    # deltas buffered before a flush
assert DEFAULT_MAX_BYTES * 2 < MAX_EVENT_BYTES


class Coalescer:
    """Buffer of ``part.updated`` deltas for one (owner, conversation).

    A delta is a dict; those with equal ``data[key_field]`` that arrive
    back-to-back merge by concatenating ``data[text_field]`` (other fields:
    the latest value wins). Deltas without the text field never merge.
    """

    def __init__(self, journal: Journal, owner: OwnerLike, conversation: str, *,
                 guard: Callable[[Any], Awaitable[Any]] | None = None,
                 type: str = ev.PART_UPDATED, key_field: str = "part", text_field: str = "delta",
                 max_delay: float = DEFAULT_MAX_DELAY, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_deltas: int = DEFAULT_MAX_DELTAS, clock: Callable[[], float] = time.monotonic) -> None:
        assert 0 < max_bytes <= DEFAULT_MAX_BYTES * 2 and max_deltas > 0 and max_delay >= 0
        self.journal = journal
        self.owner = as_tag(owner)
        self.conversation = conversation
        self.guard = guard
        self.type = type
        self.key_field = key_field
        self.text_field = text_field
        self.max_delay = max_delay
        self.max_bytes = max_bytes
        self.max_deltas = max_deltas
        self.clock = clock
        self._pending: list[dict[str, Any]] = []
        self._bytes = 0
        self._count = 0
        self._since: float | None = None
        self._inflight: tuple[Any, int] | None = None  # (transaction, items drained into it)
        self.flushes = 0    # commits made (for tests and benchmarks)
        self.deltas = 0     # deltas accepted
        self.cursors: list[str] = []  # cursors of everything flushed, in order

    @property
    def pending(self) -> int:
        return self._count

    def _merge(self, data: dict[str, Any]) -> None:
        text = data.get(self.text_field)
        if self._pending and isinstance(text, str):
            last = self._pending[-1]
            if (last.get(self.key_field) == data.get(self.key_field)
                    and isinstance(last.get(self.text_field), str)):
                merged = {**last, **data}
                merged[self.text_field] = last[self.text_field] + text
                self._pending[-1] = merged
                return
        self._pending.append(dict(data))

    def _settle_inflight(self) -> None:
        """Forget items drained into a transaction once it has committed. Until then
        they stay buffered, so a retried attempt of the same transaction drains them again."""
        if self._inflight is None:
            return
        tr, n = self._inflight
        try:
            committed = tr.get_committed_version() is not None
        except Exception:  # not committed (yet, or this attempt failed and was reset)
            committed = False
        if committed:
            self._inflight = None
            del self._pending[:n]
            if not self._pending:
                self._bytes, self._count, self._since = 0, 0, None

    async def add(self, data: dict[str, Any]) -> bool:
        """Buffer one delta; flushes (one commit) when a threshold is reached. Returns
        True when it flushed."""
        self._settle_inflight()
        now = self.clock()
        if self._since is None:
            self._since = now
        self._merge(data)
        self._count += 1
        self.deltas += 1
        text = data.get(self.text_field)
        self._bytes += len(text.encode()) if isinstance(text, str) else len(dumps(data))
        if self._bytes >= self.max_bytes or self._count >= self.max_deltas or now - self._since >= self.max_delay:
            await self.flush()
            return True
        return False

    def _take(self) -> list[tuple[str, Any]]:
        items = [(self.type, d) for d in self._pending]
        self._pending, self._bytes, self._count, self._since = [], 0, 0, None
        return items

    async def flush(self) -> list[str]:
        """Commit everything buffered (one guarded transaction); returns the cursors."""
        self._settle_inflight()
        if self._inflight is not None:
            raise RuntimeError("deltas were drained into a transaction that has not committed")
        if not self._pending:
            return []
        items = self._take()
        cursors = await self.journal.emit_many(self.owner, self.conversation, items, guard=self.guard)
        self.flushes += 1
        self.cursors.extend(cursors)
        return cursors

    async def drain(self, tr: Any) -> list[EventRef]:
        """Emit everything buffered into ``tr`` (the caller commits). Use before any
        other event of this conversation in the same transaction.

        Safe under retries: the items stay buffered until ``tr`` has committed
        (checked on the next call), so a retried attempt drains them again."""
        self._settle_inflight()
        if self._inflight is not None and self._inflight[0] is not tr:
            raise RuntimeError("deltas were drained into another transaction that has not committed")
        items = [(self.type, d) for d in self._pending]
        self._inflight = (tr, len(items)) if items else None
        return [await self.journal.emit(tr, self.owner, self.conversation, t, d) for t, d in items]

    async def emit(self, tr: Any, type: str, data: Any = None) -> EventRef:
        """Emit a non-delta event in ``tr``, after the buffered deltas (order preserved)."""
        await self.drain(tr)
        return await self.journal.emit(tr, self.owner, self.conversation, type, data)
