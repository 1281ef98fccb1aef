"""Submissions, claims, leases, attempts, cancellation — on memory and lmdb."""

from __future__ import annotations

import random

import pytest
import trio

from ledger import (CANCELLED, COMPLETED, FAILED, PARKED, QUEUED, RUNNING, ConversationBusy, LeaseLost, Ledger,
                    NotFound, SubmissionConflict, cancelled, completed, failed)
from sessions import Owner, Sessions, events

OWNER = Owner("test", "u1")


def make(db, clock=None, **kw):
    s = Sessions(db, **({"clock": clock} if clock else {}))
    return s, Ledger(db, journal=s.journal, **({"clock": clock} if clock else {}), **kw)


async def test_submit_acknowledges_and_journals_run_queued(db):
    s, L = make(db)
    ack = await L.submit("sub-1", {"text": "hi"}, {"type": "object"}, owner=OWNER, conversation="c")
    assert ack.created and ack.status == QUEUED and ack.cursor
    page = await s.journal.read(OWNER, "c")
    assert [(e.cursor, e.type, e.data["run_id"]) for e in page.events] == [(ack.cursor, events.RUN_QUEUED, ack.run_id)]
    assert await L.get_request(ack.run_id) == ({"text": "hi"}, {"type": "object"})
    again = await L.submit("sub-1", {"text": "hi"}, {"type": "object"}, owner=OWNER, conversation="c")
    assert (again.run_id, again.cursor, again.created) == (ack.run_id, ack.cursor, False)


async def test_same_id_and_hash_100_concurrent_submits_make_one_run(db):
    s, L = make(db)
    acks = []

    async def one():
        acks.append(await L.submit("dup", {"text": "same"}, None, owner=OWNER, conversation="c"))

    async with trio.open_nursery() as n:
        for _ in range(100):
            n.start_soon(one)
    assert len({a.run_id for a in acks}) == 1
    assert sum(a.created for a in acks) == 1
    assert len({a.cursor for a in acks}) == 1
    runs = await L.list_runs(OWNER, "c")
    assert len(runs) == 1
    queued = [e for e in (await s.journal.read(OWNER, "c")).events if e.type == events.RUN_QUEUED]
    assert len(queued) == 1


async def test_different_hash_or_conversation_is_a_conflict(db):
    _, L = make(db)
    await L.submit("x", {"text": "a"}, None, owner=OWNER, conversation="c")
    with pytest.raises(SubmissionConflict):
        await L.submit("x", {"text": "b"}, None, owner=OWNER, conversation="c")
    with pytest.raises(SubmissionConflict):
        await L.submit("x", {"text": "a"}, {"type": "string"}, owner=OWNER, conversation="c")
    with pytest.raises(SubmissionConflict):
        await L.submit("x", {"text": "a"}, None, owner=OWNER, conversation="other")
    # another owner's identical id is its own submission
    other = await L.submit("x", {"text": "b"}, None, owner=Owner("test", "u2"), conversation="c")
    assert other.created


async def test_submit_with_injected_1021_still_one_run(db, inject_1021):
    s, L = make(db)
    hooks = inject_1021(db, b"sub", n=1)
    ack = await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")
    assert hooks.injected == 1
    assert not ack.created  # the retry found the committed submission
    runs = await L.list_runs(OWNER, "c")
    assert [r.id for r in runs] == [ack.run_id]
    assert [e.type for e in (await s.journal.read(OWNER, "c")).events] == [events.RUN_QUEUED]
    assert ack.cursor == (await s.journal.read(OWNER, "c")).events[0].cursor


async def test_settle_is_idempotent_and_settled_submission_returns_outcome(db):
    s, L = make(db)
    ack = await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    assert lease.run_id == ack.run_id and lease.attempt == 1 and lease.token == 1
    assert await L.settle(lease, completed({"answer": 42})) == completed({"answer": 42})
    assert await L.settle(lease, completed({"answer": 42})) == completed({"answer": 42})
    again = await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")
    assert again.status == COMPLETED and again.outcome["result"] == {"answer": 42}
    assert await L.wait_settled(ack.run_id) == completed({"answer": 42})
    types = [e.type for e in (await s.journal.read(OWNER, "c")).events]
    assert types == [events.RUN_QUEUED, events.RUN_STARTED, events.RUN_COMPLETED]


