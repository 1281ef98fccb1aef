"""Session 19: Ledger._submit_tr hands its callers a tuple (ack, ref, lease, run_id, status)
instead of a _PendingAck; submit and submit_and_claim make the acknowledgement from it
inline, submit_tr still returns a _PendingAck. Whichever entry point, the same
acknowledgement: a new run's (its run.queued cursor), and a repeated id's (created False,
the settled outcome)."""

from __future__ import annotations

from ledger import COMPLETED, QUEUED, RUNNING, Acknowledgement, Ledger, completed
from sessions import Owner, Sessions

OWNER = Owner("test", "u1")


async def test_every_entry_point_acknowledges_alike(db, clock):
    s = Sessions(db, clock=clock)
    L = Ledger(db, journal=s.journal, clock=clock)
    a, lease = await L.submit_and_claim("a", {"n": 1}, None, owner=OWNER, conversation="c", worker_id="w")
    assert isinstance(a, Acknowledgement) and (a.status, a.created, lease.run_id) == (RUNNING, True, a.run_id)
    b = await L.submit("b", {"n": 2}, None, owner=OWNER, conversation="c")
    assert (b.status, b.created, b.outcome) == (QUEUED, True, None)

    async def via_tr(tr):  # guarded: submit_tr reads the submission record first
        return await L.submit_tr(tr, "t", {"n": 3}, None, owner=OWNER, conversation="c")

    pending = await db.transact(via_tr)
    t = await pending.result()
    assert (t.submission_id, t.status, t.created) == ("t", QUEUED, True)
    page = await s.journal.read(OWNER, "c", limit=50)
    queued = [e.cursor for e in page.events if e.type == "run.queued"]
    assert queued == [a.cursor, b.cursor, t.cursor]
    # a repeated id, by each entry point: the same run, created False
    b2 = await L.submit("b", {"n": 2}, None, owner=OWNER, conversation="c")
    b3, none = await L.submit_and_claim("b", {"n": 2}, None, owner=OWNER, conversation="c", worker_id="w2")
    assert none is None
    for again in (b2, b3):
        assert (again.run_id, again.cursor, again.status, again.created, again.outcome) == (
            b.run_id, b.cursor, QUEUED, False, None)
    # settled: the repeat carries the outcome
    await L.settle(lease, completed("done"))
    a2 = await L.submit("a", {"n": 1}, None, owner=OWNER, conversation="c")
    a3, lease3 = await L.submit_and_claim("a", {"n": 1}, None, owner=OWNER, conversation="c", worker_id="w")
    for again in (a2, a3):
        assert (again.run_id, again.cursor, again.status, again.created) == (a.run_id, a.cursor, COMPLETED, False)
        assert again.outcome["result"] == "done"
    assert lease3 is None
