"""A log segment sealed by the keys its batches touched, not only by its bytes (session 19:
kv/wal.py LogWriter.seal_soon, kv/lmdb_engine.py SEGMENT_KEYS).

Why: the store's overlay holds about two segments' keys, and CPython rebuilds its dicts whole
when they grow, inside one batch's step: with 8 MiB segments of small writes that step took
6-26 ms. These check that a segment counted full early is sealed only once everything written
to it is durable, that nothing is written ahead past it, that every record reads back in
order, and that a store sealing by keys keeps every commit (reopened) and its overlay small.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

import kv
import kv.lmdb_engine as lmdb_engine
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.wal import LogWriter, encode_record, list_segments, read_segment


def _record(i: int) -> bytes:
    return encode_record(i, [0, b"k%05d" % i, b"v" * 50])


def test_seal_soon_seals_with_the_next_inline_append(tmp_path):
    w = LogWriter(tmp_path, segment_bytes=1 << 20)
    w.seal_soon()  # an empty segment: left be
    assert w.has_room() and w.full_at == 1 << 20
    assert not w.append(_record(1)) and not w.append(_record(2))
    w.seal_soon()
    assert not w.has_room()  # nothing more written ahead
    assert w.append(_record(3))  # the next durable record seals it
    assert w.has_room() and w.full_at == 1 << 20 and w.written == 0
    assert not w.append(_record(4))
    (first, p1), (second, p2) = list_segments(tmp_path)
    assert second == first + 1
    assert [v for v, _ in read_segment(p1)[0]] == [1, 2, 3]
    assert [v for v, _ in read_segment(p2)[0]] == [4]
    w.close()


def test_seal_soon_waits_for_every_record_written_ahead(tmp_path):
    w = LogWriter(tmp_path, segment_bytes=1 << 20)
    a, b = _record(1), _record(2)
    w.write(a)
    w.write(b)  # two records out, neither synced yet
    w.seal_soon()
    assert not w.has_room()
    os.fdatasync(w.wfd)
    assert not w.synced(len(a))  # b is not durable yet: not sealed
    assert w.synced(len(b))  # now everything written is: sealed
    assert len(list_segments(tmp_path)) == 2
    w.close()


async def _set(db: kv.Database, key: bytes, value: bytes) -> None:
    async def fn(tr):  # idempotent: a plain set
        tr.set(key, value)

    await db.transact(fn)


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path, checkpointer=False), clock=time.time), url=f"lmdb:{path}")


async def test_a_store_seals_by_keys_and_keeps_every_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_engine, "SEGMENT_KEYS", 40)
    async with _open(tmp_path / "data") as db:
        store = db.engine.store

        async def writer(w: int) -> None:
            for i in range(30):
                async def fn(tr, i=i):  # idempotent: plain sets
                    for j in range(3):
                        tr.set(b"w%02d/%03d/%d" % (w, i, j), b"%d" % (i * 3 + j))
                await db.transact(fn)

        async with trio.open_nursery() as nursery:  # batches written ahead (the sync helper) too
            for w in range(8):
                nursery.start_soon(writer, w)
        await writer(99)  # and lone commits, one at a time (written inline)
        sealed = store.stats["segments_sealed"]
        assert sealed >= (9 * 30 * 3) // 40 // 2  # sealed by keys long before 8 MiB
        store.checkpoint()
        await _set(db, b"after", b"1")  # a publish trims what the tree holds
        assert store.overlay_size() < 9 * 30 * 3
    async with _open(tmp_path / "data") as db:  # everything durable, in order
        tr = db.create_transaction()
        for w in list(range(8)) + [99]:
            for i in range(30):
                for j in range(3):
                    assert await tr.get(b"w%02d/%03d/%d" % (w, i, j)) == b"%d" % (i * 3 + j)
        assert await tr.get(b"after") == b"1"
        tr.cancel()


async def test_a_big_segment_limit_is_still_sealed_by_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_engine, "SEGMENT_KEYS", 1 << 30)  # never by keys
    path = tmp_path / "data"
    db = kv.Database(Engine(LmdbStore(path, checkpointer=False, segment_bytes=4096), clock=time.time),
                     url=f"lmdb:{path}")
    async with db:
        for i in range(60):
            await _set(db, b"k%03d" % i, b"v" * 200)
        assert db.engine.store.stats["segments_sealed"] >= 2