async def test_50_workers_500_runs_20_conversations(db):
    _, L = make(db)
    convs = [f"c{i}" for i in range(20)]
    order: dict[str, list[str]] = {c: [] for c in convs}
    rng = random.Random(7)
    for i in range(500):
        c = convs[rng.randrange(20)] if i >= 20 else convs[i]
        ack = await L.submit(f"s{i}", {"i": i}, None, owner=OWNER, conversation=c)
        order[c].append(ack.run_id)
    held: dict[str, str] = {}          # run -> worker holding a live lease
    active: dict[str, str] = {}        # conversation -> run being worked
    claimed: dict[str, list[str]] = {c: [] for c in convs}
    done = set()

    async def worker(w: str) -> None:
        while len(done) < 500:
            lease = await L.claim(w, lease_seconds=300)
            if lease is None:
                await L.wait_for_work(0.01)
                continue
            assert lease.run_id not in held, "a run held by two live leases"
            assert lease.conversation not in active, "two active runs in one conversation"
            held[lease.run_id] = w
            active[lease.conversation] = lease.run_id
            claimed[lease.conversation].append(lease.run_id)
            await trio.sleep(0)
            del held[lease.run_id]
            del active[lease.conversation]
            await L.settle(lease, completed(w))
            done.add(lease.run_id)

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            for k in range(50):
                n.start_soon(worker, f"w{k}")
    assert claimed == order  # FIFO per conversation, each run exactly once
    for c in convs:
        assert await L.active_run(OWNER, c) is None


async def test_lease_expiry_takeover_and_stale_worker_fails(db, clock):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)
    assert await L.claim("B", lease_seconds=10) is None  # not expired yet
    clock.advance(11)
    b = await L.claim("B", lease_seconds=10)
    assert b.run_id == ack.run_id and b.token == a.token + 1 and b.attempt == 2 and b.takeover

    async def stale_write(tr):  # guarded by the lease check
        await L.check_lease(tr, a)
        await s.journal.emit(tr, OWNER, "c", events.MESSAGE_ADDED, {"from": "A"})

    with pytest.raises(LeaseLost):
        await db.transact(stale_write)
    with pytest.raises(LeaseLost):
        await L.settle(a, completed("A"))
    with pytest.raises(LeaseLost):
        await L.renew(a)
    await L.renew(b, 10)
    assert await L.settle(b, completed("B")) == completed("B")
    assert not any(e.data.get("from") == "A" for e in (await s.journal.read(OWNER, "c")).events)


