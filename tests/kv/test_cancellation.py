"""Cancellation and the commit path: trio's rule that every async operation is a checkpoint."""

from __future__ import annotations

import trio

import kv

N_MAX = 200_000  # commits the loop below may make: far more than fit in its deadline on either engine


async def test_a_task_committing_in_a_loop_can_be_cancelled(tmp_path):
    """``await tr.commit()`` raises Cancelled in a cancelled scope before anything is sent (once
    handed over a commit is never abandoned). Before, a task committing in a loop on the durable
    engine could not be cancelled at all: the pipeline's waits are uninterruptible and an inline
    write yields only in a shielded checkpoint, so a Ctrl-C left such a process committing forever.
    (The memory engine's lone commits do not yield at all, on purpose: the simulator's schedules
    depend on it. There a deadline is only seen at the loop's next real checkpoint.)"""
    db = await kv.open(f"lmdb:{tmp_path / 'data'}")
    n = 0
    with trio.move_on_after(0.05) as scope:
        while n < N_MAX:
            tr = db.create_transaction()
            tr.set(b"loop/%08d" % n, b"v")
            await tr.commit()
            n += 1
    assert scope.cancelled_caught, f"never cancelled: {n} commits"
    assert 0 < n < N_MAX
    tr = db.create_transaction()
    rows = await tr.get_range(b"loop/", b"loop0")
    assert len(rows) == n  # every commit that returned is there, and nothing after the cancel
    await db.close()


async def test_a_cancelled_commit_sends_nothing(db):
    tr = db.create_transaction()
    tr.set(b"never", b"x")
    with trio.CancelScope() as scope:
        scope.cancel()
        await tr.commit()
    assert scope.cancelled_caught
    assert await db.create_transaction().get(b"never") is None
