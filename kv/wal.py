"""The embedded engine's write-ahead log, and the checkpoint that empties it into LMDB.

Why a log in front of LMDB: a durable LMDB commit writes every B-tree page
the batch dirtied, wherever it lies, then syncs twice (data pages, then the
meta page). For the small scattered writes an agent runtime makes (a run
record, a queue entry, a journal event, a usage counter: a dozen leaves per
turn) that is several milliseconds per batch, and py-lmdb re-takes the GIL
around every single ``put``, so a batch written from a thread waits on a
busy event loop once per key (measured: 20,000 puts took 13 s beside a
spinning loop instead of 0.03 s). The log turns a batch into one sequential
append, synced (``O_DSYNC``, or ``fdatasync``); the B-tree is brought up to date later, in
bulk, by a *checkpoint* in another process (``kv.checkpoint``), where the
page writes and syncs are off every acknowledgement's path and off this
process's GIL.

Layout (``PATH/wal/``): segments ``%016x.wal``, numbered upwards. The store
appends only to the newest; a segment is *sealed* when the store moves on
to the next one, and only sealed segments are checkpointed while the store
runs. A segment is a sequence of records::

    u32 LE payload length | u32 LE crc32(payload) | payload

and a payload is the pickled (protocol 5) ``(version, effects)``, or CBOR
``[version, effects]`` in records written before 2026-12-01 (both read; see
``RECORD_PICKLE_PROTOCOL``): one group-commit batch, its
effects in order, flat (``0, key, value`` set, ``1, key`` delete, ``2,
begin, end`` clear range; atomic operations already applied, so replay
needs no reads beyond the tree it replays onto). Flat because cbor2 (6.x)
spends about a microsecond on every array it encodes that is not a dict:
one array per effect made the record's encoding 3x slower. Records written
before 2026-11-29 nest one array per effect; replay reads both
(``lmdb_layout.apply_effects``).

Invariants (asserted where they are relied on):

* A batch is acknowledged only after its record is ``fdatasync``-ed in a
  segment whose directory entry was synced when the segment was created.
* The tree's ``mapplied`` version V means: every batch <= V is in the tree,
  every later acknowledged batch is in a segment still present. A
  checkpoint applies a segment's records > V in one LMDB transaction that
  also raises V, and deletes the segment only after that commit is durable;
  a crash in between replays records the tree already has, which the
  version check skips.
* Only the newest segment can end in a torn record (a process killed mid
  append): the store seals a segment only after a successful sync, and
  creates the next segment only then. Recovery truncates that tail; a bad
  record anywhere else is corruption and is refused, naming the file.

A segment's room is reserved ahead, ``PREALLOCATE_BYTES`` at a time, with
``fallocate`` (unwritten extents: no data is written, the room reads back as
zeros), and records are written into it at the end of the last one
(``pwrite``): a synced write inside the file's size does not also have to make
a new size durable (2026-12-01, ext4 on this host's virtio disk: a 1.2 KiB
``O_DSYNC`` write p50 0.064 -> 0.043 ms; a one-submitter ledger submit p50
0.165 -> 0.147 ms). So a segment ends in zeros, which end its records (no
record is empty); anything but zeros after them is damage as before. Where
the filesystem has no ``fallocate`` a segment grows as it is written.

Tried on 2026-11-30 and not kept: zero-filled preallocated segments (the next
one zero-filled, synced and its directory entry synced by a thread ahead of
time; records overwrite the zeros, a zero header ends the log; the code is
on the branch ``kv-prealloc-experiment``). A bare write + sync measured p50
0.057-0.077 ms over zeros vs 0.064-0.103 ms appending while the disk was
fast, but the disk spent most of the session throttled (syncs quantized at
4 ms), and there, in fresh-store A/B blocks, sequential commit p50 was
slower with preallocation (median ratio per pair 3.6x, 4.2x, 5.4x over three
runs, while the next spare's 8 MiB of zeros were being written; 1.13x with
no spare being made), and 64-writer commits/s moved by 2.26x, 1.31x,
1.14x, 0.78x (medians of four runs; 1.02x and 0.93x with both stores open
and alternating). Not a measurable win: revisit on a disk that holds still.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import logging
import os
import pickle
import struct
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import cbor2
import lmdb

from . import lmdb_layout as layout
from .errors import KVError

log = logging.getLogger(__name__)

__all__ = ["SEGMENT_BYTES", "LogWriter", "RecordEncoder", "encode_record", "read_segment", "list_segments", "checkpoint_pass",
           "checkpoint_lock", "WalCorrupt"]

SEGMENT_BYTES = 8 << 20  # a segment is sealed (and checkpointed) once it holds this much (bounds the overlay)
HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
MAX_RECORD_BYTES = 1 << 30  # a length above this in a header is garbage, not a record
SUFFIX = ".wal"
#: A record's payload is pickled (protocol 5, whose reading every later Python keeps): the
#: C pickler, reused without its memo (``RecordEncoder``), encodes a batch's flat effects
#: in less than half cbor2 6.x's instructions (cbor2 spends ~0.25 us on every item). Read
#: back by an unpickler that refuses every class (``_PlainUnpickler``): only ints, bytes,
#: None, lists and tuples make a record. Records written before 2026-12-01 are CBOR and
#: still read.
RECORD_PICKLE_PROTOCOL = 5
PREALLOCATE_BYTES = 1 << 20  # a segment's room is reserved this much at a time (LogWriter._preallocate)
LOCK_NAME = "CHECKPOINT.LOCK"  # held by whoever runs a checkpoint pass (store or checkpointer process)
#: Segments are opened O_DSYNC where the platform has it: each ``write`` returns only once its
#: data (and the size needed to read it back) is on disk, as write + ``fdatasync`` would (same
#: cost, measured here: p50 0.21 ms both). Used for a batch written inline (``append``); a
#: pipelined batch is written through a second, plain descriptor and synced by the helper
#: process (``write`` + ``synced``, see ``kv.walsync``).
SYNC_OPEN_FLAG: int = getattr(os, "O_DSYNC", 0)


def _load_fallocate():
    """Linux's ``fallocate(2)`` (mode 0), or None. Not ``os.posix_fallocate``: where the
    filesystem lacks it, glibc emulates that by writing zeros (the cost this avoids)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


