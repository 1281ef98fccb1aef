"""What a worker's transaction no longer reads back, and the reads that still guard it.

A settle given the lease record its transaction's check read (``lease_rec``) settles from the
run record its claim wrote, without reading it; a usage step a caller proves new is counted
without reading its marker (``UsageBook.record_tr(..., new=True)``). The lease check stays a real read:
a worker whose lease was taken over is refused, before and during the takeover, and nothing
of its settle lands.
"""

from __future__ import annotations

import pytest

from ledger import COMPLETED, RUNNING, LeaseLost, Ledger, completed
from sessions import Owner, Sessions

OWNER = Owner("test", "u1")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _settle_with_check(L, lease, outcome):
    """A runner's settle: the lease check, then the settle given the record it read."""

    async def fn(tr):  # guarded: lease check
        rec = await L.check_lease(tr, lease)
        return await L.settle_tr(tr, lease, outcome, lease_rec=rec)

    return await L.db.transact(fn)


@pytest.mark.parametrize("how", ["claim", "submit_and_claim"])
async def test_a_settle_from_the_claimed_run_record_stores_what_a_read_one_did(db, clock, how):
    s, L = make(db, clock)
    if how == "claim":
        ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
        lease = await L.claim("A", lease_seconds=10)
    else:
        ack, lease = await L.submit_and_claim("k", {}, None, owner=OWNER, conversation="c", worker_id="A")
    assert lease.run_seen is not None
    clock.advance(1)
    assert await _settle_with_check(L, lease, completed("done")) == completed("done")
    run = await L.get_run(ack.run_id)
    assert run.state == COMPLETED and run.outcome == completed("done")
    assert await L.active_run(OWNER, "c") is None
    # the conversation's next run starts at once (the FIFO advanced with the settle)
    ack2, lease2 = await L.submit_and_claim("k2", {}, None, owner=OWNER, conversation="c", worker_id="A")
    assert lease2 is not None and lease2.run_id == ack2.run_id


async def test_a_fenced_worker_is_refused_although_its_settle_reads_no_run_record(db, clock):
    """Worker A's lease lapsed and B took the run over: A's settle (lease check + settle from
    its claim's run record) is refused with LeaseLost, and the run stays B's."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)
    clock.advance(11)
    b = await L.claim("B", lease_seconds=10)
    assert b.run_id == a.run_id and b.token == a.token + 1 and a.run_seen is not None
    with pytest.raises(LeaseLost):
        await _settle_with_check(L, a, completed("from A"))
    run = await L.get_run(ack.run_id)
    assert run.state == RUNNING and run.attempt == 2
    assert await _settle_with_check(L, b, completed("from B")) == completed("from B")
    assert (await L.get_run(ack.run_id)).outcome == completed("from B")


async def test_a_takeover_racing_a_settle_makes_it_conflict_then_lose(db, clock):
    """The takeover commits after A's lease check read: A's commit conflicts on the lease key
    it read (1020), and the retry finds the lease gone: nothing of A's settle is stored."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=5)
    clock.advance(6)
    attempts = []

    async def fn(tr):  # guarded: lease check
        attempts.append(1)
        rec = await L.check_lease(tr, a)
        if len(attempts) == 1:
            await L.claim("B", lease_seconds=5)  # commits after our read
        return await L.settle_tr(tr, a, completed("from A"), lease_rec=rec)

    with pytest.raises(LeaseLost):
        await db.transact(fn)
    assert len(attempts) == 2
    run = await L.get_run(ack.run_id)
    assert run.state == RUNNING and run.outcome is None


