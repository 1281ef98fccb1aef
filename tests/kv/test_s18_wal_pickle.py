"""Log records pickled (kv/wal.py: encode_record, _decode_payload) and the CBOR records
written before 2026-12-01 still read: in one segment, mixed, across a crash; a payload
naming a class is damage (never imported), torn in the newest segment, refused in a sealed one."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

import kv
from kv import lmdb_layout as layout
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.wal import (HEADER, WalCorrupt, encode_record, encode_record_cbor, list_segments, read_segment,
                    segment_path)

ROOT = Path(__file__).resolve().parents[2]


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path), clock=time.time), url=f"lmdb:{path}")


async def _all(db, begin=b"", end=b"\xff") -> dict[bytes, bytes]:
    tr = db.create_transaction()
    return {r.key: r.value for r in await tr.get_range(begin, end)}


def _crash_after_commits(path: Path, n: int) -> None:
    code = (
        "import os, sys, trio, kv\n"
        "async def main():\n"
        "    db = await kv.open('lmdb:' + sys.argv[1])\n"
        "    for i in range(int(sys.argv[2])):\n"
        "        tr = db.create_transaction(); tr.set(b'c/%04d' % i, b'v%d' % i); await tr.commit()\n"
        "    os._exit(0)\n"
        "trio.run(main)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code, str(path), str(n)], check=True, env=env, timeout=120)


EFFECTS = [layout.SET, b"k\x00\xff", b"v" * 300, layout.DELETE, b"gone", layout.CLEAR, b"a", b"b",
           layout.SET, b"", b""]


def test_a_record_is_pickle_and_reads_back_as_written(tmp_path):
    rec = encode_record(1 << 60, EFFECTS)
    length, crc = HEADER.unpack_from(rec)
    payload = rec[HEADER.size:]
    assert payload[:2] == b"\x80\x05" and length == len(payload) and crc == zlib.crc32(payload)
    path = tmp_path / "s.wal"
    path.write_bytes(rec + encode_record_cbor(5 + (1 << 60), EFFECTS) + bytes(64))
    records, end, torn = read_segment(path)
    assert records == [(1 << 60, EFFECTS), (5 + (1 << 60), EFFECTS)]
    assert end == path.stat().st_size - 64 and not torn


async def test_a_crashed_log_of_cbor_records_then_pickled_ones_replays_in_order(tmp_path):
    path = tmp_path / "data"
    _crash_after_commits(path, 6)  # pickled records, from this code
    _, newest = list_segments(path / "wal")[-1]
    _, end, torn = read_segment(newest)
    assert not torn
    base = 1 << 52  # above the child's clock-based versions
    with open(newest, "r+b") as f:  # CBOR records, as a store before 2026-12-01 wrote them
        f.seek(end)
        f.write(encode_record_cbor(base + 1, [layout.SET, b"old/a", b"1", layout.DELETE, b"c/0001"]))
        f.write(encode_record(base + 2, [layout.SET, b"old/b", b"2", layout.CLEAR, b"c/0003", b"c/0005"]))
        f.write(encode_record_cbor(base + 3, [layout.SET, b"old/a", b"3"]))
        f.flush()
        os.fsync(f.fileno())
    async with _open(path) as db:
        assert await _all(db, b"c/", b"c0") == {b"c/%04d" % i: b"v%d" % i for i in (0, 2, 5)}
        assert await _all(db, b"old/", b"old0") == {b"old/a": b"3", b"old/b": b"2"}
        tr = db.create_transaction()
        tr.set(b"after", b"ok")
        await tr.commit()
        assert tr.get_committed_version() > base + 3
    async with _open(path) as db:
        assert (await _all(db))[b"after"] == b"ok"


CALLED: list[int] = []


def _mark() -> int:
    CALLED.append(1)
    return 1


class _Boom:
    def __reduce__(self):
        return (_mark, ())  # a function: a record naming it must never run it


def _record_naming_a_function(version: int) -> bytes:
    payload = pickle.dumps((version, [layout.SET, b"x", _Boom()]), 5)
    assert b"_mark" in payload
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def test_a_payload_naming_a_function_is_damage_not_imported(tmp_path):
    path = tmp_path / "s.wal"
    good = encode_record(7, [layout.SET, b"a", b"1"])
    path.write_bytes(good + _record_naming_a_function(8))
    records, end, torn = read_segment(path)
    assert records == [(7, [layout.SET, b"a", b"1"])] and end == len(good) and torn
    assert not CALLED


async def test_such_a_record_is_cut_off_the_newest_segment_and_refused_in_a_sealed_one(tmp_path):
    path = tmp_path / "data"
    _crash_after_commits(path, 3)
    number, newest = list_segments(path / "wal")[-1]
    _, end, _ = read_segment(newest)
    with open(newest, "r+b") as f:
        f.seek(end)
        f.write(_record_naming_a_function(1 << 52))
    async with _open(path) as db:  # newest segment: a damaged tail, cut off
        assert await _all(db, b"c/", b"c0") == {b"c/%04d" % i: b"v%d" % i for i in range(3)}
    # the same record in a segment followed by another (a sealed one): refused, left as it is
    wal_dir = path / "wal"
    sealed = segment_path(wal_dir, number + 10)
    sealed.write_bytes(encode_record(1 << 53, [layout.SET, b"s", b"1"]) + _record_naming_a_function((1 << 53) + 1))
    segment_path(wal_dir, number + 11).write_bytes(encode_record((1 << 53) + 2, [layout.SET, b"t", b"1"]))
    before = sealed.read_bytes()
    with pytest.raises(WalCorrupt):
        _open(path)
    assert sealed.read_bytes() == before


def test_a_reused_encoder_writes_each_record_whole_and_alone(tmp_path):
    from kv.wal import RecordEncoder

    enc = RecordEncoder()
    big = [layout.SET, b"k" * 100, b"v" * 5000] * 50
    small = [layout.DELETE, b"x"]
    records = [enc.encode(1, big), enc.encode(2, small), enc.encode(3, big), enc.encode(4, small)]
    # a record after a bigger one carries nothing of it, and each is what a fresh encoder writes
    assert len(records[1]) == len(records[3]) < 40
    assert records[1] == encode_record(2, small) and records[2] == encode_record(3, big)
    path = tmp_path / "s.wal"
    path.write_bytes(b"".join(records))
    got, end, torn = read_segment(path)
    assert got == [(1, big), (2, small), (3, big), (4, small)] and end == path.stat().st_size and not torn