class WalCorrupt(KVError):
    """A sealed log segment does not read back whole: refuse to open rather than lose a batch."""

    def __init__(self, message: str) -> None:
        super().__init__(4100, message)


def segment_path(wal_dir: Path, number: int) -> Path:
    return wal_dir / f"{number:016x}{SUFFIX}"


def list_segments(wal_dir: Path) -> list[tuple[int, Path]]:
    """The segments present, oldest first."""
    out = []
    for entry in os.scandir(wal_dir):
        name = entry.name
        if name.endswith(SUFFIX) and len(name) == 16 + len(SUFFIX):
            try:
                out.append((int(name[:16], 16), Path(entry.path)))
            except ValueError:
                continue
    out.sort()
    return out


class RecordEncoder:
    """Encodes log records with one pickler kept for reuse (one per store: not shared
    between threads). The pickler runs without its memo (``fast``): a record holds only
    ints, bytes and None in flat lists, nothing it could meet twice by reference or
    recursively, and the memo's entry per bytes object made a 64-submitter batch's record
    (~670 items) cost more than cbor2's (cachegrind: 350k instructions against 266k; without
    the memo 197k; a one-submit record 9.6k against cbor2's 22.5k)."""

    __slots__ = ("_buf", "_pickler")

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._pickler = pickle.Pickler(self._buf, RECORD_PICKLE_PROTOCOL)
        try:
            self._pickler.fast = True
        except AttributeError:  # pragma: no cover (a pickler without it: the memo, same records)
            pass

    def encode(self, version: int, effects: list) -> bytes:
        """One log record: the header and the pickled ``(version, effects)`` (see ``_decode_payload``)."""
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        self._pickler.dump((version, effects))
        payload = buf.getvalue()
        return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def encode_record(version: int, effects: list) -> bytes:
    """One log record (as a store's ``RecordEncoder`` writes it)."""
    return RecordEncoder().encode(version, effects)


def encode_record_cbor(version: int, effects: list) -> bytes:
    """A record as written before 2026-12-01 (CBOR ``[version, effects]``): still read, no
    longer written (tests write it to check that)."""
    payload = cbor2.dumps([version, effects])
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class _PlainUnpickler(pickle.Unpickler):
    """Reads a record's payload: tuples, lists, ints, bytes and None, never a class or a
    function (a payload naming one is damage, and is refused, not imported)."""

    def find_class(self, module: str, name: str):  # type: ignore[override]
        raise pickle.UnpicklingError(f"a log record names {module}.{name}")


def _decode_payload(payload: bytes) -> tuple[int, list]:
    """``(version, effects)`` of a record's payload, pickled (0x80: pickle's PROTO opcode) or,
    written before 2026-12-01, CBOR (0x82: an array of two). Raises on anything else."""
    if payload[:1] == b"\x80":
        version, effects = _PlainUnpickler(io.BytesIO(payload)).load()
    else:
        version, effects = cbor2.loads(payload)
    if type(version) is not int or type(effects) is not list:
        raise ValueError("not a log record")
    return version, effects


