"""The cancel request carried by the lease record (ledger/keyspace.py, ``("rl", run)``'s "cancel").

A worker's every write reads its run's lease (the fencing check); once a cancel of the run is
requested, that record says so, so the worker need not read the cancel record as well. These
tests hold every path that writes a lease to it: a cancel of a running run rewrites the lease
(same token, expiry and nonce: the holder is not fenced by it), which makes a worker
transaction that read the lease before it conflict and its retry see the flag; renewals keep
it; a claim and a takeover of a cancelled run set it (from the cancel record, or from the
lease taken over), and a claim racing a cancel conflicts rather than dropping it; the
interrupt policy's cancel sets it; a release, park or settle clears the lease and the next
claim sets it again. And a takeover still fences the cancelled run's old worker.
"""

from __future__ import annotations

import pytest

from ledger import CANCELLED, QUEUED, RUNNING, LeaseLost, Ledger, cancelled, completed
from sessions import Owner, Sessions
from sessions.codec import dumps

OWNER = Owner("test", "u1")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _lease_rec(L, lease):
    return await L.db.transact(lambda tr: L.check_lease(tr, lease))  # read-only


async def _raw_lease(L, run_id):
    return await L.db.transact(lambda tr: tr.get(L.keys.lease(run_id)))  # read-only


async def test_a_cancel_of_a_running_run_rewrites_its_lease_under_the_same_token(db, clock):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("A", lease_seconds=10)
    before = dict(await _lease_rec(L, lease))
    assert "cancel" not in before
    assert await L.cancel(ack.run_id, reason="user") == RUNNING
    after = await _lease_rec(L, lease)  # the holder is not fenced by the rewrite
    assert after == {**before, "cancel": True}
    assert await L.cancel_requested(ack.run_id)  # the cancel record too, as before
    raw = await _raw_lease(L, ack.run_id)
    assert await L.cancel(ack.run_id) == RUNNING  # again: idempotent, the lease not rewritten
    assert await _raw_lease(L, ack.run_id) == raw
    # the expiry index still names the lease: it is taken over when it lapses, flag and all
    clock.advance(11)
    b = await L.claim("B", lease_seconds=10)
    assert b is not None and b.run_id == ack.run_id and b.takeover and b.token == lease.token + 1
    assert (await _lease_rec(L, b))["cancel"] is True
    # the takeover fences the old holder, cancel or not
    with pytest.raises(LeaseLost):
        await _lease_rec(L, lease)
    with pytest.raises(LeaseLost):
        await L.settle(lease, cancelled("A"))
    assert await L.settle(b, cancelled("user")) == cancelled("user")
    assert (await L.get_run(ack.run_id)).state == CANCELLED
    assert await _raw_lease(L, ack.run_id) is None


async def test_a_cancel_committed_after_a_workers_lease_read_makes_it_conflict_and_retry(db, clock):
    """Promise 7 at a worker's boundary: the lease read is the worker's read of the request."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("A", lease_seconds=10)
    attempts = []

    async def worker_write(tr):  # guarded: lease check
        attempts.append(1)
        rec = await L.check_lease(tr, lease)
        if len(attempts) == 1:
            await L.cancel(ack.run_id)  # another transaction, committed after this attempt's read
        tr.set(L.keys.base.pack(("test-worker-write",)), b"")  # (a read-only attempt never conflicts)
        return rec.get("cancel", False)

    assert await db.transact(worker_write) is True
    assert attempts == [1, 1]  # the first attempt conflicted on the lease it read


@pytest.mark.parametrize("how", ["renew", "renew_many"])
async def test_a_renewal_keeps_the_cancel(db, clock, how):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("A", lease_seconds=10)
    await L.cancel(ack.run_id)
    clock.advance(5)
    if how == "renew":
        await L.renew(lease, 10)
    else:
        assert await L.renew_many([lease], 10) == set()
    rec = await _lease_rec(L, lease)
    assert rec["cancel"] is True and rec["expires_at"] == clock.t + 10


async def test_a_renewal_racing_a_cancel_does_not_drop_it(db, clock):
    """The renewal read the lease before the cancel rewrote it: it conflicts, and its retry
    extends the rewritten record (had it written the record it read, the flag was lost)."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("A", lease_seconds=10)
    get_lease = L.keys.lease(ack.run_id)
    cancelled_once = []

    class Tr:  # the renewal's transaction, cancelled under it after its lease read
        def __init__(self, tr):
            self._tr = tr

        async def get(self, key):
            v = await self._tr.get(key)
            if key == get_lease and not cancelled_once:
                cancelled_once.append(1)
                await L.cancel(ack.run_id)
            return v

        def __getattr__(self, name):
            return getattr(self._tr, name)

    transact = db.transact

    async def renew_through(fn):
        return await transact(lambda tr: fn(Tr(tr)))

    L.db = type("DB", (), {"transact": staticmethod(renew_through)})()
    try:
        await L.renew(lease, 10)
    finally:
        L.db = db
    assert cancelled_once == [1]
    assert (await _lease_rec(L, lease))["cancel"] is True


