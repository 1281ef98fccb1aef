"""The engine finds the watched keys a batch changed by asking its store (``written_since``),
not by walking the batch's mutations. The cases where the store's record of a key is gone by
the time the engine asks (the LMDB overlay's purge drops a deleted key in the same publish)
or never existed (a key only the base holds) must still fire the watch."""

from __future__ import annotations

import trio

from kv.engine import Engine


async def _watch(db, key: bytes):
    tr = db.create_transaction()
    w = tr.watch(key)
    await tr.commit()  # idempotent: read-only but for the watch it arms
    return w


async def _fired(w) -> None:
    with trio.fail_after(10):
        await w


async def test_a_watch_fires_when_its_key_is_cleared_and_the_deletion_purged_at_once(edb):
    # On LMDB: a key written since the last checkpoint, then cleared while no snapshot is
    # open, is dropped from the overlay by the very publish that deletes it (_purge_dead),
    # before the engine checks watches: the store no longer knows the key was written.
    async def put(tr):  # idempotent: plain set
        tr.set(b"w/gone", b"v")

    await edb.transact(put)
    w = await _watch(edb, b"w/gone")
    assert not w.ready

    async def clear(tr):  # idempotent: plain clear
        tr.clear(b"w/gone")

    await edb.transact(clear)
    await _fired(w)
    store = edb._engine.store
    if hasattr(store, "_top_ver"):  # LMDB: the case this test is about did happen
        assert b"w/gone" not in store._top_ver


async def test_a_watch_fires_on_a_key_only_the_base_held(edb, tmp_path):
    async def put(tr):  # idempotent: plain set
        tr.set(b"w/base", b"1")

    await edb.transact(put)
    store = edb._engine.store
    if hasattr(store, "checkpoint"):
        store.checkpoint()  # LMDB: the key now lives in the tree, the overlay drops it
    w = await _watch(edb, b"w/base")

    async def change(tr):  # idempotent: plain set
        tr.set(b"w/base", b"2")

    await edb.transact(change)
    await _fired(w)


async def test_watches_on_keys_a_batch_did_not_change_stay_pending(edb):
    async def put(tr):  # idempotent: plain sets
        tr.set(b"w/a", b"1")
        tr.set(b"w/b", b"1")

    await edb.transact(put)
    wa, wb = await _watch(edb, b"w/a"), await _watch(edb, b"w/b")
    assert isinstance(edb._engine, Engine) and edb._engine._written_since is not None

    async def touch_a(tr):  # idempotent: plain set
        tr.set(b"w/a", b"2")

    await edb.transact(touch_a)
    await _fired(wa)
    # a rewrite of w/b with its own value again, and writes elsewhere: nothing changed it
    async def same_b(tr):  # idempotent: plain sets
        tr.set(b"w/b", b"1")
        tr.set(b"w/c", b"1")

    await edb.transact(same_b)
    await trio.sleep(0)
    assert not wb.ready
    wb.cancel()