async def test_a_lease_is_claimable_from_its_expiry_microsecond_on(db, clock):
    """wait_for_work wakes a worker exactly at the first lease expiry: the
    claim it then makes must find that lease (a busy claim/wait loop with
    time standing still otherwise, as the simulator's clock showed)."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)
    clock.t = a.expires_at - 1e-6
    assert await L.claim("B", lease_seconds=10) is None  # one microsecond before: still A's
    clock.t = a.expires_at
    with trio.fail_after(1):
        await L.wait_for_work(max_wait=5)  # returns at once: the expiry is now
    b = await L.claim("B", lease_seconds=10)
    assert b is not None and b.run_id == ack.run_id and b.token == a.token + 1


async def test_stale_worker_racing_a_takeover_conflicts_then_loses(db, clock):
    s, L = make(db, clock)
    await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=5)
    clock.advance(6)
    attempts = []

    async def write(tr):  # guarded by the lease check
        attempts.append(1)
        await L.check_lease(tr, a)
        if len(attempts) == 1:
            await L.claim("B", lease_seconds=5)  # the takeover commits after our read
        await s.journal.emit(tr, OWNER, "c", events.MESSAGE_ADDED, {"from": "A"})

    with pytest.raises(LeaseLost):
        await db.transact(write)
    assert len(attempts) == 2  # first attempt conflicted (1020), the retry saw the lost lease


async def test_attempt_11_is_retry_exhausted(db, clock):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    for attempt in range(1, 11):
        lease = await L.claim("w", lease_seconds=1)
        assert lease.attempt == attempt
        clock.advance(2)  # the worker "died"
    assert await L.claim("w", lease_seconds=1) is None
    info = await L.get_run(ack.run_id)
    assert info.state == FAILED and info.outcome["error"]["type"] == "retry_exhausted"
    assert info.attempt == 10
    evs = [e.type for e in (await s.journal.read(OWNER, "c", limit=100)).events]
    assert evs.count(events.RUN_STARTED) == 10 and evs[-1] == events.RUN_FAILED
    assert await L.active_run(OWNER, "c") is None


async def test_fifo_advances_past_failed_and_cancelled_runs(db, clock):
    _, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c", max_attempts=1)
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    assert await L.cancel(b.run_id) == CANCELLED  # queued, never started: settles at once
    la = await L.claim("w", lease_seconds=1)
    assert la.run_id == a.run_id
    clock.advance(2)
    lc = await L.claim("w")  # a exhausted its single attempt; c is next
    assert lc.run_id == c.run_id
    assert (await L.get_run(a.run_id)).state == FAILED


async def test_cancel_running_is_seen_at_boundary_and_watchable(db):
    _, L = make(db)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    seen = trio.Event()

    async def watcher():
        await L.wait_cancel_requested(ack.run_id)
        seen.set()

    async with trio.open_nursery() as n:
        n.start_soon(watcher)
        await trio.sleep(0.01)
        assert not seen.is_set()
        assert await L.cancel(ack.run_id, reason="user") == RUNNING
        with trio.fail_after(5):
            await seen.wait()

    async def boundary(tr):  # read-only check at a boundary
        await L.check_lease(tr, lease)
        return await L.is_cancel_requested(tr, ack.run_id)

    assert await db.transact(boundary) is True
    await L.settle(lease, cancelled("user"))
    assert (await L.get_run(ack.run_id)).state == CANCELLED


async def test_park_and_resume(db):
    _, L = make(db)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    await L.submit("k2", {}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    assert await L.release(lease, park=True) == PARKED
    assert await L.release(lease, park=True) == PARKED  # idempotent
    assert await L.claim("w") is None  # parked is not claimable, and it still blocks its queue
    assert (await L.get_run(ack.run_id)).state == PARKED
    assert await L.resume(ack.run_id) == QUEUED
    again = await L.claim("w")
    assert again.run_id == ack.run_id and again.attempt == 1  # a clean release is not an attempt
    await L.settle(again, completed())


async def test_cancel_parked_run_is_handed_to_a_worker(db):
    _, L = make(db)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    lease = await L.release(await L.claim("w"), park=True)
    assert await L.cancel(ack.run_id) == QUEUED
    lease = await L.claim("w")
    assert lease.run_id == ack.run_id
    assert await L.cancel_requested(ack.run_id)
    await L.settle(lease, cancelled("approval cancelled"))


async def test_policies_reject_and_interrupt(db):
    _, L = make(db)
    first = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    with pytest.raises(ConversationBusy) as info:
        await L.submit("b", {}, None, owner=OWNER, conversation="c", policy="reject")
    assert info.value.active_run == first.run_id
    lease = await L.claim("w")
    second = await L.submit("c", {}, None, owner=OWNER, conversation="c", policy="interrupt")
    assert await L.cancel_requested(first.run_id)
    await L.settle(lease, cancelled("interrupted"))
    nxt = await L.claim("w")
    assert nxt.run_id == second.run_id
    # interrupt of a run that never started cancels it at once
    await L.settle(nxt, completed())
    q = await L.submit("d", {}, None, owner=OWNER, conversation="c")
    r = await L.submit("e", {}, None, owner=OWNER, conversation="c", policy="interrupt")
    assert (await L.get_run(q.run_id)).state == CANCELLED
    assert (await L.claim("w")).run_id == r.run_id


async def test_foreign_run_is_missing(db):
    _, L = make(db)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    bob = Owner("test", "bob")
    with pytest.raises(NotFound) as foreign:
        await L.get_run(ack.run_id, owner=bob)
    with pytest.raises(NotFound) as missing:
        await L.get_run("no-such-run", owner=bob)
    assert str(foreign.value) == str(missing.value).replace("no-such-run", ack.run_id)
    with pytest.raises(NotFound):
        await L.cancel(ack.run_id, owner=bob)
    assert (await L.get_run(ack.run_id, owner=OWNER)).state == QUEUED


async def test_release_makes_runnable_again_and_claim_after_1021(db, inject_1021):
    _, L = make(db)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c")
    hooks = inject_1021(db, b"rl", n=1)
    lease = await L.claim("w")
    assert hooks.injected == 1 and lease is not None and lease.run_id == ack.run_id
    assert lease.token == 1  # the retry recognised its own committed claim
    assert await L.release(lease) == QUEUED
    again = await L.claim("w")
    assert again.token == 2 and again.attempt == 1
    await L.settle(again, failed("boom", "it broke"))
    assert (await L.wait_settled(ack.run_id))["error"]["type"] == "boom"


async def test_finalize_exhausted_hands_the_last_claim_to_the_worker(db, clock):
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c", max_attempts=2)
    for _ in range(2):
        assert not (await L.claim("w", lease_seconds=1, finalize_exhausted=True)).exhausted
        clock.advance(2)
    fin = await L.claim("w", lease_seconds=1, finalize_exhausted=True)
    assert fin.exhausted and fin.run_id == ack.run_id
    await L.settle(fin, failed("retry_exhausted", "gave up after 2 attempts"))
    assert (await L.get_run(ack.run_id)).outcome["error"]["type"] == "retry_exhausted"
    types = [e.type for e in (await s.journal.read(OWNER, "c")).events]
    assert types.count(events.RUN_STARTED) == 2 and types[-1] == events.RUN_FAILED
    # finalizing claims that die too are retried FINALIZE_CLAIMS times, then the ledger settles the run
    from ledger.runs import FINALIZE_CLAIMS
    b = await L.submit("k2", {}, None, owner=OWNER, conversation="d", max_attempts=1)
    await L.claim("w", lease_seconds=1, finalize_exhausted=True)
    clock.advance(2)
    for _ in range(FINALIZE_CLAIMS):
        assert (await L.claim("w", lease_seconds=1, finalize_exhausted=True)).exhausted
        clock.advance(2)
    assert await L.claim("w", lease_seconds=1, finalize_exhausted=True) is None
    assert (await L.get_run(b.run_id)).outcome["error"]["type"] == "retry_exhausted"


async def test_an_exhausted_run_with_a_cancel_requested_ends_cancelled(db, clock):
    """An acknowledged cancel ends the run cancelled (promise 7) even when every attempt died
    and the ledger's backstop is what settles it: cancelled, not retry_exhausted."""
    s, L = make(db, clock)
    ack = await L.submit("k", {}, None, owner=OWNER, conversation="c", max_attempts=1)
    await L.claim("w", lease_seconds=1)
    assert await L.cancel(ack.run_id) == RUNNING  # recorded; the worker would see it at a boundary
    clock.advance(2)  # ... but it died
    assert await L.claim("w", lease_seconds=1) is None  # past max_attempts: settled in the claim
    info = await L.get_run(ack.run_id)
    assert info.state == CANCELLED and info.outcome["status"] == CANCELLED
    types = [e.type for e in (await s.journal.read(OWNER, "c")).events]
    assert types[-1] == events.RUN_CANCELLED and events.RUN_FAILED not in types


