"""The LMDB store's own behaviour: its storage format and when a batch is written inline.

The write-ahead log and checkpoints have their own module (test_wal.py)."""

from __future__ import annotations

import socket

import lmdb
import pytest
import trio
import trio.testing

import kv
from kv import KVError


async def test_directory_of_the_first_format_is_refused_and_left_as_it_was(tmp_path):
    # Format 1 kept data in named databases "data" and "meta".
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=1 << 24)
    data = env.open_db(b"data")
    with env.begin(write=True, db=data) as txn:
        txn.put(b"kold", b"value")
    env.close()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name == "data.mdb"}
    with pytest.raises(KVError) as info:
        await kv.open(f"lmdb:{tmp_path}")
    assert info.value.code == 2000
    assert "format 1" in str(info.value) and str(tmp_path) in str(info.value)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name == "data.mdb"}
    assert after == before  # nothing written
    # and the directory is not left locked: a retry fails the same way, not "already open"
    with pytest.raises(KVError, match="format 1"):
        await kv.open(f"lmdb:{tmp_path}")


async def test_new_directory_is_stamped_and_reopens(tmp_path):
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        await db.transact(lambda tr: _set(tr, b"a", b"1"))
    env = lmdb.open(str(tmp_path), max_dbs=0, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"mformat") == b"3"
        assert txn.get(b"ka") == b"1"  # closing checkpointed the log into the tree
    env.close()
    assert list((tmp_path / "wal").iterdir()) == []  # ...and left no segment behind
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        tr = db.create_transaction()
        assert await tr.get(b"a") == b"1"
        # range reads see data keys only, never the engine's own records
        assert [kv_.key for kv_ in await tr.get_range(b"", b"\xff")] == [b"a"]
        assert [kv_.key for kv_ in await tr.get_range(b"", b"\xff", reverse=True)] == [b"a"]


async def _set(tr, k, v):  # idempotent: plain set
    tr.set(k, v)


@pytest.fixture
def any_disk_speed(monkeypatch):
    """Inline writes regardless of how slow this machine's syncs are right now
    (the slow-disk fallback has its own test below)."""
    import kv.lmdb_engine

    monkeypatch.setattr(kv.lmdb_engine, "INLINE_MAX_COMMIT_SECONDS", 3600.0)


async def test_lone_commits_are_written_inline_and_concurrent_ones_batched(tmp_path, any_disk_speed):
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        stats = db.engine.stats
        for i in range(20):
            tr = db.create_transaction()
            tr.set(b"seq/%02d" % i, b"v")
            await tr.commit()
        assert stats["inline_batches"] == stats["batches"] == 20

        inline0, batches0 = stats["inline_batches"], stats["batches"]

        async def writer(w: int) -> None:
            for n in range(10):
                tr = db.create_transaction()
                tr.set(b"w/%02d/%02d" % (w, n), b"v")
                await tr.commit()

        async with trio.open_nursery() as nursery:
            for w in range(32):
                nursery.start_soon(writer, w)
        batches = stats["batches"] - batches0
        assert batches < 320  # group commit: fewer batches than commits
        assert stats["inline_batches"] - inline0 < batches  # others were runnable: the writer thread wrote
        tr = db.create_transaction()
        assert len(await tr.get_range(b"w/", b"w0")) == 320


async def test_a_loop_of_inline_commits_still_lets_io_in(tmp_path, any_disk_speed):
    """A task waiting on I/O is not runnable when a lone commit starts (so the
    write is inline), but the commit yields afterwards, so the I/O is served
    between commits rather than after the whole loop."""
    a, b = socket.socketpair()
    reader_sock = trio.socket.from_stdlib_socket(b)
    received = 0

    async def reader() -> None:
        nonlocal received
        while True:
            data = await reader_sock.recv(64)
            if not data:
                return
            received += len(data)

    try:
        async with await kv.open(f"lmdb:{tmp_path}") as db:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await trio.sleep(0.05)  # the reader is parked in recv
                inline0 = db.engine.stats["inline_batches"]
                for i in range(10):
                    a.send(b"x")
                    tr = db.create_transaction()
                    tr.set(b"k%d" % i, b"v")
                    await tr.commit()  # the loop's only await
                served_during_loop = received
                inline = db.engine.stats["inline_batches"] - inline0
                a.shutdown(socket.SHUT_WR)
        assert inline >= 5  # mostly inline: the reader was not runnable when they started
        assert served_during_loop >= 9  # yet the reader ran between them
    finally:
        a.close()
        reader_sock.close()


