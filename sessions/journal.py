"""The event journal: per (owner, conversation), an append-only log of domain
events under versionstamped keys.

Positions and cursors
    An event's key ends in a 12-byte versionstamp: the 10-byte commit stamp
    (strictly increasing in commit order, never reused) and a 2-byte order of
    the event inside its transaction. That position is the cursor, handed out
    as an opaque 24-character string. Live and replayed events are read from
    the same keys, so a cursor is identical in replay and live.

Writing
    :meth:`Journal.emit` takes the caller's transaction: the state change and
    its event commit together or not at all. Several emits in one transaction
    get distinct positions in call order. Emits read nothing that another
    emitter writes (the counter is an atomic ``add``; the event key is unique),
    so concurrent emitters never conflict with each other or with trimming.
    The position is known after commit: ``await ref.cursor()``.

Reading
    :meth:`Journal.read` costs O(page) however long the journal is: one range
    read starting just after the cursor, plus two point reads. When the cursor
    is at or before the last trimmed position (it fell behind retention) the
    page says so (``behind=True``) and carries ``first_retained``.
    :meth:`Journal.follow` replays then waits on a watch of the emitted-count
    key created in the *same* transaction as the read that came up short, so
    no commit falls between replay and live (no gap), and it always reads
    strictly after the last cursor it yielded (no duplicate).

Retention
    The most recent ``retention`` events per conversation are kept (default
    20,000; 0 keeps all). :meth:`Journal.trim` deletes the excess in batches;
    it reads only the trimmed-count key (which only trimmers write) and the
    doomed keys, so it never blocks an append. Emits note which conversations
    grew; :meth:`Journal.run_trimmer` (a service task for the runtime's
    nursery) trims them, and :meth:`Journal.maybe_trim` does it inline.
"""

from __future__ import annotations

import gc
import logging
import os
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, NamedTuple, Sequence

import trio

import kv

from . import events as ev
from .codec import Encoded, dumps, loads, own_dumps, pack_i64, unpack_i64
from .errors import CursorBehind, InvalidCursor, NotFound, TooLarge
from .keyspace import SessionsKeyspace
from .owners import OwnerLike, as_tag

log = logging.getLogger(__name__)

__all__ = [
    "Journal", "Event", "EventRef", "JournalPage",
    "DEFAULT_RETENTION", "DEFAULT_PAGE", "MAX_PAGE", "MAX_EVENT_BYTES", "MAX_EVENTS_PER_TRANSACTION",
    "encode_cursor", "decode_cursor", "check_conversation_id",
]

#: Events kept per conversation (0 keeps all).
DEFAULT_RETENTION = 20_000
#: Default and largest page of :meth:`Journal.read`.
DEFAULT_PAGE = 256
MAX_PAGE = 10_000
#: An event's encoded value must fit one kv value; bigger payloads belong in the
#: transcript or an attachment, referenced from the event.
MAX_EVENT_BYTES = 90_000
#: The 2-byte in-transaction order bounds events per transaction.
MAX_EVENTS_PER_TRANSACTION = 65_535
#: Trim deletes at most this many events per transaction (stays far under 5 s / 10 MB).
TRIM_BATCH = 5_000
#: Conversations whose small growth the trimmer remembers between sweeps.
MAX_TRACKED_CONVERSATIONS = 100_000
#: Conversations whose emit keys an emit remembers (see Journal._append_keys): as the
#: keyspace's caches, small (the hot ones are those with runs in flight); forgetting is safe.
APPEND_KEYS_CACHE = 1_024
#: Conversation ids are key parts.
MAX_CONVERSATION_ID = 512
#: Cursor = 12 bytes, hex.
CURSOR_BYTES = 12
assert TRIM_BATCH <= MAX_PAGE and MAX_EVENT_BYTES < kv.limits.VALUE_SIZE_LIMIT


def encode_cursor(position: bytes) -> str:
    assert len(position) == CURSOR_BYTES
    return position.hex()


def decode_cursor(cursor: str) -> bytes:
    if not isinstance(cursor, str) or len(cursor) != CURSOR_BYTES * 2:
        raise InvalidCursor("not a journal cursor")
    try:
        return bytes.fromhex(cursor)
    except ValueError:
        raise InvalidCursor("not a journal cursor") from None