async def test_submit_and_claim_leases_a_runnable_run_in_the_submitting_commit(db, clock):
    s, L = make(db, clock)
    seen = []

    async def on_claimed(tr, lease):
        seen.append(lease.run_id)
        tr.set(b"hook/" + lease.run_id.encode(), b"x")  # commits with the submission
        return "prepared"

    ack, lease = await L.submit_and_claim("s1", {"text": "hi"}, None, owner=OWNER, conversation="c",
                                          worker_id="w", lease_seconds=5, on_claimed=on_claimed)
    assert ack.created and ack.status == RUNNING and ack.cursor
    assert (lease.run_id, lease.token, lease.attempt, lease.new_run, lease.prepared) == (ack.run_id, 1, 1, True, "prepared")
    assert seen == [ack.run_id]
    assert await db.transact(lambda tr: tr.get(b"hook/" + ack.run_id.encode())) == b"x"
    evs = (await s.journal.read(OWNER, "c")).events
    assert [e.type for e in evs] == [events.RUN_QUEUED, events.RUN_STARTED] and evs[0].cursor == ack.cursor
    assert evs[1].data == {"run_id": ack.run_id, "attempt": 1, "max_attempts": 10, "takeover": False}
    info = await L.get_run(ack.run_id)
    assert info.state == RUNNING and info.worker == "w" and info.lease_expires_at == clock() + 5
    assert await L.claim("other") is None  # never in the ready index
    # a second run of the conversation queues behind it; no lease
    ack2, lease2 = await L.submit_and_claim("s2", {"text": "more"}, None, owner=OWNER, conversation="c", worker_id="w")
    assert lease2 is None and ack2.status == QUEUED
    # the same submission again: its run, no lease for this caller
    again, lease3 = await L.submit_and_claim("s1", {"text": "hi"}, None, owner=OWNER, conversation="c", worker_id="w")
    assert (again.run_id, again.created, lease3) == (ack.run_id, False, None)
    # fenced like any lease: an expired one is taken over and the stale holder loses
    clock.advance(6)
    taken = await L.claim("w2")
    assert taken.run_id == ack.run_id and taken.token == 2 and taken.attempt == 2 and taken.takeover
    with pytest.raises(LeaseLost):
        await L.settle(lease, completed("stale"))
    await L.settle(taken, completed("ok"))
    nxt = await L.claim("w2")
    assert nxt.run_id == ack2.run_id and nxt.attempt == 1