async def test_the_idle_check_agrees_with_trios_public_statistics():
    from kv.lmdb_engine import _loop_is_idle

    def public() -> bool:
        stats = trio.lowlevel.current_statistics()
        return stats.tasks_runnable == 0 and stats.run_sync_soon_queue_size == 0

    assert _loop_is_idle() is public() is True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 0)  # runnable, not yet run
        assert _loop_is_idle() is public() is False
    trio.lowlevel.current_trio_token().run_sync_soon(lambda: None)  # a queued callback
    assert _loop_is_idle() is public() is False
    await trio.sleep(0.01)
    assert _loop_is_idle() is public() is True


async def test_a_slow_disk_sends_lone_commits_to_the_writer_thread(tmp_path):
    """While recent LMDB commits are slow, even a lone commit keeps the loop
    free (writer thread); when they are fast again, it is inline again."""
    from kv.lmdb_engine import INLINE_MAX_COMMIT_SECONDS

    async with await kv.open(f"lmdb:{tmp_path}") as db:
        store, stats = db.engine.store, db.engine.stats

        async def lone_commit(i: int) -> None:
            tr = db.create_transaction()
            tr.set(b"k%03d" % i, b"v")
            await tr.commit()

        store._commit_seconds = 100 * INLINE_MAX_COMMIT_SECONDS  # as after a run of slow syncs
        inline0 = stats["inline_batches"]
        await lone_commit(0)
        assert stats["inline_batches"] == inline0  # written by the thread
        # and its sync time was folded into the average (either way: under heavy load a
        # sync can take longer than the average's 0.2 s, and that is not what this tests)
        assert store._commit_seconds != 100 * INLINE_MAX_COMMIT_SECONDS
        store._commit_seconds = 0.0  # fast again
        # inline also needs an idle loop: let anything the thread's hand-back woke settle
        await trio.testing.wait_all_tasks_blocked()
        await lone_commit(1)
        assert stats["inline_batches"] == inline0 + 1


async def test_concurrent_batches_keep_version_order_and_lose_nothing(tmp_path):
    """With many writers, batches form while one is on the writer thread. Every
    commit must land exactly once, versions and versionstamps must follow
    commit order, and a read-modify-write counter must equal the number of
    increments acknowledged."""
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        acked: list[tuple[int, bytes]] = []
        increments = 0

        async def writer(w: int) -> None:
            nonlocal increments
            for n in range(25):
                tr = db.create_transaction()
                tr.set(b"c/%02d/%02d" % (w, n), b"v")
                tr.set_versionstamped_key(b"vs/" + b"\x00" * 10 + b"\x03\x00\x00\x00", b"%d/%d" % (w, n))
                stamp = tr.get_versionstamp()
                await tr.commit()
                acked.append((tr.get_committed_version(), await stamp))

                async def bump(tr):  # guarded: reads the counter, so a concurrent bump conflicts
                    raw = await tr.get(b"counter")
                    tr.set(b"counter", b"%d" % (int(raw or b"0") + 1))

                await db.transact(bump)
                increments += 1

        async with trio.open_nursery() as nursery:
            for w in range(48):
                nursery.start_soon(writer, w)
        stats = db.engine.stats
        assert stats["batches"] - stats["inline_batches"] > 0  # the writer thread's path ran
        tr = db.create_transaction()
        assert len(await tr.get_range(b"c/", b"c0")) == 48 * 25
        assert await tr.get(b"counter") == b"%d" % increments == b"%d" % (48 * 25)
        stamps = [kv_.key[3:13] for kv_ in await tr.get_range(b"vs/", b"vs0")]
        assert len(stamps) == len(set(stamps)) == 48 * 25
        # a versionstamp is its commit version and batch order, so sorting by one sorts by the other
        by_version = sorted(acked)
        assert [s for _, s in by_version] == sorted(s for _, s in acked)
        assert all(s[:8] == v.to_bytes(8, "big") for v, s in acked)


