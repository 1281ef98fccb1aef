"""An embedded-engine transaction with FoundationDB's read-your-writes semantics.

Reads happen at one read version (taken lazily at the first read) through a
store snapshot, merged with the transaction's own buffered writes. Each
non-snapshot read records a read conflict range exactly where FoundationDB
would (ReadYourWrites.cpp): reads answered from the transaction's own sets
and clears record none, a ``get_range`` stopped by its limit records only up
to the last key returned. Writes are buffered as an ordered mutation log plus
a sorted write map used to answer reads; ``commit`` ships both to the
:class:`~kv.engine.Engine`.
"""

from __future__ import annotations

import bisect
import functools
import struct
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable

import trio
from trio._core import _run as _trio_run
from trio.lowlevel import checkpoint_if_cancelled

from . import atomic as _atomic
from .atomic import apply_atomic
from .engine import Watch, _stamp
from .errors import KVError
from .limits import (
    DEFAULT_MAX_RETRY_DELAY,
    INITIAL_BACKOFF,
    KEY_SIZE_LIMIT,
    SYSTEM_KEY_PREFIX,
    TRANSACTION_SIZE_LIMIT,
    VALUE_SIZE_LIMIT,
    VERSIONS_PER_SECOND,
    check_size_limit,
)
from .resolver import key_after
from .selectors import KeySelector

if TYPE_CHECKING:
    from .database import Database

__all__ = ["Transaction", "KeyValue", "RangeResult", "TransactionOptions"]

_RANGE_PAGE = 1_000  # rows fetched from the snapshot per page when iterating

# Write-map entries: a tuple whose first item is its kind and whose last is its payload. A set's
# entry is its mutation itself, ("set", key, value): one tuple a set, not two (~36 sets a turn).
_SET, _CLEAR, _ATOMIC, _UNREADABLE = "set", 1, 2, 3
_CLEARED = (_CLEAR, None)  # (shared: entries are never changed in place but for an atomic's list)
_UNREADABLE_ENTRY = (_UNREADABLE, None)

# What _get looks in when there is no write map and nothing written: never written to.
_NO_WRITES: dict = {}

_UNKNOWN = object()  # a write whose value is not known in the transaction (atomic op, stamped value)


_new_tuple = tuple.__new__  # builds a KeyValue from a (key, value) pair without a Python-level __new__


class KeyValue(tuple):
    """A (key, value) pair with ``.key`` / ``.value``, like fdb's KeyValue."""

    __slots__ = ()

    def __new__(cls, key: bytes, value: bytes) -> "KeyValue":
        return tuple.__new__(cls, (key, value))

    @property
    def key(self) -> bytes:
        return self[0]

    @property
    def value(self) -> bytes:
        return self[1]

    def __repr__(self) -> str:
        return f"KeyValue({self[0]!r}, {self[1]!r})"


class TransactionOptions:
    """FoundationDB-style options; timeout/retry_limit/max_retry_delay survive on_error.

    Stateless (the settings live on the transaction), so ``tr.options`` makes a new one
    each time rather than caching it: a cached view pointing back at its transaction
    is a reference cycle, and a transaction in a cycle is freed only by the garbage
    collector, never by reference counting."""

    __slots__ = ("_tr",)

    def __init__(self, tr: "Transaction") -> None:
        self._tr = tr

    def set_timeout(self, ms: int) -> None:
        tr = self._tr
        tr._timeout = ms / 1000 if ms else None
        tr._update_slow()

    def set_retry_limit(self, n: int) -> None:
        self._tr._retry_limit = n

    def set_max_retry_delay(self, ms: int) -> None:
        self._tr._max_retry_delay = ms / 1000

    def set_next_write_no_write_conflict_range(self) -> None:
        self._tr._next_write_no_conflict = True

    def set_size_limit(self, nbytes: int) -> None:
        self._tr._size_limit = check_size_limit(nbytes)


def _check_write_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"keys are bytes, not {type(key).__name__}")
    if len(key) > KEY_SIZE_LIMIT:
        raise KVError(2102, f"key of {len(key)} bytes exceeds {KEY_SIZE_LIMIT}")
    if key >= SYSTEM_KEY_PREFIX:
        raise KVError(2004, "keys at or above \\xff are outside the legal range")


def _check_value(value: bytes) -> None:
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"values are bytes, not {type(value).__name__}")
    if len(value) > VALUE_SIZE_LIMIT:
        raise KVError(2103, f"value of {len(value)} bytes exceeds {VALUE_SIZE_LIMIT}")


def _check_range(begin: bytes, end: bytes) -> None:
    if end > SYSTEM_KEY_PREFIX or begin > SYSTEM_KEY_PREFIX:
        raise KVError(2004, "range end beyond \\xff is outside the legal range")
    if begin > end:
        raise KVError(2005, "range begin is after its end")


class _Deferred:
    """A value that becomes ready later (versionstamp): awaitable, single-shot.

    Its ``trio.Event`` is made only for a waiter that comes before the value: a
    versionstamp is usually awaited after its commit (~3 a turn), when the value is
    there and an Event (an attrs class: ~0.7 us to build and set) would only be set and dropped."""

    __slots__ = ("_done", "_event", "_value", "_error")

    def __init__(self) -> None:
        self._done = False
        self._event: trio.Event | None = None
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self._done:
            self._done = True
            self._value, self._error = value, error
            if self._event is not None:
                self._event.set()

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        # Usually ready by the time anyone asks (a versionstamp is awaited after
        # its commit): then answer without a trip through the scheduler, which
        # ``Event.wait`` takes even when set (one of four steps in a turn).
        if not self._done:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class RangeResult:
    """``get_range``'s result: ``await`` it for a list, or ``async for`` over it."""

    def __init__(self, tr: "Transaction", begin: bytes | KeySelector, end: bytes | KeySelector,
                 limit: int, reverse: bool, snapshot: bool) -> None:
        self._args = (tr, begin, end, limit, reverse, snapshot)

    def __await__(self):
        tr, begin, end, limit, reverse, snapshot = self._args
        return tr._get_range(begin, end, limit, reverse, snapshot).__await__()

    async def __aiter__(self) -> AsyncIterator[KeyValue]:
        tr, begin, end, limit, reverse, snapshot = self._args
        # Pages as fdb's FDBRange: each one a range read with the selectors as given (its own
        # read conflict range, as FoundationDB records per getRange), then continuing from
        # first_greater_than(last row) (reverse: ending at first_greater_or_equal(last row)).
        remaining = limit
        while True:
            page_limit = _RANGE_PAGE if not remaining else min(remaining, _RANGE_PAGE)
            page = await tr._get_range(begin, end, page_limit, reverse, snapshot)
            for row in page:
                yield row
            if len(page) < page_limit:
                return
            if remaining:
                remaining -= len(page)
                if remaining <= 0:
                    return
            if reverse:
                end = page[-1][0]
            else:
                begin = key_after(page[-1][0])


