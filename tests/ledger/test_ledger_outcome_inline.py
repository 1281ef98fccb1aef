"""Session 17: a settled run's outcome, when small (ledger.runs.INLINE_OUTCOME_BYTES), is kept in
its run record (``"out"``), which the settle writes anyway: one key less per settle. Larger
outcomes keep their chunks; outcomes settled before (chunks, a record without ``"out"``) still
read, wake waiters and answer a repeated submit."""

from __future__ import annotations

import trio

from ledger import COMPLETED, Ledger, completed, failed
from ledger.runs import INLINE_OUTCOME_BYTES
from sessions import Owner, Sessions
from sessions.codec import dumps, loads

OWNER = Owner("test", "u1")


def make(db):
    s = Sessions(db)
    return Ledger(db, journal=s.journal)


async def _rows(db, r):
    return await db.transact(lambda tr: tr.get_range(r.start, r.stop))  # read-only


async def _record(db, L, run_id):
    return loads(await db.transact(lambda tr: tr.get(L.keys.run(run_id))))  # read-only


async def test_a_small_outcome_is_kept_in_the_run_record(db):
    L = make(db)
    ack = await L.submit("a", {"n": 1}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    got = []
    async with trio.open_nursery() as n:
        async def wait():
            got.append(await L.wait_settled(ack.run_id))
        n.start_soon(wait)
        await trio.sleep(0.05)  # the waiter is watching the run record
        out = completed({"answer": 42})
        assert await L.settle(lease, out) == out
    assert got == [out]
    assert await _rows(db, L.keys.outcome(ack.run_id).range()) == []
    rec = await _record(db, L, ack.run_id)
    assert rec["state"] == COMPLETED and loads(rec["out"]) == out
    assert (await L.get_run(ack.run_id)).outcome == out
    assert await L.wait_settled(ack.run_id) == out
    assert await L.settle(lease, out) == out  # settling again with the same lease: the stored outcome
    again = await L.submit("a", {"n": 1}, None, owner=OWNER, conversation="c")
    assert not again.created and again.outcome == out
    # one past the inline size goes to chunks
    ack2 = await L.submit("b", {"n": 2}, None, owner=OWNER, conversation="c2")
    lease2 = await L.claim("w")
    big = failed({"type": "x", "detail": "z" * INLINE_OUTCOME_BYTES})
    await L.settle(lease2, big)
    assert len(await _rows(db, L.keys.outcome(ack2.run_id).range())) == 1
    assert "out" not in await _record(db, L, ack2.run_id)
    assert (await L.get_run(ack2.run_id)).outcome == big


async def test_an_outcome_of_the_older_layout_still_reads(db):
    """A run settled by the older layout: its record without "out", its outcome in chunk 0."""
    L = make(db)
    ack = await L.submit("old", {"n": 1}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    out = completed("old result")
    await L.settle(lease, out)
    rec = await _record(db, L, ack.run_id)

    async def older(tr):  # a test without retries: rewrite it as the older settle stored it
        del rec["out"]
        tr.set(L.keys.run(ack.run_id), dumps(rec))
        tr.set(L.keys.outcome_chunk(ack.run_id, 0), dumps(out))

    await db.transact(older)
    assert (await L.get_run(ack.run_id)).outcome == out
    assert await L.wait_settled(ack.run_id) == out
    assert await L.settle(lease, out) == out
    again = await L.submit("old", {"n": 1}, None, owner=OWNER, conversation="c")
    assert again.outcome == out
