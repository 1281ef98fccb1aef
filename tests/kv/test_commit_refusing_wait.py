"""A pipelined LMDB commit is seen through without a shielded cancel scope.

The engine hands a batch to the log's sync helper and waits for the answer;
that wait refuses cancellation by itself (``walsync._wait_readable_refusing_cancel``:
trio's epoll wait with an abort that fails), so no ``CancelScope(shield=True)``
(~48k instructions entered and left) is needed to keep the rule that a commit
handed to the pipeline is never abandoned. These hold the rule, and the wait.
"""

from __future__ import annotations

import socket
import time

import pytest
import trio

import kv
import kv.lmdb_engine
import kv.walsync as walsync
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore


def _open(path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path), clock=time.time), url=f"lmdb:{path}")


async def test_a_pipelined_commit_cancelled_while_its_sync_is_out_still_lands(tmp_path, monkeypatch):
    monkeypatch.setattr(kv.lmdb_engine, "INLINE_WHEN_IDLE", False)  # every batch through the helper
    db = _open(tmp_path / "data")
    engine = db._engine
    store = engine.store
    assert engine._waits_refuse_cancel == walsync._REFUSING_WAIT
    events: list[str] = []
    try:
        for round_ in range(3):
            key = b"k%d" % round_

            async def committer(scope: trio.CancelScope) -> None:
                with scope:
                    tr = db.create_transaction()
                    tr.set(key, b"v")  # blind write: idempotent
                    await tr.commit()
                    events.append("committed")
                    await trio.sleep(0)  # the cancellation arrives here, after the commit
                    events.append("not cancelled")
                events.append("cancelled" if scope.cancelled_caught else "scope left")

            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                nursery.start_soon(committer, scope)
                while not store._sync._out:  # until the batch is written and its sync requested
                    await trio.sleep(0)
                scope.cancel()
            assert events == ["committed", "cancelled"], events
            events.clear()
            tr = db.create_transaction()
            assert await tr.get(key) == b"v"
        assert engine.stats["inline_batches"] == 0
    finally:
        await db.close()
    db = _open(tmp_path / "data")  # and durable: the reopened store has them
    try:
        tr = db.create_transaction()
        assert [await tr.get(b"k%d" % i) for i in range(3)] == [b"v"] * 3
    finally:
        await db.close()


@pytest.mark.skipif(not walsync._REFUSING_WAIT, reason="the refusing wait copies trio 0.32's epoll wait (walsync.REFUSING_WAIT_TRIO); not used here")
async def test_the_refusing_wait_outlasts_a_cancel_and_wakes_on_data_or_close():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        order: list[str] = []

        async def waiter() -> None:
            with trio.CancelScope() as scope:
                scope.cancel()  # cancelled before it waits: the wait still waits
                await walsync._wait_readable_refusing_cancel(a)
                order.append("readable")
                await trio.sleep(0)
                order.append("not cancelled")
            order.append("cancelled" if scope.cancelled_caught else "left")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            for _ in range(5):
                await trio.sleep(0)
            assert order == []  # still waiting despite the cancel
            b.send(b"x")
        assert order == ["readable", "cancelled"]
        assert a.recv(1) == b"x"

        # notify_closing wakes it with ClosedResourceError, as trio's wait_readable
        closed: list[BaseException] = []

        async def closing_waiter() -> None:
            try:
                await walsync._wait_readable_refusing_cancel(a)
            except trio.ClosedResourceError as exc:
                closed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(closing_waiter)
            for _ in range(3):
                await trio.sleep(0)
            trio.lowlevel.notify_closing(a)
        assert len(closed) == 1
    finally:
        a.close()
        b.close()
