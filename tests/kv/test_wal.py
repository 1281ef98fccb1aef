"""The LMDB store's write-ahead log, overlay and checkpoints (kv/wal.py, kv/lmdb_engine.py).

SIGKILL at random points, with and without a busy checkpointer, is in
test_crash.py; the kv semantics on this store are the conformance suite's.
These tests cover what those do not reach: a torn log tail and a damaged
sealed segment, the upgrade from format 2, a log write that fails, and
reads that merge the overlay with the tree while checkpoints move the tree
underneath (checked against a plain dict model).
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import trio

import kv
from kv import KVError
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.wal import WalCorrupt, list_segments, read_segment

ROOT = Path(__file__).resolve().parents[2]
SEED = 1234  # of the random model test (a stress run sets others)


def _open(path: Path, **store_options) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path, **store_options), clock=time.time), url=f"lmdb:{path}")


async def _set(db, items: dict[bytes, bytes]) -> None:
    async def fn(tr):  # idempotent: plain sets
        for k, v in items.items():
            tr.set(k, v)

    await db.transact(fn)


async def _all(db, begin=b"", end=b"\xff") -> dict[bytes, bytes]:
    tr = db.create_transaction()
    return {r.key: r.value for r in await tr.get_range(begin, end)}


def _crash_after_commits(path: Path, n: int) -> None:
    """Commit ``n`` keys in a child process that then dies without closing
    (``os._exit``): the log keeps them, the tree does not."""
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
    subprocess.run([sys.executable, "-c", code, str(path), str(n)], check=True, env=env, timeout=60)


async def test_a_crash_leaves_the_log_and_reopening_replays_it_into_the_tree(tmp_path):
    path = tmp_path / "data"
    _crash_after_commits(path, 50)
    segments = list_segments(path / "wal")
    assert segments and sum(p.stat().st_size for _, p in segments) > 0  # the batches are in the log
    async with _open(path) as db:
        data = await _all(db, b"c/", b"c0")
        assert data == {b"c/%04d" % i: b"v%d" % i for i in range(50)}
        # recovery moved everything into the tree: the overlay starts empty
        assert db.engine.store.overlay_size() == 0


async def test_a_torn_record_at_the_end_of_the_log_is_cut_off(tmp_path, caplog):
    path = tmp_path / "data"
    _crash_after_commits(path, 20)
    _, newest = list_segments(path / "wal")[-1]
    with open(newest, "ab") as f:  # half a record: a header promising more than follows
        f.write((1000).to_bytes(4, "little") + b"\x00\x00\x00\x00" + b"partial")
    async with _open(path) as db:
        assert await _all(db, b"c/", b"c0") == {b"c/%04d" % i: b"v%d" % i for i in range(20)}
        tr = db.create_transaction()
        tr.set(b"after", b"ok")
        await tr.commit()
    assert "torn record" in caplog.text
    async with _open(path) as db:
        assert (await _all(db))[b"after"] == b"ok"


async def test_a_log_written_before_flat_records_still_replays(tmp_path):
    """Records nest one array per effect in logs written before 2026-11-29
    (now they are flat); a crash left such a log: reopening replays both kinds,
    in order, sets, deletes and range clears alike."""
    from kv import lmdb_layout as layout
    from kv.wal import encode_record

    path = tmp_path / "data"
    _crash_after_commits(path, 10)  # flat records, versions below the ones appended here
    _, newest = list_segments(path / "wal")[-1]
    _, end, torn = read_segment(newest)
    assert not torn
    os.truncate(newest, end)  # as such a log was: no preallocated tail after its records
    base = 1 << 52  # above every version the child committed (versions are clock-based)
    with open(newest, "ab") as f:
        f.write(encode_record(base + 1, [[layout.SET, b"old/a", b"1"], [layout.SET, b"old/b", b"2"],
                                         [layout.DELETE, b"c/0001"], [layout.CLEAR, b"c/0005", b"c/0007"]]))
        f.write(encode_record(base + 2, [layout.SET, b"old/c", b"3", layout.DELETE, b"old/a"]))
        f.flush()
        os.fsync(f.fileno())
    async with _open(path) as db:
        expect = {b"c/%04d" % i: b"v%d" % i for i in range(10) if i not in (1, 5, 6)}
        assert await _all(db, b"c/", b"c0") == expect
        assert await _all(db, b"old/", b"old0") == {b"old/b": b"2", b"old/c": b"3"}
        tr = db.create_transaction()
        tr.set(b"after", b"ok")
        await tr.commit()
        assert tr.get_committed_version() > base + 2  # versions carry on above the log's


async def test_an_unknown_effect_in_a_logged_batch_is_refused(tmp_path):
    from kv import lmdb_layout as layout

    env = lmdb.open(str(tmp_path / "t"), map_size=1 << 20)
    with pytest.raises(ValueError, match="unknown effect 7 at 3"):
        with env.begin(write=True) as txn:
            layout.apply_effects(txn, [layout.SET, b"k", b"v", 7, b"x"])
    env.close()


async def test_a_damaged_sealed_segment_is_refused_naming_it_and_nothing_changes(tmp_path):
    path = tmp_path / "data"
    _crash_after_commits(path, 5)  # segment 1 holds five batches
    wal_dir = path / "wal"
    (_, first), = list_segments(wal_dir)
    # a newer segment exists, so the first one is sealed: damage in it is not a torn tail
    (wal_dir / "0000000000000002.wal").write_bytes(b"")
    data = bytearray(first.read_bytes())
    data[20] ^= 0xFF
    first.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in wal_dir.iterdir()}
    tree_before = (path / "data.mdb").read_bytes()
    with pytest.raises(WalCorrupt) as info:
        LmdbStore(path)
    assert str(first) in str(info.value) and info.value.code == 4100
    assert {p.name: p.read_bytes() for p in wal_dir.iterdir()} == before
    assert (path / "data.mdb").read_bytes() == tree_before
    with pytest.raises(WalCorrupt):  # and the directory is not left locked
        LmdbStore(path)


async def test_a_format_2_directory_is_upgraded_in_place(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    ceiling = 5_000_000_000
    env = lmdb.open(str(path), max_dbs=0, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"mformat", b"2")
        txn.put(b"mversion", ceiling.to_bytes(8, "big"))
        txn.put(b"kold", b"value")
    env.close()
    async with _open(path) as db:
        tr = db.create_transaction()
        assert await tr.get(b"old") == b"value"
        tr.set(b"new", b"v")
        await tr.commit()
        assert tr.get_committed_version() > ceiling  # versions continue above format 2's ceiling
    env = lmdb.open(str(path), max_dbs=0, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"mformat") == b"3"
        assert txn.get(b"mversion") is None
        assert int.from_bytes(txn.get(b"mapplied"), "big") > ceiling
    env.close()


async def test_a_failed_log_write_stops_commits_but_not_reads_until_reopened(tmp_path, monkeypatch):
    path = tmp_path / "data"
    db = _open(path)
    try:
        await _set(db, {b"before": b"1"})
        import kv.wal

        log_fd = db.engine.store._log.fd
        failures = []
        # The sync fails after the record reached the page cache: with O_DSYNC the
        # write itself reports it, otherwise the fdatasync after it.
        name = "pwrite" if kv.wal.SYNC_OPEN_FLAG else "fdatasync"
        real = getattr(os, name)

        def failing(fd, *args):
            result = real(fd, *args)
            if fd == log_fd and not failures:
                failures.append(fd)
                raise OSError(errno.EIO, "injected I/O error")
            return result

        monkeypatch.setattr(kv.wal.os, name, failing)
        tr = db.create_transaction()
        tr.set(b"doomed", b"x")
        with pytest.raises(KVError) as info:
            await tr.commit()
        assert info.value.code == 1021 and info.value.maybe_committed  # written, durability unknown
        tr = db.create_transaction()
        assert await tr.get(b"doomed") is None  # never visible in this process
        tr.set(b"later", b"y")
        with pytest.raises(KVError) as info:
            await tr.commit()
        assert info.value.code == 4100 and "reopen" in str(info.value)
        assert await _all(db) == {b"before": b"1"}  # reads go on
    finally:
        await db.close()
    monkeypatch.undo()
    async with _open(path) as db:  # reopened: the log's record was whole, so it counts
        data = await _all(db)
        assert data[b"before"] == b"1" and b"later" not in data
        await _set(db, {b"after": b"2"})
        assert (await _all(db))[b"after"] == b"2"


async def test_the_checkpointer_process_empties_sealed_segments_and_the_overlay_shrinks(tmp_path):
    path = tmp_path / "data"
    async with _open(path, segment_bytes=1024) as db:
        store = db.engine.store
        for i in range(300):
            await _set(db, {b"k/%04d" % i: b"v%d" % i * 10})
        assert store.stats["segments_sealed"] > 10
        # The checkpointer runs asynchronously: wait until every sealed segment is in the tree.
        with trio.fail_after(30):
            while len(list_segments(path / "wal")) > 1 or store.overlay_size() > 50:
                await _set(db, {b"tick": b"%d" % time.monotonic_ns()})  # commits move the base forward
                await trio.sleep(0.05)
        assert store._proc is not None and store._proc.poll() is None  # a separate process did it
        assert await _all(db, b"k/", b"k0") == {b"k/%04d" % i: b"v%d" % i * 10 for i in range(300)}
    assert not (path / "wal").exists() or list_segments(path / "wal") == []


async def test_a_snapshot_taken_before_a_checkpoint_still_reads_its_own_version(tmp_path):
    path = tmp_path / "data"
    async with _open(path, checkpointer=False) as db:
        store = db.engine.store
        await _set(db, {b"a": b"1", b"b": b"1", b"c": b"1"})
        old = db.create_transaction()
        assert await old.get(b"a") == b"1"  # read version fixed here
        await _set(db, {b"a": b"2"})
        tr = db.create_transaction()
        tr.clear_range(b"b", b"c")
        await tr.commit()
        store.checkpoint()  # the tree now holds a=2, no b, c=1
        store.checkpoint()
        assert store.overlay_size() > 0  # kept: the old snapshot still needs the overlay's history
        assert [(r.key, r.value) for r in await old.get_range(b"", b"\xff")] == [(b"a", b"1"), (b"b", b"1"), (b"c", b"1")]
        assert await old.get(b"b") == b"1"
        old.cancel()
        del old
        new = db.create_transaction()
        assert [(r.key, r.value) for r in await new.get_range(b"", b"\xff")] == [(b"a", b"2"), (b"c", b"1")]
        new.cancel()
        del new
        await _set(db, {b"d": b"1"})  # a commit after the old snapshot closed lets the trim run
        assert store.overlay_size() <= 1


def _long(i: int) -> bytes:
    return b"L" * 600 + b"%03d" % i  # past LMDB's key limit: stored in a shared bucket


async def test_reads_merge_overlay_and_tree_like_a_dict_across_random_checkpoints(tmp_path):
    """Random sets, clears, atomic adds and long keys, with segments sealed and
    checkpointed at random points (some passes taking only older segments)
    and snapshots held across them: every read agrees with a dict model of
    the snapshot's version."""
    from kv.wal import checkpoint_lock, checkpoint_pass

    rng = random.Random(SEED)
    keys = [b"k%02d" % i for i in range(40)] + [_long(i) for i in range(8)]
    model: dict[bytes, bytes] = {}
    held: list[tuple[object, dict[bytes, bytes]]] = []
    path = tmp_path / "data"
    async with _open(path, checkpointer=False, segment_bytes=1 << 30) as db:
        store = db.engine.store
        for step in range(300):
            tr = db.create_transaction()
            for _ in range(rng.randint(1, 4)):
                op = rng.random()
                if op < 0.6:
                    k = rng.choice(keys)
                    v = b"v%d" % step
                    tr.set(k, v)
                    model[k] = v
                elif op < 0.75:
                    a, b = sorted(rng.sample(keys, 2))
                    tr.clear_range(a, b)
                    for k in [k for k in model if a <= k < b]:
                        del model[k]
                else:
                    k = rng.choice(keys)
                    tr.add(k, (1).to_bytes(8, "little"))
                    old = int.from_bytes(model.get(k, b"").ljust(8, b"\x00")[:8], "little")
                    model[k] = ((old + 1) % 2**64).to_bytes(8, "little")
            await tr.commit()
            r = rng.random()
            if r < 0.05:
                store.checkpoint()  # seal the current segment, checkpoint every sealed one
            elif r < 0.12:
                store._log.seal()  # seal only: a later pass may take some segments and not others
            elif r < 0.2:
                with checkpoint_lock(path):
                    checkpoint_pass(store.env, path / "wal", include_newest=False)
                store._checkpoint_due = True
                store._maintain()
            if rng.random() < 0.1:
                snap = db.create_transaction()
                await snap.get_read_version()
                held.append((snap, dict(model)))
            # check the newest state and every held snapshot
            for snap, expect in [(db.create_transaction(), model)] + held:
                want = sorted(expect.items())
                got = [(r.key, r.value) for r in await snap.snapshot.get_range(b"", b"\xff")]
                assert got == want, step
                rev = [(r.key, r.value) for r in await snap.snapshot.get_range(b"", b"\xff", reverse=True, limit=5)]
                assert rev == want[::-1][:5], step
                lo, hi = sorted(rng.sample(keys, 2))
                part = [(r.key, r.value) for r in await snap.snapshot.get_range(lo, hi, limit=3)]
                assert part == [kv_ for kv_ in want if lo <= kv_[0] < hi][:3], step
                k = rng.choice(keys)
                assert await snap.snapshot.get(k) == expect.get(k), step
            if held and rng.random() < 0.2:  # drop the oldest held snapshot
                snap, _ = held.pop(0)
                snap.cancel()
        assert store._log.number > 10  # many segments were sealed along the way
    async with _open(path) as db:  # and what the tree holds after close is the model
        assert await _all(db) == model


