"""Preallocated log segments (kv/wal.py: LogWriter._preallocate, read_segment's zero tail).

A segment's room is reserved with ``fallocate`` a chunk at a time, so a
synced record lands inside the file's size; the unwritten rest reads back as
zeros, which end the segment's records. These check that the records written
either way (inline ``append``, buffered ``write`` + ``synced``) read back in
order across chunk boundaries, that a zero tail is the end and not damage,
that anything but zeros after it still is, and that a store killed with a
preallocated tail reopens with every acknowledged commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

import kv
import kv.wal as wal
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.wal import HEADER, LogWriter, WalCorrupt, encode_record, list_segments, read_segment

ROOT = Path(__file__).resolve().parents[2]


def _fallocate_works(tmp_path: Path) -> bool:
    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return wal._fallocate_or_not(fd, 0, 4096)
    finally:
        os.close(fd)


def _records(n: int, size: int = 300) -> list[tuple[int, list]]:
    return [(i + 1, [0, b"k%05d" % i, b"v" * size]) for i in range(n)]


def test_records_cross_chunk_boundaries_and_read_back_in_order(tmp_path, monkeypatch):
    if not _fallocate_works(tmp_path):
        pytest.skip("no fallocate on this filesystem")
    monkeypatch.setattr(wal, "PREALLOCATE_BYTES", 4096)  # a chunk every ~12 records
    w = LogWriter(tmp_path, segment_bytes=1 << 20)
    recs = _records(40)
    for i, (version, effects) in enumerate(recs):
        record = encode_record(version, effects)
        if i % 3 == 0:  # buffered, synced elsewhere (here: by hand)
            w.write(record)
            os.fdatasync(w.wfd)
            assert not w.synced(len(record))
        else:
            assert not w.append(record)
        assert w.allocated >= w.written  # every record inside reserved room
    (_, path), = list_segments(tmp_path)
    size = path.stat().st_size
    assert size == w.allocated > w.written  # the file's size is the reservation, not the records
    got, end, torn = read_segment(path)
    assert (got, end, torn) == (recs, w.written, False)
    assert path.read_bytes()[end:] == bytes(size - end)  # the rest: zeros
    w.close()


def test_without_fallocate_a_segment_grows_as_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(wal, "_fallocate", None)
    w = LogWriter(tmp_path, segment_bytes=1 << 20)
    recs = _records(5)
    for version, effects in recs:
        w.append(encode_record(version, effects))
    (_, path), = list_segments(tmp_path)
    assert path.stat().st_size == w.written
    assert read_segment(path) == (recs, w.written, False)
    w.close()


def test_a_zero_tail_ends_the_records_but_anything_after_it_is_damage(tmp_path):
    recs = _records(3)
    body = b"".join(encode_record(v, e) for v, e in recs)
    path = tmp_path / "0000000000000001.wal"
    path.write_bytes(body + bytes(5000))
    assert read_segment(path) == (recs, len(body), False)
    path.write_bytes(body + bytes(3))  # shorter than a header, all zeros: still the end
    assert read_segment(path) == (recs, len(body), False)
    path.write_bytes(body + bytes(HEADER.size) + b"junk" + bytes(100))
    assert read_segment(path) == (recs, len(body), True)
    # a zero length with a non-zero checksum is not a preallocated tail either
    path.write_bytes(body + HEADER.pack(0, 7) + bytes(100))
    assert read_segment(path) == (recs, len(body), True)


def test_a_sealed_segment_with_junk_after_its_zero_tail_is_refused(tmp_path):
    recs = _records(3)
    body = b"".join(encode_record(v, e) for v, e in recs)
    wal_dir = tmp_path / "wal"
    wal_dir.mkdir()
    (wal_dir / "0000000000000001.wal").write_bytes(body + bytes(64) + b"x")
    (wal_dir / "0000000000000002.wal").write_bytes(b"")  # so the first is sealed
    env = lmdb.open(str(tmp_path / "tree"), map_size=1 << 24, max_dbs=8)
    try:
        with pytest.raises(WalCorrupt, match="damaged at byte %d" % len(body)):
            wal.checkpoint_pass(env, wal_dir, include_newest=True, repair_tail=True)
        assert len(list_segments(wal_dir)) == 2  # nothing deleted
    finally:
        env.close()


async def test_a_store_killed_with_a_preallocated_tail_reopens_with_every_commit(tmp_path):
    if not _fallocate_works(tmp_path):
        pytest.skip("no fallocate on this filesystem")
    path = tmp_path / "data"
    code = (
        "import os, sys, trio, kv\n"
        "async def main():\n"
        "    db = await kv.open('lmdb:' + sys.argv[1])\n"
        "    for i in range(30):\n"
        "        tr = db.create_transaction(); tr.set(b'c/%04d' % i, b'v%d' % i); await tr.commit()\n"
        "    os._exit(0)\n"
        "trio.run(main)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    _, newest = list_segments(path / "wal")[-1]
    records, end, torn = read_segment(newest)
    assert not torn and newest.stat().st_size > end  # killed with reserved room after its records
    assert len(records) >= 30
    db = kv.Database(Engine(LmdbStore(path), clock=time.time), url=f"lmdb:{path}")
    try:
        tr = db.create_transaction()
        got = {r.key: r.value for r in await tr.get_range(b"c/", b"c0")}
        assert got == {b"c/%04d" % i: b"v%d" % i for i in range(30)}
        tr = db.create_transaction()
        tr.set(b"after", b"ok")
        await tr.commit()
    finally:
        await db.close()