async def test_a_failed_batch_fails_only_its_own_commits(tmp_path, monkeypatch):
    """An error building one batch among concurrent ones (before anything of
    it reaches the log) reaches exactly the commits in that batch (nothing of
    it is stored, its staged overlay entries are gone); the pipeline goes on
    for the rest. (A failed log write instead stops commits: test_wal.py.)"""
    import kv.lmdb_engine

    original = kv.lmdb_engine.LmdbStore._stage
    failed_once = []

    def flaky(self, version, mutations):
        record, touched, dead = original(self, version, mutations)
        if not failed_once and any(m[0] == "set" and m[1].startswith(b"doomed") for m in mutations):
            failed_once.append(version)
            self._unstage(version, touched)  # as _stage does when it fails half-way
            raise lmdb.DiskError("injected failure building the batch")
        return record, touched, dead

    monkeypatch.setattr(kv.lmdb_engine.LmdbStore, "_stage", flaky)
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        outcomes: dict[bytes, str] = {}

        async def writer(w: int) -> None:
            for n in range(20):
                key = (b"doomed/%02d/%02d" if n == 10 else b"ok/%02d/%02d") % (w, n)
                tr = db.create_transaction()
                tr.set(key, b"v")
                try:
                    await tr.commit()
                    outcomes[key] = "ok"
                except lmdb.DiskError:
                    outcomes[key] = "failed"

        async with trio.open_nursery() as nursery:
            for w in range(32):
                nursery.start_soon(writer, w)
        assert failed_once
        failed = {k for k, o in outcomes.items() if o == "failed"}
        assert any(k.startswith(b"doomed") for k in failed)  # the batch holding the first doomed key
        tr = db.create_transaction()
        stored = {kv_.key for kv_ in await tr.get_range(b"", b"\xff")}
        assert stored == {k for k, o in outcomes.items() if o == "ok"}  # exactly the acknowledged ones
        assert len(outcomes) == 32 * 20


def _stored_applied(path) -> int:
    env = lmdb.open(str(path), max_dbs=0, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return int.from_bytes(txn.get(b"mapplied"), "big")
    finally:
        env.close()


async def test_a_reopened_store_starts_above_every_version_it_used(tmp_path):
    versions = []
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        for i in range(30):
            tr = db.create_transaction()
            tr.set(b"k%02d" % i, b"v")
            await tr.commit()
            versions.append(tr.get_committed_version())
    assert versions == sorted(set(versions))
    applied = _stored_applied(tmp_path)
    assert applied == max(versions)  # the tree records exactly the newest batch it holds
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        tr = db.create_transaction()
        assert await tr.get(b"k29") == b"v"
        assert await tr.get_read_version() >= applied
        tr.set(b"after", b"v")
        await tr.commit()
        assert tr.get_committed_version() > applied  # no version reused across the restart


async def test_snapshot_versions_are_exact_while_the_writer_thread_commits(tmp_path):
    """A reader opened while batches are staged and logged on the writer
    thread sees exactly the keys of versions up to its read version, never
    one from a later (staged, not yet durable) batch."""
    async with await kv.open(f"lmdb:{tmp_path}") as db:
        written: dict[bytes, int] = {}
        done = False

        async def writer(w: int) -> None:
            for n in range(40):
                tr = db.create_transaction()
                key = b"s/%02d/%02d" % (w, n)
                tr.set(key, b"v")
                await tr.commit()
                written[key] = tr.get_committed_version()

        async def reader() -> None:
            checks = 0
            while not done or checks == 0:
                tr = db.create_transaction()
                rv = await tr.get_read_version()
                seen = {kv_.key for kv_ in await tr.get_range(b"s/", b"s0")}
                # everything acknowledged at or before rv is visible, nothing committed later is
                for key in seen:
                    assert key not in written or written[key] <= rv
                for key, version in list(written.items()):
                    if version <= rv:
                        assert key in seen
                checks += 1
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            async with trio.open_nursery() as writers:
                for w in range(16):
                    writers.start_soon(writer, w)
            done = True
        assert len(written) == 16 * 40


async def test_closing_with_commits_queued_answers_every_one(tmp_path):
    """Closing while commits are queued behind a batch on its way to disk:
    the one on disk finishes, every commit still waiting is answered
    (committed or "database is closed"), none hangs."""
    db = await kv.open(f"lmdb:{tmp_path}")
    outcomes: list[str] = []

    async def writer(w: int) -> None:
        for n in range(50):
            try:
                tr = db.create_transaction()
                tr.set(b"q/%02d/%02d" % (w, n), b"v")
                await tr.commit()
                outcomes.append("ok")
            except KVError as e:
                assert e.code == 2000
                outcomes.append("closed")
                return

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for w in range(32):
                nursery.start_soon(writer, w)
            while db.engine.stats["batches"] - db.engine.stats["inline_batches"] < 3:
                await trio.sleep(0.001)
            await db.close()
    assert "closed" in outcomes and "ok" in outcomes
    assert outcomes.count("closed") == 32  # every writer was told, once
