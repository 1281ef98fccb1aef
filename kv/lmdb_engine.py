"""The durable embedded engine: a write-ahead log, an MVCC overlay and LMDB.

A batch (the engine's group commit) is made durable by appending one record
to the write-ahead log and ``fdatasync``-ing it (``kv.wal``): one
sequential write, whatever keys the batch touched. Its effects then live in
an in-memory *overlay* until a *checkpoint* (a helper process,
``kv.checkpoint``) has written them into the LMDB B-tree in bulk. Why: see
``kv.wal`` (a durable LMDB commit per batch cost several milliseconds of
scattered page writes and a GIL convoy; the log costs one append).

Reads see the overlay over a *base*: an LMDB read transaction on the tree
as of some checkpoint version C. The overlay keeps, per key, the versions
``[(version, value or None), ...]`` written after the oldest base still in
use, so a snapshot at version V answers a key from its newest overlay entry
<= V, or else from its base (which is at C <= V, and nothing changed the
key in (C, V] or the overlay would hold it). A cleared range becomes a
tombstone per key that was visible, so a range read merges overlay and base
in key order. When a checkpoint lands, new snapshots take the newer base
and, once the last snapshot on an older base is closed, overlay entries at
or below the oldest base in use are dropped (a few thousand keys per call,
so no single commit pays for a whole segment).

Writes: a batch's effects are staged into the overlay at the batch's
version on the event loop (invisible: every snapshot's version is below
it), the record is written and synced (inline, ``O_DSYNC``, when no other
task could run, see ``LmdbStore.can_apply_inline``; else written buffered on
the loop and synced by a helper process, see ``kv.walsync``), and only then
does the store's version move, which makes the batch visible. A
log write that fails leaves the store refusing commits until it is reopened
(after a failed ``fdatasync`` the page cache can no longer be trusted; the
batch is reported ``commit_unknown_result``) while reads go on.

Opening runs a checkpoint of every segment left over (recovery after a
crash: a torn record at the log's end is cut off), so a store always starts
with an empty overlay; closing checkpoints everything too, so a cleanly
closed directory is a plain LMDB tree. The B-tree layout is in
``kv.lmdb_layout``; ``LOCK``/``HOLDER`` files: one process owns the
directory (``flock``), a second open fails at once naming the holder.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import lmdb
import trio
from sortedcontainers import SortedList
from trio._core import _run as _trio_run

from . import lmdb_layout as layout
from .keyindex import add_sorted
from . import wal, walsync
from .atomic import apply_atomic
from .engine import Engine, FaultHooks, Mutation
from .errors import KVError

log = logging.getLogger(__name__)

__all__ = ["LmdbStore", "DataDirectoryLocked", "open_lmdb_engine"]

FORMAT = layout.FORMAT
_SHORT, _PREFIX = layout.SHORT, layout.PREFIX  # (read by every snapshot get: a global, not an attribute)
CHECKPOINT_SYNCS_PER_SEGMENT = 2  # a sealed segment becomes one durable LMDB commit (data, then meta page)
INLINE_WHEN_IDLE = True  # write a batch on the loop thread when no other task could run (can_apply_inline)
INLINE_MAX_COMMIT_SECONDS = 0.002  # ...and only while recent log syncs took at most this long
RELEASED_ACCOUNT_AT = 64  # closed snapshots queued before taking a snapshot accounts them (snapshot)
SNAPSHOT_ORDER_COMPACT_AT = 10_000  # distinct snapshot versions remembered before closed ones are swept
TRIM_BUDGET = 4_096  # overlay keys dropped per call once a checkpoint has landed
STALE_SWEEP_FRACTION = 0.5  # rebuild the ordered key index once this share of it is trimmed keys (_trim)
MAX_CHECKPOINTER_STARTS = 5  # after this many starts of the helper, checkpoint in this process
CHECKPOINTER_EXIT_SECONDS = 60.0  # close() waits this long for the helper's current pass, then kills it
_COMMIT_EWMA_WEIGHT = 0.1  # weight of the newest sync in the recent-sync-time average
_KV_PARENT = str(Path(__file__).resolve().parents[1])  # put on the checkpointer's PYTHONPATH


def _loop_is_idle() -> bool:
    """True if no task is runnable and no thread callback is queued on this trio loop.

    ``trio.lowlevel.current_statistics()`` answers this, but also counts the
    I/O waiters by walking every registered socket: a millisecond per commit
    with a thousand SSE connections open. So this reads the two queues it
    needs from the runner (trio is pinned in pyproject.toml; the sim relies on
    its internals too), and falls back to the public call on a trio it does
    not recognise.
    """
    try:  # (attribute reads, not getattr calls: asked before every lone commit)
        runner = _trio_run.GLOBAL_RUN_CONTEXT.runner
        entry_queue = runner.entry_queue  # (EntryQueue.size(), its two deques, read directly)
        return not runner.runq and not entry_queue.queue and not entry_queue.idempotent_queue
    except AttributeError:
        stats = trio.lowlevel.current_statistics()
        return stats.tasks_runnable == 0 and stats.run_sync_soon_queue_size == 0


class DataDirectoryLocked(RuntimeError):
    """Another process (or handle) already owns this data directory."""


class _Base:
    """One LMDB read transaction: the tree as of checkpoint ``version``, shared by snapshots."""

    __slots__ = ("txn", "txnid", "version", "refs")

    def __init__(self, env: lmdb.Environment) -> None:
        self.txn = env.begin(buffers=False)
        self.txnid = self.txn.id()
        self.version = layout.read_applied(self.txn)
        self.refs = 0


class _LmdbSnapshot:
    """A view at ``version``: the overlay over a base, shared by every transaction that takes
    a snapshot while the store is at that version (``LmdbStore.snapshot``): ``holders`` counts
    them, each ``close()`` gives one back."""

    __slots__ = ("_store", "_base", "_top_ver", "_top_val", "_older", "version", "holders")

    def __init__(self, store: "LmdbStore", base: _Base, version: int) -> None:
        assert base.version <= version, (base.version, version)
        self._store = store
        self._base = base
        self._top_ver, self._top_val, self._older = store._top_ver, store._top_val, store._older
        base.refs += 1
        self.version = version
        self.holders = 1

    def get(self, key: bytes) -> bytes | None:
        ver = self._top_ver.get(key)
        if ver is not None:
            if ver <= self.version:
                return self._top_val[key]
            older = self._older.get(key)
            if older is not None:
                for i in range(len(older) - 2, -1, -2):
                    if older[i] <= self.version:
                        return older[i + 1]
            # every overlay entry is newer than this snapshot: the base has the key's value
        if len(key) <= _SHORT:  # the hot path, inline (layout's constants as globals of this module)
            return self._base.txn.get(_PREFIX + key)
        return layout.get(self._base.txn, key)

    def range(self, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
        if begin >= end:
            return []
        store = self._store
        if store._unindexed:
            store._index()
        keys = store._keys.irange(begin, end, inclusive=(True, False), reverse=reverse)
        if store._stale:
            keys = itertools.filterfalse(store._stale.__contains__, keys)  # (a C filter, no Python step a key)
        first = next(keys, None)
        if first is None:  # nothing in the overlay here: the base alone
            return layout.read_range(self._base.txn, begin, end, reverse, limit)
        return self._merge(itertools.chain((first,), keys), begin, end, reverse, limit)

    def _merge(self, keys, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
        """Overlay keys (in order) merged with the base's pairs in [begin, end)."""
        out: list[tuple[bytes, bytes]] = []
        top_ver, top_val, olders = self._top_ver, self._top_val, self._older
        v = self.version
        base = layout.iter_range(self._base.txn.cursor(), begin, end, reverse)
        b = next(base, None)
        for k in keys:
            while b is not None and (b[0] > k if reverse else b[0] < k):
                out.append(b)
                if limit and len(out) >= limit:
                    return out
                b = next(base, None)
            base_value = None
            if b is not None and b[0] == k:
                base_value = b[1]
                b = next(base, None)
            if top_ver[k] <= v:
                val = top_val[k]
            else:
                val = base_value
                older = olders.get(k)
                if older is not None:
                    for i in range(len(older) - 2, -1, -2):
                        if older[i] <= v:
                            val = older[i + 1]
                            break
            if val is not None:
                out.append((k, val))
                if limit and len(out) >= limit:
                    return out
        while b is not None:
            out.append(b)
            if limit and len(out) >= limit:
                return out
            b = next(base, None)
        return out

    def close(self) -> None:
        """Give back one holder's hold (each holder closes once). The last one releases the
        view unless it is still the store's current one, which the next transaction reuses."""
        holders = self.holders - 1
        self.holders = holders
        if not holders and self._store._shared is not self:
            self._release()

    def _release(self) -> None:
        base, self._base = self._base, None
        if base is not None:
            store = self._store
            if not store._closed:  # (else close() aborted every base already)
                base.refs -= 1
                # accounted at the next _maintain, never here (see there): a finalizer may
                # release a snapshot in the middle of a walk over the overlay
                store._released.append((base, self.version))

    def __del__(self) -> None:
        # A transaction dropped without commit, reset or cancel (a read-only one, usually)
        # still holds its snapshot: releasing it here lets the store release the base and
        # trim the overlay once no holder is left. The finalizer is the shared view's, so it
        # runs once per version taken (~per batch), not once per transaction; a blind write
        # (no snapshot) pays nothing for it.
        if getattr(self, "_base", None) is not None:  # (None too if __init__ failed early)
            try:
                self._release()
            except Exception:
                pass


