"""Transcripts: a session's ordered messages.

Shape
    A session is a head key (message count, fork segments, last append token,
    owner tag), numbered message keys ``(seq, chunk)`` and a listing key holding its metadata (see
    keyspace.py). Messages are any CBOR-able dicts; the loop defines their
    contents (role, parts, tool calls, results...). A message larger than one
    kv value is split into chunks, written in the same transaction.

Appends
    Every append is one transaction that reads the head (a read conflict), so a
    concurrent appender gets :class:`SessionConflict` (with ``expected_head``)
    or is serialised after the other (without it) — never an interleaved
    history. An append past the transaction limit is refused with
    :class:`TooLarge` before anything is written. Each append carries a random
    token stored in the head, so a retry after ``commit_unknown_result``
    recognises its own committed append instead of reporting a conflict.

Marks
    An append may set the head's ``mark``: a sequence number where a reader
    that needs only the recent part of the history may start
    (:meth:`Transcripts.read_tail_tr`). The loop marks where the context of
    its latest compaction begins, in the transaction that appends the
    compaction entry, so a claim reads O(context), not O(history). A mark
    only moves forward with the appends that set it (other appends keep
    it); a fork starts without one (its reader starts at 0: correct, only
    slower, until its own first mark).

Forks
    ``fork(session, at)`` makes a new session holding messages [0, at). By
    default it is *by reference*: one transaction writes the new head with a
    list of segments ``[(source session, lo, hi)]`` pointing at the parent's
    messages. Messages are immutable once written (appends only add sequence
    numbers >= the head), so a referenced range never changes: the fork is
    unaffected by the parent's later appends, and since it is one transaction a
    reader sees no fork or the whole fork. Sessions are never deleted while
    referenced (this package has no session deletion).

    When the reference chain would exceed ``MAX_FORK_SEGMENTS`` (or
    ``by_reference=False``), the fork copies: a staging head (the sentinel)
    is written first, messages are copied over as many transactions as needed,
    and the real head is published last. A staging session reads as missing;
    a crash mid-copy leaves a staging sentinel that :meth:`Transcripts.cleanup_staging`
    removes.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import kv

from .codec import _SMALL_INTS, CHUNK_SIZE, dumps, fastpack, loads, own_dumps, pack_uint, split_chunks
from .errors import InvalidState, NotFound, SessionConflict, TooLarge
from .keyspace import SessionsKeyspace
from .owners import OwnerLike, as_tag

log = logging.getLogger(__name__)

__all__ = [
    "Transcripts", "Message", "TranscriptPage", "SessionInfo", "HeadRead",
    "MAX_APPEND_BYTES", "MAX_FORK_SEGMENTS", "DEFAULT_READ_PAGE", "MAX_READ_PAGE", "check_session_id",
]

#: An append's encoded keys + values must stay under this (kv's transaction limit is 10,000,000).
MAX_APPEND_BYTES = 9_000_000
assert MAX_APPEND_BYTES < kv.limits.TRANSACTION_SIZE_LIMIT
#: Longest reference chain a by-reference fork may build before it copies instead.
MAX_FORK_SEGMENTS = 32
DEFAULT_READ_PAGE = 200
MAX_READ_PAGE = 5_000
#: Copy-fork batch: keys and bytes per transaction (far under 5 s and 10 MB).
COPY_BATCH_KEYS = 5_000
COPY_BATCH_BYTES = 4_000_000
MAX_SESSION_ID = 512
_KEY_OVERHEAD = 64  # per message key, for the size estimate
_CHUNK_0 = _SMALL_INTS[0]  # (a message key's last part: chunk 0, the only chunk of a message up to CHUNK_SIZE)
HEAD_MEMO_ENTRIES = 256  # decoded session heads remembered by their bytes (Transcripts._checked_head)
assert HEAD_MEMO_ENTRIES > 0
#: Sessions whose append keys an append remembers (Transcripts._append_keys): as the
#: keyspace's caches, small (the hot ones are those with runs in flight); forgetting is safe.
APPEND_KEYS_ENTRIES = 1_024
assert APPEND_KEYS_ENTRIES > 0


def check_session_id(sid: str) -> str:
    # (``__class__ is str`` first: a str needs no isinstance call; a str subclass still passes)
    if (sid.__class__ is not str and not isinstance(sid, str)) or not sid or len(sid) > MAX_SESSION_ID:
        raise ValueError(f"a session id is a non-empty string of at most {MAX_SESSION_ID} characters")
    return sid


@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TranscriptPage:
    messages: list[Message]
    head: int
    next_seq: int | None  # None when the page reached the head
    start: int = 0  # the sequence number the page starts at (read_tail_tr: the mark)


class HeadRead:
    """A session's head record as read in a transaction (None: no such record), for that
    transaction's next append (:meth:`Transcripts.read_tail_for_append_tr`); used once."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any] | None) -> None:
        self.record = record