async def test_a_key_created_and_deleted_between_checkpoints_stays_deleted(tmp_path):
    """A queue entry written and deleted before any checkpoint is forgotten at
    once (no tombstone for range reads to walk past), and stays deleted when
    a checkpoint of only the segment that created it lands."""
    from kv.wal import checkpoint_lock, checkpoint_pass

    path = tmp_path / "data"
    async with _open(path, checkpointer=False, segment_bytes=1 << 30) as db:
        store = db.engine.store
        await _set(db, {b"q/1": b"job"})
        store._log.seal()  # segment 1 holds the write; the delete goes to segment 2

        async def take(tr):  # guarded by the read of the entry
            assert await tr.get(b"q/1") == b"job"
            tr.clear(b"q/1")

        await db.transact(take)
        assert b"q/1" not in store._top_ver  # purged: nothing open can read it, the tree lacks it
        with checkpoint_lock(path):
            checkpoint_pass(store.env, path / "wal", include_newest=False)  # segment 1 only
        store._checkpoint_due = True
        store._maintain()
        assert store._base.version > 0 and layout_get(store, b"q/1") == b"job"  # the tree has it again
        tr = db.create_transaction()
        assert await tr.get(b"q/1") is None
        assert await tr.get_range(b"q/", b"q0") == []

    async with _open(path) as db:
        assert await _all(db, b"q/", b"q0") == {}


