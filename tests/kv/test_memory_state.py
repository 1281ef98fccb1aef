"""The memory engine's state copy (MemoryEngine.snapshot_state / restore_state), for the simulator.

A restored engine must answer every read the original would (current and older
versions, point and range reads, keys written since the last range walk), hand
out versions and versionstamps above everything before, and stay independent
of the original afterwards.
"""

from __future__ import annotations

import struct

import pytest

import kv
from kv.memory import MemoryEngine


async def _fill(db) -> tuple[int, bytes]:
    """Some history: a key overwritten, one cleared, a range cleared, a counter, fresh keys
    no range read has walked yet. Returns the version after the first write and the last versionstamp."""

    async def first(tr):  # idempotent: plain sets
        for i in range(5):
            tr.set(b"a/%d" % i, b"v0-%d" % i)
        tr.set(b"gone", b"x")

    await db.transact(first)
    tr = db.create_transaction()
    early = await tr.get_read_version()
    tr.cancel()
    assert [kv_.key async for kv_ in db.create_transaction().get_range(b"a/", b"a0")]  # index the a/ keys

    async def second(tr):  # idempotent: sets, clears and a guarded add (one run per call here)
        tr.set(b"a/1", b"v1-1")
        tr.clear(b"gone")
        tr.clear_range(b"a/3", b"a/5")
        tr.add(b"n", struct.pack("<q", 7))
        for i in range(3):
            tr.set(b"b/%d" % i, b"fresh")  # not yet in the ordered index
        tr.set_versionstamped_key(b"j/" + b"\x00" * 10 + struct.pack("<I", 2), b"event")

    tr = db.create_transaction()
    await second(tr)
    stamp = tr.get_versionstamp()
    await tr.commit()
    return early, await stamp


async def _reads(db) -> tuple:
    tr = db.create_transaction()
    now = (await tr.get_range(b"", b"\xff"), await tr.get(b"a/1"), await tr.get(b"gone"), await tr.get(b"n"))
    return now


async def test_restore_gives_the_same_reads_and_later_versions():
    source = MemoryEngine()
    db = source.database()
    early, stamp = await _fill(db)
    before = await _reads(db)
    state = source.snapshot_state()

    target = MemoryEngine()
    target.restore_state(state)
    db2 = target.database()
    assert await _reads(db2) == before
    rows = before[0]
    assert [k for k, _ in rows if k.startswith(b"b/")] == [b"b/0", b"b/1", b"b/2"]
    assert [k for k, _ in rows if k.startswith(b"a/")] == [b"a/0", b"a/1", b"a/2"]
    assert before[1:] == (b"v1-1", None, struct.pack("<q", 7))
    # an older version is still readable (the history was copied, not just the newest values)
    snap = target.store.snapshot()
    snap.version = early
    assert snap.get(b"a/1") == b"v0-1" and snap.get(b"gone") == b"x"
    assert target.engine.committed_version() == source.engine.committed_version()

    # new commits get later versions and versionstamps than anything before the copy
    tr = db2.create_transaction()
    tr.set_versionstamped_key(b"j/" + b"\x00" * 10 + struct.pack("<I", 2), b"after")
    later = tr.get_versionstamp()
    await tr.commit()
    assert await later > stamp
    assert tr.get_committed_version() > source.engine.committed_version()


async def test_the_copy_is_independent_and_restored_once():
    source = MemoryEngine()
    db = source.database()
    await _fill(db)
    state = source.snapshot_state()

    async def overwrite(tr):  # idempotent: plain sets and a clear
        tr.set(b"a/0", b"changed")
        tr.set(b"c/new", b"x")
        tr.clear_range(b"b/", b"b0")

    await db.transact(overwrite)  # after the copy: must not show in it
    target = MemoryEngine()
    target.restore_state(state)
    tr = target.database().create_transaction()
    assert await tr.get(b"a/0") == b"v0-0"
    assert await tr.get(b"c/new") is None
    assert len(await tr.get_range(b"b/", b"b0")) == 3
    with pytest.raises(RuntimeError):
        MemoryEngine().restore_state(state)
    assert isinstance(state, kv.memory.MemoryState)
