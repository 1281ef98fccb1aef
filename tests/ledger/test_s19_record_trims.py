"""Session 19: a submit's run record leaves out "attempt" and "claims" while 0, "limits" while
empty and "updated" (= "created"), and its submission record "id", "attempt" and "policy";
readers put the run fields back (ledger.runs._complete_run). Records of the older layouts
(every field present) are read, claimed, parked, resumed, cancelled, settled and answered
as before, on every engine, and across an LMDB restart."""

from __future__ import annotations

import pytest

import kv
from ledger import (CANCELLED, COMPLETED, PARKED, QUEUED, RUNNING, Ledger, SubmissionConflict,
                    completed)
from ledger.runs import _SUB_HEAD, _parse_submission
from sessions import Owner, Sessions
from sessions.codec import dumps, loads

OWNER = Owner("test", "u1")
TRIMMED_RUN = ("attempt", "claims", "updated", "limits")
TRIMMED_SUB = ("id", "attempt", "policy")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _run_record(db, L, run_id):
    return loads(await db.transact(lambda tr: tr.get(L.keys.run(run_id))))  # read-only


async def _sub_record(db, L, sid):
    raw = await db.transact(lambda tr: tr.get(L.keys.submission(OWNER.tag, sid)))  # read-only
    return raw, _parse_submission(raw)[0]


async def _as_older_layout(db, L, run_id, sid, policy="queue"):
    """Rewrite a run's and its submission's records as session 18 stored them: every field
    present (idempotent: blind sets of the records read, completed)."""
    async def fn(tr):
        run = loads(await tr.get(L.keys.run(run_id)))
        run.setdefault("attempt", 0)
        run.setdefault("claims", 0)
        run.setdefault("updated", run["created"])
        run.setdefault("limits", {})
        tr.set(L.keys.run(run_id), dumps(run))
        key = L.keys.submission(OWNER.tag, sid)
        raw = await tr.get(key)
        rec = loads(memoryview(raw)[_SUB_HEAD:])
        old = {"id": sid, "owner": rec["owner"], "conversation": rec["conversation"], "hash": rec["hash"],
               "attempt": 0, "created": rec["created"], "run_id": rec["run_id"], "policy": policy,
               "body": rec["body"]}
        tr.set(key, raw[:_SUB_HEAD] + dumps(old))

    await db.transact(fn)


async def test_a_submit_leaves_out_the_fields_at_their_first_values(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {"x": 1}, None, owner=OWNER, conversation="c")  # active: made ready
    b = await L.submit("b", {"x": 2}, None, owner=OWNER, conversation="c",
                       limits={"max_output_tokens": 5})  # queued behind it
    ra, rb = await _run_record(db, L, a.run_id), await _run_record(db, L, b.run_id)
    assert all(f not in ra for f in TRIMMED_RUN) and isinstance(ra["rd"], int)
    assert [f for f in TRIMMED_RUN if f in rb] == ["limits"] and rb["limits"] == {"max_output_tokens": 5}
    for sid, run_id in (("a", a.run_id), ("b", b.run_id)):
        raw, rec = await _sub_record(db, L, sid)
        assert all(f not in rec for f in TRIMMED_SUB)
        assert rec["run_id"] == run_id and rec["owner"] == OWNER.tag and rec["conversation"] == "c"
    ia, ib = await L.get_run(a.run_id), await L.get_run(b.run_id)
    assert (ia.state, ia.attempt, ia.updated, ia.limits) == (QUEUED, 0, ia.created, {})
    assert (ib.state, ib.attempt, ib.updated, ib.limits) == (QUEUED, 0, ib.created, {"max_output_tokens": 5})
    assert [r.id for r in await L.list_runs(OWNER, "c")] == [a.run_id, b.run_id]
    # retries answer as before; another request under the id is refused
    again = await L.submit("b", {"x": 2}, None, owner=OWNER, conversation="c")
    assert (again.run_id, again.cursor, again.created) == (b.run_id, b.cursor, False)
    with pytest.raises(SubmissionConflict):
        await L.submit("b", {"x": 3}, None, owner=OWNER, conversation="c")
    with pytest.raises(SubmissionConflict):
        await L.submit("b", {"x": 2}, None, owner=OWNER, conversation="other")
    # claimed: the record is whole from then on
    clock.advance(1.0)
    lease = await L.claim("w", lease_seconds=10)
    assert (lease.run_id, lease.attempt, lease.token) == (a.run_id, 1, 1)
    ra = await _run_record(db, L, a.run_id)
    assert (ra["attempt"], ra["claims"], ra["limits"], ra["updated"]) == (1, 1, {}, clock())
    await L.settle(lease, completed("a"))
    assert (await L.get_run(a.run_id)).state == COMPLETED
    lease_b = await L.claim("w", lease_seconds=10)
    assert (lease_b.run_id, lease_b.attempt) == (b.run_id, 1)
    assert await L.get_request(b.run_id) == ({"x": 2}, None)