def check_conversation_id(conversation: str) -> str:
    # (``__class__ is str`` first: a str needs no isinstance call; a str subclass still passes)
    if ((conversation.__class__ is not str and not isinstance(conversation, str)) or not conversation
            or len(conversation) > MAX_CONVERSATION_ID):
        raise ValueError(f"a conversation id is a non-empty string of at most {MAX_CONVERSATION_ID} characters")
    return conversation


class Event(NamedTuple):
    """One journal event. ``cursor`` is its position (resume *after* it).
    (A NamedTuple: replay builds tens of thousands of these per second.)"""

    cursor: str
    type: str
    data: Any
    ts: float
    eid: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "type": self.type, "data": self.data, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class JournalPage:
    """A page of events after a cursor.

    ``next_cursor`` resumes after this page (the cursor passed in when empty).
    ``first_retained`` is the oldest position still stored (None when empty).
    ``behind`` is True when the cursor fell behind retention: events between it
    and ``first_retained`` are gone.
    """

    events: list[Event]
    next_cursor: str | None
    first_retained: str | None
    behind: bool
    more: bool = False


class EventRef:
    """What :meth:`Journal.emit` returns: the event's position once its transaction commits."""

    __slots__ = ("_stamp", "order", "type", "_cursor")

    def __init__(self, stamp: Any, order: int, type: str) -> None:
        self._stamp = stamp
        self.order = order
        self.type = type
        self._cursor: str | None = None

    async def cursor(self) -> str:
        """The committed event's cursor; awaits the commit's versionstamp."""
        if self._cursor is None:
            stamp = await self._stamp
            # encode_cursor inline (the hex of the 12 position bytes), the order's 2 bytes from
            # the table: one per acknowledged submit, where a Python call costs as much as the rest.
            order = self.order
            self._cursor = (bytes(stamp) + (_ORDER_BYTES[order] if order < _ORDER_BYTES_CACHED
                                            else order.to_bytes(2, "big"))).hex()
        return self._cursor


# Per-transaction event order, kept on the transaction object itself (an attribute;
# a weak map for transaction types that take none; see Journal.emit_many_tr). Never reset across a
# transaction's retries: the order only has to be unique and increasing inside one commit.
_ORDER_ATTR = "_surefoot_event_order"
_ORDER: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


# An event key is ``prefix + pack((Versionstamp,))``: the tuple layer's code
# 0x33 then the 12 stamp bytes. Built and parsed by hand on the hot path (tuple
# packing costs tens of microseconds); tests check it against kv.tuple.
_VS_CODE = bytes((kv.tuple.VERSIONSTAMP_CODE,))


def _stamped_event_key(prefix: bytes, order: int) -> bytes:
    """``Subspace(raw_prefix=prefix).pack_with_versionstamp((Versionstamp(user_version=order),))``."""
    return (prefix + _VS_CODE + b"\xff" * 10 + order.to_bytes(2, "big")
            + struct.pack("<I", len(prefix) + 1))


_ADD_ONE = pack_i64(1)
_ADD_ZERO = pack_i64(0)
#: The emitted-count operands of emits of 0.._ADD_N_CACHED - 1 events.
_ADD_N_CACHED = 64
_ADD_N = [pack_i64(n) for n in range(_ADD_N_CACHED)]
#: The 2-byte in-transaction orders 0.._ORDER_BYTES_CACHED - 1 (a turn's transactions use a few).
_ORDER_BYTES_CACHED = 256
_ORDER_BYTES = [i.to_bytes(2, "big") for i in range(_ORDER_BYTES_CACHED)]
#: An event key's parts around the journal prefix (see _stamped_event_key, _append_keys).
_STAMP_PLACEHOLDER = b"\xff" * 10
_VS_OFFSET = struct.Struct("<I").pack
_EVENTS_PART, _EMITTED_PART = kv.tuple.pack(("e",)), kv.tuple.pack(("n",))

#: An event value's first bytes per event type: CBOR's head of a 4-element array, then the
#: type's string (see Journal.emit_many_tr); the keys are exactly ev.EVENT_TYPES.
_EVENT_HEADS: dict[str, bytes] = {t: b"\x84" + dumps(t) for t in ev.EVENT_TYPES}
_NULL = dumps(None)
_pack_f64 = struct.Struct(">d").pack