class _SnapshotView:
    """``tr.snapshot``: the same reads at the same read version, adding no read conflicts.

    Stateless, and made anew by each ``tr.snapshot`` (see :class:`TransactionOptions`
    for why it is not cached)."""

    __slots__ = ("_tr",)

    def __init__(self, tr: "Transaction") -> None:
        self._tr = tr

    def get(self, key: bytes) -> Awaitable[bytes | None]:
        return self._tr._get(key, True)  # (_get's coroutine itself: see Transaction.get)

    def get_range(self, begin: bytes | KeySelector | None, end: bytes | KeySelector | None, *,
                  limit: int = 0, reverse: bool = False) -> RangeResult:
        return RangeResult(self._tr, _b(begin), _e(end), limit, reverse, True)

    def get_range_startswith(self, prefix: bytes, *, limit: int = 0, reverse: bool = False) -> RangeResult:
        return self.get_range(prefix, _strinc(prefix), limit=limit, reverse=reverse)

    async def get_multi(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return [await self._tr._get(k, snapshot=True) for k in keys]

    async def get_key(self, selector: KeySelector) -> bytes:
        return await self._tr._get_key(selector, snapshot=True)

    async def get_read_version(self) -> int:
        return await self._tr.get_read_version()


def _b(k: bytes | KeySelector | None) -> bytes | KeySelector:
    return b"" if k is None else k


def _e(k: bytes | KeySelector | None) -> bytes | KeySelector:
    return SYSTEM_KEY_PREFIX if k is None else k


def _merge_interval(intervals: list[tuple[bytes, bytes]], begin: bytes, end: bytes) -> list[tuple[bytes, bytes]]:
    """Insert [begin, end) into sorted disjoint ``intervals``, merging what it touches."""
    lo = bisect.bisect_left(intervals, (begin,))
    if lo > 0 and intervals[lo - 1][1] >= begin:
        lo -= 1
    hi = lo
    while hi < len(intervals) and intervals[hi][0] <= end:
        begin, end = min(begin, intervals[hi][0]), max(end, intervals[hi][1])
        hi += 1
    return [*intervals[:lo], (begin, end), *intervals[hi:]]  # (a new list, also from the shared empty tuple)


# Most transactions use few of their containers: a blind write only its write map, its
# mutation log and its write conflict keys. The others start as this shared empty tuple
# (read as an empty sequence everywhere) and become a list at their first append
# (``_appended``), so a transaction does not allocate and free ten empty lists it never
# uses: measured at 64 concurrent blind writers, about 3% of a commit's CPU.
_EMPTY: tuple = ()

# The lowest and highest versionstamp: a versionstamped key lands between the two.
_STAMP_LOW, _STAMP_HIGH = b"\x00" * 10, b"\xff" * 10


def _appended(items: list | tuple, item: Any) -> list:
    """``items`` with ``item`` appended: in place for a list, a new list for ``_EMPTY``."""
    if type(items) is list:
        items.append(item)
        return items
    return [item]


def _fail_dropped(watches: list, _ref: Any) -> None:
    """A transaction holding unarmed watches was dropped: they fail with 1025 (see _drop_guard)."""
    for w in watches:
        w._fire(KVError(1025, "transaction destroyed before its watch was armed"))


def _strinc(prefix: bytes) -> bytes:
    p = prefix.rstrip(b"\xff")
    if not p:
        raise ValueError("key must contain at least one byte not equal to 0xFF")
    return p[:-1] + bytes([p[-1] + 1])


def _put_atomic(writes: dict[bytes, tuple], key: bytes, op: int, param: bytes, cleared: tuple | None) -> None:
    """Record atomic op ``op`` on ``key`` in the write map ``writes`` (``cleared``: _CLEARED if a
    range this transaction cleared holds the key, else None): combined with what the map knows."""
    entry = writes.get(key, cleared)
    if entry is None:
        writes[key] = (_ATOMIC, [(op, param)])
    elif entry[0] == _ATOMIC:
        entry[-1].append((op, param))
    elif entry[0] == _UNREADABLE:
        writes[key] = (_ATOMIC, [(op, param)])
    else:
        new = apply_atomic(op, entry[-1] if entry[0] == _SET else None, param)
        writes[key] = _CLEARED if new is None else (_SET, new)


def _atomic_op(op: int, name: str) -> Callable[["Transaction", bytes, bytes], None]:
    """The method ``Transaction.<name>``: FoundationDB's atomic operation ``op`` on a key.

    Made per operation (``op`` a closure cell), so ``tr.add(k, p)`` is one Python frame, not
    a method calling a shared ``_atomic(op, ...)`` (~8 a turn)."""

    def atomic(self: "Transaction", key: bytes, param: bytes) -> None:
        # the common case is tested in one expression, as in set()
        if (
            self._slow or type(key) is not bytes or type(param) is not bytes
            or len(key) > KEY_SIZE_LIMIT or key >= SYSTEM_KEY_PREFIX or len(param) > VALUE_SIZE_LIMIT
        ):
            self._check_usable()
            _check_write_key(key)
            _check_value(param)
            key, param = bytes(key), bytes(param)
            if self._watches:
                self._trigger_watches(key, None, _UNKNOWN)  # (RYW atomicOp: valueKnown false)
        writes = self._writes
        if writes is not None:  # (else _write_map replays this mutation if anything reads)
            _put_atomic(writes, key, op, param, _CLEARED if self._clears and self._cleared(key) else None)
        self._mutations.append(("atomic", op, key, param))
        if self._next_write_no_conflict:  # (_add_write_point inlined)
            self._next_write_no_conflict = False
            self._size += len(key) + len(param)
        else:
            self._write_points.append(key)
            self._size += 3 * len(key) + len(param) + 1  # the key, its operand, its write conflict range

    atomic.__name__ = name
    atomic.__qualname__ = f"Transaction.{name}"
    return atomic


def cancel_pending(task: Any) -> bool:
    """trio's checkpoint_if_cancelled() test without its coroutine (~0.3 us a commit): whether
    ``task`` (the current one) would be cancelled, or interrupted, at a checkpoint now. Read from
    trio's run state (trio is pinned in pyproject.toml). commit() and Database.transact
    checkpoint before handing a commit over only when this says so."""
    return task._cancel_status.effectively_cancelled or (task is task._runner.main_task and task._runner.ki_pending)

class Transaction:
    """One FoundationDB-semantics transaction on the embedded engine.

    Slotted (``options`` and ``snapshot`` are stateless views made per use): one is
    built per attempt of every transaction, so its construction is on
    every hot path.
    """

    __slots__ = (
        "db", "_engine", "_timeout", "_retry_limit", "_max_retry_delay",
        "_size_limit", "_started", "_backoff", "_retries", "_snap", "_read_version", "_writes",
        "_sorted_write_keys", "_clears", "_clear_begins", "_mutations", "_stamped",
        "_unreadable_ranges", "_unreadable_begins", "_unreadable_new", "_read_ranges", "_read_points",
        "_write_ranges", "_write_points", "_size", "_next_write_no_conflict", "_commit_started",
        "_committed_version", "_cancelled", "_watches", "_versionstamp", "_slow", "_drop_guard",
        # The engine's, while it commits this transaction (kv.engine.Committing: the pipeline
        # carries the transaction itself, and reads the attempt's lists above where they are)
        "_batch_version", "_batch_order", "_commit_error", "_commit_answered", "_parked_task", "_lead_batch",
        "__weakref__",  # (_drop_guard's weak reference)
        # Layers may tag a transaction with attributes of their own (sessions.journal does);
        # every attribute of the transaction's own is a slot above, so the dict is only
        # allocated for a transaction that is tagged.
        "__dict__",
    )

    # Whether Database.transact may commit this transaction itself (commit()'s steps, awaiting
    # the engine directly: one coroutine frame less a commit) instead of awaiting commit().
    # False for a subclass that overrides commit (sim.oracle's RecordingTransaction does), so
    # its commit() is always the one that runs.
    _direct_commit = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._direct_commit = cls.commit is Transaction.commit

    def __init__(self, db: "Database") -> None:
        self.db = db
        self._engine = db._engine
        self._timeout: float | None = None
        self._retry_limit: int = -1
        self._max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY
        self._size_limit: int = TRANSACTION_SIZE_LIMIT
        self._started = time.monotonic()
        self._backoff = INITIAL_BACKOFF
        self._retries = 0
        self._snap = None
        self._versionstamp: _Deferred | None = None
        self._clear_state()

    @property
    def options(self) -> TransactionOptions:
        """FoundationDB-style options (timeout, retry limit, ...)."""
        return TransactionOptions(self)

    @property
    def snapshot(self) -> "_SnapshotView":
        """``tr.snapshot``: the same reads at the same read version, adding no read conflicts."""
        return _SnapshotView(self)

    # -- state ------------------------------------------------------------

    def _reset_state(self) -> None:
        """Drop the attempt's snapshot and versionstamp, then start a fresh attempt."""
        snap = self._snap
        if snap is not None:
            snap.close()
        self._snap = None
        old = self._versionstamp
        if old is not None:
            old._set(error=KVError(1025, "transaction was reset"))
        self._versionstamp = None
        self._clear_state()

    def _clear_state(self) -> None:
        """The per-attempt state of a new attempt (a new transaction calls only this:
        it has no snapshot or versionstamp to drop)."""
        self._read_version: int | None = None
        # key -> (kind, ..., payload): see _SET. Built at its first use (_write_map): until then
        # (None) every mutation in the log is a plain set, which is its own entry.
        self._writes: dict[bytes, tuple] | None = None
        self._sorted_write_keys: list[bytes] | None = None  # cache for range reads
        # (the _EMPTY ones become lists when first appended to: see _appended)
        self._clears: list[tuple[bytes, bytes]] = _EMPTY  # disjoint, sorted
        self._clear_begins: list[bytes] = _EMPTY
        self._mutations: list[tuple] = []
        self._stamped: list[tuple[int, str, bytes, bytes, int]] = _EMPTY
        self._unreadable_ranges: list[tuple[bytes, bytes]] = _EMPTY  # disjoint, sorted
        self._unreadable_begins: list[bytes] = _EMPTY
        # versionstamped keys' _stamped entries whose ranges are not yet merged into the above
        self._unreadable_new: list[tuple[int, str, bytes, bytes, int]] = _EMPTY
        # Conflict ranges; single keys ([k, k+\x00), the common case) are kept apart as
        # plain keys so neither side allocates key_after(k) or tests for points.
        self._read_ranges: list[tuple[bytes, bytes]] = _EMPTY
        self._read_points: list[bytes] = _EMPTY
        self._write_ranges: list[tuple[bytes, bytes]] = _EMPTY
        self._write_points: list[bytes] = []
        # The transaction's size as commit checks it (TRANSACTION_SIZE_LIMIT): keys, values, clear
        # bounds and conflict ranges, read ones included, each added when it is recorded.
        self._size = 0
        self._next_write_no_conflict = False
        # FoundationDB's RYW commitStarted: set by commit() and kept, whatever the commit's
        # outcome, until reset/on_error start a new attempt; meanwhile every use of the
        # transaction is used_during_commit (2017). (RYWImpl::commit clears it on failure
        # only below API 410.) The hot paths test it in place of `_committed_version is not
        # None`, which only a started commit sets.
        self._commit_started = False
        self._committed_version: int | None = None
        # FoundationDB's resetPromise, as the code it fails with (0: not set): cancel()
        # sets 1025, a failed on_error 1025 (API >= 610), a use refused as used during
        # commit 2017 (checkUsedDuringCommit); cleared by reset/on_error.
        self._cancelled = 0
        self._watches: list[Watch] = _EMPTY
        # While this attempt holds unarmed watches: a weak reference to the transaction whose
        # callback fails them with 1025 if the transaction is dropped ("If an uncommitted
        # transaction is reset or destroyed, then any watches it created will be set with the
        # transaction_cancelled error"; NativeAPI ~Transaction: cancelWatches()). Dropped (None)
        # when the watches leave the list: fired, or armed by a commit. (Not a __del__: that is
        # a Python call at every transaction's end, ~1.3k instructions; this costs only a
        # transaction that makes a watch.)
        self._drop_guard: weakref.ref | None = None
        # The hot paths' one test (reads, set, atomic ops, stamped keys, commit): True when the
        # full checks must run, i.e. a commit started, a resetPromise code (cancel), a timeout
        # or watches (whose own-write triggers run in the writes' full path) — or after any
        # of those until reset/on_error; see _update_slow. (Kept by every site that sets one.)
        self._slow = self._timeout is not None

    def reset(self) -> None:
        """Forget everything, as a new transaction (options other than the persistent ones reset)."""
        for w in self._watches:
            w._fire(KVError(1025, "transaction was reset before its watch was armed"))
        self._reset_state()
        self._started = time.monotonic()
        self._backoff = INITIAL_BACKOFF
        self._retries = 0
        # reset() drops even the options that survive on_error (ReadYourWrites.cpp reset())
        self._size_limit = TRANSACTION_SIZE_LIMIT
        self._timeout = None
        self._slow = False  # (everything _update_slow looks at is cleared)
        self._retry_limit = -1
        self._max_retry_delay = DEFAULT_MAX_RETRY_DELAY

    def _update_slow(self) -> None:
        self._slow = bool(self._cancelled or self._commit_started or self._timeout is not None or self._watches)

    def cancel(self) -> None:
        """FoundationDB's cancel(): every later use is transaction_cancelled (1025), on_error
        included, until reset() (RYW cancel: resetPromise.sendError(transaction_cancelled)).
        Watches a successful commit armed are the database's by then and live on."""
        if not self._cancelled:
            self._cancelled = 1025
        self._slow = True
        # Watches not armed by a commit stay pending: RYW cancel() only sets resetPromise, and
        # RYWImpl::watch waits on it only until the watch's read is done (kv's read is done when
        # watch() returns); after that the watch waits in NativeAPI's `watches`, which only
        # cancelWatches() (transaction_cancelled, at reset or destruction) or a commit fails.
        if self._versionstamp is not None:
            self._versionstamp._set(error=KVError(1025))
        if self._snap is not None:
            self._snap.close()
            self._snap = None

    def _check_usable(self) -> None:
        # In RYW's order: checkUsedDuringCommit() before resetPromise (cancel), in every call.
        if self._commit_started:
            # checkUsedDuringCommit also fails resetPromise with used_during_commit (if not
            # set yet): a later on_error raises 2017 instead of retrying (RYWImpl::onError)
            if not self._cancelled:
                self._cancelled = 2017
            if self._committed_version is not None:
                raise KVError(2017, "transaction already committed; reset() it to reuse")
            raise KVError(2017, "commit() was called: reset() or on_error() the transaction to reuse it")
        if self._cancelled:
            raise KVError(self._cancelled)
        if self._timeout is not None and time.monotonic() - self._started > self._timeout:
            raise KVError(1031)

    # -- reads ------------------------------------------------------------

    def _ensure_snapshot(self):
        snap = self._snap
        if snap is None:
            snap = self._snap = self._engine.store.snapshot()
            self._read_version = self._engine.read_version_for(snap.version)
        else:
            self._engine.check_read_version(self._read_version)
        return snap

    async def get_read_version(self) -> int:
        # RYW getReadVersion looks at resetPromise only, not checkUsedDuringCommit: it answers
        # during and after a commit (the commit's read version), and does not poison on_error.
        if self._slow:
            if self._cancelled:
                raise KVError(self._cancelled)
            if self._timeout is not None and time.monotonic() - self._started > self._timeout:
                raise KVError(1031)
            if self._commit_started:
                rv = self._read_version
                return self._engine.committed_version() if rv is None else rv
        self._ensure_snapshot()
        return self._read_version  # type: ignore[return-value]

    def _write_map(self) -> dict[bytes, tuple]:
        """The write map (key -> its entry, see _SET), built from the mutation log at its first use.

        Most transactions never read their own writes (a blind write; a ledger submit reads
        first, then writes): until something needs the map (a read, a watch, a clear), sets,
        atomic ops and versionstamped keys and values are only logged, so such a transaction
        builds and fills no dict. Until then the log holds only those four kinds (a clear builds
        the map before logging its mutation), and no clear range exists, so replaying the log in
        order, each mutation updating the map as its write would have, gives the same map."""
        writes = self._writes
        if writes is None:
            writes = self._writes = {}
            mutations = self._mutations
            if not self._stamped:  # (the usual case: plain sets and atomic ops)
                for m in mutations:
                    if m[0] == "set":
                        writes[m[1]] = m  # a set's mutation is its entry
                    else:  # ("atomic", op, key, param)
                        _put_atomic(writes, m[2], m[1], m[3], None)
            else:
                stamped = {s[0]: s[1] for s in self._stamped}
                for i, m in enumerate(mutations):
                    if m[0] == "set":
                        kind = stamped.get(i)
                        if kind is None:
                            writes[m[1]] = m
                        elif kind == "value":
                            writes[m[1]] = _UNREADABLE_ENTRY
                        # a versionstamped key has no entry: its key is known only at the commit
                    else:
                        _put_atomic(writes, m[2], m[1], m[3], None)
        return writes

    def _cleared(self, key: bytes) -> bool:
        i = bisect.bisect_right(self._clear_begins, key) - 1
        return i >= 0 and key < self._clears[i][1]

    def _check_readable(self, begin: bytes, end: bytes) -> None:
        """1036 if [begin, end) meets a range a versionstamped key may land in (disjoint, sorted)."""
        if self._unreadable_new:  # merged lazily: most transactions never read after stamping
            ranges = self._unreadable_ranges
            for _, _, body, _, offset in self._unreadable_new:  # entries of _stamped
                head, tail = body[:offset], body[offset + 10 :]
                ranges = _merge_interval(ranges, head + _STAMP_LOW + tail, key_after(head + _STAMP_HIGH + tail))
            self._unreadable_new = _EMPTY
            self._unreadable_ranges = ranges
            self._unreadable_begins = [b for b, _ in ranges]
        ranges = self._unreadable_ranges
        i = bisect.bisect_right(self._unreadable_begins, begin) - 1
        if (i >= 0 and ranges[i][1] > begin) or (i + 1 < len(ranges) and ranges[i + 1][0] < end):
            raise KVError(1036, "range includes a versionstamped key written by this transaction")

    def get(self, key: bytes) -> Awaitable[bytes | None]:
        # A plain method handing back _get's coroutine (awaited by the caller exactly as an
        # async get's would be): one coroutine a read, not two (~17 reads a turn). _get stays
        # the coroutine every read path goes through (sim.oracle overrides it).
        return self._get(key, False)

    async def get_multi(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return [await self._get(k, snapshot=False) for k in keys]

    async def _get(self, key: bytes, snapshot: bool) -> bytes | None:
        # ~17 per agent turn: the common case (usable, no timeout, a snapshot already
        # taken, nothing of this transaction's own to merge) makes no Python-level call
        # but the snapshot's get and the too-old check.
        if self._slow:
            self._check_usable()
        if key >= SYSTEM_KEY_PREFIX:
            raise KVError(2004, "keys at or above \\xff are outside the legal range")
        if len(key) > KEY_SIZE_LIMIT:
            return None  # as FoundationDB: such a key cannot exist
        engine = self._engine
        if engine.hooked:
            engine._hooks.on_read(self)  # (the attribute, not the property: a call less a read in the simulator)
        writes = self._writes
        if writes is None:  # (no write map yet: built if there are writes, else none to look in)
            writes = self._write_map() if self._mutations else _NO_WRITES
        entry = writes.get(key)
        if entry is not None:
            kind = entry[0]
            if kind == _SET:
                return entry[-1]
            if kind == _CLEAR:
                return None
            if kind == _UNREADABLE:
                raise KVError(1036, "key has a versionstamped value written by this transaction")
        else:
            if self._unreadable_ranges or self._unreadable_new:
                self._check_readable(key, key_after(key))
            if self._clears and self._cleared(key):
                return None
        snap = self._snap
        if snap is None:
            snap = self._ensure_snapshot()
        else:
            # (Engine.check_read_version inlined: every read after a transaction's first, ~13
            # a turn; the two change together)
            now = int(engine.clock() * VERSIONS_PER_SECOND)
            last = engine._last_version
            if self._read_version < (now if now > last else last) - engine.mvcc_window:
                raise KVError(1007, "read version is older than the MVCC window")
        value = snap.get(key)
        if not snapshot:  # (_appended inlined)
            points = self._read_points
            if type(points) is list:
                points.append(key)
            else:
                self._read_points = [key]
            self._size += 2 * len(key) + 1  # its read conflict range [key, key + \x00)
        if entry is not None:  # atomic ops on an unknown base: apply them to what we read
            for op, param in entry[-1]:
                value = apply_atomic(op, value, param)
        return value

    def get_range(self, begin: bytes | KeySelector | None, end: bytes | KeySelector | None, *,
                  limit: int = 0, reverse: bool = False) -> RangeResult:
        return RangeResult(self, _b(begin), _e(end), limit, reverse, False)

    def get_range_startswith(self, prefix: bytes, *, limit: int = 0, reverse: bool = False) -> RangeResult:
        return self.get_range(prefix, _strinc(prefix), limit=limit, reverse=reverse)

    async def _resolve_bounds(self, begin: bytes | KeySelector, end: bytes | KeySelector,
                              snapshot: bool) -> tuple[bytes, bytes]:
        # Both selectors' keys first, as FoundationDB's RYW getRange does ("begin.getKey() >
        # maxKey || end.getKey() > maxKey"), before either is resolved.
        if ((isinstance(begin, KeySelector) and begin.key > SYSTEM_KEY_PREFIX)
                or (isinstance(end, KeySelector) and end.key > SYSTEM_KEY_PREFIX)):
            raise KVError(2004, "a range selector's key beyond \\xff is outside the legal range")
        if isinstance(begin, KeySelector):
            begin = await self._get_key(begin, snapshot)
        if isinstance(end, KeySelector):
            end = await self._get_key(end, snapshot)
        return begin, end

    async def _get_range(self, begin: bytes | KeySelector, end: bytes | KeySelector, limit: int,
                         reverse: bool, snapshot: bool) -> list[KeyValue]:
        # (range reads are a hot path of the simulator: journal pages, claim windows) the usual
        # case, a usable transaction without a timeout and plain keys for bounds, makes no call
        # to check it or resolve them; the checks and their order are the same either way
        if self._slow:
            self._check_usable()
        if limit < 0:
            raise KVError(2000, "limit must be >= 0")
        if type(begin) is not bytes or type(end) is not bytes:
            return self._selector_range(begin, end, limit, reverse, snapshot)
        if end > SYSTEM_KEY_PREFIX:
            raise KVError(2004, "range end beyond \\xff is outside the legal range")
        if begin >= end:
            return []
        if self._engine.hooked:
            self._engine._hooks.on_read(self)
        if self._unreadable_ranges or self._unreadable_new:
            self._check_readable(begin, end)
        rows = self._merged_range(begin, end, limit, reverse)
        if not snapshot:
            if limit and len(rows) >= limit:
                if reverse:
                    self._add_read_range(rows[-1][0], end)
                else:
                    self._add_read_range(begin, key_after(rows[-1][0]))
            else:
                self._add_read_range(begin, end)
        return rows

    def _selector_range(self, begin: bytes | KeySelector, end: bytes | KeySelector, limit: int,
                        reverse: bool, snapshot: bool) -> list[KeyValue]:
        """A range read with a KeySelector bound, recording the one read conflict range
        FoundationDB's RYW client records for it (docs/kv-api.md, "Range reads with key
        selectors"): built from the selectors' own keys and the rows returned
        (``RYWImpl::addConflictRange`` for ``GetRangeReq``), not from resolving each
        selector as a ``get_key`` (which adds the span up to the resolved key, and so made
        writes just past an end selector's key conflict where FoundationDB's would not).
        """
        # ReadYourWritesTransaction::getRange: both keys checked before anything is resolved
        bk, boff = (begin, 1) if type(begin) is bytes else (begin.key, begin.offset)
        ek, eoff = (end, 1) if type(end) is bytes else (end.key, end.offset)
        if bk > SYSTEM_KEY_PREFIX or ek > SYSTEM_KEY_PREFIX:
            raise KVError(2004, "a range selector's key beyond \\xff is outside the legal range")
        # removeOrEqual: (k, or_equal, n) is (keyAfter(k), not or_equal, n)
        if type(begin) is not bytes and begin.or_equal:
            bk = key_after(bk)
        if type(end) is not bytes and end.or_equal:
            ek = key_after(ek)
        if boff >= eoff and bk >= ek:
            return []  # "RYW range inverted": no read, no conflict range
        if self._engine.hooked:
            self._engine._hooks.on_read(self)
        b_at, lo = self._resolve_position(bk, boff)
        e_at, hi = self._resolve_position(ek, eoff)
        if b_at >= e_at:
            # resolved to an empty range: getRangeValue returns RangeResultRef(false, false)
            rows: list[KeyValue] = []
            to_begin = through_end = False
        else:
            if lo < hi:
                if self._unreadable_ranges or self._unreadable_new:
                    self._check_readable(lo, hi)
                rows = self._merged_range(lo, hi, limit, reverse)
            else:
                rows = []
            # resolveKeySelectorFromCache: readToBegin when a selector is left before the
            # first key, readThroughEnd when one is left 2+ keys past the last (a selector one
            # past the last key is first_greater_or_equal of the key after it, unflagged)
            to_begin = b_at[0] == 0 or e_at[0] == 0
            through_end = (b_at[0] == 2 and b_at[1] >= 2) or (e_at[0] == 2 and e_at[1] >= 2)
        if snapshot:
            return rows
        more = bool(limit) and len(rows) >= limit
        if not reverse:
            # RYWImpl::addConflictRange(GetRangeReq<false>); getRangeValue's result flags:
            # readThroughEnd = !more && readThroughEnd
            if bk < ek:
                rb, re = bk, (bk if eoff > 0 and more else ek)
            else:
                rb, re = ek, bk
            if to_begin and boff <= 0:
                rb = b""
            if through_end and not more and eoff > 0:
                re = SYSTEM_KEY_PREFIX
            if rows:
                if boff <= 0 and rows[0][0] < rb:
                    rb = rows[0][0]
                if re <= rows[-1][0]:
                    re = key_after(rows[-1][0])
        else:
            # RYWImpl::addConflictRange(GetRangeReq<true>); getRangeValueBack's result flags:
            # readToBegin = !more && readToBegin
            if bk < ek:
                rb, re = (ek if boff <= 1 and more else bk), ek
            else:
                rb, re = ek, bk
            if to_begin and not more and boff <= 0:
                rb = b""
            if through_end and eoff > 0:
                re = SYSTEM_KEY_PREFIX
            if rows:
                if rows[-1][0] < rb:
                    rb = rows[-1][0]
                if eoff > 0 and re <= rows[0][0]:
                    re = key_after(rows[0][0])
        if rb < re:
            self._add_read_range(rb, re)
        return rows

    def _resolve_position(self, key: bytes, offset: int) -> tuple[tuple[int, int, bytes], bytes]:
        """Where the selector (key, offset), or_equal already removed, lands in this
        transaction's view, and the key it resolves to (b"" before the first key, \\xff past
        the last). The first item orders positions: (0, n, b"") n <= 0 before the first key,
        (1, 0, k) at key k, (2, n, b"") n >= 1 at or past the end (n = 1: just past the last
        key). Reads without recording a conflict: the range read records one for all."""
        if offset >= 1:
            rows = self._merged_range(key, SYSTEM_KEY_PREFIX, offset, False) if key < SYSTEM_KEY_PREFIX else []
            if len(rows) == offset:
                k = rows[-1][0]
                return (1, 0, k), k
            return (2, offset - len(rows), b""), SYSTEM_KEY_PREFIX
        need = 1 - offset
        rows = self._merged_range(b"", key, need, True) if key > b"" else []
        if len(rows) == need:
            k = rows[-1][0]
            return (1, 0, k), k
        return (0, offset + len(rows), b""), b""

    def _add_read_range(self, begin: bytes, end: bytes) -> None:
        """Record [begin, end) minus what this transaction's own writes answer.

        As ReadYourWrites.cpp's updateConflictMap: keys this transaction set
        or cleared (and ranges it cleared) were never read from the database,
        so they add no read conflict; keys with pending atomic operations were
        (their base value is read), so they keep theirs.
        """
        writes = self._writes if self._writes is not None else self._write_map()
        if not self._clears and not writes:
            self._read_ranges = _appended(self._read_ranges, (begin, end))
            self._size += len(begin) + len(end)
            return
        known: list[tuple[bytes, bytes]] = [c for c in self._clears if c[0] < end and begin < c[1]]
        if writes:
            known.extend((k, key_after(k)) for k in self._write_keys_in(begin, end, False)
                         if writes[k][0] != _ATOMIC)
            known.sort()
        cur = begin
        for cb, ce in known:
            if ce <= cur:
                continue
            if cb >= end:
                break
            if cb > cur:
                self._read_ranges = _appended(self._read_ranges, (cur, cb))
                self._size += len(cur) + len(cb)
            cur = max(cur, ce)
            if cur >= end:
                return
        if cur < end:
            self._read_ranges = _appended(self._read_ranges, (cur, end))
            self._size += len(cur) + len(end)

    def _merged_range(self, begin: bytes, end: bytes, limit: int, reverse: bool) -> list[KeyValue]:
        """The store's rows in [begin, end) overlaid with this transaction's writes."""
        snap = self._ensure_snapshot()
        writes = self._writes if self._writes is not None else self._write_map()
        wkeys = self._write_keys_in(begin, end, reverse) if writes else []
        if not wkeys and not self._clears:
            return [_new_tuple(KeyValue, row) for row in snap.range(begin, end, reverse, limit)]
        out: list[KeyValue] = []
        wi = 0
        lo, hi = begin, end
        page = max(limit * 2, 64) if limit else 0
        while True:
            stored = snap.range(lo, hi, reverse, page)
            exhausted = not page or len(stored) < page
            for k, v in stored:
                # write-map keys that sort before this stored key come first
                while wi < len(wkeys) and (wkeys[wi] > k if reverse else wkeys[wi] < k):
                    row = self._write_row(wkeys[wi], None, snap)
                    wi += 1
                    if row is not None:
                        out.append(row)
                        if limit and len(out) >= limit:
                            return out
                if wi < len(wkeys) and wkeys[wi] == k:
                    row = self._write_row(k, v, snap)
                    wi += 1
                elif self._clears and self._cleared(k):
                    row = None
                else:
                    row = KeyValue(k, v)
                if row is not None:
                    out.append(row)
                    if limit and len(out) >= limit:
                        return out
            if exhausted:
                break
            if reverse:
                hi = stored[-1][0]
            else:
                lo = key_after(stored[-1][0])
        while wi < len(wkeys):
            row = self._write_row(wkeys[wi], None, snap)
            wi += 1
            if row is not None:
                out.append(row)
                if limit and len(out) >= limit:
                    break
        return out

    def _write_keys_in(self, begin: bytes, end: bytes, reverse: bool) -> list[bytes]:
        keys = self._sorted_write_keys
        writes = self._writes if self._writes is not None else self._write_map()
        if keys is None or len(keys) != len(writes):
            keys = self._sorted_write_keys = sorted(writes)
        out = keys[bisect.bisect_left(keys, begin) : bisect.bisect_left(keys, end)]
        if reverse:
            out.reverse()
        return out

    def _write_row(self, key: bytes, stored: bytes | None, snap) -> KeyValue | None:
        entry = self._writes[key]  # (built: _merged_range asked for it)
        kind, payload = entry[0], entry[-1]
        if kind == _SET:
            return KeyValue(key, payload)
        if kind == _CLEAR:
            return None
        if kind == _UNREADABLE:
            raise KVError(1036, "range includes a versionstamped value written by this transaction")
        value = stored if stored is not None or not self._cleared(key) else None
        if stored is None and not self._cleared(key):
            value = snap.get(key)
        for op, param in payload:
            value = apply_atomic(op, value, param)
        return None if value is None else KeyValue(key, value)

    async def get_key(self, selector: KeySelector) -> bytes:
        return await self._get_key(selector, snapshot=False)

    async def _get_key(self, sel: KeySelector, snapshot: bool) -> bytes:
        self._check_usable()
        if self._engine.hooked:
            self._engine._hooks.on_read(self)
        ref = sel.key
        if ref > SYSTEM_KEY_PREFIX:  # (RYW getKey: "key.getKey() > getMaxReadKey()"; \xff itself is legal)
            raise KVError(2004, "a key selector's key beyond \\xff is outside the legal range")
        if sel.offset <= 0:
            # walk backwards from the anchor (last key < ref, or <= ref)
            hi = key_after(ref) if sel.or_equal else ref
            need = 1 - sel.offset
            rows = self._merged_range(b"", hi, need, True) if hi > b"" else []
            result = rows[need - 1][0] if len(rows) >= need else b""
            lo_conf = result
            hi_conf = hi
        else:
            lo = key_after(ref) if sel.or_equal else ref
            need = sel.offset
            rows = self._merged_range(lo, SYSTEM_KEY_PREFIX, need, False) if lo < SYSTEM_KEY_PREFIX else []
            result = rows[need - 1][0] if len(rows) >= need else SYSTEM_KEY_PREFIX
            lo_conf = lo
            hi_conf = key_after(result) if result < SYSTEM_KEY_PREFIX else SYSTEM_KEY_PREFIX
        if not snapshot and lo_conf < hi_conf:
            self._add_read_range(lo_conf, hi_conf)
        return result

    # -- writes -----------------------------------------------------------

    def _add_write_range(self, begin: bytes, end: bytes) -> None:
        if self._next_write_no_conflict:
            self._next_write_no_conflict = False
            return
        self._write_ranges = _appended(self._write_ranges, (begin, end))
        self._size += len(begin) + len(end)

    def _add_write_point(self, key: bytes) -> None:
        if self._next_write_no_conflict:
            self._next_write_no_conflict = False
            return
        self._write_points.append(key)
        self._size += 2 * len(key) + 1

    def set(self, key: bytes, value: bytes) -> None:
        # The most frequent call of every layer, so the common case (usable,
        # plain bytes within the limits) is tested in one expression; anything
        # else takes the full checks, which raise the precise error.
        if (
            self._slow or type(key) is not bytes or type(value) is not bytes
            or len(key) > KEY_SIZE_LIMIT or key >= SYSTEM_KEY_PREFIX or len(value) > VALUE_SIZE_LIMIT
        ):
            self._check_usable()
            _check_write_key(key)
            _check_value(value)
            key, value = bytes(key), bytes(value)
            if self._watches:
                self._trigger_watches(key, None, value)
        m = ("set", key, value)
        writes = self._writes
        if writes is not None:  # (else it is built from the log if anything reads: _write_map)
            writes[key] = m
        self._mutations.append(m)
        if self._next_write_no_conflict:
            self._next_write_no_conflict = False
            self._size += len(key) + len(value)
        else:
            self._write_points.append(key)
            self._size += 3 * len(key) + len(value) + 1  # the key, its value, its write conflict range

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.set(key, value)

    def clear(self, key: bytes) -> None:
        if self._slow:
            self._check_usable()  # (only a transaction marked slow can fail it)
        if type(key) is not bytes:
            if not isinstance(key, (bytes, bytearray)):
                raise TypeError(f"keys are bytes, not {type(key).__name__}")
            key = bytes(key)
        if key >= SYSTEM_KEY_PREFIX:
            raise KVError(2004, "keys at or above \\xff are outside the legal range")
        if len(key) > KEY_SIZE_LIMIT:
            # No such key can exist, so there is nothing to clear and nothing to conflict on:
            # FoundationDB's ReadYourWritesTransaction::clear returns before writing anything
            # (getMaxClearKeySize: "keys larger than this will be assumed not to exist").
            return
        if self._watches:
            self._trigger_watches(key, None, None)
        (self._writes if self._writes is not None else self._write_map())[key] = _CLEARED
        self._mutations.append(("clear", key, key + b"\x00"))  # (key_after inlined)
        if self._next_write_no_conflict:  # (_add_write_point inlined)
            self._next_write_no_conflict = False
            self._size += 2 * len(key) + 1
        else:
            self._write_points.append(key)
            self._size += 4 * len(key) + 2  # the key and its end, its write conflict range

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self._check_usable()
        begin, end = bytes(begin), bytes(end)
        _check_range(begin, end)
        if begin == end:
            return
        if self._watches:
            self._trigger_watches(begin, end, None)
        doomed = self._write_keys_in(begin, end, False)
        if doomed:
            writes = self._writes  # (built by _write_keys_in)
            for k in doomed:
                del writes[k]
            self._sorted_write_keys = None
        self._merge_clear(begin, end)
        self._mutations.append(("clear", begin, end))
        self._size += len(begin) + len(end)
        self._add_write_range(begin, end)

    def clear_range_startswith(self, prefix: bytes) -> None:
        self.clear_range(prefix, _strinc(prefix))

    def _merge_clear(self, begin: bytes, end: bytes) -> None:
        self._clears = _merge_interval(self._clears, begin, end)
        self._clear_begins = [b for b, _ in self._clears]

    # The atomic operations (~8 a turn: usage counters), each one frame: see _atomic_op.
    add = _atomic_op(_atomic.ADD, "add")
    bit_and = _atomic_op(_atomic.BIT_AND, "bit_and")
    bit_or = _atomic_op(_atomic.BIT_OR, "bit_or")
    bit_xor = _atomic_op(_atomic.BIT_XOR, "bit_xor")
    max = _atomic_op(_atomic.MAX, "max")
    min = _atomic_op(_atomic.MIN, "min")
    byte_min = _atomic_op(_atomic.BYTE_MIN, "byte_min")
    byte_max = _atomic_op(_atomic.BYTE_MAX, "byte_max")
    append_if_fits = _atomic_op(_atomic.APPEND_IF_FITS, "append_if_fits")
    compare_and_clear = _atomic_op(_atomic.COMPARE_AND_CLEAR, "compare_and_clear")

    @staticmethod
    def _split_offset(param: bytes, what: str) -> tuple[bytes, int]:
        if len(param) < 4:
            raise KVError(2000, f"versionstamped {what} needs a 4-byte offset suffix")
        body, offset = param[:-4], struct.unpack("<I", param[-4:])[0]
        if offset + 10 > len(body):
            raise KVError(2000, f"versionstamp offset {offset} does not fit the {what} of {len(body)} bytes")
        return body, offset

    def set_versionstamped_key(self, key: bytes, value: bytes) -> None:
        """Write ``value`` at ``key`` with 10 bytes at the suffix offset replaced by the versionstamp."""
        # One per journal event, so the common case (usable, plain bytes) skips the
        # calls; the checks run in the same order either way, so the same error wins.
        if (
            self._slow or type(key) is not bytes
        ):
            self._check_usable()
            key = bytes(key)
        if len(key) < 14:
            raise KVError(2000, "a versionstamped key needs at least 14 bytes (10 + 4-byte offset)")
        # (_split_offset inlined, ~11 a turn; it raises the precise error for a bad offset)
        body, offset = key[:-4], int.from_bytes(key[-4:], "little")
        if offset + 10 > len(body):
            self._split_offset(key, "key")
        if len(body) > KEY_SIZE_LIMIT or body >= SYSTEM_KEY_PREFIX:
            _check_write_key(body)
        if type(value) is not bytes or len(value) > VALUE_SIZE_LIMIT:
            _check_value(value)
            value = bytes(value)
        if self._slow and self._watches:
            # RYW atomicOp(SetVersionstampedKey): transformVersionstampKey places the stamp's
            # lower bound (read version + 1, batch 0; 0 without a read version) in the key, its
            # 4-byte offset suffix kept, and triggerWatches(k, valueKnown=false) fires a watch
            # on exactly that key (never one on the final key, unknown until the commit)
            rv = self._read_version
            low = (0 if rv is None else rv + 1).to_bytes(8, "big") + b"\x00\x00"
            self._trigger_watches(key[:offset] + low + key[offset + 10 :], None, _UNKNOWN)
        mutations = self._mutations
        stamped = (len(mutations), "key", body, value, offset)
        mutations.append(("set", body, value))  # replaced at resolve time
        # (_appended inlined twice: ~11 a turn)
        lst = self._stamped
        if type(lst) is list:
            lst.append(stamped)
        else:
            self._stamped = [stamped]
        # The range the final key may land in is only worked out if something is read
        # (_check_readable): most transactions never read after stamping.
        lst = self._unreadable_new
        if type(lst) is list:
            lst.append(stamped)
        else:
            self._unreadable_new = [stamped]
        self._size += len(body) + len(value)
        # its write conflict is added on the final key at commit
        self._next_write_no_conflict = False

    def set_versionstamped_value(self, key: bytes, value: bytes) -> None:
        # One per ledger submit: as in set(), the common case (usable, plain bytes, a legal key,
        # an offset suffix) is tested in one expression and skips the checking calls; the checks
        # run in the same order either way, so the same error wins.
        if (
            self._slow or type(key) is not bytes or type(value) is not bytes
            or len(key) > KEY_SIZE_LIMIT or key >= SYSTEM_KEY_PREFIX or len(value) < 4
        ):
            self._check_usable()
            _check_write_key(key)
            body, offset = self._split_offset(bytes(value), "value")
            _check_value(body)
            key = bytes(key)
            if self._watches:
                self._trigger_watches(key, None, _UNKNOWN)
        else:
            # (_split_offset inlined; it raises the precise error for an offset that does not fit)
            body, offset = value[:-4], int.from_bytes(value[-4:], "little")
            if offset + 10 > len(body):
                self._split_offset(value, "value")
            if len(body) > VALUE_SIZE_LIMIT:
                _check_value(body)
        mutations = self._mutations
        stamped = (len(mutations), "value", key, body, offset)
        mutations.append(("set", key, body))
        lst = self._stamped  # (_appended inlined)
        if type(lst) is list:
            lst.append(stamped)
        else:
            self._stamped = [stamped]
        if self._writes is not None:  # (else _write_map replays it: see there)
            self._writes[key] = _UNREADABLE_ENTRY
        if self._next_write_no_conflict:  # (_add_write_point inlined)
            self._next_write_no_conflict = False
            self._size += len(key) + len(body)
        else:
            self._write_points.append(key)
            self._size += 3 * len(key) + len(body) + 1  # the key, its value, its write conflict range

    # -- conflict ranges --------------------------------------------------

    def add_read_conflict_range(self, begin: bytes, end: bytes) -> None:
        self._check_usable()
        _check_range(begin, end)
        if begin < end:
            self._add_read_range(bytes(begin), bytes(end))

    def add_read_conflict_key(self, key: bytes) -> None:
        self.add_read_conflict_range(key, key_after(key))

    def add_write_conflict_range(self, begin: bytes, end: bytes) -> None:
        self._check_usable()
        _check_range(begin, end)
        if begin < end:
            self._write_ranges = _appended(self._write_ranges, (bytes(begin), bytes(end)))
            self._size += len(begin) + len(end)

    def add_write_conflict_key(self, key: bytes) -> None:
        self.add_write_conflict_range(key, key_after(key))

    # -- watches and versionstamps ---------------------------------------

    def watch(self, key: bytes) -> Watch:
        """A :class:`Watch` on ``key``; armed when this transaction commits.

        As FoundationDB's RYWImpl::watch, it reads the key now (not a snapshot read: a read
        conflict on it, unless this transaction wrote it) and compares with that value; until
        the commit it reports only this transaction's own writes, at once (triggerWatches)."""
        self._check_usable()
        if key >= SYSTEM_KEY_PREFIX:
            raise KVError(2004)
        if len(key) > KEY_SIZE_LIMIT:
            raise KVError(2102, f"key of {len(key)} bytes exceeds {KEY_SIZE_LIMIT}")
        key = bytes(key)
        w = Watch(self._engine, key)
        try:
            w.seen = self._watch_read(key)
        except KVError as e:
            if e.code != 1036:
                raise
            w._fire(e)  # RYW: the watch's own read fails it (accessed_unreadable)
        self._watches = _appended(self._watches, w)
        if self._drop_guard is None:
            self._drop_guard = weakref.ref(self, functools.partial(_fail_dropped, self._watches))
        self._slow = True  # (set and atomic ops take their full path, which triggers watches)
        return w

    def _watch_read(self, key: bytes) -> bytes | None:
        """The value a new watch compares with: ``_get(key, snapshot=False)``'s, synchronously
        (its read conflict included; no read hooks: no caller sees this value). The same steps
        as ``_get``'s, which keeps them inline because it is the hottest read path (~17 calls a
        turn): a change to either is a change to both."""
        entry = self._write_map().get(key)
        if entry is not None:
            kind = entry[0]
            if kind == _SET:
                return entry[-1]
            if kind == _CLEAR:
                return None
            if kind == _UNREADABLE:
                raise KVError(1036, "key has a versionstamped value written by this transaction")
        else:
            if self._unreadable_ranges or self._unreadable_new:
                self._check_readable(key, key_after(key))
            if self._clears and self._cleared(key):
                return None
        snap = self._snap
        if snap is None:
            snap = self._ensure_snapshot()
        else:
            self._engine.check_read_version(self._read_version)
        value = snap.get(key)
        self._read_points = _appended(self._read_points, key)
        self._size += 2 * len(key) + 1  # (as _get)
        if entry is not None:  # pending atomic ops: applied to the stored value (which was read)
            for op, param in entry[-1]:
                value = apply_atomic(op, value, param)
        return value

    def _trigger_watches(self, begin: bytes, end: bytes | None, value: Any) -> None:
        """Fire this transaction's watches on ``begin`` (or in [begin, end)) that a write of
        ``value`` (None: cleared; _UNKNOWN: an atomic op) changes: RYWImpl::triggerWatches."""
        for w in self._watches:
            k = w.key
            if (k == begin if end is None else begin <= k < end) and not w.ready:
                if value is _UNKNOWN or value != w.seen:
                    w._fire()

    def get_versionstamp(self) -> _Deferred:
        """Awaitable 10-byte versionstamp of this transaction, ready after commit.

        Ask before commit(): a first request once the commit has been handed over would never
        be answered, so it is refused with used_during_commit (2017), as FoundationDB's
        ReadYourWritesTransaction answers it (checkUsedDuringCommit), until reset/on_error.
        """
        if self._versionstamp is None:
            if self._commit_started:
                if not self._cancelled:  # (as _check_usable)
                    self._cancelled = 2017
                raise KVError(2017, "get_versionstamp() must be called before commit()")
            if self._cancelled:  # (a new awaitable after cancel() would never be answered)
                raise KVError(self._cancelled)
            self._versionstamp = _Deferred()
        return self._versionstamp

    def get_committed_version(self) -> int:
        if self._committed_version is None:
            raise KVError(2000, "transaction has not committed")
        return self._committed_version

    # -- commit and retry -------------------------------------------------

    async def commit(self) -> None:
        if self._slow:
            self._check_usable()  # (the usual case, a usable transaction without a timeout, skips the call)
        # A checkpoint before anything is handed over, as every trio operation is: a cancelled
        # task gets Cancelled here, with nothing sent (after this point a commit is never
        # abandoned). Without it a task committing in a loop could not be cancelled at all: the
        # pipeline's waits are uninterruptible and an inline write yields, if at all, only in a
        # shielded checkpoint. (The fdb backend's commit checks the same way.)
        # trio's checkpoint_if_cancelled() with its test made here: it is a coroutine
        # of its own, and that call is ~0.3 us of every commit (checked by
        # test_cancellation; trio is pinned, and kv.lmdb_engine reads its run state too).
        task = _trio_run.GLOBAL_RUN_CONTEXT.task
        if cancel_pending(task):
            await checkpoint_if_cancelled()  # raises here
        task._cancel_points += 1  # (what checkpoint_if_cancelled counts when it passes)
        engine = self._engine
        # The commit waits for each watch's read (RYW commit waits on `reading`, which holds
        # every watch's read): read again here at the same read version, it gives the value
        # watch() read, own writes included (one that changed it fired the watch already).
        # (sim.oracle's _get adds its network round trip to this wait.)
        if self._watches:  # (tested first: iterating even the empty tuple builds an iterator)
            for w in self._watches:
                if not w.ready:
                    w.seen = await self._get(w.key, snapshot=True) if self._write_map().get(w.key, (None,))[0] != _UNREADABLE else None
        if not self._prepare_commit():
            return
        try:
            await engine.commit(self)
        except BaseException as exc:
            self._commit_failed(exc)
            raise
        self._commit_done()

    def _commit_failed(self, exc: BaseException) -> None:
        """The engine's commit of this attempt raised ``exc``: the attempt fails with it (1101
        when it is not a KVError, e.g. a cancellation reaching the wait). commit() and
        Database.transact both end a failed commit here."""
        self._fail_attempt(exc if isinstance(exc, KVError) else KVError(1101, "commit did not complete"))

    def _commit_done(self) -> None:
        """The engine committed this attempt (at _batch_version, order _batch_order in its
        batch): commit()'s end."""
        version = self._committed_version = self._batch_version
        # _finish's other steps, only when there is something for them: the snapshot was closed
        # before the commit and no read can open one from here (commit_started), so watches to
        # arm and a versionstamp to answer are all that remain (most commits have neither).
        if self._watches or self._versionstamp is not None:
            self._finish(version, _stamp(version, self._batch_order) if self._versionstamp is not None else None)

    def _prepare_commit(self) -> bool:
        """commit()'s steps from the commit's start to handing this transaction to the engine
        (no wait among them): True when it is to be handed over (``engine.commit(self)``: the
        pipeline carries the transaction itself, see kv.engine.Committing), False when there is
        nothing to commit (the transaction finished). Database.transact calls it too, awaiting
        the engine itself (see _direct_commit)."""
        # The commit has started (RYW commitStarted, set first thing in RYWImpl::commit): from
        # here on, whatever the outcome, every use is 2017 until reset/on_error.
        self._commit_started = self._slow = True
        # (kept as the transaction goes: every write, clear and conflict range, read ones included,
        # adds its bytes to _size when it is recorded)
        size = self._size
        if size > self._size_limit:
            err = KVError(2101, f"transaction of {size} bytes exceeds {self._size_limit}")
            self._fail_attempt(err)
            raise err
        if not self._mutations and not self._write_ranges and not self._write_points:
            self._finish(-1, None)
            return False
        engine = self._engine
        if engine.hooked:
            engine._hooks.before_commit(self)
        if self._read_version is None:  # a blind write: the commit's own read version (get_read_version answers it)
            # (Engine.committed_version inlined, as _get inlines check_read_version: every blind write)
            self._read_version = engine._last_version
        # The engine reads the attempt's lists where they are: a committing transaction is
        # frozen (2017 on any use), and a retry starts from fresh ones (_reset_state).
        if self._snap is not None:  # release the storage snapshot before waiting
            self._snap.close()
            self._snap = None
        return True

    def _fail_attempt(self, err: KVError) -> None:
        """A started commit failed: its error goes to the watches and the versionstamp
        (NativeAPI commitAndWatch: cancelWatches(e), versionstampPromise.sendError)."""
        watches, self._watches = self._watches, _EMPTY
        self._drop_guard = None
        for w in watches:
            w._fire(err)
        if self._versionstamp is not None:
            self._versionstamp._set(error=err)

    def _finish(self, version: int, stamp: bytes | None) -> None:
        self._committed_version = version
        if self._snap is not None:
            self._snap.close()
            self._snap = None
        watches = self._watches
        if watches:
            # Armed, they are the database's (NativeAPI setupWatches ends watches.clear()):
            # a later cancel/reset/on_error of this transaction leaves them be.
            self._watches = _EMPTY
            self._drop_guard = None
            for w in watches:
                self._engine.arm_watch(w)
        if self._versionstamp is not None:
            if stamp is None:
                self._versionstamp._set(error=KVError(2021, "read-only transactions have no versionstamp"))
            else:
                self._versionstamp._set(stamp)

    async def on_error(self, error: BaseException | int) -> None:
        """FoundationDB's retry step: back off and reset for a retryable error, else re-raise."""
        if isinstance(error, int):
            error = KVError(error)
        if not isinstance(error, KVError):
            raise error
        if self._cancelled:  # RYWImpl::onError: a set resetPromise is thrown before anything else
            raise KVError(self._cancelled)
        if self._timeout is not None and time.monotonic() - self._started > self._timeout:
            # The timeout has run out: FoundationDB's timebomb has set resetPromise with
            # transaction_timed_out, so onError throws that (whatever `error` is) and leaves it
            # set: later uses are 1031 too, not the 1025 of a failed on_error, until reset().
            self._cancelled = 1031
            self._slow = True
            raise KVError(1031)
        if not error.retryable or (self._retry_limit >= 0 and self._retries >= self._retry_limit):
            # RYWImpl::onError's catch (API >= 610): resetPromise.sendError(transaction_cancelled)
            self._cancelled = 1025
            self._slow = True
            raise error
        if error.code in (1007, 1009):
            delay = min(INITIAL_BACKOFF, self._max_retry_delay)
        else:
            delay = self._backoff * self._engine.random.random()
            self._backoff = min(self._backoff * 2, self._max_retry_delay)
        self._retries += 1
        await trio.sleep(delay)
        if self._cancelled:  # cancel() during the backoff (RYW waits on resetPromise || tr.onError(e))
            raise KVError(self._cancelled)
        started, backoff, retries = self._started, self._backoff, self._retries
        # NativeAPI Transaction::onError resets the transaction for a retryable error, and its
        # reset() runs cancelWatches() with its default, transaction_cancelled: not `error`
        for w in self._watches:
            w._fire(KVError(1025, "transaction retried (on_error) before its watch was armed"))
        self._reset_state()
        self._started, self._backoff, self._retries = started, backoff, retries
        self._size_limit = TRANSACTION_SIZE_LIMIT
        if self._timeout is not None and time.monotonic() - self._started > self._timeout:
            raise KVError(1031)