_USED: Any = object()  # a HeadRead's record once an append has taken it


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: str
    owner: str
    head: int
    created: float
    project: str | None = None
    parent: str | None = None
    fork_at: int | None = None
    title: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Transcripts:
    """Sessions (transcripts) of every owner in one deployment root."""

    def __init__(self, db: Any, root: "kv.Subspace | None" = None, *,
                 clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.db = db
        self.keys = SessionsKeyspace(root)
        self.clock = clock
        self.new_id = new_id
        # head key -> (the head record's bytes as last written here, their decoding): see
        # _checked_head. Bounded (cleared when full; forgetting only costs a decode).
        self._head_memo: dict[bytes, tuple[bytes, dict[str, Any]]] = {}
        # (owner tag, session id) -> (tag, head key, messages prefix): see _append_keys.
        self._appends: dict[tuple[str, str], tuple[str, bytes, bytes]] = {}
        # Messages and heads encoded by an encoder of its own (used from the database's trio
        # thread only): see codec.own_dumps.
        self._dumps = own_dumps()

    def _append_keys(self, owner: OwnerLike, sid: str) -> tuple[str, bytes, bytes]:
        """``(tag, head key, messages prefix)`` of a session an append writes, the owner and
        session id checked, remembered. A str owner and session id found in ``_appends`` were
        checked (as_tag gave the str back) when first remembered, so a turn's later appends
        (three of four) look them up there (see append_tr) and skip as_tag, check_session_id
        and two keyspace lookups. (A dict on the instance, as the journal's: an lru_cache on
        the method would keep every instance alive.)"""
        if owner.__class__ is str:
            try:
                keys = self._appends.get((owner, sid))
            except TypeError:  # (an unhashable session id: check_session_id refuses it)
                keys = None
            if keys is not None:
                return keys
        tag = as_tag(owner)
        check_session_id(sid)
        if len(self._appends) >= APPEND_KEYS_ENTRIES:
            self._appends.clear()
        keys = self._appends[(tag, sid)] = (tag, *self.keys.head_and_messages(tag, sid))
        return keys

    # -- records ------------------------------------------------------------

    async def _head(self, tr: Any, tag: str, sid: str, *, snapshot: bool = False) -> dict[str, Any]:
        reader = tr.snapshot if snapshot else tr
        key = self.keys.head(tag, sid)
        raw = await reader.get(key)
        if raw is None:
            raise NotFound(f"session {sid!r} not found")
        return self._checked_head(key, raw, tag, sid)

    def _checked_head(self, key: bytes, raw: bytes, tag: str, sid: str) -> dict[str, Any]:
        """The head record ``raw`` (read at ``key``), decoded (a copy of the memo's decoding
        when it holds these very bytes: the head this process wrote last) and checked."""
        memo = self._head_memo.get(key)
        head = dict(memo[1]) if memo is not None and memo[0] == raw else loads(raw)
        if head.get("owner") != tag:
            log.error("session head under %r carries a different owner tag", tag)
            raise NotFound(f"session {sid!r} not found")
        if head.get("staging"):
            raise NotFound(f"session {sid!r} not found")
        return head

    async def create_tr(self, tr: Any, owner: OwnerLike, session_id: str | None = None, *,
                        project: str | None = None, title: str | None = None,
                        extra: Mapping[str, Any] | None = None) -> SessionInfo:
        """Create a session, or return the existing one with that id (idempotent)."""
        tag = as_tag(owner)
        sid = check_session_id(session_id or self.new_id())
        raw = await tr.get(self.keys.head(tag, sid))
        if raw is not None:
            head = loads(raw)
            if head.get("staging"):
                raise InvalidState(f"session {sid!r} is being created by a fork")
            return await self._info(tr, tag, sid, head)
        head, now = self._new_session(tr, tag, sid, project, title, extra)
        tr.set(self.keys.head(tag, sid), dumps(head))
        return SessionInfo(sid, tag, 0, now, project, None, None, title, dict(extra or {}))

    def _new_session(self, tr: Any, tag: str, sid: str, project: str | None = None, title: str | None = None,
                     extra: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], float]:
        """Write a new session's records but its head; returns the empty head (the caller writes it)."""
        now = self.clock()
        meta = {"owner": tag, "id": sid, "created": now, "project": project, "parent": None,
                "fork_at": None, "title": title, "extra": dict(extra or {})}
        # The metadata is the listing entry's value (one key a new session, not two: a new
        # conversation's first commit makes it); see _meta_raw for the older layout.
        tr.set(self.keys.session_listing(tag, sid), dumps(meta))
        if project is not None:
            tr.set(self.keys.project_member(tag, project, sid), b"")
        return {"owner": tag, "n": 0, "base": 0, "seg": [], "tok": None}, now

    async def create(self, owner: OwnerLike, session_id: str | None = None, **kw: Any) -> SessionInfo:
        """Guarded (reads the head first): a retried create returns the committed session."""
        sid = session_id or self.new_id()
        return await self.db.transact(lambda tr: self.create_tr(tr, owner, sid, **kw))

    async def _meta_raw(self, tr: Any, tag: str, sid: str) -> bytes | None:
        """The session's metadata record (CBOR), None when there is none. Stored as the value
        of its listing entry ("sl") since session 17; sessions created before that have an
        empty listing value and the record under ("ss", sid, "meta"), read then."""
        raw = await tr.get(self.keys.session_listing(tag, sid))
        if not raw:  # (None: no listing either; b"": the older layout)
            raw = await tr.get(self.keys.meta(tag, sid))
        return raw

    async def _info(self, tr: Any, tag: str, sid: str, head: dict[str, Any]) -> SessionInfo:
        raw = await self._meta_raw(tr, tag, sid)
        meta = loads(raw) if raw is not None else {}
        if meta and meta.get("owner") != tag:
            raise NotFound(f"session {sid!r} not found")
        return SessionInfo(sid, tag, head["n"], meta.get("created", 0.0), meta.get("project"), meta.get("parent"),
                           meta.get("fork_at"), meta.get("title"), meta.get("extra") or {})

    async def get_tr(self, tr: Any, owner: OwnerLike, session_id: str) -> SessionInfo:
        tag = as_tag(owner)
        head = await self._head(tr, tag, check_session_id(session_id))
        return await self._info(tr, tag, session_id, head)

    async def get(self, owner: OwnerLike, session_id: str) -> SessionInfo:
        return await self.db.transact(lambda tr: self.get_tr(tr, owner, session_id))  # read-only

    async def head_tr(self, tr: Any, owner: OwnerLike, session_id: str) -> int:
        return (await self._head(tr, as_tag(owner), check_session_id(session_id)))["n"]

    async def head(self, owner: OwnerLike, session_id: str) -> int:
        return await self.db.transact(lambda tr: self.head_tr(tr, owner, session_id))  # read-only

    async def exists(self, owner: OwnerLike, session_id: str) -> bool:
        try:
            await self.head(owner, session_id)
            return True
        except NotFound:
            return False

    async def list(self, owner: OwnerLike, *, project: str | None = None, limit: int = 1_000) -> list[str]:
        """Session ids of ``owner`` (of one project if given), in id order. Read-only."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> list[str]:  # read-only
            if project is None:
                r = self.keys.session_listing_range(tag)
            else:
                r = self.keys.project_members_range(tag, project)
            rows = await tr.get_range(r.start, r.stop, limit=limit)
            return [kv.tuple.unpack(row.key[len(self.keys.base.key()):])[-1] for row in rows]

        return await self.db.transact(fn)

    # -- appends ------------------------------------------------------------

    async def append_tr(self, tr: Any, owner: OwnerLike, session_id: str, messages: Sequence[Mapping[str, Any]], *,
                        expected_head: int | None = None, token: bytes | None = None, create: bool = False,
                        mark: int | None = None, head: "HeadRead | None" = None,
                        encoded_out: list[bytes] | None = None,
                        known_head: Mapping[str, Any] | None = None,
                        head_out: list[dict[str, Any]] | None = None) -> int:
        """Append ``messages`` in ``tr``; returns the new head (message count).

        Guarded: reads the head (so a concurrent append conflicts) and, when a
        ``token`` is given, recognises its own already-committed append.
        Raises :class:`SessionConflict` when ``expected_head`` is given and the
        head differs, :class:`TooLarge` before writing anything when the append
        cannot fit one transaction.  With ``create``, a missing session is
        created first, as :meth:`create_tr` would (its head written once, with
        the messages), instead of raising :class:`NotFound`.  ``mark`` sets the
        head's mark (see the module docstring) to a sequence number below the new
        head, at least the current mark.  ``head``: what :meth:`read_tail_for_append_tr`
        read of this session's head earlier in ``tr`` (used once): the head is not read
        again (the same key, so the same conflict: the guard is unchanged).
        ``encoded_out``: extended with each message's CBOR (``dumps``), in order, once they
        are all encoded (a caller that journals the messages too need not encode them again).

        ``known_head``: the head record as the caller *knows* it is stored (``head_out`` of
        its own last committed append), so it is not read: the head key is then not in the
        transaction's read conflict set, and a second writer is no longer caught by this
        append. Only for a caller whose transaction reads another guard that every other
        writer of the session must pass: the loop's runner, whose commits check the run's
        lease (only the conversation's one active run appends to it, and only while holding
        its lease; a takeover rewrites the lease first, so a stale writer fails that check).
        ``head_out``: gets the head record this append writes (do not change it).
        """
        # (_append_keys' lookup inline: a remembered str owner and session id, else the checks)
        keys = None
        if owner.__class__ is str:
            try:
                keys = self._appends.get((owner, session_id))
            except TypeError:  # (an unhashable session id: _append_keys refuses it)
                pass
        tag, head_key, prefix = keys if keys is not None else self._append_keys(owner, session_id)
        encoded: list[bytes] = []
        size = 0
        for m in messages:
            if type(m) is not dict:
                if not isinstance(m, Mapping):
                    raise TypeError("a transcript message is a dict")
                m = dict(m)
            data = self._dumps(m)
            encoded.append(data)
            k = len(data)
            size += k + _KEY_OVERHEAD if k < CHUNK_SIZE else k + _KEY_OVERHEAD * (1 + k // CHUNK_SIZE)
        if size > MAX_APPEND_BYTES:
            raise TooLarge(f"append of {size} bytes exceeds {MAX_APPEND_BYTES}; append fewer messages at a time")
        if encoded_out is not None:
            encoded_out.extend(encoded)
        if head is not None:  # read by the caller in this transaction
            record, head.record = head.record, _USED
            assert record is not _USED, "a HeadRead is used once"
            if record is None:
                if not create:
                    raise NotFound(f"session {session_id!r} not found")
                head, _ = self._new_session(tr, tag, session_id)
            else:
                head = record
        elif known_head is not None:  # (the caller's guard vouches for it: see the docstring)
            head = dict(known_head)
        elif create and await tr.get(head_key) is None:
            head, _ = self._new_session(tr, tag, session_id)
        else:
            head = await self._head(tr, tag, session_id)
        n = head["n"]
        if token is not None and head.get("tok") == token and (expected_head is None or n == expected_head + len(encoded)):
            return n  # this very append already committed (1021 retry)
        if expected_head is not None and n != expected_head:
            raise SessionConflict(f"session {session_id!r} head is {n}, expected {expected_head}",
                                  expected=expected_head, actual=n)
        for i, data in enumerate(encoded, n):
            if len(data) <= CHUNK_SIZE:  # (the common case: one chunk)
                # fastpack(prefix, (i, 0)) inline: the tuple codes of seq i, then of 0
                tr.set(prefix + (_SMALL_INTS[i] if i < 256 else pack_uint(i)) + _CHUNK_0, data)
                continue
            for c, chunk in enumerate(split_chunks(data)):
                tr.set(fastpack(prefix, (i, c)), chunk)
        head["n"] = n + len(encoded)
        head["tok"] = token
        if mark is not None:
            if not head.get("mark", 0) <= mark < head["n"]:
                raise ValueError(f"mark {mark} outside [{head.get('mark', 0)}, {head['n']})")
            head["mark"] = mark
        raw = self._dumps(head)
        tr.set(head_key, raw)
        # Remembered by its bytes (a pure decoding: right whether or not this commits), so the
        # next append, which reads these bytes back, does not decode them.
        memo = self._head_memo
        if len(memo) >= HEAD_MEMO_ENTRIES:
            memo.clear()
        memo[head_key] = (raw, head)
        if head_out is not None:
            head_out.append(head)
        return head["n"]

    async def appended_tr(self, tr: Any, owner: OwnerLike, session_id: str, token: bytes) -> bool:
        """True when the session's last append carried ``token``: the guard a composite
        transaction checks first, so a retry after ``commit_unknown_result`` whose
        first attempt committed does nothing twice (pass the same token to append_tr)."""
        head = await self._head(tr, as_tag(owner), check_session_id(session_id))
        return head.get("tok") == token

    async def append(self, owner: OwnerLike, session_id: str, messages: Sequence[Mapping[str, Any]], *,
                     expected_head: int | None = None) -> int:
        """Append in a transaction of its own. Guarded by a token chosen before the first attempt."""
        token = self.new_id().encode()
        return await self.db.transact(
            lambda tr: self.append_tr(tr, owner, session_id, messages, expected_head=expected_head, token=token))

    # -- reads --------------------------------------------------------------

    @staticmethod
    def _pieces(head: dict[str, Any], sid: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """The (source session, lo, hi) ranges that hold messages [start, stop)."""
        out = []
        for src, lo, hi in head.get("seg") or ():
            lo2, hi2 = max(lo, start), min(hi, stop)
            if lo2 < hi2:
                out.append((src, lo2, hi2))
        lo2 = max(head.get("base", 0), start)
        if lo2 < stop:
            out.append((sid, lo2, stop))
        return out

    async def _read_range(self, tr: Any, tag: str, src: str, lo: int, hi: int) -> list[Message]:
        msgs = self.keys.messages(tag, src)
        rows = await tr.get_range(msgs.pack((lo,)), msgs.pack((hi,)))
        out: list[Message] = []
        cur_seq: int | None = None
        parts: list[bytes] = []
        for row in rows:
            seq, _chunk = msgs.unpack(row.key)
            if seq != cur_seq:
                if cur_seq is not None:
                    out.append(Message(cur_seq, loads(b"".join(parts))))
                cur_seq, parts = seq, []
            parts.append(row.value)
        if cur_seq is not None:
            out.append(Message(cur_seq, loads(b"".join(parts))))
        if len(out) != hi - lo:
            raise InvalidState(f"session {src!r} is missing messages in [{lo}, {hi})")
        return out

    async def read_tr(self, tr: Any, owner: OwnerLike, session_id: str, start: int = 0,
                      limit: int = DEFAULT_READ_PAGE) -> TranscriptPage:
        """Messages [start, start+limit) clipped at the head: O(page)."""
        tag = as_tag(owner)
        if not 0 < limit <= MAX_READ_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_READ_PAGE}")
        if start < 0:
            raise ValueError("start must be >= 0")
        head = await self._head(tr, tag, check_session_id(session_id))
        n = head["n"]
        stop = min(n, start + limit)
        out: list[Message] = []
        for src, lo, hi in self._pieces(head, session_id, start, stop):
            out.extend(await self._read_range(tr, tag, src, lo, hi))
        return TranscriptPage(out, n, stop if stop < n else None)

    async def read_tail_tr(self, tr: Any, owner: OwnerLike, session_id: str,
                           limit: int = DEFAULT_READ_PAGE) -> TranscriptPage:
        """Messages [mark, mark+limit) clipped at the head, where ``mark`` is the head's mark
        (0 when none): the recent part of the history its writer marked, read with the head
        in one pass. ``page.start`` says where it starts. O(page)."""
        tag = as_tag(owner)
        if not 0 < limit <= MAX_READ_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_READ_PAGE}")
        head = await self._head(tr, tag, check_session_id(session_id))
        return await self._tail(tr, tag, session_id, head, limit)

    async def read_tail_for_append_tr(self, tr: Any, owner: OwnerLike, session_id: str,
                                      limit: int = DEFAULT_READ_PAGE) -> "tuple[TranscriptPage | None, HeadRead]":
        """:meth:`read_tail_tr` for a caller about to append in the same transaction:
        ``(page, head)``, the page None for a session with no head record yet (raises
        :class:`NotFound` as ``read_tail_tr`` does for any other reason); pass ``head`` to
        :meth:`append_tr` (with ``create=True`` for a new session) so that it does not read
        the head again (a read and a decode per append less)."""
        tag, key, _ = self._append_keys(owner, session_id)  # (remembered for the appends to come)
        if not 0 < limit <= MAX_READ_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_READ_PAGE}")
        raw = await tr.get(key)
        if raw is None:
            return None, HeadRead(None)
        head = self._checked_head(key, raw, tag, session_id)
        page = await self._tail(tr, tag, session_id, head, limit)
        return page, HeadRead(head)

    async def _tail(self, tr: Any, tag: str, session_id: str, head: dict[str, Any], limit: int) -> TranscriptPage:
        n = head["n"]
        start = head.get("mark", 0)
        if not 0 <= start <= n:  # (never written so; a reader must not trust it past the head)
            start = 0
        stop = min(n, start + limit)
        out: list[Message] = []
        for src, lo, hi in self._pieces(head, session_id, start, stop):
            out.extend(await self._read_range(tr, tag, src, lo, hi))
        return TranscriptPage(out, n, stop if stop < n else None, start)

    async def read(self, owner: OwnerLike, session_id: str, start: int = 0,
                   limit: int = DEFAULT_READ_PAGE) -> TranscriptPage:
        return await self.db.transact(lambda tr: self.read_tr(tr, owner, session_id, start, limit))  # read-only

    async def read_all(self, owner: OwnerLike, session_id: str, start: int = 0,
                       page: int = DEFAULT_READ_PAGE) -> list[Message]:
        """All messages from ``start`` to the head at the first page's read (page by page)."""
        out: list[Message] = []
        first = await self.read(owner, session_id, start, page)
        out.extend(first.messages)
        end = first.head
        nxt = first.next_seq
        while nxt is not None and nxt < end:
            p = await self.read(owner, session_id, nxt, min(page, end - nxt))
            out.extend(p.messages)
            nxt = p.next_seq if p.next_seq is not None and p.next_seq < end else None
        return out

    # -- forks --------------------------------------------------------------

    async def fork(self, owner: OwnerLike, session_id: str, at: int, *, new_session_id: str | None = None,
                   by_reference: bool = True, title: str | None = None) -> SessionInfo:
        """A new session holding messages [0, at) of ``session_id``; see the module docstring."""
        tag = as_tag(owner)
        check_session_id(session_id)
        new_sid = check_session_id(new_session_id or self.new_id())
        if by_reference:
            # guarded: an existing head for the new id is checked and returned
            info = await self.db.transact(lambda tr: self._fork_ref_tr(tr, tag, session_id, at, new_sid, title))
            if info is not None:
                return info
        return await self._fork_copy(tag, session_id, at, new_sid, title)

    async def _fork_ref_tr(self, tr: Any, tag: str, sid: str, at: int, new_sid: str,
                           title: str | None) -> SessionInfo | None:
        # Guarded: an existing head for new_sid that is our fork of (sid, at) is returned as is.
        parent = await self._head(tr, tag, sid)
        if not 0 <= at <= parent["n"]:
            raise ValueError(f"fork point {at} outside [0, {parent['n']}]")
        existing = await tr.get(self.keys.head(tag, new_sid))
        if existing is not None:
            return await self._existing_fork(tr, tag, sid, at, new_sid, loads(existing))
        seg = [list(p) for p in self._pieces(parent, sid, 0, at)]
        if len(seg) > MAX_FORK_SEGMENTS:
            return None  # too deep a chain: copy instead
        now = self.clock()
        tr.set(self.keys.head(tag, new_sid), dumps({"owner": tag, "n": at, "base": at, "seg": seg, "tok": None}))
        pmeta_raw = await self._meta_raw(tr, tag, sid)
        project = loads(pmeta_raw).get("project") if pmeta_raw else None
        self._write_fork_meta(tr, tag, new_sid, sid, at, now, project, title)
        return SessionInfo(new_sid, tag, at, now, project, sid, at, title, {})

    def _write_fork_meta(self, tr: Any, tag: str, new_sid: str, sid: str, at: int, now: float,
                         project: str | None, title: str | None) -> None:
        meta = {"owner": tag, "id": new_sid, "created": now, "project": project, "parent": sid,
                "fork_at": at, "title": title, "extra": {}}
        tr.set(self.keys.session_listing(tag, new_sid), dumps(meta))  # (the metadata: see _new_session)
        if project is not None:
            tr.set(self.keys.project_member(tag, project, new_sid), b"")

    async def _existing_fork(self, tr: Any, tag: str, sid: str, at: int, new_sid: str,
                             head: dict[str, Any]) -> SessionInfo:
        raw = await self._meta_raw(tr, tag, new_sid)
        meta = loads(raw) if raw else {}
        if meta.get("parent") != sid or meta.get("fork_at") != at or head.get("owner") != tag:
            raise SessionConflict(f"session {new_sid!r} already exists")
        if head.get("staging"):
            raise InvalidState(f"fork {new_sid!r} is still being copied")
        return await self._info(tr, tag, new_sid, head)

    async def _fork_copy(self, tag: str, sid: str, at: int, new_sid: str, title: str | None) -> SessionInfo:
        created_us = int(self.clock() * 1e6)

        # 1. The staging sentinel. Guarded: re-reads the new head.
        async def begin(tr: Any) -> tuple[dict[str, Any], SessionInfo | None, str | None]:  # guarded: re-reads the new head
            parent = await self._head(tr, tag, sid)
            if not 0 <= at <= parent["n"]:
                raise ValueError(f"fork point {at} outside [0, {parent['n']}]")
            existing = await tr.get(self.keys.head(tag, new_sid))
            if existing is not None:
                head = loads(existing)
                if head.get("staging") and head.get("fork_of") == [sid, at]:
                    return parent, None, None  # resume our own staging copy
                return parent, await self._existing_fork(tr, tag, sid, at, new_sid, head), None
            pmeta_raw = await self._meta_raw(tr, tag, sid)
            project = loads(pmeta_raw).get("project") if pmeta_raw else None
            tr.set(self.keys.head(tag, new_sid), dumps({"owner": tag, "n": 0, "base": 0, "seg": [], "tok": None,
                                                        "staging": True, "fork_of": [sid, at],
                                                        "created_us": created_us}))
            tr.set(self.keys.staging_fork(created_us, tag, new_sid), b"")
            return parent, None, project

        parent, done, project = await self.db.transact(begin)
        if done is not None:
            return done
        dst = self.keys.messages(tag, new_sid)
        # 2. Copy, piece by piece, in bounded transactions. Idempotent: the same
        #    bytes land on the same keys however often a batch is retried.
        for src, lo, hi in self._pieces(parent, sid, 0, at):
            src_msgs = self.keys.messages(tag, src)
            cursor = src_msgs.pack((lo,))
            stop = src_msgs.pack((hi,))
            while cursor < stop:
                async def batch(tr: Any, cursor: bytes = cursor) -> bytes:  # idempotent: same bytes, same keys
                    head = await tr.get(self.keys.head(tag, new_sid))
                    if head is None or not loads(head).get("staging"):
                        raise InvalidState(f"fork {new_sid!r} staging record vanished (cleaned up?)")
                    nbytes = 0
                    last = None
                    async for row in tr.snapshot.get_range(cursor, stop, limit=COPY_BATCH_KEYS):
                        tr.set(dst.raw_prefix + row.key[len(src_msgs.raw_prefix):], row.value)
                        nbytes += len(row.key) + len(row.value)
                        last = row.key
                        if nbytes >= COPY_BATCH_BYTES:
                            break
                    return stop if last is None else last + b"\x00"

                cursor = await self.db.transact(batch)

        # 3. Publish the head last. Guarded: only a staging head of this fork is replaced.
        async def publish(tr: Any) -> SessionInfo:  # guarded: only a staging head of this fork is replaced
            raw = await tr.get(self.keys.head(tag, new_sid))
            head = loads(raw) if raw else None
            if head is None:
                raise InvalidState(f"fork {new_sid!r} staging record vanished (cleaned up?)")
            if not head.get("staging"):
                return await self._info(tr, tag, new_sid, head)
            now = self.clock()
            tr.set(self.keys.head(tag, new_sid), dumps({"owner": tag, "n": at, "base": 0, "seg": [], "tok": None}))
            tr.clear(self.keys.staging_fork(head.get("created_us", created_us), tag, new_sid))
            self._write_fork_meta(tr, tag, new_sid, sid, at, now, project, title)
            return SessionInfo(new_sid, tag, at, now, project, sid, at, title, {})

        return await self.db.transact(publish)

    async def cleanup_staging(self, older_than: float = 3600.0) -> int:
        """Remove copy-forks a crash left in staging for longer than ``older_than`` seconds.

        Guarded: each removal re-reads the head and only clears a staging one.
        """
        cutoff_us = int((self.clock() - older_than) * 1e6)
        removed = 0
        while True:
            async def fn(tr: Any) -> int:  # guarded: re-reads each head
                r = self.keys.staging_forks_range()
                rows = await tr.get_range(r.start, self.keys.staging_fork(cutoff_us, "", ""), limit=50)
                n = 0
                for row in rows:
                    _fs, created_us, tag, sid = kv.tuple.unpack(row.key[len(self.keys.base.key()):])
                    raw = await tr.get(self.keys.head(tag, sid))
                    if raw is not None and loads(raw).get("staging"):
                        sr = self.keys.session_range(tag, sid)
                        tr.clear_range(sr.start, sr.stop)
                        tr.clear(self.keys.head(tag, sid))
                        n += 1
                    tr.clear(row.key)
                return len(rows) and n or (0 if not rows else -1)

            n = await self.db.transact(fn)
            if n == 0:
                return removed
            removed += max(n, 0)
