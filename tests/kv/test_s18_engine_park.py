"""The engine's own park and wake of a committer (kv.engine._park / _WOKEN): a waiting
committer is woken once by its batch, is not cancelled while parked, and anything but the
engine's own wake-up value sent into the park is unwrapped as trio's call would."""

from __future__ import annotations

import outcome
import pytest
import trio
import trio.testing

import kv
from kv import engine as engine_mod

WRITERS = 64
COMMITS = 5


@pytest.mark.parametrize("url", ["memory:", "lmdb"])
async def test_concurrent_committers_are_each_woken_with_their_outcome(tmp_path, url):
    db = await kv.open(url if url == "memory:" else f"lmdb:{tmp_path / 'data'}")
    seen_conflicts = 0

    async def writer(w: int) -> None:
        nonlocal seen_conflicts
        for i in range(COMMITS):
            tr = db.create_transaction()
            await tr.get(b"hot")  # a read conflict range on the key everyone writes
            tr.set(b"hot", b"%d/%d" % (w, i))
            tr.set(b"w/%02d/%02d" % (w, i), b"v")
            try:
                await tr.commit()
            except kv.KVError as exc:
                assert exc.code == 1020
                seen_conflicts += 1

    async with trio.open_nursery() as n:
        for w in range(WRITERS):
            n.start_soon(writer, w)
    rows = await db.create_transaction().get_range(b"w/", b"w0")
    assert len(rows) == WRITERS * COMMITS - seen_conflicts
    if url == "lmdb":
        assert db._engine.stats["batches"] < WRITERS * COMMITS  # parked waiters were batched and woken
    await db.close()


async def test_a_parked_committer_is_not_cancelled_and_hears_its_commit(tmp_path):
    db = await kv.open(f"lmdb:{tmp_path / 'data'}")
    results: dict[int, str] = {}

    async def writer(w: int, scope_box: list) -> None:
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            tr = db.create_transaction()
            tr.set(b"c/%02d" % w, b"v")
            await tr.commit()
            results[w] = "committed"
            await trio.lowlevel.checkpoint()
        if scope.cancelled_caught:
            results[w] = results.get(w, "") + "+cancelled"

    scopes: list = []
    async with trio.open_nursery() as n:
        for w in range(16):
            n.start_soon(writer, w, scopes)
        await trio.testing.wait_all_tasks_blocked()  # the leader waits on its sync, the rest are parked
        for s in scopes:
            s.cancel()  # some are parked in the pipeline now: they must still finish their commit
    committed = await db.create_transaction().get_range(b"c/", b"c0")
    # every commit that reported success is there; none was left half-way
    for w, outcome_ in results.items():
        if outcome_.startswith("committed"):
            assert (b"c/%02d" % w, b"v") in committed
    assert len(committed) == sum(1 for o in results.values() if o.startswith("committed"))
    # the cancellation reached commits already in the pipeline: they finished, then heard it
    assert sum(1 for o in results.values() if o == "committed+cancelled") > 1
    await db.close()


async def test_the_park_unwraps_anything_but_the_engines_wake_up():
    task_box: list = []

    async def parked(expect_error: bool) -> None:
        task_box.append(trio.lowlevel.current_task())
        if expect_error:
            with pytest.raises(ZeroDivisionError):
                await engine_mod._park()
        else:
            assert await engine_mod._park() is None

    async with trio.open_nursery() as n:
        n.start_soon(parked, False)
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.reschedule(task_box.pop(), engine_mod._WOKEN)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(parked, True)
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.reschedule(task_box.pop(), outcome.Error(ZeroDivisionError()))
    async with trio.open_nursery() as n:
        n.start_soon(parked, False)
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.reschedule(task_box.pop())  # trio's own Value(None): unwrapped, None
    # the shared wake-up value was never unwrapped (it can wake any number of parks)
    assert not engine_mod._WOKEN._unwrapped