class _Job:
    """One batch handed to the log's sync helper: written, its sync requested.

    ``await wait()`` hears the sync (the waiter is shielded: see
    ``SyncHelper.done``), then books the batch in the store (``_publish``)
    or, if the log failed, unstages it and raises. The engine has at most
    two jobs out (the next batch is written while one syncs, see
    ``LmdbStore.can_submit_ahead``) and waits for them in version order, so
    batches publish in version order.
    """

    __slots__ = ("store", "version", "touched", "dead", "nbytes", "started")

    def __init__(self, store: "LmdbStore", version: int, touched: list[bytes], dead: list[tuple[int, bytes]],
                 nbytes: int) -> None:
        self.store, self.version, self.touched, self.dead, self.nbytes = store, version, touched, dead, nbytes
        self.started = time.perf_counter()

    async def wait(self) -> None:
        store = self.store
        try:
            await store._sync.done()
            if store._closed:
                # Closed while this batch was on disk: close() saw its sync through, so it
                # is durable (reopening replays it), but the log and the tree are shut.
                return
            if store._broken is not None:
                # An earlier batch's sync failed after this one was written behind it: the
                # log cannot be trusted past that point, so this one is not known durable either.
                raise KVError(1021, f"an earlier write-ahead log write failed ({store._broken!r}); "
                                    "the batch may or may not be durable")
            store._note_sync_time(time.perf_counter() - self.started)
            sealed = store._log.synced(self.nbytes)  # a full segment is sealed here, on the loop
        except BaseException as exc:
            store._unstage(self.version, self.touched)
            error = store._broke(exc)
            if error is exc:
                raise
            raise error from exc
        store._publish(self.version, self.touched, self.dead, self.nbytes, sealed)



