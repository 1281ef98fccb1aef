"""The LMDB store's shared view carried across a publish, and the snapshot bookkeeping kept
bounded (session 19, kv/lmdb_engine.py: LmdbStore._publish, _maintain).

When a batch is published and nobody holds the current view (a lone committer closed it at
its commit), the view becomes the view at the new version instead of being released and made
again by the next snapshot(). A view someone still holds keeps its version. The versions no
snapshot reads any more are forgotten as they close (before, only a tombstone purge did it, so
a store that never deleted anything kept an entry per batch for good)."""

from __future__ import annotations

import time
from pathlib import Path

import trio

import kv
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path, checkpointer=False), clock=time.time), url=f"lmdb:{path}")


async def _read_then_write(db, read: bytes, key: bytes, value: bytes) -> bytes | None:
    seen = []

    async def fn(tr):  # idempotent: a read and a plain set
        seen.append(await tr.get(read))
        tr.set(key, value)

    await db.transact(fn)
    return seen[-1]


async def test_lone_committers_share_one_carried_view_and_keep_no_history(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        for i in range(200):
            # each reads the previous one's write: the carried view is at the new version
            assert await _read_then_write(db, b"k%d" % (i - 1), b"k%d" % i, b"v%d" % i) == (
                b"v%d" % (i - 1) if i else None)
        view = store._shared
        assert view is not None and view.holders == 0 and view.version == store._version
        assert list(store._snap_order) == [store._version] and store._snap_counts == {store._version: 1}
        assert store._oldest_snapshot_version() == store._version
        assert store._base.refs == 1  # the carried view's one hold on the base


async def test_a_held_view_keeps_its_version_when_the_store_moves_on(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        await _read_then_write(db, b"x", b"a", b"1")
        held = db.create_transaction()
        assert await held.get(b"a") == b"1"
        view, version = held._snap, held._snap.version
        await _read_then_write(db, b"x", b"a", b"2")  # held: not carried
        assert view.version == version and store._shared is not view
        assert await held.get(b"a") == b"1"
        assert store._oldest_snapshot_version() == version
        fresh = db.create_transaction()
        assert await fresh.get(b"a") == b"2"
        fresh.cancel()
        held.cancel()
        await _read_then_write(db, b"x", b"a", b"3")
        assert store._oldest_snapshot_version() == store._version
        assert view._base is None  # the held view was released once its holder closed


async def test_concurrent_readers_leave_no_bookkeeping_behind(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store

        async def worker(w: int) -> None:
            for i in range(40):
                await _read_then_write(db, b"w%d/%d" % (w, i - 1), b"w%d/%d" % (w, i), b"v")

        async with trio.open_nursery() as nursery:
            for w in range(16):
                nursery.start_soon(worker, w)
        assert db.engine.stats["batches"] > 40
        await _read_then_write(db, b"x", b"y", b"z")  # a publish accounts the last closed views
        assert len(store._snap_order) <= 1 and len(store._snap_counts) <= 1
        assert store._oldest_snapshot_version() == store._version
        for w in range(16):
            for i in range(40):
                assert await _read_then_write(db, b"w%d/%d" % (w, i), b"q", b"r") == b"v"


async def test_a_checkpoint_releases_the_carried_view_and_reads_stay_right(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        for i in range(5):
            await _read_then_write(db, b"x", b"k%d" % i, b"v%d" % i)
        view = store._shared
        old_base = store._base
        store.checkpoint()  # the tree now holds everything: a new base
        assert store._base is not old_base and view._base is None
        for i in range(5):
            assert await _read_then_write(db, b"k%d" % i, b"n%d" % i, b"w") == b"v%d" % i
        assert store._shared is not view and store._shared.version == store._version
    async with _open(tmp_path / "data") as db:  # reopened: everything durable
        tr = db.create_transaction()
        assert [await tr.get(b"k%d" % i) for i in range(5)] == [b"v%d" % i for i in range(5)]
        assert await tr.get(b"n4") == b"w"
        tr.cancel()
