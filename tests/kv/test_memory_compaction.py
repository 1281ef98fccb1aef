"""The memory store's compaction cuts exactly what no reader in the MVCC window can see.

A reader at any version from the window's floor on must still read what it read before
compaction (the newest entry at or below its version, across many batches that rewrote a
key); what is older than that entry, and keys whose last word is a deletion below the
floor, must go. Checked against a model that keeps every version.
"""

from __future__ import annotations

import random

from kv.memory import _COMPACT_EVERY, MemoryStore, _MemorySnapshot

WINDOW = 497  # versions; small so a few hundred batches span several windows; a multiple of
STEP = 7  # STEP, so the floor lands exactly on a batch (the cut must keep that entry alone)


def _read(store: MemoryStore, version: int, key: bytes) -> bytes | None:
    return _MemorySnapshot(store, version).get(key)


def _model_read(model: dict[bytes, list[tuple[int, bytes | None]]], version: int, key: bytes) -> bytes | None:
    value = None
    for v, val in model.get(key, ()):
        if v <= version:
            value = val
    return value


def test_compaction_keeps_what_the_window_reads_and_drops_the_rest():
    rng = random.Random(44)
    store = MemoryStore(mvcc_window=WINDOW)
    model: dict[bytes, list[tuple[int, bytes | None]]] = {}
    keys = [b"hot", b"warm/1", b"warm/2"] + [b"cold/%d" % i for i in range(40)]
    version = 0
    for batch in range(20 * _COMPACT_EVERY):
        version += STEP
        muts = [("set", b"hot", b"h%d" % batch)]  # every batch: a long history for one key
        for _ in range(rng.randrange(3)):
            k = rng.choice(keys[1:])
            if rng.random() < 0.3:
                muts.append(("clear", k, k + b"\x00"))
            else:
                muts.append(("set", k, b"v%d" % batch))
        for m in muts:
            if m[0] == "clear" and _model_read(model, version, m[1]) is None:
                continue  # the store records no deletion of an absent key
            model.setdefault(m[1], []).append((version, m[2] if m[0] == "set" else None))
        store.apply_sync(version, muts)
        if (batch + 1) % _COMPACT_EVERY == 0:
            floor = version - WINDOW
            # every reader the window admits reads what the full history says
            for k in keys:
                for v in range(max(floor, 0), version + 1):
                    assert _read(store, v, k) == _model_read(model, v, k), (k, v, floor)
            # and nothing a reader at the floor or later cannot see is kept: at most one entry
            # below the floor per key (every entry below it came from a batch this or an
            # earlier compaction visited), none if it is a deletion; the hot key, rewritten
            # by every batch, keeps exactly one entry at or below the floor
            for k, hist in store._hist.items():
                below = [(v, val) for v, val in hist if v < floor]
                assert len(below) <= 1, (k, floor, hist)
                assert not (len(hist) == 1 and below and below[0][1] is None), (k, floor, hist)
            if floor > 0:
                assert sum(v <= floor for v, _ in store._hist[b"hot"]) == 1, (floor, store._hist[b"hot"][:3])
    hot = store._hist[b"hot"]
    # the hot key keeps its window (~WINDOW/STEP entries plus one batch run), not its whole life
    assert len(hot) <= (WINDOW + _COMPACT_EVERY * STEP) // STEP + 1, len(hot)
    assert len(hot) >= WINDOW // STEP



def test_a_key_deleted_below_the_floor_goes_and_one_deleted_inside_the_window_stays():
    store = MemoryStore(mvcc_window=100)
    store.apply_sync(1, [("set", b"gone", b"a"), ("set", b"kept", b"b")])
    store.apply_sync(2, [("clear", b"gone", b"gone\x00")])
    version = 2
    for _ in range(_COMPACT_EVERY - 3):  # fillers at 3..63
        version += 1
        store.apply_sync(version, [("set", b"filler", b"f")])
    version = 200  # the window's floor (100) is now above versions 1 and 2
    store.apply_sync(version, [("clear", b"kept", b"kept\x00")])
    assert store._applied % _COMPACT_EVERY == 0  # that batch compacted
    assert b"gone" not in store._hist and b"gone" not in store._keys and b"gone" not in store._unindexed
    # "kept" was deleted at 200, inside the window: a reader at 100..199 still sees b"b"
    assert _read(store, 100, b"kept") == b"b"
    assert _read(store, 199, b"kept") == b"b"
    assert _read(store, 200, b"kept") is None
    assert store._hist[b"kept"] == [(1, b"b"), (200, None)]
    assert store._hist[b"filler"] == [(_COMPACT_EVERY - 1, b"f")]  # its newest entry <= the floor
