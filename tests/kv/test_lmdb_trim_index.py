"""The LMDB overlay's ordered key index after a trim (kv/lmdb_engine.py ``_trim``).

A trim leaves the keys it drops in the index, marked stale, and rebuilds the
index once they are ``STALE_SWEEP_FRACTION`` of it. These tests hold range
reads and one-key clears to a model through that: stale keys skipped, stale
keys written again (revived, not indexed twice), deleted again, and the sweep.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

import kv
import kv.lmdb_engine as lmdb_engine
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.wal import checkpoint_lock, checkpoint_pass

SEED = 43
KEYS = 60


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path, checkpointer=False, segment_bytes=1 << 30), clock=time.time),
                       url=f"lmdb:{path}")


async def _check(db, model: dict[bytes, bytes]) -> None:
    tr = db.create_transaction()
    want = sorted(model.items())
    got = [(r.key, r.value) for r in await tr.get_range(b"", b"\xff")]
    assert got == want
    got = [(r.key, r.value) for r in await tr.get_range(b"", b"\xff", reverse=True, limit=5)]
    assert got == want[::-1][:5]
    if want:  # a range that starts inside the keyspace
        mid = want[len(want) // 2][0]
        got = [(r.key, r.value) for r in await tr.get_range(mid, b"\xff", limit=3)]
        assert got == [kv_ for kv_ in want if kv_[0] >= mid][:3]


@pytest.mark.parametrize("fraction", [lmdb_engine.STALE_SWEEP_FRACTION, 1000.0], ids=["sweeping", "never-swept"])
async def test_trimmed_keys_go_stale_are_revived_and_swept(tmp_path, monkeypatch, fraction):
    monkeypatch.setattr(lmdb_engine, "STALE_SWEEP_FRACTION", fraction)
    path = tmp_path / "data"
    rng = random.Random(SEED)
    keys = [b"k%03d" % i for i in range(KEYS)]
    model: dict[bytes, bytes] = {}
    async with _open(path) as db:
        store = db.engine.store
        saw_stale = saw_revive = False
        for step in range(400):
            tr = db.create_transaction()
            for _ in range(rng.randint(1, 5)):
                k = rng.choice(keys)
                if rng.random() < 0.75:
                    tr.set(k, b"v%d" % step)
                    model[k] = b"v%d" % step
                elif rng.random() < 0.5:
                    tr.clear(k)
                    model.pop(k, None)
                else:
                    a, b = sorted(rng.sample(keys, 2))
                    tr.clear_range(a, b)
                    for d in [d for d in model if a <= d < b]:
                        del model[d]
            stale_before = set(store._stale)
            await tr.commit()
            assert store._stale <= set(store._keys), "a stale key is not in the index"
            r = rng.random()
            if r < 0.04:
                store.checkpoint()  # everything into the tree: the next commit trims it all
            elif r < 0.12:
                store._log.seal()  # seal only: a later pass takes this segment, not what follows
            elif r < 0.2:  # a checkpoint of the sealed segments only: trims some keys, not others
                with checkpoint_lock(path):
                    checkpoint_pass(store.env, path / "wal", include_newest=False)
                store._checkpoint_due = True
                store._maintain()
            saw_stale |= bool(store._stale)
            if rng.random() < 0.5:
                await _check(db, model)
                if store._stale & set(store._top_ver):
                    raise AssertionError("a key with an overlay entry is still stale after a walk")
                saw_revive |= bool(stale_before & set(store._top_ver))
            # The index never holds a key twice, and holds every key that has an entry
            # and was walked over (the rest wait in _unindexed).
            assert len(set(store._keys)) == len(store._keys)
            assert set(store._top_ver) <= set(store._keys) | set(store._unindexed)
        await _check(db, model)
        assert saw_stale and saw_revive, (saw_stale, saw_revive)
    async with _open(path) as db:  # and the tree holds the same after a reopen
        await _check(db, model)
