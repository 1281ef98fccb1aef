"""The LMDB store hands every transaction that takes a snapshot at the same version and base
one shared view (``LmdbStore.snapshot``): each holder closes its own hold, a dropped
holder's hold goes with the view, and a view is never handed out once the store moved on."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import kv
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path, checkpointer=False), clock=time.time), url=f"lmdb:{path}")


async def _set(db, items: dict[bytes, bytes]) -> None:
    async def fn(tr):  # idempotent: plain sets
        for k, v in items.items():
            tr.set(k, v)

    await db.transact(fn)


async def test_readers_at_one_version_share_a_view_and_each_keeps_its_version(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        await _set(db, {b"a": b"1"})
        t1, t2 = db.create_transaction(), db.create_transaction()
        assert await t1.get(b"a") == b"1" and await t2.get(b"a") == b"1"
        assert t1._snap is t2._snap and t1._snap.holders == 2
        await _set(db, {b"a": b"2"})  # the store moves on: the old view is not handed out again
        t3 = db.create_transaction()
        assert await t3.get(b"a") == b"2"
        assert t3._snap is not t1._snap
        t1.cancel()  # one holder gives back its hold: the other still reads the old version
        assert await t2.get(b"a") == b"1"
        assert store._oldest_snapshot_version() < store._version  # t2's version is kept readable
        t2.cancel()
        t3.cancel()
        await _set(db, {b"b": b"x"})  # a publish accounts the released views
        assert store._oldest_snapshot_version() == store._version
        assert store._shared is None or store._shared.version == store._version


async def test_a_dropped_holder_is_released_with_the_view(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        await _set(db, {b"a": b"1"})
        kept, dropped = db.create_transaction(), db.create_transaction()
        assert await kept.get(b"a") == b"1" and await dropped.get(b"a") == b"1"
        old_version = kept._snap.version
        del dropped  # never closed: its hold goes when the view dies
        gc.collect()
        await _set(db, {b"a": b"2"})
        assert store._oldest_snapshot_version() == old_version  # kept's hold is still there
        kept.cancel()  # the view's last closing holder releases it
        await _set(db, {b"a": b"3"})
        assert store._oldest_snapshot_version() == store._version

        leaked = db.create_transaction()
        assert await leaked.get(b"a") == b"3"
        leaked_version = leaked._snap.version
        await _set(db, {b"a": b"4"})
        assert store._oldest_snapshot_version() == leaked_version
        del leaked  # the only holder, dropped after the store moved on: the finalizer releases
        gc.collect()
        await _set(db, {b"a": b"5"})
        assert store._oldest_snapshot_version() == store._version


async def test_the_current_view_with_no_holder_is_reused_and_then_released(tmp_path):
    async with _open(tmp_path / "data") as db:
        store = db.engine.store
        await _set(db, {b"a": b"1"})
        t1 = db.create_transaction()
        assert await t1.get(b"a") == b"1"
        view = t1._snap
        t1.cancel()
        assert view.holders == 0 and store._shared is view  # kept for the next reader
        t2 = db.create_transaction()
        assert await t2.get(b"a") == b"1"
        assert t2._snap is view and view.holders == 1
        t2.cancel()
        await _set(db, {b"a": b"2"})
        # Nobody held it when the store moved on: it is carried to the new version (session
        # 19: the same object, what releasing it and making a new one would give)
        assert store._shared is view and view.version == store._version and view.get(b"a") == b"2"
        assert store._oldest_snapshot_version() == store._version
        store.checkpoint()  # a new base: the carried view, unheld, is released
        assert store._shared is not view and view._base is None
        t3 = db.create_transaction()
        assert await t3.get(b"a") == b"2" and t3._snap is not view
        t3.cancel()