async def test_a_new_usage_step_is_counted_as_record_counts_it(db, clock):
    s, L = make(db, clock)
    await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("A", lease_seconds=10)
    u = {"input_tokens": 100, "output_tokens": 20, "cache_read_tokens": 0}

    async def fn(tr):  # guarded: lease check (the step is new by the caller's own guard)
        await L.check_lease(tr, lease)
        assert await L.usage.record_tr(tr, lease.run_id, "model-1", u, run_exists=True, new=True) is True

    await db.transact(fn)
    assert await L.usage.record(lease.run_id, "model-2", {"input_tokens": 1}) is True
    # the marker is the one record() writes: the same figures again are not counted twice,
    # other figures are a conflict
    assert await L.usage.record(lease.run_id, "model-1", u) is False
    assert await L.usage.totals(lease.run_id) == {"input_tokens": 101, "output_tokens": 20, "total_tokens": 121}
    with pytest.raises(ValueError):
        await db.transact(lambda tr: L.usage.record_tr(tr, lease.run_id, "", u, new=True))
    with pytest.raises(ValueError):
        await db.transact(lambda tr: L.usage.record_tr(tr, lease.run_id, "model-3", {"input_tokens": -1}, new=True))


# -- the FIFO holds only runs queued behind the active one ---------------------------------


def _tag():
    from sessions.owners import as_tag

    return as_tag(OWNER)


async def _fifo_ids(db, L, conv="c"):
    r = L.keys.fifo_range(_tag(), conv)
    tr = db.create_transaction()
    return [row.value.decode() for row in await tr.get_range(r.start, r.stop)]


async def test_a_run_active_from_its_submit_has_no_fifo_entry_and_the_queue_still_advances(db, clock):
    # (Session 18: no run gets a FIFO entry any more, queued or not: the FIFO is the history
    # after the active run; tests/ledger/test_s18_fifo_in_history.py.)
    s, L = make(db, clock)
    a, lease_a = await L.submit_and_claim("a", {}, None, owner=OWNER, conversation="c", worker_id="w")
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    assert await _fifo_ids(db, L) == []
    assert await L.claim("w2", lease_seconds=10) is None  # b and c wait behind a
    await L.settle(lease_a, completed("a"))
    assert await L.active_run(OWNER, "c") == b.run_id
    lease_b = await L.claim("w2", lease_seconds=10)
    assert lease_b.run_id == b.run_id
    await L.settle(lease_b, completed("b"))
    assert await _fifo_ids(db, L) == []
    lease_c = await L.claim("w2", lease_seconds=10)
    assert lease_c.run_id == c.run_id
    await L.settle(lease_c, completed("c"))
    assert await _fifo_ids(db, L) == [] and await L.active_run(OWNER, "c") is None
    # queued runs cancelled behind an active one, and an active unclaimed one, leave no entry
    d = await L.submit("d", {}, None, owner=OWNER, conversation="c")
    e = await L.submit("e", {}, None, owner=OWNER, conversation="c")
    assert await _fifo_ids(db, L) == []
    await L.cancel(e.run_id)
    await L.cancel(d.run_id)
    assert await _fifo_ids(db, L) == [] and await L.active_run(OWNER, "c") is None
    assert [(await L.get_run(r.run_id)).state for r in (d, e)] == ["cancelled", "cancelled"]


async def test_an_active_run_stored_with_a_fifo_entry_by_the_older_layout_clears_it(db, clock):
    """A run record without "q" (written before runs active from their submit had no FIFO
    entry) and its entry: settling it clears the entry, and the run queued behind it starts."""
    from sessions.codec import dumps, loads

    s, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")

    async def older_layout(tr):  # idempotent: blind sets of the older layout's records
        raw = await tr.get(L.keys.run(a.run_id))
        run = loads(raw)
        assert run.pop("q") is False
        tr.set(L.keys.run(a.run_id), dumps(run))
        tr.set(L.keys.fifo(_tag(), "c", run["seq"]), a.run_id.encode())

    await db.transact(older_layout)
    assert await _fifo_ids(db, L) == [a.run_id]  # (b: no entry since session 18)
    lease_a = await L.claim("w", lease_seconds=10)
    assert lease_a.run_id == a.run_id
    await L.settle(lease_a, completed("a"))
    assert await _fifo_ids(db, L) == []
    assert await L.active_run(OWNER, "c") == b.run_id
    lease_b = await L.claim("w", lease_seconds=10)
    assert lease_b.run_id == b.run_id
    await L.settle(lease_b, completed("b"))
    assert await _fifo_ids(db, L) == []
