"""Session 18: a submit stores no None-valued "rd", "settled_token", "released_token", "error" in
its run record; every reader uses .get. Records written before (those four present, None) are
read, claimed, released, resumed, cancelled and settled as before, on every engine."""

from __future__ import annotations

import pytest

from ledger import CANCELLED, COMPLETED, PARKED, QUEUED, RUNNING, Ledger, completed
from sessions import Owner, Sessions
from sessions.codec import dumps, loads

OWNER = Owner("test", "u1")
OLD_FIELDS = ("rd", "settled_token", "released_token", "error")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _record(db, L, run_id):
    tr = db.create_transaction()
    return loads(await tr.get(L.keys.run(run_id)))


async def _as_older_layout(db, L, run_id):
    """Rewrite a run record as code before session 18 stored it: the four fields present,
    None unless set (idempotent: a blind set of the record read)."""
    async def fn(tr):
        run = loads(await tr.get(L.keys.run(run_id)))
        for f in OLD_FIELDS:
            run.setdefault(f, None)
        tr.set(L.keys.run(run_id), dumps(run))

    await L.db.transact(fn)


@pytest.mark.parametrize("how", ["submit", "submit_and_claim"])
async def test_a_new_run_record_leaves_the_none_fields_out(db, clock, how):
    s, L = make(db, clock)
    if how == "submit":
        a = await L.submit("a", {}, None, owner=OWNER, conversation="c")  # active: made ready
        b = await L.submit("b", {}, None, owner=OWNER, conversation="c")  # queued behind it
        ra, rb = await _record(db, L, a.run_id), await _record(db, L, b.run_id)
        assert isinstance(ra["rd"], int) and all(f not in ra for f in OLD_FIELDS[1:])
        assert all(f not in rb for f in OLD_FIELDS)
    else:
        a, lease = await L.submit_and_claim("a", {}, None, owner=OWNER, conversation="c", worker_id="w")
        ra = await _record(db, L, a.run_id)
        assert ra["state"] == RUNNING and all(f not in ra for f in OLD_FIELDS)
        await L.settle(lease, completed(1))
        ra = await _record(db, L, a.run_id)
        assert ra["settled_token"] == lease.token and ra["error"] is None
        assert (await L.get_run(a.run_id)).outcome["result"] == 1


async def test_older_run_records_go_through_every_transition(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    ready_us = (await _record(db, L, a.run_id))["rd"]
    for r in (a, b, c):
        await _as_older_layout(db, L, r.run_id)
    assert (await _record(db, L, a.run_id))["rd"] == ready_us
    assert (await _record(db, L, b.run_id))["released_token"] is None
    assert [(await L.get_run(r.run_id)).state for r in (a, b, c)] == [QUEUED] * 3
    # a: claimed, parked, resumed, claimed again, settled
    la = await L.claim("w", lease_seconds=10)
    assert la.run_id == a.run_id and la.attempt == 1
    await L.release(la, park=True)
    assert (await L.get_run(a.run_id)).state == PARKED
    await L.release(la, park=True)  # a repeated release of the same lease: no change
    assert (await L.get_run(a.run_id)).state == PARKED
    await L.resume(a.run_id)
    la2 = await L.claim("w", lease_seconds=10)
    assert la2.run_id == a.run_id and la2.token == la.token + 1
    await L.settle(la2, completed("a"))
    await L.settle(la2, completed("a"))  # idempotent: settled_token read back
    info = await L.get_run(a.run_id)
    assert info.state == COMPLETED and info.outcome["result"] == "a"
    # b: cancelled while queued behind a (older record, never claimed)
    assert await L.cancel(c.run_id) == CANCELLED
    lb = await L.claim("w", lease_seconds=10)
    assert lb.run_id == b.run_id
    await L.settle(lb, completed("b"))
    assert await L.active_run(OWNER, "c") is None
    assert await L.claim("w", lease_seconds=10) is None
    assert [(await L.get_run(r.run_id)).state for r in (a, b, c)] == [COMPLETED, COMPLETED, CANCELLED]