async def test_submit_and_claim_after_1021_returns_its_own_lease_once(db, inject_1021):
    s, L = make(db)
    hooks = inject_1021(db, b"sub", n=1)
    calls = []

    async def on_claimed(tr, lease):
        calls.append(lease.token)
        return "prepared"

    ack, lease = await L.submit_and_claim("k", {"text": "hi"}, None, owner=OWNER, conversation="c",
                                          worker_id="w", on_claimed=on_claimed)
    assert hooks.injected == 1 and calls == [1]
    assert not ack.created  # the retry found the committed submission...
    assert lease is not None and lease.run_id == ack.run_id and lease.token == 1 and lease.prepared is None  # ...and lease
    assert [r.id for r in await L.list_runs(OWNER, "c")] == [ack.run_id]
    assert [e.type for e in (await s.journal.read(OWNER, "c")).events] == [events.RUN_QUEUED, events.RUN_STARTED]
    await L.settle(lease, completed(1))
    assert (await L.wait_settled(ack.run_id))["result"] == 1


async def test_renew_many_extends_held_leases_in_one_commit_and_reports_lost_ones(db, clock):
    s, L = make(db, clock)
    for c in ("c1", "c2"):
        await L.submit(f"s-{c}", {}, None, owner=OWNER, conversation=c)
    a1 = await L.claim("A", lease_seconds=10)
    a2 = await L.claim("A", lease_seconds=10)
    clock.advance(5)
    await L.renew(a1, 2)  # a1 now expires long before a2
    clock.advance(3)
    b = await L.claim("B", lease_seconds=10)  # takes a1's run over
    assert b.run_id == a1.run_id and b.takeover
    before = a2.expires_at
    lost = await L.renew_many([a1, a2], 10)
    assert lost == {a1.run_id}
    assert a2.expires_at == clock() + 10 > before
    info = await L.get_run(a2.run_id)
    assert info.lease_expires_at == a2.expires_at and info.worker == "A"
    assert (await L.get_run(b.run_id)).worker == "B"  # the lost lease was left as it is
    with pytest.raises(LeaseLost):
        await L.renew(a1)
    # the expiry index follows the renewal: a2 is not claimable at its old expiry
    clock.advance(before - clock() + 0.5)
    assert await L.claim("C", lease_seconds=10) is None
    assert await L.renew_many([], 10) == set()