def _position_of(prefix: bytes, key: bytes) -> bytes:
    """The 12 position bytes of an event key (see :func:`_stamped_event_key`)."""
    n = len(prefix)
    if key[n:n + 1] != _VS_CODE or len(key) != n + 1 + CURSOR_BYTES:
        raise ValueError("not a journal event key")
    return key[n + 1:]


def _new_eid() -> str:
    return os.urandom(8).hex()


class Journal:
    """The journal of every conversation in one deployment root."""

    def __init__(
        self,
        db: Any,
        root: "kv.Subspace | None" = None,
        *,
        retention: int = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        trim_slack: int | None = None,
        new_id: Callable[[], str] = _new_eid,
    ) -> None:
        assert retention >= 0
        self.db = db
        self.keys = SessionsKeyspace(root)
        self.retention = retention
        self.clock = clock
        self.new_id = new_id  # ids of guarded emits (injectable: the simulator wants byte-identical runs)
        # Trim once the excess passes the slack, so trimming is amortised
        # over many appends instead of costing a transaction per append.
        self.trim_slack = trim_slack if trim_slack is not None else max(1, min(1_000, retention // 10 or 1))
        self._appends: dict[tuple[str, str], tuple[bytes, bytes, bytes]] = {}  # see _append_keys
        self._grown: dict[tuple[str, str], int] = {}  # emits since last trim, per conversation
        # Those of _grown past the slack, noted as they cross it: the trimmer takes them from
        # here instead of scanning every conversation _grown tracks (up to
        # MAX_TRACKED_CONVERSATIONS, each second) to find the few that are due.
        self._due: set[tuple[str, str]] = set()
        self._grown_event = trio.Event()
        self._recent: set[tuple[str, str]] = set()    # trimmed since the last sweep
        # Event data encoded by an encoder of the journal's own (a journal is used from its
        # database's trio thread only): see codec.own_dumps.
        self._dumps = own_dumps()

    # -- writing ------------------------------------------------------------

    async def emit(self, tr: Any, owner: OwnerLike, conversation: str, type: str, data: Any = None,
                   *, eid: str | None = None, before: "Sequence[tuple[str, Any]]" = ()) -> EventRef:
        """Append one event in ``tr`` (the caller's transaction, committed by the caller).
        ``eid`` (optional) is stored with the event so a guarded writer can find it again.
        ``before``: ``(type, data)`` events to journal just ahead of it, in the same
        :meth:`emit_many_tr` (``eid`` is stored with those too); the ref is this event's.

        Not idempotent by itself: the caller's transaction must be guarded (a
        lease check, a head check, a marker) so a 1021 retry does not emit twice.
        """
        if before:  # (only this event's ref is made: the settle's three events ask for one)
            return (await self.emit_many_tr(tr, owner, conversation, (*before, (type, data)), eid=eid,
                                            last_ref_only=True))[0]
        return (await self.emit_many_tr(tr, owner, conversation, ((type, data),), eid=eid))[0]

    async def emit_many_tr(self, tr: Any, owner: OwnerLike, conversation: str,
                           items: "Sequence[tuple[str, Any]]", *, eid: str | None = None,
                           refs: bool = True, first_ref_only: bool = False,
                           last_ref_only: bool = False) -> list[EventRef]:
        """:meth:`emit` for each ``(type, data)`` of ``items``, in order, in ``tr``: the same
        keys and values as that many emits, with the conversation checked and its emitted
        count bumped once for all of them. Not idempotent by itself (see :meth:`emit`).
        ``refs=False``: the caller wants no positions back (returns ``[]``; no awaitable
        versionstamp is asked of the transaction for them); ``first_ref_only``: the first
        event's position only (a one-element list; the submit's ``run.queued``);
        ``last_ref_only``: the last event's only (a one-element list; :meth:`emit` with
        ``before``). A ``data`` that is a
        :class:`sessions.codec.Encoded` is stored as its bytes (what encoding the value they
        encode would store)."""
        # A str owner found in _appends with this conversation was validated as a tag (and
        # normalised: as_tag gave the str back) and the conversation checked when the pair was
        # first emitted to: no as_tag call for every emit after the first.
        ck = (owner, conversation)
        keys = self._appends.get(ck) if owner.__class__ is str else None
        if keys is None:
            tag = as_tag(owner)
            check_conversation_id(conversation)
            if not items:
                return []
            ck = (tag, conversation)
            keys = self._appends.get(ck)
            if keys is None:
                keys = self._append_keys(ck)
        elif not items:
            return []
        now = self.clock()
        # The value is a CBOR array [type, data, ts, eid] (cheaper to decode than a map on
        # replay), built as its parts' encodings concatenated: the same bytes as
        # dumps([type, data, now, eid]) (cbor2 shares no values or strings by default), with
        # the array head and the type encoded once per process, ts and eid once per emit, and
        # no list to encode (cbor2 checks every list against collections.abc.Mapping, a
        # Python-level call: ~0.5 us of the ~0.8 us each event's list used to add).
        # (a finite float, as every real clock gives: cbor2 writes it as a double, 0xfb + its 8
        # bytes big-endian, and packing it here saves a cbor2 call, ~2,400 instructions)
        tail = ((b"\xfb" + _pack_f64(now) if now.__class__ is float and now - now == 0.0 else dumps(now))
                + (_NULL if eid is None else dumps(eid)))
        values = []
        for etype, data in items:
            try:
                head = _EVENT_HEADS[etype]
            except (KeyError, TypeError):
                raise ValueError(f"unknown journal event type {etype!r}; see sessions.events") from None
            # (data already encoded by the caller: its bytes; see sessions.codec.Encoded)
            value = head + (data if data.__class__ is Encoded else self._dumps(data)) + tail
            if len(value) > MAX_EVENT_BYTES:
                raise TooLarge(f"journal event of {len(value)} bytes exceeds {MAX_EVENT_BYTES}; store the payload "
                               "in the transcript or an attachment and reference it")
            values.append(value)
        # (No create-if-missing of the conversation: the emitted-count add below makes it
        # exist, see _check_conversation. Nothing read, so nothing for a retry to guard.)
        count = len(values)
        # The first of ``count`` orders reserved in ``tr`` (inline: 4 emits a turn).
        try:
            order = getattr(tr, _ORDER_ATTR, 0)
            setattr(tr, _ORDER_ATTR, order + count)
        except AttributeError:  # no attributes (slots): a weak map
            order = _ORDER.get(tr, 0)
            _ORDER[tr] = order + count
        if order + count > MAX_EVENTS_PER_TRANSACTION:
            raise TooLarge(f"more than {MAX_EVENTS_PER_TRANSACTION} journal events in one transaction")
        head, tail, emitted = keys
        setk = tr.set_versionstamped_key
        if count == 1 and order < _ORDER_BYTES_CACHED:
            # (one event, as a submit's run.queued: its value is the loop's last, no second loop)
            setk(head + _ORDER_BYTES[order] + tail, value)
        elif order + count <= _ORDER_BYTES_CACHED:  # (the 2-byte orders from a table, not to_bytes)
            for i, value in enumerate(values, order):
                setk(head + _ORDER_BYTES[i] + tail, value)
        else:
            for i, value in enumerate(values, order):
                setk(head + i.to_bytes(2, "big") + tail, value)
        tr.add(emitted, _ADD_N[count] if count < _ADD_N_CACHED else pack_i64(count))
        if self.retention:  # (retention 0 keeps everything: no growth to track for the trimmer)
            self._grown[ck] = n = self._grown.get(ck, 0) + count
            if n >= self.trim_slack:
                self._due.add(ck)
                self._grown_event.set()
        if not refs:
            return []
        stamp = tr.get_versionstamp()
        if first_ref_only:
            return [EventRef(stamp, order, items[0][0])]
        if last_ref_only:
            return [EventRef(stamp, order + count - 1, items[-1][0])]
        out: list[EventRef] = []
        for etype, _ in items:
            out.append(EventRef(stamp, order, etype))
            order += 1
        return out

    def _append_keys(self, ck: tuple[str, str]) -> tuple[bytes, bytes, bytes]:
        """What every emit to conversation ``ck`` writes, remembered per conversation: an
        event key is ``head + order + tail`` (:func:`_stamped_event_key` split around the
        per-event order), and the emitted-count key. (A dict on the journal, not an
        lru_cache on the method: that would keep every journal, and its database, alive.)
        Built from the journal's packed prefix directly: a turn of the benchmark is a new
        conversation, and ``keys.events``' Subspace and the other cached keys went unused."""
        keys = self._appends.get(ck)
        if keys is None:
            if len(self._appends) >= APPEND_KEYS_CACHE:
                self._appends.clear()
            journal = self.keys._journal(*ck)
            prefix = journal + _EVENTS_PART
            keys = self._appends[ck] = (prefix + _VS_CODE + _STAMP_PLACEHOLDER, _VS_OFFSET(len(prefix) + 1),
                                        journal + _EMITTED_PART)
        return keys

    def note_committed(self, owner: OwnerLike, conversation: str) -> None:
        """Tell the journal a transaction that emitted to ``conversation`` committed. Kept for
        callers: an emit reads nothing about its conversation any more (its emitted-count add
        is what makes the conversation exist), so there is nothing left to skip."""

    async def ensure_conversation_tr(self, tr: Any, owner: OwnerLike, conversation: str) -> None:
        """Make the conversation exist for ``owner`` (journal reads of it then succeed, empty).

        Idempotent and blind: an add of 0 to the emitted count, which creates that key (as
        0) when absent and changes nothing otherwise; the count's existence is what
        :meth:`_check_conversation` looks for."""
        tr.add(self.keys.emitted(as_tag(owner), check_conversation_id(conversation)), _ADD_ZERO)

    async def emit_many(self, owner: OwnerLike, conversation: str, items: list[tuple[str, Any]],
                        *, guard: Callable[[Any], Any] | None = None) -> list[str]:
        """Emit ``items`` [(type, data)] in one transaction of its own; returns their cursors.

        Guarded: every event carries a random id chosen before the first
        attempt; a retry (which may follow a 1021 whose commit happened) first
        scans the events appended since the first attempt's tail for that id
        and, if found, returns the committed cursors instead of emitting again.
        ``guard(tr)`` (e.g. a lease check) runs first in every attempt.
        """
        tag = as_tag(owner)
        check_conversation_id(conversation)
        eids = [self.new_id() for _ in items]
        state: dict[str, Any] = {"attempt": 0, "tail": None}

        async def fn(tr: Any) -> list[EventRef] | list[str]:  # guarded: eid scan on retries (see docstring)
            if guard is not None:
                await guard(tr)
            sub = self.keys.events(tag, conversation)
            if state["attempt"] == 0:
                last = await tr.snapshot.get_range(sub.range().start, sub.range().stop, limit=1, reverse=True)
                state["tail"] = last[0].key if last else None
            else:
                found = await self._find_eids(tr, sub, state["tail"], eids)
                if found is not None:
                    return found
            state["attempt"] += 1
            return [await self.emit(tr, tag, conversation, t, d, eid=e) for (t, d), e in zip(items, eids)]

        refs = await self.db.transact(fn)
        if refs and isinstance(refs[0], str):
            return refs  # type: ignore[return-value]
        return [await r.cursor() for r in refs]  # type: ignore[union-attr]

    async def emit_one(self, owner: OwnerLike, conversation: str, type: str, data: Any = None,
                       *, guard: Callable[[Any], Any] | None = None) -> str:
        """Convenience: one event in its own guarded transaction; returns its cursor."""
        return (await self.emit_many(owner, conversation, [(type, data)], guard=guard))[0]

    async def _find_eids(self, tr: Any, sub: "kv.Subspace", tail: bytes | None, eids: list[str]) -> list[str] | None:
        r = sub.range()
        begin = tail + b"\x00" if tail is not None else r.start
        want = set(eids)
        found: dict[str, str] = {}
        async for row in tr.snapshot.get_range(begin, r.stop):
            eid = loads(row.value)[3]
            if eid in want:
                found[eid] = self._cursor_of(sub, row.key)
                if len(found) == len(want):
                    return [found[e] for e in eids]
        return None

    # -- reading ------------------------------------------------------------

    @staticmethod
    def _cursor_of(sub: "kv.Subspace", key: bytes) -> str:
        return encode_cursor(_position_of(sub.raw_prefix, key))

    def _key_of(self, sub: "kv.Subspace", position: bytes) -> bytes:
        return sub.raw_prefix + _VS_CODE + position

    async def _check_conversation(self, tr: Any, tag: str, conversation: str) -> None:
        # A conversation exists once its emitted-count key does: every emit adds to it and
        # ensure_conversation_tr adds 0, and nothing ever clears it (trimming counts in its
        # own key), so a snapshot read is enough (no conflict with the emits that bump it;
        # existence never goes away). The count is under the owner's prefix, so only the
        # owner's writes made it. Older stored data: a conversation record ("cv") written by
        # the first emit or by ensure_conversation_tr, with the owner tag in its value, the
        # only sign of a conversation made by ensure_conversation_tr alone; read when the
        # count is absent.
        if await tr.snapshot.get(self.keys.emitted(tag, conversation)) is not None:
            return
        raw = await tr.get(self.keys.conversation(tag, conversation))
        if raw is None or loads(raw).get("owner") != tag:
            if raw is not None:
                log.error("conversation record under %r carries a different owner tag", tag)
            raise NotFound(f"conversation {conversation!r} not found")

    async def read_tr(self, tr: Any, owner: OwnerLike, conversation: str, after: str | None = None,
                      limit: int = DEFAULT_PAGE) -> JournalPage:
        """One page of events strictly after ``after`` (None: from the oldest retained)."""
        tag = as_tag(owner)
        check_conversation_id(conversation)
        if not 0 < limit <= MAX_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_PAGE}")
        position = decode_cursor(after) if after is not None else None
        await self._check_conversation(tr, tag, conversation)
        sub = self.keys.events(tag, conversation)
        r = sub.range()
        first = await tr.get_range(r.start, r.stop, limit=1)
        first_retained = self._cursor_of(sub, first[0].key) if first else None
        behind = False
        if position is not None:
            watermark = await tr.get(self.keys.watermark(tag, conversation))
            behind = watermark is not None and position <= watermark
            begin = self._key_of(sub, position) + b"\x00"
        else:
            begin = r.start
        rows = await tr.get_range(begin, r.stop, limit=limit)
        # Hot loop (replay): every key in this range is prefix + 0x33 + 12 position bytes.
        n = len(sub.raw_prefix) + 1
        # The objects built here are acyclic; pausing the cycle collector for this
        # synchronous loop keeps a replay from paying for collections that scan
        # the whole (possibly large) heap every few hundred events.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            events = [Event(row.key[n:].hex(), *loads(row.value)) for row in rows]
        finally:
            if gc_was_enabled:
                gc.enable()
        next_cursor = events[-1].cursor if events else after
        return JournalPage(events, next_cursor, first_retained, behind, more=len(rows) == limit)

    async def read(self, owner: OwnerLike, conversation: str, after: str | None = None,
                   limit: int = DEFAULT_PAGE) -> JournalPage:
        """Read-only transaction (idempotent): one page; see :meth:`read_tr`."""
        return await self.db.transact(lambda tr: self.read_tr(tr, owner, conversation, after, limit))

    async def tail_cursor(self, owner: OwnerLike, conversation: str) -> str | None:
        """The newest event's cursor (follow from it to get only live events)."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> str | None:  # read-only: idempotent
            await self._check_conversation(tr, tag, conversation)
            sub = self.keys.events(tag, conversation)
            r = sub.range()
            last = await tr.get_range(r.start, r.stop, limit=1, reverse=True)
            return self._cursor_of(sub, last[0].key) if last else None

        return await self.db.transact(fn)

    async def follow(self, owner: OwnerLike, conversation: str, after: str | None = None, *,
                     page_size: int = DEFAULT_PAGE,
                     on_behind: Literal["raise", "continue"] = "raise") -> AsyncIterator[Event]:
        """Replay events after ``after``, then yield new ones as they commit, forever.

        If the cursor fell behind retention, raises :class:`CursorBehind`
        (carrying ``first_retained``) before yielding anything from that page,
        unless ``on_behind="continue"`` (then it carries on from the oldest
        retained event). Cancel the consuming scope to stop.
        """
        tag = as_tag(owner)
        cursor = after
        while True:
            async def fn(tr: Any) -> tuple[JournalPage, Any]:  # read-only: idempotent
                page = await self.read_tr(tr, tag, conversation, cursor, page_size)
                watch = None
                if not page.more:
                    # Same transaction as the read that came up short: any emit
                    # committed after this read version changes the counter.
                    watch = tr.watch(self.keys.emitted(tag, conversation))
                return page, watch

            page, watch = await self.db.transact(fn)
            try:
                if page.behind and on_behind == "raise":
                    raise CursorBehind(page.first_retained)
                for e in page.events:
                    yield e
                    cursor = e.cursor
                if watch is not None:
                    await watch
            finally:
                if watch is not None and not watch.ready:
                    watch.cancel()

    # -- retention ----------------------------------------------------------

    async def trim(self, owner: OwnerLike, conversation: str, *, retention: int | None = None) -> int:
        """Delete events beyond the most recent ``retention``; returns how many were deleted.

        Guarded: each transaction re-reads the trimmed count (which only
        trimmers write, so concurrent trimmers conflict and serialise) and the
        doomed keys; a 1021 retry recomputes from committed state.
        """
        tag = as_tag(owner)
        keep = self.retention if retention is None else retention
        if keep == 0:
            return 0
        total = 0
        while True:
            async def fn(tr: Any) -> int:  # guarded: re-reads the trimmed count and the doomed keys
                emitted = unpack_i64(await tr.snapshot.get(self.keys.emitted(tag, conversation)))
                trimmed = unpack_i64(await tr.get(self.keys.trimmed(tag, conversation)))
                excess = emitted - trimmed - keep
                if excess <= 0:
                    return 0
                sub = self.keys.events(tag, conversation)
                r = sub.range()
                rows = await tr.snapshot.get_range(r.start, r.stop, limit=min(excess, TRIM_BATCH))
                if not rows:
                    return 0
                last = rows[-1].key
                tr.clear_range(rows[0].key, last + b"\x00")
                tr.add(self.keys.trimmed(tag, conversation), pack_i64(len(rows)))
                tr.set(self.keys.watermark(tag, conversation), _position_of(sub.raw_prefix, last))
                return len(rows)

            n = await self.db.transact(fn)
            total += n
            if n < TRIM_BATCH:
                return total

    async def maybe_trim(self, *, sweep: bool = False) -> int:
        """Trim every conversation that grew past the slack since its last trim. With
        ``sweep``, also re-trim those trimmed recently: growth is counted at emit
        time, before commit, so an emit in flight during a trim is only visible to
        a later one (a conversation leaves the recent set once a trim finds nothing
        to do). Conversations that grew less than the slack are remembered, up to
        ``MAX_TRACKED_CONVERSATIONS``; past that a sweep trims them all and forgets."""
        if not self.retention:
            self._grown.clear()
            self._due.clear()
            return 0
        due, self._due = self._due, set()
        if sweep:
            due |= self._recent
            self._recent = set()
            if len(self._grown) > MAX_TRACKED_CONVERSATIONS:
                due |= set(self._grown)
        total = 0
        order = sorted(due)
        for i, (tag, conv) in enumerate(order):
            self._grown.pop((tag, conv), None)
            try:
                n = await self.trim(tag, conv)
            except BaseException:
                self._due.update(order[i:])  # not trimmed: the next pass tries them again
                raise
            total += n
            if n or not sweep:
                self._recent.add((tag, conv))
        return total

    async def run_trimmer(self, *, interval: float = 1.0, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Service task: trims grown conversations as emits report them, and every
        ``interval`` seconds sweeps the recently trimmed ones again (growth is counted
        at emit time, before commit, so a trim can race an in-flight emit; the sweep
        catches up). Start it in the runtime's nursery: ``await nursery.start(journal.run_trimmer)``."""
        task_status.started()
        while True:
            with trio.move_on_after(interval) as scope:
                await self._grown_event.wait()
            self._grown_event = trio.Event()
            try:
                await self.maybe_trim(sweep=scope.cancelled_caught)
            except kv.KVError as e:  # retention is best effort; the next growth retries
                log.warning("journal trim failed: %s", e)