class LmdbStore:
    """The durable store: log appends for batches, overlay + LMDB for snapshots.

    ``segment_bytes``: how much log a segment holds before it is sealed and
    checkpointed. ``checkpointer``: run the helper process (False: sealed
    segments wait for :meth:`checkpoint` or close; for tests).
    """

    def __init__(self, path: str | os.PathLike, *, segment_bytes: int = wal.SEGMENT_BYTES,
                 checkpointer: bool = True) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._wal_dir = self.path / "wal"
        self._lock_fd = _acquire_directory(self.path)
        try:
            self.env = layout.open_env(self.path)
            try:
                self._check_format()
                self._wal_dir.mkdir(exist_ok=True)
                # Recovery: whatever a previous process left in the log goes into
                # the tree (after any checkpoint pass it left running finishes).
                with wal.checkpoint_lock(self.path):
                    wal.checkpoint_pass(self.env, self._wal_dir, include_newest=True, repair_tail=True)
                self._log = wal.LogWriter(self._wal_dir, segment_bytes=segment_bytes)
            except BaseException:
                self.env.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise
        # The overlay: each key's entries (version, value or None for a deletion) since the
        # base. The newest is split over two dicts of atoms; the older ones (kept while a
        # snapshot may read them, until a checkpoint), for the keys written more than once,
        # are one flat list per key, [version, value, version, value, ...], oldest first.
        # Why not (version, value) tuples: a new tuple is tracked by the garbage collector,
        # so every overlay entry counted toward the next collection, and each collection
        # walked every commit still in flight (at 64 submitters: a collection per ~40
        # submissions, 1.2 ms each, ~16% of the CPU, measured). Ints and bytes are never
        # tracked, in a dict or appended to a list. Invariant: _top_ver and _top_val have
        # the same keys, _older's keys are among them, and every version in _older[k] is
        # below _top_ver[k].
        self._top_ver: dict[bytes, int] = {}
        self._top_val: dict[bytes, bytes | None] = {}
        self._older: dict[bytes, list[int | bytes | None]] = {}
        # The overlay's keys in order, for range reads; keys first written since the last range
        # read wait in _unindexed (an insert there is a tenth of a sorted one, and write-only
        # traffic, a submit or a blind write, never pays for the order). A key is in exactly
        # one of the two while it has an overlay entry.
        self._keys: SortedList = SortedList()
        self._unindexed: dict[bytes, None] = {}  # a dict of None: never tracked by the collector
        # Keys the trim dropped from the overlay but left in _keys (see _trim): walks skip them,
        # and _keys is rebuilt without them once they are STALE_SWEEP_FRACTION of it. A stale
        # key written again waits in _unindexed too until the next _index revives it.
        self._stale: set[bytes] = set()
        self._recent: deque[tuple[int, tuple[bytes, ...]]] = deque()  # (version, keys it touched), oldest first
        self._base = _Base(self.env)
        self._old_bases: list[_Base] = []  # superseded bases some snapshot still reads
        self._version = self._base.version
        self._sealed_through = self._version  # newest version in a sealed segment
        self._checkpoint_due = False  # a sealed segment may not be in the base yet
        self._trim_floor = self._version  # overlay entries <= this are in every base in use
        # Open snapshots' versions (version -> count, and the versions in the order first
        # taken, which is ascending): what the dead-key purge must keep readable.
        self._snap_counts: dict[int, int] = {}
        self._snap_order: deque[int] = deque()
        self._released: list[tuple[_Base, int]] = []  # closed snapshots, not yet accounted
        # The view at (_version, _base) that snapshot() hands out, counted once in
        # _snap_counts and once in the base's refs however many hold it (see snapshot)
        self._shared: _LmdbSnapshot | None = None
        self._dead: deque[tuple[int, bytes]] = deque()  # (version, key) of tombstones, oldest first
        self._purged: list[tuple[int, bytes]] = []  # purged tombstones the base does not hold yet
        self._broken: BaseException | None = None
        self._commit_seconds = 0.0  # recent log sync time (moving average), for can_apply_inline
        self._use_checkpointer = checkpointer
        self._proc: subprocess.Popen | None = None
        self._checkpointer_starts = 0
        # (the figures read through the stats property; its two derived ones are filled in there)
        self._stats = {"batches": 0, "bytes_written": 0, "fsyncs": 0, "segments_sealed": 0, "overlay_keys": 0}
        self._encode_record = wal.RecordEncoder().encode  # (its pickler reused batch after batch)
        self._sync = walsync.SyncHelper(self._wal_dir)  # its process starts with the first pipelined batch
        self._closed = False

    def _check_format(self) -> None:
        """Stamp a new environment with ``FORMAT``, upgrade format 2, refuse any other layout."""
        with self.env.begin(write=True) as txn:
            fmt = txn.get(layout.FORMAT_KEY)
            if fmt is None:
                if txn.get(b"data") is not None or txn.get(b"meta") is not None:
                    fmt = b"1"  # named-database records of the first layout
                elif txn.cursor().first():
                    fmt = b"unknown"
                else:
                    txn.put(layout.FORMAT_KEY, FORMAT)
                    fmt = FORMAT
            elif fmt in layout.UPGRADABLE_FORMATS:
                # Format 2 had no log (the tree is everything) and kept a version
                # ceiling: batches start above it, as they did.
                ceiling = txn.get(layout.LEGACY_CEILING_KEY) or bytes(8)
                txn.put(layout.APPLIED_KEY, ceiling)
                txn.delete(layout.LEGACY_CEILING_KEY)
                txn.put(layout.FORMAT_KEY, FORMAT)
                fmt = FORMAT
        if fmt != FORMAT:
            raise KVError(
                2000,
                f"data directory {self.path} holds storage format {fmt.decode(errors='replace')}, "
                f"this surefoot reads formats {FORMAT.decode()} and 2 only; "
                "start from an empty directory (format 1 was written before 2026-11-29)",
            )

    # -- reads ------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """Counters: batches, bytes_written, segments_sealed, and two figures derived when read
        (not by every batch: ~1k instructions a commit): overlay_keys (the overlay's keys now)
        and fsyncs (the log's syncs, plus the checkpoint's for every sealed segment, made in
        the helper process, off every acknowledgement's path, but made: the honest count).
        The same dict each time."""
        stats = self._stats
        stats["overlay_keys"] = len(self._top_ver)
        stats["fsyncs"] = self._log.fsyncs + CHECKPOINT_SYNCS_PER_SEGMENT * stats["segments_sealed"]
        return stats

    def committed_version(self) -> int:
        return self._version

    def written_since(self, key: bytes, version: int) -> bool:
        """Whether the overlay's newest entry of ``key`` is at ``version`` or later (the
        engine's watch check). Also true when unsure: for a key a batch staged after
        ``version`` wrote (written ahead, not published yet), and for a key the overlay does
        not hold (never written since the base, or dropped by the publish's trim or purge,
        which may be this very batch's entry): the engine then reads it again for nothing."""
        top = self._top_ver.get(key)
        return top is None or top >= version

    def snapshot(self) -> _LmdbSnapshot:
        # Closed snapshots are accounted in bulk (every publish does it too), not one
        # _maintain call per snapshot taken: until then their versions only hold the
        # dead-key purge's floor a little lower, and an old base a little longer.
        # Every transaction taking a snapshot at the store's current version and base reads
        # the same thing: they share one view (~13 transactions a batch in 32 concurrent
        # turns), one more holder each, instead of an object, a finalizer and a count each.
        # (Closed views queue one per version now, so the count test is only made here.)
        snap = self._shared
        if snap is not None and not self._checkpoint_due:
            snap.holders += 1
            return snap
        if self._checkpoint_due or len(self._released) >= RELEASED_ACCOUNT_AT:
            self._maintain()  # (may take a new base, which drops the shared view)
            snap = self._shared
            if snap is not None:
                snap.holders += 1
                return snap
        version = self._version
        count = self._snap_counts.get(version)
        if count is None:
            self._snap_counts[version] = 1
            self._snap_order.append(version)
        else:
            self._snap_counts[version] = count + 1
        snap = self._shared = _LmdbSnapshot(self, self._base, version)
        return snap

    def _drop_shared(self) -> None:
        """The store's version or base moves on: the shared view is not handed out again
        (released now if nobody holds it, else by its last holder's close)."""
        snap = self._shared
        if snap is not None:
            self._shared = None
            if not snap.holders:
                snap._release()

    def _maintain(self) -> None:
        """Account closed snapshots, take a landed checkpoint as the new base,
        and drop what no base needs.

        Only called where no read is under way (taking a snapshot, publishing
        a batch): a snapshot may be closed by a finalizer at any allocation,
        even in the middle of a range read's walk over the overlay, so
        closing one only queues it on ``_released`` (``list.append`` is
        atomic) and the bookkeeping happens here.
        """
        released, counts = self._released, self._snap_counts
        floor_stale = False
        if released:
            while released:
                base, version = released.pop()
                counts[version] -= 1
                if base.refs == 0 and base is not self._base and base in self._old_bases:
                    base.txn.abort()
                    self._old_bases.remove(base)
                    floor_stale = True
            # Forget the versions no snapshot reads any more (else, with no tombstone ever
            # purged, the only other caller, they piled up: an entry per batch, for good).
            self._oldest_snapshot_version()
        if self._checkpoint_due:
            self._take_new_base()
        if floor_stale:
            self._raise_trim_floor()

    def _oldest_snapshot_version(self) -> int:
        """The lowest version any open snapshot reads at (the store's version if none)."""
        order, counts = self._snap_order, self._snap_counts
        while order and counts[order[0]] == 0:
            del counts[order.popleft()]
        if len(order) > SNAPSHOT_ORDER_COMPACT_AT:
            # One snapshot left open for long holds the front: drop the closed ones behind it
            # so the bookkeeping stays as small as the set of open versions.
            live = deque(v for v in order if counts[v])
            for v in order:
                if not counts[v]:
                    del counts[v]
            order = self._snap_order = live
        return order[0] if order else self._version

    def _take_new_base(self) -> None:
        """Move new snapshots onto the newest checkpoint, if one has landed."""
        if self.env.info()["last_txnid"] == self._base.txnid:
            return
        new = _Base(self.env)
        self._restore_purged(new)
        self._drop_shared()
        old, self._base = self._base, new
        if old.refs == 0:
            old.txn.abort()
        else:
            self._old_bases.append(old)
        if new.version >= self._sealed_through:
            self._checkpoint_due = False
        self._raise_trim_floor()

    def _restore_purged(self, new: _Base) -> None:
        """Put back the tombstones of purged keys that ``new`` holds again.

        A key written in one segment and deleted in the next may be purged
        (see :meth:`_purge_dead`) while the base holds neither; a checkpoint
        of the first segment alone then brings the key into the tree. Its
        deletion, still only in the log, must hide it again.
        """
        keep = []
        for version, key in self._purged:
            if version <= new.version:
                continue  # the tree has the deletion too
            keep.append((version, key))
            if layout.get(new.txn, key) is not None:
                self._insert_entry(key, version, None)
        self._purged = keep

    def _insert_entry(self, key: bytes, version: int, value: bytes | None) -> None:
        """An overlay entry at ``version``, in version order among the key's others."""
        top = self._top_ver.get(key)
        if top is None or top < version:
            self._put(version, key, value, [])  # the newest: as a write puts it
            return
        if top == version:
            return  # already there
        older = self._older.setdefault(key, [])
        i = len(older)
        while i and older[i - 2] > version:
            i -= 2
        if i and older[i - 2] == version:
            return  # already there
        older[i:i] = (version, value)

    def _raise_trim_floor(self) -> None:
        floor = min([b.version for b in self._old_bases] + [self._base.version])
        if floor > self._trim_floor:
            self._trim_floor = floor
            self._trim()

    def _trim(self, budget: int = TRIM_BUDGET) -> None:
        """Drop overlay entries every base in use already holds (at most ``budget`` keys now).

        A dropped key that is in the ordered index (``_keys``) is not taken
        out of it here but marked stale: ``SortedList.remove`` costs ~1-1.7 us
        a key, and a trim drops every key the checkpointed segment held (helper-39's
        profile: ~22 removals per concurrent turn, 2.2% of its CPU). Walks
        skip stale keys (their values are in the base, which the walk merges
        anyway), and once they are ``STALE_SWEEP_FRACTION`` of the index it is
        rebuilt without them in one filtered pass (~0.1-0.15 us a key), so a
        walk passes at most as many stale keys as live ones, and only keys
        the overlay held until the last checkpoint (as tombstones, or with
        values the base now holds), which walks passed before the trim too.
        ``_purge_dead`` still removes its keys from the index at once: it is
        there so that queue walks stop passing dead keys.
        """
        floor = self._trim_floor
        recent, top_ver, top_val, olders = self._recent, self._top_ver, self._top_val, self._older
        unindexed, stale = self._unindexed, self._stale
        while recent and recent[0][0] <= floor and budget > 0:
            _, touched = recent.popleft()
            budget -= len(touched)
            for k in touched:
                top = top_ver.get(k)
                if top is None:
                    continue  # already gone (a key touched by several batches)
                if top <= floor:  # _drop_key, but the index entry goes stale
                    del top_ver[k]
                    del top_val[k]
                    olders.pop(k, None)
                    if k in unindexed:
                        del unindexed[k]
                    else:
                        stale.add(k)
                    continue
                older = olders.get(k)
                if older is not None:
                    i = 0
                    while i < len(older) and older[i] <= floor:
                        i += 2
                    if i == len(older):
                        del olders[k]
                    elif i:
                        del older[:i]
        if len(stale) > len(self._keys) * STALE_SWEEP_FRACTION:
            self._keys = SortedList(itertools.filterfalse(stale.__contains__, self._keys))
            stale.clear()

    # -- writes -----------------------------------------------------------

    def can_apply_inline(self, mutations: int) -> bool:
        """Whether the engine may write the next batch on the loop thread now.

        Why inline at all: handing a batch's sync to the helper process and
        hearing back costs two cross-process wake-ups (~0.05-0.1 ms here), and
        buys nothing when no other task is runnable and no callback is queued:
        the loop would only sit in ``epoll`` until the helper answers. So a
        lone committer (the embedded, one-request-at-a-time case) writes
        inline, and as soon as anything else could run, batches are synced by
        the helper and the next batch forms meanwhile. Inline is only for a
        fast disk: while recent log syncs have taken longer than
        ``INLINE_MAX_COMMIT_SECONDS``, batches go to the helper and the loop
        stays responsive.
        """
        return INLINE_WHEN_IDLE and self._commit_seconds <= INLINE_MAX_COMMIT_SECONDS and _loop_is_idle()

    def apply_sync(self, version: int, mutations: list[Mutation]) -> int:
        """Stage, log and publish one batch on the calling (loop) thread."""
        record, touched, dead = self._stage(version, mutations)
        try:
            sealed = self._append(record)
        except BaseException as exc:
            self._unstage(version, touched)
            error = self._broke(exc)
            if error is exc:
                raise
            raise error from exc
        self._publish(version, touched, dead, len(record), sealed)
        return len(record)

    async def apply(self, version: int, mutations: list[Mutation]) -> None:
        """Stage and write on the loop, sync in the helper process (the loop runs meanwhile), then publish."""
        await self.submit(version, mutations).wait()

    def submit(self, version: int, mutations: list[Mutation]) -> _Job:
        """Stage the batch, write its record (buffered) and ask the sync helper
        to make it durable; ``await job.wait()`` hears the outcome and
        publishes it (or unstages it).

        The engine submits a batch while another is out only when
        ``can_submit_ahead()`` says so, and waits for the jobs in submission
        (= version) order, so batches publish in version order.
        """
        record, touched, dead = self._stage(version, mutations)
        try:
            self._log.write(record)  # into the page cache: microseconds for a batch's few KiB
            self._sync.request(self._log.number, self._log.wfd)
        except BaseException as exc:
            self._unstage(version, touched)
            error = self._broke(exc)
            if error is exc:
                raise
            raise error from exc
        return _Job(self, version, touched, dead, len(record))

    @property
    def waits_refuse_cancel(self) -> bool:
        """Whether a job's wait refuses cancellation by itself (see ``walsync.done``)."""
        return walsync._REFUSING_WAIT

    def can_submit_ahead(self) -> bool:
        """Whether the next batch may be written and its sync requested while one is still out.

        Why: the loop hears a sync only between task steps, so with one
        batch out the disk waited for the loop's tick (running the previous
        batch's woken tasks) before the next batch's sync could start. With
        the next batch written behind it, the helper starts that sync the
        moment the first one returns. Not when the segment is full (it is
        sealed only once all it holds is durable: see ``LogWriter.has_room``)
        nor after a log failure.
        """
        return self._broken is None and self._sync.has_room() and self._log.has_room()

    def _stage(self, version: int, mutations: list[Mutation]) -> tuple[bytes, list[bytes], list[tuple[int, bytes]]]:
        """Put the batch's effects into the overlay at ``version`` (not yet visible)
        and encode its log record. All or nothing: a failure unstages."""
        if self._broken is not None:
            raise KVError(4100, f"this store refuses commits after a write-ahead log failure "
                                f"({self._broken!r}); close and reopen the database")
        assert version > self._version, (version, self._version)
        touched: list[bytes] = []
        effects: list = []  # flat (see wal.py): one CBOR array, not one per effect
        dead: list[tuple[int, bytes]] = []  # tombstones this batch writes (purged later, see _purge_dead)
        top_ver, top_val, olders, unindexed = self._top_ver, self._top_val, self._older, self._unindexed
        SET = layout.SET
        try:
            for m in mutations:
                kind = m[0]
                if kind == "set":  # the common case
                    _, key, value = m  # (one specialised unpack, not two subscripts)
                    top = top_ver.get(key)
                elif kind == "atomic":  # ("atomic", op, key, param): ~8 a turn (counters)
                    _, op, key, param = m
                    top = top_ver.get(key)  # (_latest inlined)
                    old = top_val[key] if top is not None else layout.get(self._base.txn, key)
                    value = apply_atomic(op, old, param)
                    if value is None:  # (compare_and_clear) a deletion, if there was a value
                        if old is not None:
                            self._put(version, key, None, touched)
                            dead.append((version, key))
                            effects.append(layout.DELETE)
                            effects.append(key)
                        continue
                    # a value: written as a set is, below
                else:  # ("clear", begin, end)
                    begin, end = m[1], m[2]
                    if len(end) == len(begin) + 1 and end[-1] == 0 and end.startswith(begin):
                        # one key (tr.clear(k), most clears, ~2 a turn): _visible_keys, _latest
                        # and _put inlined; a tombstone only over a value
                        top = top_ver.get(begin)
                        if (top_val[begin] if top is not None else layout.get(self._base.txn, begin)) is not None:
                            if top is None:
                                unindexed[begin] = None
                            elif top != version:
                                older = olders.get(begin)
                                if older is None:
                                    olders[begin] = [top, top_val[begin]]
                                else:
                                    older.append(top)
                                    older.append(top_val[begin])
                            top_ver[begin] = version
                            top_val[begin] = None
                            touched.append(begin)
                            dead.append((version, begin))
                    else:
                        for key in self._visible_keys(begin, end):
                            self._put(version, key, None, touched)
                            dead.append((version, key))
                    effects.append(layout.CLEAR)
                    effects.append(begin)
                    effects.append(end)
                    continue
                # a set, or an atomic's new value (_put inlined)
                if top is None:
                    unindexed[key] = None
                elif top != version:
                    older = olders.get(key)
                    if older is None:
                        olders[key] = [top, top_val[key]]
                    else:
                        older.append(top)
                        older.append(top_val[key])
                top_ver[key] = version
                top_val[key] = value
                touched.append(key)
                effects.append(SET)
                effects.append(key)
                effects.append(value)
            record = self._encode_record(version, effects)
        except BaseException:
            self._unstage(version, touched)
            raise
        return record, touched, dead

    def _put(self, version: int, key: bytes, value: bytes | None, touched: list[bytes]) -> None:
        top = self._top_ver.get(key)
        if top is None:
            self._unindexed[key] = None
        elif top != version:
            older = self._older.get(key)
            if older is None:
                self._older[key] = [top, self._top_val[key]]
            else:
                older.append(top)
                older.append(self._top_val[key])
        self._top_ver[key] = version
        self._top_val[key] = value
        touched.append(key)

    def _drop_key(self, key: bytes) -> None:
        """Forget every overlay entry of ``key``."""
        del self._top_ver[key]
        del self._top_val[key]
        self._older.pop(key, None)
        self._forget_key(key)

    def _latest(self, key: bytes) -> bytes | None:
        """The key's newest value, staged entries of the batch being built included."""
        if key in self._top_ver:
            return self._top_val[key]
        return layout.get(self._base.txn, key)

    def _visible_keys(self, begin: bytes, end: bytes) -> list[bytes]:
        """Every key in [begin, end) with a value now (what a clear must tombstone).

        A one-key range [k, k+\\x00) (``tr.clear(k)``, most clears) is answered by
        looking the key up: walking the ordered overlay for it would first index
        every key written since the last range read (``_index``), measured at
        ~0.17 ms of a concurrent agent turn's ~4.7 ms (profiled), for nothing.
        """
        if len(end) == len(begin) + 1 and end[-1] == 0 and end.startswith(begin):
            return [begin] if self._latest(begin) is not None else []
        if begin >= end:
            return []
        top_val = self._top_val
        if self._unindexed:
            self._index()
        keys = self._keys.irange(begin, end, inclusive=(True, False))
        if self._stale:
            keys = itertools.filterfalse(self._stale.__contains__, keys)
        out = [k for k in keys if top_val[k] is not None]
        out.extend(k for k, _ in layout.iter_range(self._base.txn.cursor(), begin, end, False) if k not in top_val)
        return out

    def _index(self) -> None:
        """Bring the ordered key list up to date (before any walk over it)."""
        unindexed, stale = self._unindexed, self._stale
        if stale:
            # Stale keys written again are still in _keys: revive them there, not a second copy.
            revived = stale.intersection(unindexed)
            if revived:
                stale -= revived
                for k in revived:
                    del unindexed[k]
        if unindexed:
            add_sorted(self._keys, sorted(unindexed))
        unindexed.clear()  # in place: _stage holds it while a clear may index

    def _forget_key(self, key: bytes) -> None:
        if key in self._unindexed:
            del self._unindexed[key]
        else:
            self._keys.remove(key)

    def _unstage(self, version: int, touched: list[bytes]) -> None:
        # Usually the batch being unstaged is the newest, so its entries are the keys' tops. A
        # batch written behind it (can_submit_ahead) may be staged on top: then its entry is
        # in the key's older list, taken out there.
        for key in touched:
            if self._top_ver.get(key) != version:
                older = self._older.get(key)
                if older is not None:
                    for i in range(0, len(older), 2):
                        if older[i] == version:
                            del older[i:i + 2]
                            if not older:
                                del self._older[key]
                            break
                continue  # (or not there: a repeat in touched, already undone)
            older = self._older.get(key)
            if older is None:
                self._drop_key(key)
                continue
            self._top_val[key] = older.pop()
            self._top_ver[key] = older.pop()
            if not older:
                del self._older[key]

    def _append(self, record: bytes) -> bool:
        started = time.perf_counter()
        sealed = self._log.append(record)
        self._note_sync_time(time.perf_counter() - started)
        return sealed

    def _note_sync_time(self, seconds: float) -> None:
        """Fold one batch's write-to-durable time into the recent average (``can_apply_inline``)."""
        self._commit_seconds += (seconds - self._commit_seconds) * _COMMIT_EWMA_WEIGHT

    def _broke(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, OSError):
            return exc  # not the disk (e.g. a crash injected above): nothing is known to be wrong with the log
        self._broken = exc
        log.error("write-ahead log write failed in %s: %r; refusing commits until reopened", self.path, exc)
        return KVError(1021, f"the write-ahead log write failed ({exc!r}); the batch may or may not be durable")

    def _publish(self, version: int, touched: list[bytes], dead: list[tuple[int, bytes]], nbytes: int,
                 sealed: bool) -> None:
        self._version = version
        snap = self._shared
        if snap is not None:
            if snap.holders:
                self._drop_shared()  # its holders keep it at its version; the next snapshot() makes a new one
            else:
                # Nobody holds the current view (a lone committer closed it at its commit):
                # it becomes the view at the new version, on the same base, as if dropped
                # (_release, then _maintain's accounting) and made again by the next
                # snapshot() -- without a new object, a finalizer and a trip through
                # _released every lone batch.
                counts = self._snap_counts
                old = snap.version
                left = counts[old] - 1
                if left or self._snap_order[0] != old:
                    counts[old] = left
                else:  # the oldest remembered version, now unread: forgotten here
                    del counts[old]
                    self._snap_order.popleft()
                snap.version = version
                counts[version] = 1  # (a new version: every snapshot so far is below it)
                self._snap_order.append(version)
        # a tuple: untracked by the collector after one pass (a list never is)
        self._recent.append((version, tuple(touched)))
        if dead:
            self._dead.extend(dead)
        stats = self._stats
        stats["batches"] += 1
        stats["bytes_written"] += nbytes
        if sealed:
            stats["segments_sealed"] += 1
            self._sealed_through = version
            self._checkpoint_due = True
            if self._use_checkpointer:
                self._request_checkpoint()
        if self._released or self._checkpoint_due:  # (blind writers take no snapshots: look here too)
            self._maintain()
        if self._recent and self._recent[0][0] <= self._trim_floor:
            self._trim()
        if self._dead:
            self._purge_dead()

    def _purge_dead(self, budget: int = TRIM_BUDGET) -> None:
        """Forget keys that were deleted and that nothing can read any more.

        A key created and deleted between two checkpoints (a ready-index or
        lease-expiry entry: the queues of the ledger) would otherwise stay
        as a tombstone until the next checkpoint, and every range read over
        its queue would walk past all of them: claim after claim, each
        slower than the last. Such a key can go once every open snapshot
        reads at or after its deletion and no base holds it (then a read
        that misses the overlay finds nothing in the base either, which is
        right). Keys the base still holds wait for the checkpoint, as does
        everything while a superseded base is still read.
        """
        if self._old_bases:
            return
        floor = self._oldest_snapshot_version()
        dead, top_ver, top_val, txn = self._dead, self._top_ver, self._top_val, self._base.txn
        while dead and dead[0][0] <= floor and budget > 0:
            version, key = dead.popleft()
            budget -= 1
            top = top_ver.get(key)
            if top is None or top_val[key] is not None or top > floor:
                continue  # gone already, written again, or deleted again later (its own entry)
            if layout.get(txn, key) is not None:
                continue  # the base still has it: the tombstone hides it until a checkpoint
            self._drop_key(key)
            # The newest deletion's version, not this entry's: the key may have been written
            # and deleted again since, and a base between the two must not show it.
            self._purged.append((top, key))

    # -- checkpoints ------------------------------------------------------

    def _request_checkpoint(self) -> None:
        """Poke the checkpointer process (started the first time it is needed).

        If it keeps dying (``MAX_CHECKPOINTER_STARTS``), checkpoint in this
        process instead: slower for the loop, but the overlay stays bounded.
        """
        if self._checkpointer_starts >= MAX_CHECKPOINTER_STARTS and (self._proc is None or self._proc.poll() is not None):
            if self._proc is not None:
                log.error("checkpointer for %s keeps exiting (%s); checkpointing in this process from now on",
                          self.path, self._proc.returncode)
                self._proc = None
            self._checkpoint_inline()
            return
        for _ in range(2):
            proc = self._proc
            if proc is None or proc.poll() is not None:
                if self._checkpointer_starts >= MAX_CHECKPOINTER_STARTS:
                    break  # (one that died as we wrote to it was the last allowed)
                if proc is not None:
                    log.warning("checkpointer for %s exited with %s; starting another", self.path, proc.returncode)
                self._checkpointer_starts += 1
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [_KV_PARENT, env.get("PYTHONPATH")]))
                proc = self._proc = subprocess.Popen(
                    [sys.executable, "-m", "kv.checkpoint", str(self.path)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, close_fds=True)
            try:
                proc.stdin.write(b"c")
                proc.stdin.flush()
                return
            except OSError:  # it died between the poll and the write
                continue
        log.error("could not reach a checkpointer for %s; checkpointing in this process", self.path)
        self._checkpoint_inline()

    def _checkpoint_inline(self) -> None:
        with wal.checkpoint_lock(self.path):
            wal.checkpoint_pass(self.env, self._wal_dir, include_newest=False)

    def checkpoint(self) -> None:
        """Seal the current segment and checkpoint every sealed one now, in this process.

        For tests and maintenance; call with no commit in flight.
        """
        if self._log.size:
            self._log.seal()
            self._stats["segments_sealed"] += 1  # (seal() counted its fsync in the log's)
        self._sealed_through = self._version
        with wal.checkpoint_lock(self.path):
            wal.checkpoint_pass(self.env, self._wal_dir, include_newest=False)
        self._checkpoint_due = True
        self._maintain()

    def overlay_size(self) -> int:
        """Keys held in memory awaiting a checkpoint (or a snapshot older than it)."""
        return len(self._top_ver)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_shared()  # (the view refers to the store: no cycle left behind)
        try:
            self._sync.close()
            self._log.close()
            proc, self._proc = self._proc, None
            if proc is not None:
                proc.stdin.close()  # the checkpointer finishes its pass and exits
                try:
                    proc.wait(CHECKPOINTER_EXIT_SECONDS)
                except subprocess.TimeoutExpired:
                    log.error("checkpointer for %s did not exit; killing it (the log keeps its work)", self.path)
                    proc.kill()
                    proc.wait()
            for base in [self._base, *self._old_bases]:
                base.txn.abort()
            self._old_bases = []
            if self._broken is None:
                # Leave a plain tree behind: the next open has nothing to replay.
                with wal.checkpoint_lock(self.path):
                    wal.checkpoint_pass(self.env, self._wal_dir, include_newest=True)
        finally:
            self.env.close()
            try:
                (self.path / "HOLDER").unlink(missing_ok=True)
            finally:
                os.close(self._lock_fd)


def _acquire_directory(path: Path) -> int:
    """Take the directory's exclusive lock or fail at once naming its holder."""
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            holder = json.loads((path / "HOLDER").read_text())
            who = f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('cmd')}) since {holder.get('since')}"
        except (OSError, ValueError):
            who = "another process (holder unknown)"
        raise DataDirectoryLocked(f"data directory {path} is already open by {who}") from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cmd": " ".join(sys.argv)[:200] or "python",
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (path / "HOLDER").write_text(json.dumps(info))
    return fd


def open_lmdb_engine(path: str | os.PathLike, *, hooks: FaultHooks | None = None) -> Engine:
    store = LmdbStore(path)
    # Wall-clock versions: persisted versions and the clock both move forward across restarts.
    return Engine(store, clock=time.time, hooks=hooks)