async def test_submit_and_claim_stores_the_trimmed_record_and_settles_from_the_whole_one(db, clock):
    s, L = make(db, clock)
    a, lease = await L.submit_and_claim("a", {}, None, owner=OWNER, conversation="c", worker_id="w")
    ra = await _run_record(db, L, a.run_id)
    assert ra["state"] == RUNNING and (ra["attempt"], ra["claims"]) == (1, 1)
    assert "updated" not in ra and "limits" not in ra
    info = await L.get_run(a.run_id)
    assert (info.state, info.attempt, info.updated, info.limits) == (RUNNING, 1, info.created, {})
    assert lease.run_seen is not None and all(f in lease.run_seen[1] for f in TRIMMED_RUN)
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    clock.advance(2.0)
    await L.settle(lease, completed(1))  # from the claim's record (run_seen), not re-read
    ra = await _run_record(db, L, a.run_id)
    assert (ra["state"], ra["attempt"], ra["claims"], ra["limits"], ra["updated"]) == (COMPLETED, 1, 1, {}, clock())
    info = await L.get_run(a.run_id)
    assert (info.outcome["result"], info.limits, info.updated) == (1, {}, clock())
    lb = await L.claim("w")
    assert lb.run_id == b.run_id


async def test_older_records_go_through_every_transition(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {"n": "a"}, None, owner=OWNER, conversation="c")
    b = await L.submit("b", {"n": "b"}, None, owner=OWNER, conversation="c")
    c = await L.submit("c", {"n": "c"}, None, owner=OWNER, conversation="c")
    for r, sid in ((a, "a"), (b, "b"), (c, "c")):
        await _as_older_layout(db, L, r.run_id, sid)
        run, (_, rec) = await _run_record(db, L, r.run_id), await _sub_record(db, L, sid)
        assert all(f in run for f in TRIMMED_RUN) and all(f in rec for f in TRIMMED_SUB)
    infos = [await L.get_run(r.run_id) for r in (a, b, c)]
    assert [(i.state, i.attempt, i.limits) for i in infos] == [(QUEUED, 0, {})] * 3
    # retries of the older records answer with their runs; other requests refused
    for r, sid in ((a, "a"), (b, "b")):
        again = await L.submit(sid, {"n": sid}, None, owner=OWNER, conversation="c")
        assert (again.run_id, again.cursor, again.created, again.status) == (r.run_id, r.cursor, False, QUEUED)
        with pytest.raises(SubmissionConflict):
            await L.submit(sid, {"n": "other"}, None, owner=OWNER, conversation="c")
    # a: claimed, parked, resumed, claimed again, settled
    la = await L.claim("w", lease_seconds=10)
    assert (la.run_id, la.attempt) == (a.run_id, 1)
    assert await db.transact(lambda tr: L.request_tr(tr, la)) == ({"n": "a"}, None)
    await L.release(la, park=True)
    assert (await L.get_run(a.run_id)).state == PARKED
    await L.resume(a.run_id)
    la2 = await L.claim("w", lease_seconds=10)
    assert la2.run_id == a.run_id and la2.token == la.token + 1
    await L.settle(la2, completed("a"))
    assert (await L.get_run(a.run_id)).outcome["result"] == "a"
    # c (queued, never claimed): cancelled at once; b then runs
    assert await L.cancel(c.run_id) == CANCELLED
    lb = await L.claim("w", lease_seconds=10)
    assert lb.run_id == b.run_id
    await L.settle(lb, completed("b"))
    assert [r.state for r in await L.list_runs(OWNER, "c")] == [COMPLETED, COMPLETED, CANCELLED]


async def test_trimmed_and_older_records_survive_an_lmdb_restart(tmp_path, clock):
    url = f"lmdb:{tmp_path / 'data'}"
    db = await kv.open(url)
    try:
        s, L = make(db, clock)
        a = await L.submit("a", {"n": 1}, None, owner=OWNER, conversation="c")
        b = await L.submit("b", {"n": 2}, None, owner=OWNER, conversation="c")
        await _as_older_layout(db, L, a.run_id, "a")
    finally:
        await db.close()
    db = await kv.open(url)
    try:
        s, L = make(db, clock)
        assert "claims" in await _run_record(db, L, a.run_id)
        assert "claims" not in await _run_record(db, L, b.run_id)
        again = await L.submit("b", {"n": 2}, None, owner=OWNER, conversation="c")
        assert (again.run_id, again.created) == (b.run_id, False)
        la = await L.claim("w")
        assert la.run_id == a.run_id
        await L.settle(la, completed())
        lb = await L.claim("w")
        assert (lb.run_id, lb.attempt) == (b.run_id, 1)
        assert await db.transact(lambda tr: L.request_tr(tr, lb)) == ({"n": 2}, None)
        await L.settle(lb, completed())
        assert [r.state for r in await L.list_runs(OWNER, "c")] == [COMPLETED, COMPLETED]
    finally:
        await db.close()
