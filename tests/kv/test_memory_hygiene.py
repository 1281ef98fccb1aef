"""What the embedded engines leave to Python's garbage collector.

Reference counting frees most objects at once; only reference cycles wait for the
cyclic collector, and every collection walks every tracked object still alive
(at 64 concurrent submitters, the commits in flight). So a transaction must not
become a cycle, and the store's long-lived indexes must not hold tracked objects
per entry (each one brought the next collection nearer: ~16% of a busy store's CPU
before they were taken out). These tests pin both down.
"""

from __future__ import annotations

import gc
import struct

import trio

import kv


async def _busy_transaction(tr: kv.Transaction, i: int) -> None:  # idempotent per i: plain sets
    await tr.snapshot.get(b"h/snap")
    await tr.get(b"h/read")
    async for _ in tr.snapshot.get_range(b"h/", b"h0", limit=3):
        pass
    tr.options.set_retry_limit(5)
    tr.set(b"h/k/%d" % i, b"v")
    tr.add(b"h/counter", struct.pack("<q", 1))
    tr.set_versionstamped_key(b"h/j/" + b"\x00" * 10 + struct.pack("<I", 4), b"e")


async def test_a_finished_transaction_is_freed_without_the_cyclic_collector(edb):
    for i in range(5):  # warm: caches, first-use paths
        await edb.transact(lambda tr, i=i: _busy_transaction(tr, i))
    gc.collect()
    gc.disable()
    try:
        for i in range(5, 55):
            await edb.transact(lambda tr, i=i: _busy_transaction(tr, i))
        await trio.testing.wait_all_tasks_blocked()
        left = gc.collect()  # objects that only the cyclic collector could free
    finally:
        gc.enable()
    assert left == 0, f"{left} objects of cyclic garbage after 50 transactions"


async def test_the_overlay_and_resolver_indexes_stay_untracked_by_the_collector(tmp_path):
    async with await kv.open(f"lmdb:{tmp_path / 'data'}") as db:
        store, resolver = db.engine.store, db.engine.resolver
        for i in range(200):
            async def fn(tr, i=i):  # idempotent: plain sets (a key rewritten, so older entries exist)
                tr.set(b"o/%d" % (i % 50), b"v%d" % i)
                tr.set(b"p/%d" % i, b"w")

            await db.transact(fn)
        async def one(tr):  # idempotent: a plain set
            tr.set(b"q/one", b"x")

        await db.transact(one)
        assert store.overlay_size() >= 250
        # Dicts of bytes, ints and None are never tracked; one tuple per entry made them
        # tracked, and every new entry counted toward the next collection.
        for name in ("_top_ver", "_top_val", "_unindexed"):
            assert not gc.is_tracked(getattr(store, name)), name
        assert not gc.is_tracked(resolver._points)
        # a single-key commit keeps its key itself in the resolver's history, not a tuple
        assert resolver._history_keys[-1] == b"q/one"