async def test_cancels_requested_reads_several_runs_at_once(db):
    _, L = make(db)
    acks = [await L.submit(f"s{i}", {}, None, owner=OWNER, conversation=f"c{i}") for i in range(3)]
    for i in range(3):
        await L.claim("w", lease_seconds=10)
    await L.cancel(acks[1].run_id)
    assert await L.cancels_requested([a.run_id for a in acks]) == {acks[1].run_id}
    assert await L.cancels_requested([]) == set()


async def test_the_request_is_stored_canonically_and_hashed_from_that_one_encoding(db):
    from ledger import encode_request
    from sessions.codec import canonical_hash, loads

    _, L = make(db)
    delivery = {"message": "hi", "agent": "a", "limits": {"max_total_tokens": 5}, "f": 1.5}
    body, digest = encode_request(delivery, {"type": "object"})
    assert digest == canonical_hash({"delivery": delivery, "result_schema": {"type": "object"}})
    assert loads(body) == {"delivery": delivery, "result_schema": {"type": "object"}}
    ack = await L.submit("canon", delivery, {"type": "object"}, owner=OWNER, conversation="c")
    assert await L.get_request(ack.run_id) == (delivery, {"type": "object"})
    reordered = dict(reversed(list(delivery.items())))
    again = await L.submit("canon", reordered, {"type": "object"}, owner=OWNER, conversation="c")
    assert again.run_id == ack.run_id and not again.created
    with pytest.raises(SubmissionConflict):
        await L.submit("canon", {**delivery, "f": 2.5}, {"type": "object"}, owner=OWNER, conversation="c")


async def test_a_hook_may_leave_its_events_to_the_submitting_emit(db):
    """``lease.journal_after_start``: set only while the hook runs inside submit_and_claim; the
    events put there are journaled right after run.started (in that order), not otherwise."""
    s, L = make(db)
    during = []

    async def on_claimed(tr, lease):
        during.append(lease.journal_after_start is not None)
        lease.journal_after_start.extend([(events.MESSAGE_ADDED, {"seq": 0}), (events.MESSAGE_ADDED, {"seq": 1})])
        return "prepared"

    ack, lease = await L.submit_and_claim("s1", {"text": "hi"}, None, owner=OWNER, conversation="c",
                                          worker_id="w", on_claimed=on_claimed)
    assert during == [True] and lease.journal_after_start is None and lease.prepared == "prepared"
    evs = (await s.journal.read(OWNER, "c")).events
    assert [(e.type, e.data.get("seq")) for e in evs] == [
        (events.RUN_QUEUED, None), (events.RUN_STARTED, None), (events.MESSAGE_ADDED, 0), (events.MESSAGE_ADDED, 1)]
    assert evs[0].cursor == ack.cursor
    # a claim's hook (not in a submitting transaction) has no such list: it emits itself
    await L.settle(lease, completed("ok"))
    await L.submit("s2", {"text": "more"}, None, owner=OWNER, conversation="c")
    seen = []

    async def claim_hook(tr, lease):
        seen.append(lease.journal_after_start)
        return None

    assert (await L.claim("w", on_claimed=claim_hook)) is not None and seen == [None]