@pytest.mark.parametrize("how", ["released", "parked"])
async def test_a_claim_of_a_cancelled_run_sets_it_from_the_cancel_record(db, clock, how):
    """Cancelled while it had no lease (released, or parked: made runnable by the cancel)."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)
    await L.release(a, park=how == "parked")
    assert await L.cancel(ack.run_id) == QUEUED
    b = await L.claim("B", lease_seconds=10)
    assert b.run_id == ack.run_id and not b.takeover
    assert (await _lease_rec(L, b))["cancel"] is True
    assert b.seen is not None and b.seen[1]["cancel"] is True  # as the claim wrote it
    # a run of another conversation, never cancelled: no flag
    ack2 = await L.submit("k2", {}, None, owner=OWNER, conversation="c2")
    d = await L.claim("D", lease_seconds=10)
    assert d.run_id == ack2.run_id and "cancel" not in await _lease_rec(L, d)


async def test_a_takeover_reads_the_cancel_record_when_the_old_lease_has_no_flag(db, clock):
    """A cancel record beside a lease without the flag (a lease written before the lease carried
    it): the takeover's lease has the flag all the same."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)

    async def old_cancel(tr):  # guarded: a blind set of the record, the same each time
        tr.set(L.keys.cancel(ack.run_id), dumps({"at": clock.t, "reason": "old"}))

    await db.transact(old_cancel)
    assert "cancel" not in await _lease_rec(L, a)
    clock.advance(11)
    b = await L.claim("B", lease_seconds=10)
    assert b.run_id == ack.run_id and b.takeover
    assert (await _lease_rec(L, b))["cancel"] is True


async def test_a_claim_racing_a_cancel_conflicts_and_its_retry_carries_it(db, clock):
    """The cancel commits between the claim's read of the cancel record and its commit (inside
    its ``on_claimed`` hook): the claim conflicts, and the lease it then writes has the flag."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    await L.release(await L.claim("A", lease_seconds=10))  # queued again, claims > 0
    seen = []

    async def on_claimed(tr, lease):
        seen.append(lease.seen[1].get("cancel", False))
        if len(seen) == 1:
            assert await L.cancel(ack.run_id) == QUEUED  # commits now, before the claim
        return None

    b = await L.claim("B", lease_seconds=10, on_claimed=on_claimed)
    assert b.run_id == ack.run_id
    assert seen == [False, True]
    assert (await _lease_rec(L, b))["cancel"] is True


async def test_the_interrupt_policy_sets_it_on_the_running_run(db, clock):
    s, L = make(db, clock)
    first = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w", lease_seconds=10)
    await L.submit("b", {}, None, owner=OWNER, conversation="c", policy="interrupt")
    assert (await _lease_rec(L, lease))["cancel"] is True
    assert await L.settle(lease, cancelled("interrupted")) == cancelled("interrupted")
    assert (await L.get_run(first.run_id)).state == CANCELLED


async def test_an_exhausted_runs_finalising_claim_carries_it(db, clock):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c", max_attempts=1)
    a = await L.claim("A", lease_seconds=10)
    await L.cancel(ack.run_id)
    clock.advance(11)  # A died
    b = await L.claim("B", lease_seconds=10, finalize_exhausted=True)
    assert b.run_id == ack.run_id and b.exhausted
    assert (await _lease_rec(L, b))["cancel"] is True


async def test_runs_never_cancelled_and_settled_ones_get_no_flag(db, clock):
    """A cancel of a settled run, or of a queued never-claimed one (settled by it), writes no lease."""
    s, L = make(db, clock)
    ack, lease = await L.submit_and_claim("k", {}, None, owner=OWNER, conversation="c", worker_id="A")
    assert "cancel" not in lease.seen[1] and "cancel" not in await _lease_rec(L, lease)
    q = await L.submit("q", {}, None, owner=OWNER, conversation="c")  # queued behind it
    assert await L.settle(lease, completed("done")) == completed("done")
    assert await L.cancel(ack.run_id) == "completed"
    assert await _raw_lease(L, ack.run_id) is None
    nxt = await L.claim("B", lease_seconds=10)
    assert nxt.run_id == q.run_id and "cancel" not in await _lease_rec(L, nxt)
    await L.settle(nxt, completed())
    r = await L.submit("r", {}, None, owner=OWNER, conversation="c2")
    assert await L.cancel(r.run_id) == CANCELLED
    assert await _raw_lease(L, r.run_id) is None