def read_segment(path: Path) -> tuple[list[tuple[int, list]], int, bool]:
    """``(records, valid_bytes, torn)``: the whole records from the start, and
    whether anything after them failed to read back (a torn or garbage tail)."""
    data = path.read_bytes()
    records: list[tuple[int, list]] = []
    pos, size = 0, len(data)
    while pos < size:
        # No record is empty (a payload is CBOR [version, effects]), so a zero length
        # (or a rest too short for a header) starts the unwritten rest of a preallocated
        # segment, which reads as zeros: the end of its records. Anything but zeros
        # from there on is a damaged tail.
        if size - pos < HEADER.size:
            return records, pos, data.count(0, pos) != size - pos
        length, crc = HEADER.unpack_from(data, pos)
        if length == 0:
            return records, pos, data.count(0, pos) != size - pos
        start = pos + HEADER.size
        if length > MAX_RECORD_BYTES or start + length > size:
            return records, pos, True
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            return records, pos, True
        try:
            version, effects = _decode_payload(payload)
        except Exception:  # (whatever a damaged payload makes either decoder raise)
            return records, pos, True
        records.append((version, effects))
        pos = start + length
    return records, pos, False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LogWriter:
    """Appends records to the newest segment; one caller at a time (the engine's pipeline).

    Two ways to append, both on the caller's thread:

    * ``append(record)``: write it synced (the ``O_DSYNC`` descriptor, or
      write + ``fdatasync``) — a lone commit written inline;
    * ``write(record)`` (buffered, the plain descriptor), then have it synced
      elsewhere (the store's sync helper process, ``kv.walsync``), then
      ``synced(len(record))``.

    Either returns / ``synced`` returns True when the segment was sealed (the
    next record goes to a new one): the caller then asks for a checkpoint.
    """

    def __init__(self, wal_dir: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        assert segment_bytes > 0
        self.wal_dir = wal_dir
        self.segment_bytes = segment_bytes
        existing = list_segments(wal_dir)
        self.number = existing[-1][0] + 1 if existing else 1
        self.fd, self.wfd = self._create(self.number)
        self.size = 0  # bytes of the current segment known durable
        self.written = 0  # bytes written to it (durable or not: a record may be ahead of its sync)
        self.fsyncs = 0  # every fdatasync / fsync this writer made or had made
        self.allocated = 0  # bytes of the current segment preallocated (_preallocate)

    def _create(self, number: int) -> tuple[int, int]:
        """The new segment's synced (``O_DSYNC``) and plain descriptors (records are written at offsets)."""
        path = segment_path(self.wal_dir, number)
        # Not O_APPEND: records are written at ``written`` (pwrite), inside the preallocated size.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SYNC_OPEN_FLAG, 0o644)
        try:
            wfd = os.open(path, os.O_WRONLY) if SYNC_OPEN_FLAG else fd
            # The new name must be durable before any record in it is acknowledged.
            _fsync_dir(self.wal_dir)
        except BaseException:
            os.close(fd)
            raise
        return fd, wfd

    def _preallocate(self, nbytes: int) -> None:
        """Reserve room for a record of ``nbytes`` at ``written``, a chunk at a time
        (``PREALLOCATE_BYTES``, at most the segment's size; see ``_fallocate_or_not``).

        In chunks, not the whole segment: the unwritten rest of the newest
        segment is read (as zeros) at every open and close, and a store opened
        with a large ``segment_bytes`` should not reserve it all up front.
        """
        step = min(PREALLOCATE_BYTES, self.segment_bytes)
        end = max(self.allocated + step, self.written + nbytes)
        if _fallocate_or_not(self.fd, self.allocated, end - self.allocated):
            self.allocated = end
        else:
            self.allocated = 1 << 62  # not on this filesystem: the segment grows as it is written

    def append(self, record: bytes) -> bool:
        """Write ``record`` and make it durable; seal the segment once it is full."""
        assert self.written == self.size, "an inline append with a record still unsynced"
        if self.written + len(record) > self.allocated:
            self._preallocate(len(record))
        _write_all(self.fd, record, self.written)
        self.written += len(record)
        if not SYNC_OPEN_FLAG:
            os.fdatasync(self.fd)
        return self.synced(len(record))

    def write(self, record: bytes) -> None:
        """Write ``record`` without syncing it (see ``synced``)."""
        if self.written + len(record) > self.allocated:
            self._preallocate(len(record))
        _write_all(self.wfd, record, self.written)
        self.written += len(record)

    def has_room(self) -> bool:
        """Whether a record written now still goes to this segment before it is sealed.

        A segment is sealed only once everything written to it is durable
        (``synced``): a sealed segment is checkpointed into the tree, and a
        record whose sync is still out must not get there first. So once a
        segment holds ``segment_bytes``, nothing more is written ahead of the
        syncs; the next record waits for the seal and starts the next segment.
        """
        return self.written < self.segment_bytes

    def synced(self, nbytes: int) -> bool:
        """A record of ``nbytes`` is durable; seal the segment once it is full
        and nothing written to it is still waiting for its sync."""
        self.fsyncs += 1  # a synced write (O_DSYNC) or an fdatasync
        self.size += nbytes
        assert self.size <= self.written, (self.size, self.written)
        if self.size < self.segment_bytes or self.size < self.written:
            return False
        self.seal()
        return True

    def seal(self) -> None:
        """Move on to a new segment (the current one is whole and synced)."""
        fd, wfd = self._create(self.number + 1)
        self.fsyncs += 1
        self._close_fds()
        self.fd, self.wfd, self.number, self.size, self.written, self.allocated = fd, wfd, self.number + 1, 0, 0, 0

    def _close_fds(self) -> None:
        if self.wfd != self.fd:
            os.close(self.wfd)
        os.close(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            self._close_fds()
            self.fd = self.wfd = -1


def _write_all(fd: int, record: bytes, offset: int) -> None:
    """Write ``record`` at ``offset`` (the segment's end of records; the fd is not O_APPEND)."""
    written = os.pwrite(fd, record, offset)
    if written < len(record):  # rare on a regular file (a full disk, a signal): write the rest
        view = memoryview(record)[written:]
        offset += written
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def _fallocate_or_not(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` at ``offset`` of a segment (``fallocate``: blocks reserved as
    unwritten extents that read back as zeros; nothing is written), so a synced
    record lands inside the file's size instead of growing it. False where the
    filesystem cannot.

    Why: an ``O_DSYNC`` append must also make the file's new size durable; a
    write inside the size does not, and measured here (ext4 on a virtio disk,
    2026-12-01) a 1,255-byte synced write went from p50 0.064 ms appending to
    0.043 ms into fallocated space, and a one-submitter ledger submit from
    0.165 to 0.147 ms. Not a zero-fill (tried on 2026-11-30, see the module
    docstring: writing 8 MiB of zeros ahead competed with the commits' own
    syncs). Where the filesystem cannot (no ``fallocate``, ``EOPNOTSUPP``) the
    segment simply grows as it is written, as before. Durability is the
    write's: ``O_DSYNC`` / ``fdatasync`` make the extent's conversion (what
    reading the record back needs) durable before they return.
    """
    if _fallocate is None:
        return False
    if _fallocate(fd, 0, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))  # (ENOSPC: the disk is full; the commit fails as a write would)


@contextmanager
def checkpoint_lock(path: Path) -> Iterator[None]:
    """One checkpoint pass at a time per data directory, across processes."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def checkpoint_pass(env: lmdb.Environment, wal_dir: Path, *, include_newest: bool,
                    repair_tail: bool = False) -> tuple[int, int]:
    """Apply segments to the tree, oldest first, deleting each once the tree has it.

    ``include_newest``: the newest segment too (at open and close, when
    nobody appends to it); otherwise only sealed ones. ``repair_tail``: a
    torn tail of the newest segment is cut off (recovery after a crash);
    anywhere else a bad record raises :class:`WalCorrupt`. Call under
    :func:`checkpoint_lock`. Returns ``(segments applied, mapplied after)``.
    """
    segments = list_segments(wal_dir)
    if not include_newest:
        segments = segments[:-1]
    with env.begin() as txn:
        applied = layout.read_applied(txn)
    done = 0
    for i, (_, path) in enumerate(segments):
        records, valid, torn = read_segment(path)
        if torn:
            if not (repair_tail and i == len(segments) - 1):
                raise WalCorrupt(f"write-ahead log segment {path} is damaged at byte {valid} "
                                 "(only the newest segment may end in a torn record); it and every segment "
                                 "after it are left as they are")
            log.warning("cutting a torn record off the end of %s at byte %d (a crash mid-append)", path, valid)
        pending = [(v, e) for v, e in records if v > applied]
        if pending:
            with env.begin(write=True) as txn:
                for version, effects in pending:
                    assert version > applied, (version, applied)
                    layout.apply_effects(txn, effects)
                    applied = version
                txn.put(layout.APPLIED_KEY, applied.to_bytes(8, "big"))
        # The commit above was durable (sync=True): the segment is no longer needed.
        os.unlink(path)
        done += 1
    return done, applied
