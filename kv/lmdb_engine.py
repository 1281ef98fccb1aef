"""The durable embedded engine: LMDB underneath the shared commit pipeline.

Why LMDB: its read transactions are MVCC snapshots (exactly a read version),
and one write transaction is crash-atomic and durable at commit (LMDB syncs
the data pages, then the meta page), which is what a group-commit batch
needs. Reads run on the trio thread (a memory-mapped B-tree lookup,
microseconds). A batch's write transaction and its syncs run on a dedicated
writer thread while other tasks are runnable, so the event loop keeps
working (and the next batch keeps forming) during the disk wait; when
nothing else could run anyway, the batch is written inline (see
``LmdbStore.apply``).

Layout of the environment (directory ``PATH``): one B-tree, LMDB's main
database, because every named database a transaction touches adds dirty
pages (its own tree plus its record in the main tree) to every commit's
write (measured: one tree instead of two cuts a durable commit by ~0.1 ms):

* ``b"k" + key``: the user's keys and values (the prefix because LMDB
  refuses the empty key, which FoundationDB allows). LMDB keys are
  limited to 511 bytes, so a key longer than ``_SHORT`` (509) bytes lives in
  a *bucket* stored under its first ``_BUCKET`` (510) bytes: a CBOR list of
  ``[key, value]`` pairs in key order. Every short key is at most 509 bytes,
  so buckets sort exactly where their keys would (see ``_iter``), and range
  reads stay in key order.
* ``b"m" + name``: the engine's own records. ``mversion`` (8 bytes
  big-endian) is a *ceiling*: above every version any batch has used, so a
  reopened engine starts there and never reuses one. A batch whose version
  reaches the ceiling raises it by ``VERSION_CEILING_STEP`` in the same LMDB
  transaction; other batches leave it alone, because that one extra key
  sits in its own leaf page and cost every small commit a second dirty page
  (~8% of a durable commit, measured). A store written before this rule
  holds the exact last version there, which is also a valid ceiling.
  ``mformat`` is ``FORMAT``. Range reads never leave the ``b"k"`` prefix.
* ``LOCK`` / ``HOLDER`` files: one process owns the directory (``flock``);
  a second open fails at once naming the holder from ``HOLDER``.

A snapshot's version is looked up from its LMDB transaction id (recorded
by each write before it commits), not read from the data, so it is exact
even while the writer thread commits concurrently.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import cbor2
import lmdb
import trio
from trio._core import _run as _trio_run

from .atomic import apply_atomic
from .engine import Engine, FaultHooks, Mutation
from .errors import KVError
from .limits import VERSIONS_PER_SECOND

__all__ = ["LmdbStore", "DataDirectoryLocked", "open_lmdb_engine"]

_PREFIX = b"k"     # every data key is stored as _PREFIX + key (LMDB has no empty key)
_PREFIX_END = b"l"  # first LMDB key after every data key
_VERSION_KEY = b"mversion"
_FORMAT_KEY = b"mformat"
FORMAT = b"2"      # 1 (before 2026-11-29): named databases "data" and "meta"
_SHORT = 509       # longest key stored as itself
_BUCKET = 510      # length of a bucket's key prefix (the long keys inside it share it)
MAP_SIZE = 1 << 38  # 256 GiB of address space; the file grows only as used
MAX_READERS = 16_384  # distinct open read versions (transactions between two commits share one)
SYNCS_PER_COMMIT = 2  # LMDB's durable commit: fdatasync of the data pages, then an O_DSYNC meta-page write
INLINE_WHEN_IDLE = True  # write a batch on the loop thread when no other task could run (can_apply_inline)
INLINE_MAX_COMMIT_SECONDS = 0.002  # ...and only while recent LMDB commits took at most this long
INLINE_ALWAYS_ABOVE_MUTATIONS = 512  # a batch this big is written inline even on a busy loop (GIL convoy)
VERSION_CEILING_STEP = 5 * VERSIONS_PER_SECOND  # mversion is raised this far past a batch that reaches it
TXN_VERSIONS_KEPT = 4_096  # LMDB txn id -> version entries remembered (a reader opens at the newest)
_COMMIT_EWMA_WEIGHT = 0.1  # weight of the newest commit in the recent-commit-time average


def _loop_is_idle() -> bool:
    """True if no task is runnable and no thread callback is queued on this trio loop.

    ``trio.lowlevel.current_statistics()`` answers this, but also counts the
    I/O waiters by walking every registered socket: a millisecond per commit
    with a thousand SSE connections open. So this reads the two queues it
    needs from the runner (trio is pinned in pyproject.toml; the sim relies on
    its internals too), and falls back to the public call on a trio it does
    not recognise.
    """
    runner = getattr(_trio_run.GLOBAL_RUN_CONTEXT, "runner", None)
    runq = getattr(runner, "runq", None)
    entry_queue = getattr(runner, "entry_queue", None)
    if runq is None or entry_queue is None:
        stats = trio.lowlevel.current_statistics()
        return stats.tasks_runnable == 0 and stats.run_sync_soon_queue_size == 0
    return not runq and entry_queue.size() == 0


class DataDirectoryLocked(RuntimeError):
    """Another process (or handle) already owns this data directory."""


class _ReadTxn:
    """One LMDB read transaction, shared by every snapshot taken at its version."""

    __slots__ = ("txn", "version", "refs")

    def __init__(self, store: "LmdbStore") -> None:
        self.txn = store.env.begin(buffers=False)
        self.version = store._version_of_txn(self.txn.id())
        self.refs = 0


class _LmdbSnapshot:
    """A transaction's view: a reference to a shared LMDB read transaction.

    Why shared: every transaction that starts between two commits sees the
    same data, so they can share one LMDB reader. That keeps the reader
    table small (thousands of open transactions cost a handful of slots)
    and makes starting a transaction nearly free.
    """

    __slots__ = ("_store", "_read", "version")

    def __init__(self, store: "LmdbStore", read: _ReadTxn) -> None:
        self._store = store
        self._read = read
        read.refs += 1
        self.version = read.version

    def get(self, key: bytes) -> bytes | None:
        if len(key) <= _SHORT:  # the hot path, inline
            return self._read.txn.get(_PREFIX + key)
        return _get(self._read.txn, key)

    def range(self, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        if begin >= end:
            return out
        cur = self._read.txn.cursor()
        if reverse:
            for kv in _iter(cur, begin, end, True):
                out.append(kv)
                if limit and len(out) >= limit:
                    break
            return out
        # Forward, the hot path (journal replay, transcript pages), inlined:
        # raw LMDB keys compare like user keys under the shared prefix, and the
        # engine's b"m" records sort after every b"k" key, so one comparison
        # against b"k" + end stops the walk.
        if not cur.set_range(_PREFIX + begin[:_BUCKET]):  # a bucket below begin may hold keys >= begin
            return out
        stop = _PREFIX + end
        append = out.append
        for raw, value in cur:
            if raw >= stop:
                break
            if len(raw) <= _SHORT + 1:
                append((raw[1:], value))
            else:
                for kv in _expand(raw[1:], value, begin, end, False):
                    append(kv)
            if limit and len(out) >= limit:
                del out[limit:]
                break
        return out

    def close(self) -> None:
        read, self._read = self._read, None
        if read is not None:
            self._store._release(read)


def _expand(key: bytes, value: bytes, begin: bytes, end: bytes, reverse: bool) -> Iterator[tuple[bytes, bytes]]:
    if len(key) <= _SHORT:
        if begin <= key < end:
            yield key, value
        return
    pairs = cbor2.loads(value)
    for k, v in reversed(pairs) if reverse else pairs:
        if begin <= k < end:
            yield k, v


def _iter(cur: lmdb.Cursor, begin: bytes, end: bytes, reverse: bool) -> Iterator[tuple[bytes, bytes]]:
    """Pairs in [begin, end) in key order, expanding long-key buckets.

    Only LMDB keys under ``_PREFIX`` are data: the walk never steps past the
    prefix in either direction (the engine's ``b"m"`` records sort after it).
    """
    if not reverse:
        start = begin[:_BUCKET]  # a bucket below ``begin`` may hold keys >= begin
        if not cur.set_range(_PREFIX + start):
            return
        for raw, value in cur:
            if raw[:1] != _PREFIX:
                return
            key = raw[1:]
            if key >= end:
                return
            yield from _expand(key, value, begin, end, False)
    else:
        start = end[:_BUCKET]
        if cur.set_range(_PREFIX + start) and cur.key()[:1] == _PREFIX:
            key = cur.key()[1:]
            if len(key) == _BUCKET and key == start:  # the bucket of ``end`` may hold keys < end
                yield from _expand(key, cur.value(), begin, end, True)
            if not cur.prev():
                return
        elif not (cur.set_range(_PREFIX_END) and cur.prev()) and not cur.last():
            return
        for raw, value in cur.iterprev():
            if raw[:1] != _PREFIX:
                return
            key = raw[1:]
            if len(key) <= _SHORT:
                if key < begin:
                    return
            elif key < begin[:_BUCKET]:
                return
            yield from _expand(key, value, begin, end, True)


class _WriterThread:
    """One long-lived thread that runs the store's write transactions.

    Why not ``trio.to_thread.run_sync``: a commit is one thread round trip,
    and a dedicated thread parked on a queue answers in about half the time
    of the thread cache (measured ~0.1 ms vs ~0.19 ms here), which is most of
    what separates a commit from a bare fsync. It is owned by the store,
    started with it and joined when the store closes.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, token, deliver = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # delivered to the awaiting task
                result, error = None, exc
            try:
                token.run_sync_soon(deliver, result, error)
            except trio.RunFinishedError:
                pass

    async def call(self, fn, *args):
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        box: list = []

        def deliver(result, error) -> None:
            box.append((result, error))
            trio.lowlevel.reschedule(task)

        self._jobs.put((fn, args, token, deliver))
        # Not abortable: the write is under way and its outcome must be heard
        # (commits are shielded above this anyway).
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        result, error = box[0]
        if error is not None:
            raise error
        return result

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class LmdbStore:
    """LMDB-backed store: snapshots on the event loop, batches in a worker thread."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _acquire_directory(self.path)
        try:
            self.env = lmdb.open(
                str(self.path), map_size=MAP_SIZE, max_dbs=0, max_readers=MAX_READERS,
                sync=True, metasync=True, readahead=False, lock=True, subdir=True,
            )
            raw = self._check_format()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._version = int.from_bytes(raw, "big") if raw else 0  # the ceiling: above every used version
        self._ceiling = self._open_version = self._version
        self._open_txnid = self.env.info()["last_txnid"]
        # LMDB txn id -> the version of the batch it wrote, for snapshots opened at it
        self._txn_versions: dict[int, int] = {}
        self.stats = {"batches": 0, "bytes_written": 0, "fsyncs": 0}
        self._shared: _ReadTxn | None = None
        self._commit_seconds = 0.0  # recent LMDB commit time (moving average), for can_apply_inline
        self._writer = _WriterThread(f"surefoot-lmdb-writer:{self.path.name}")
        self._closed = False

    def _check_format(self) -> bytes | None:
        """Stamp a new environment with ``FORMAT``; refuse any other layout.

        Returns the stored version (None for a new store).
        """
        with self.env.begin(write=True) as txn:
            fmt = txn.get(_FORMAT_KEY)
            if fmt is None:
                if txn.get(b"data") is not None or txn.get(b"meta") is not None:
                    fmt = b"1"  # named-database records of the first layout
                elif txn.cursor().first():
                    fmt = b"unknown"
                else:
                    txn.put(_FORMAT_KEY, FORMAT)
                    fmt = FORMAT
            version = txn.get(_VERSION_KEY)
        if fmt != FORMAT:
            self.env.close()
            raise KVError(
                2000,
                f"data directory {self.path} holds storage format {fmt.decode(errors='replace')}, "
                f"this surefoot reads format {FORMAT.decode()} only; "
                "start from an empty directory (format 1 was written before 2026-11-29)",
            )
        return version

    def committed_version(self) -> int:
        return self._version

    def snapshot(self) -> _LmdbSnapshot:
        read = self._shared
        if read is None or read.version != self._version:
            try:
                read = _ReadTxn(self)
            except lmdb.ReadersFullError:
                raise KVError(1037, f"more than {MAX_READERS} distinct read versions are open") from None
            old, self._shared = self._shared, read
            if old is not None and old.refs == 0:
                old.txn.abort()
        return _LmdbSnapshot(self, read)

    def _version_of_txn(self, txnid: int) -> int:
        version = self._txn_versions.get(txnid)
        if version is not None:
            return version
        # Only the state found at open has no entry: a writer records its
        # txn id before it commits, and readers always open at the newest.
        assert txnid <= self._open_txnid, (txnid, self._open_txnid)
        return self._open_version

    def _release(self, read: _ReadTxn) -> None:
        read.refs -= 1
        if read.refs == 0 and read is not self._shared:
            read.txn.abort()

    def can_apply_inline(self, mutations: int) -> bool:
        """Whether the engine may write the next batch (``mutations`` long) on the loop thread now.

        Why inline at all: handing a batch to the writer thread and back
        costs two cross-thread wake-ups (~0.3 ms measured here, most of what
        separated a commit from LMDB's own durable commit), and buys nothing
        when no other task is runnable and no callback is queued: the loop
        would only sit in ``epoll`` until the writer answers. So a lone
        committer (the embedded, one-request-at-a-time case) writes inline,
        and as soon as anything else could run, batches go to the thread and
        the next batch forms meanwhile. ("Runnable" is trio's run queue: a
        task later in the scheduling batch that is running now is not in it,
        and waits for the one inline write.)

        The price: I/O arriving during an inline write waits for that one
        LMDB commit (the engine yields right after it). So inline is only for
        a fast disk: while recent commits have taken longer than
        ``INLINE_MAX_COMMIT_SECONDS`` (a busy or slow disk, where the hop is
        small beside the sync anyway), batches go to the thread and the loop
        stays responsive.

        Except a big batch, which is always written inline: py-lmdb releases
        and retakes the GIL around every single ``put``, and while the loop
        thread is busy each retake waits for the loop to let go (a convoy:
        20,000 puts took 0.67 s instead of 0.018 s beside a busy loop here,
        and a 100,000-message fork copy made no visible progress for
        minutes). Blocking the loop for one big write is far cheaper.
        """
        if not INLINE_WHEN_IDLE:
            return False
        if mutations > INLINE_ALWAYS_ABOVE_MUTATIONS:
            return True
        return self._commit_seconds <= INLINE_MAX_COMMIT_SECONDS and _loop_is_idle()

    async def apply(self, version: int, mutations: list[Mutation]) -> None:
        await self._writer.call(self.apply_sync, version, mutations)

    def apply_sync(self, version: int, mutations: list[Mutation]) -> int:
        """One LMDB write transaction (one fsync) for the whole batch: all or nothing."""
        assert version > self._version, (version, self._version)
        started = time.perf_counter()
        nbytes = 0
        with self.env.begin(write=True) as txn:
            # Recorded before the commit: a reader on the loop thread may open
            # at this transaction the moment it commits. (An aborted write
            # leaves an entry the next write, which gets the same id, replaces.)
            txnid = txn.id()
            self._txn_versions[txnid] = version
            for m in mutations:
                kind = m[0]
                if kind == "set":
                    _put(txn, m[1], m[2])
                    nbytes += len(m[1]) + len(m[2])
                elif kind == "clear":
                    _clear(txn, m[1], m[2])
                    nbytes += len(m[1]) + len(m[2])
                else:
                    _, op, key, param = m
                    new = apply_atomic(op, _get(txn, key), param)
                    if new is None:
                        _delete(txn, key)
                    else:
                        _put(txn, key, new)
                    nbytes += len(key) + len(param)
            ceiling = self._ceiling
            if version >= ceiling:
                ceiling = version + VERSION_CEILING_STEP
                txn.put(_VERSION_KEY, ceiling.to_bytes(8, "big"))
        self._ceiling = ceiling
        stale = txnid - TXN_VERSIONS_KEPT
        if stale in self._txn_versions:
            del self._txn_versions[stale]
        # The context manager committed: LMDB synced the data pages, then wrote
        # the meta page synchronously (sync=True, metasync=True): two syncs.
        self._version = version
        # One batch at a time (the engine's pipeline), so no two threads update this at once.
        self._commit_seconds += (time.perf_counter() - started - self._commit_seconds) * _COMMIT_EWMA_WEIGHT
        self.stats["batches"] += 1
        self.stats["fsyncs"] += SYNCS_PER_COMMIT
        self.stats["bytes_written"] += nbytes
        return nbytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.stop()
        if self._shared is not None:
            self._shared.txn.abort()
            self._shared = None
        self.env.close()
        try:
            (self.path / "HOLDER").unlink(missing_ok=True)
        finally:
            os.close(self._lock_fd)


def _get(txn: lmdb.Transaction, key: bytes) -> bytes | None:
    if len(key) <= _SHORT:
        return txn.get(_PREFIX + key)
    raw = txn.get(_PREFIX + key[:_BUCKET])
    if raw is None:
        return None
    for k, v in cbor2.loads(raw):
        if k == key:
            return v
    return None


def _put(txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
    if len(key) <= _SHORT:
        txn.put(_PREFIX + key, value)
        return
    bkey = _PREFIX + key[:_BUCKET]
    raw = txn.get(bkey)
    pairs = [p for p in cbor2.loads(raw) if p[0] != key] if raw else []
    pairs.append([key, value])
    pairs.sort(key=lambda p: p[0])
    txn.put(bkey, cbor2.dumps(pairs))


def _delete(txn: lmdb.Transaction, key: bytes) -> None:
    if len(key) <= _SHORT:
        txn.delete(_PREFIX + key)
        return
    bkey = _PREFIX + key[:_BUCKET]
    raw = txn.get(bkey)
    if raw is None:
        return
    pairs = [p for p in cbor2.loads(raw) if p[0] != key]
    if pairs:
        txn.put(bkey, cbor2.dumps(pairs))
    else:
        txn.delete(bkey)


def _clear(txn: lmdb.Transaction, begin: bytes, end: bytes) -> None:
    if begin >= end:
        return
    doomed = [k for k, _ in _iter(txn.cursor(), begin, end, False)]
    for k in doomed:
        _delete(txn, k)


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