def layout_get(store, key):
    from kv import lmdb_layout

    return lmdb_layout.get(store._base.txn, key)


async def test_range_reads_over_a_busy_queue_do_not_walk_past_its_history(tmp_path):
    """Claim-style traffic: add an entry, read the queue's head, delete it.
    The overlay keeps no trace of the finished entries."""
    async with _open(path := tmp_path / "data", checkpointer=False) as db:
        store = db.engine.store
        for i in range(500):
            await _set(db, {b"ready/%05d" % i: b"run"})

            async def claim(tr):  # guarded by the read of the head
                head = await tr.get_range(b"ready/", b"ready0", limit=1)
                tr.clear(head[0].key)

            await db.transact(claim)
        assert store.overlay_size() < 10
        assert await _all(db, b"ready/", b"ready0") == {}
    assert path.exists()


async def test_a_checkpointer_that_cannot_run_is_replaced_by_checkpoints_in_the_store(tmp_path, monkeypatch, caplog):
    """If the helper process keeps exiting (here: an interpreter that fails at
    once), the store checkpoints sealed segments itself, so the overlay and
    the log stay bounded."""
    import kv.lmdb_engine

    monkeypatch.setattr(kv.lmdb_engine.sys, "executable", "/bin/false")
    path = tmp_path / "data"
    async with _open(path, segment_bytes=512) as db:
        store = db.engine.store
        for i in range(400):
            await _set(db, {b"k/%04d" % i: b"v" * 40})
        assert store._checkpointer_starts == kv.lmdb_engine.MAX_CHECKPOINTER_STARTS
        assert len(list_segments(path / "wal")) <= 2  # sealed segments did not pile up
        assert store.overlay_size() < 100
        assert len(await _all(db, b"k/", b"k0")) == 400
    assert "checkpointing in this process from now on" in caplog.text


async def test_a_snapshot_left_open_keeps_its_reads_and_the_bookkeeping_stays_small(tmp_path, monkeypatch):
    """One transaction kept open across many commits (each taking a snapshot
    of its own) still reads its version, and the store's record of open
    snapshot versions is swept instead of growing with every commit."""
    import kv.lmdb_engine

    monkeypatch.setattr(kv.lmdb_engine, "SNAPSHOT_ORDER_COMPACT_AT", 50)
    async with _open(tmp_path / "data", checkpointer=False) as db:
        store = db.engine.store
        await _set(db, {b"q/0": b"first"})
        held = db.create_transaction()
        assert await held.get(b"q/0") == b"first"

        for i in range(1, 300):
            async def step(tr, i=i):  # guarded by the read of the previous entry
                assert await tr.get(b"q/%d" % (i - 1)) is not None
                tr.set(b"q/%d" % i, b"v")
                tr.clear(b"q/%d" % (i - 1)) if i > 1 else None

            await db.transact(step)
        assert len(store._snap_order) <= 51
        assert await held.get(b"q/0") == b"first"  # its version is still readable
        assert await held.get(b"q/299") is None  # and nothing after it
        assert store.stats["overlay_keys"] == store.overlay_size()
        held.cancel()