async def test_settle_journals_the_callers_events_before_the_settled_event(db):
    s, L = make(db)
    ack = await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w")
    before = [(events.MESSAGE_ADDED, {"seq": 7}), (events.USAGE_UPDATED, {"run_id": ack.run_id})]

    async def fn(tr):  # guarded: settle_tr is idempotent for the same lease
        return await L.settle_tr(tr, lease, completed("done"), events_before=before)

    assert await db.transact(fn) == completed("done")
    types = [e.type for e in (await s.journal.read(OWNER, "c")).events]
    assert types == [events.RUN_QUEUED, events.RUN_STARTED, events.MESSAGE_ADDED, events.USAGE_UPDATED,
                     events.RUN_COMPLETED]
    # settled already (the same lease): the outcome as stored, the events still journaled as given
    assert await db.transact(fn) == completed("done")
    types = [e.type for e in (await s.journal.read(OWNER, "c")).events]
    assert types[5:] == [events.MESSAGE_ADDED, events.USAGE_UPDATED] and events.RUN_COMPLETED not in types[5:]


async def test_settling_the_last_queued_run_leaves_the_conversation_free(db):
    """The active run settles without a FIFO read when it is the last one submitted; with
    runs behind it, the next one becomes active (both ways, one more submit then runs)."""
    _, L = make(db)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    la = await L.claim("w")
    await L.settle(la, completed(1))
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")  # active at once: nothing before it
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    assert (b.status, c.status) == (QUEUED, QUEUED)
    lb = await L.claim("w")
    assert lb.run_id == b.run_id and await L.claim("w") is None  # c waits behind b
    await L.settle(lb, completed(2))
    lc = await L.claim("w")
    assert lc.run_id == c.run_id
    await L.settle(lc, completed(3))
    d, ld = await L.submit_and_claim("d", {}, None, owner=OWNER, conversation="c", worker_id="w")
    assert ld is not None and ld.run_id == d.run_id and a.run_id != d.run_id


async def test_check_lease_decodes_a_changed_lease_record(db, clock):
    """The lease check remembers the record's bytes it decoded; a renewal or a takeover
    changes them, and the check sees the new record (or LeaseLost)."""
    _, L = make(db, clock)
    await L.submit("k", {}, None, owner=OWNER, conversation="c")
    a = await L.claim("A", lease_seconds=10)
    first = await db.transact(lambda tr: L.check_lease(tr, a))
    assert first["token"] == a.token and a.seen is not None and a.seen[1] is first
    clock.advance(5)
    await L.renew(a, 10)
    renewed = await db.transact(lambda tr: L.check_lease(tr, a))
    assert renewed["expires_at"] == clock() + 10 != first["expires_at"]
    clock.advance(11)
    b = await L.claim("B", lease_seconds=10)
    assert b.takeover
    with pytest.raises(LeaseLost):
        await db.transact(lambda tr: L.check_lease(tr, a))
    assert (await db.transact(lambda tr: L.check_lease(tr, b)))["worker"] == "B"


async def test_an_outcome_larger_than_a_chunk_is_stored_in_chunks_and_wakes_its_waiter(db):
    """A settle writes a small outcome as chunk 0 directly (no Subspace made) and a larger one
    through write_chunks: both read back whole, and a waiter watching chunk 0 wakes for each."""
    from sessions.codec import CHUNK_SIZE
    _, L = make(db)
    results = {"small": "x", "big": "y" * (2 * CHUNK_SIZE + 10)}
    for name, result in results.items():
        ack = await L.submit(name, {"n": name}, None, owner=OWNER, conversation=name)
        lease = await L.claim("w")
        got = []
        async with trio.open_nursery() as n:
            async def wait(run_id=ack.run_id):
                got.append(await L.wait_settled(run_id))
            n.start_soon(wait)
            await trio.sleep(0.05)  # the waiter is watching chunk 0 of the outcome
            await L.settle(lease, completed(result))
        assert got == [completed(result)]
        chunks = L.keys.outcome(ack.run_id).range()
        rows = await db.transact(lambda tr: tr.get_range(chunks.start, chunks.stop))
        assert len(rows) == (0 if name == "small" else 3)  # (session 17: a small one is in the run record)
        assert (await L.get_run(ack.run_id)).outcome == completed(result)
