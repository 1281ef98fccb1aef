"""The LMDB overlay's ordered key index is brought up to date only before a walk
(``LmdbStore._index``). A range clear must still find every key with a value: one a batch
still out (written ahead, not published) wrote, one its own batch wrote before it, and one
written after an earlier walk."""

from __future__ import annotations

from kv.lmdb_engine import LmdbStore


def _range(store: LmdbStore, begin: bytes, end: bytes) -> list[tuple[bytes, bytes]]:
    snap = store.snapshot()
    try:
        return snap.range(begin, end, False, 0)
    finally:
        snap.close()


async def test_a_range_clear_staged_behind_a_batch_still_out_clears_its_keys(tmp_path):
    store = LmdbStore(tmp_path, checkpointer=False)
    try:
        v = store.committed_version()
        assert _range(store, b"r/", b"r0") == []  # a walk: the index is caught up here
        first = store.submit(v + 1, [("set", b"r/a", b"1"), ("set", b"r/b", b"1")])
        second = store.submit(v + 2, [("clear", b"r/", b"r0"), ("set", b"r/c", b"2")])
        await first.wait()
        await second.wait()
        assert _range(store, b"r/", b"r0") == [(b"r/c", b"2")]
    finally:
        store.close()


async def test_a_range_clear_finds_the_keys_its_own_batch_wrote_before_it(tmp_path):
    store = LmdbStore(tmp_path, checkpointer=False)
    try:
        v = store.committed_version()
        store.apply_sync(v + 1, [("set", b"s/a", b"1")])
        assert _range(store, b"s/", b"s0") == [(b"s/a", b"1")]  # s/a listed by this walk
        store.apply_sync(v + 2, [("set", b"s/b", b"1"), ("set", b"s/c", b"1"),
                                 ("clear", b"s/a", b"s/c"), ("set", b"s/d", b"1")])
        assert _range(store, b"s/", b"s0") == [(b"s/c", b"1"), (b"s/d", b"1")]
        store.apply_sync(v + 3, [("set", b"s/b", b"3")])  # a tombstoned key written again
        assert _range(store, b"s/", b"s0") == [(b"s/b", b"3"), (b"s/c", b"1"), (b"s/d", b"1")]
        assert len(set(store._keys)) == len(store._keys)  # each key once
    finally:
        store.close()
