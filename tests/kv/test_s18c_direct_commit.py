"""Session 18 (c): Database.transact commits a plain transaction itself (Transaction._commit_request,
then the engine awaited from transact: no commit() coroutine frame). It must behave as
``await tr.commit()`` did: committed version, versionstamp, conflicts and retries, size limit,
cancellation, watches, and a subclass's own commit() (sim.oracle's RecordingTransaction)."""

from __future__ import annotations

import trio
import pytest

import kv
from kv.transaction import Transaction
from kvtest_helpers import open_backend


async def test_committed_version_and_versionstamp(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    seen = {}

    async def fn(tr):
        tr.set(b"a", b"1")
        seen["tr"] = tr
        seen["vs"] = tr.get_versionstamp()

    await db.transact(fn)
    tr = seen["tr"]
    version = tr.get_committed_version()
    assert version > 0
    stamp = await seen["vs"]
    assert stamp[:8] == version.to_bytes(8, "big") and len(stamp) == 10

    async def read(tr):
        return await tr.get(b"a")

    assert await db.transact(read) == b"1"

    async def nothing(tr):  # a read-only transaction: nothing to commit
        seen["ro"] = tr
        return await tr.get(b"a")

    assert await db.transact(nothing) == b"1"
    assert seen["ro"].get_committed_version() == -1
    # a used transaction's commit is refused, direct or not
    with pytest.raises(kv.KVError) as info:
        tr.set(b"b", b"2")
    assert info.value.code == 2017


async def test_conflict_retries_through_the_direct_commit(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    calls = []

    async def fn(tr):
        calls.append(1)
        value = int(await tr.get(b"n") or b"0")
        if len(calls) == 1:  # another commit to n between our read and our commit
            async def bump(tr2):
                tr2.set(b"n", b"10")
            await db.transact(bump)
        tr.set(b"n", str(value + 1).encode())

    await db.transact(fn)
    assert len(calls) == 2

    async def read(tr):
        return await tr.get(b"n")

    assert await db.transact(read) == b"11"


async def test_size_limit_error_passes_through(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")

    async def fn(tr):
        tr.options.set_size_limit(32)
        tr.set(b"k", b"v" * 100)

    with pytest.raises(kv.KVError) as info:
        await db.transact(fn)
    assert info.value.code == 2101


async def test_cancelled_transact_commits_nothing(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")

    async def fn(tr):
        tr.set(b"c", b"1")
        trio.current_effective_deadline()  # (no checkpoint in fn: the cancel lands at the commit)
        scope.cancel()

    with trio.CancelScope() as scope:
        await db.transact(fn)
    assert scope.cancelled_caught

    async def read(tr):
        return await tr.get(b"c")

    assert await db.transact(read) is None


async def test_watch_goes_through_commit(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    box = {}

    async def fn(tr):
        box["w"] = tr.watch(b"w")

    await db.transact(fn)

    async def write(tr):
        tr.set(b"w", b"1")

    await db.transact(write)
    with trio.fail_after(5):
        await box["w"]


def test_only_a_plain_commit_is_direct():
    assert Transaction._direct_commit is True

    class Keeps(Transaction):
        __slots__ = ()

    class Overrides(Transaction):
        __slots__ = ()

        async def commit(self) -> None:
            await super().commit()

    assert Keeps._direct_commit is True
    assert Overrides._direct_commit is False
    from sim.oracle import RecordingTransaction
    assert RecordingTransaction._direct_commit is False


async def test_an_overriding_commit_is_called(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    calls = []

    class Counting(Transaction):
        async def commit(self) -> None:
            calls.append(1)
            await super().commit()

    db.create_transaction = lambda: Counting(db)

    async def fn(tr):
        tr.set(b"o", b"1")

    await db.transact(fn)
    assert calls == [1]
