"""A seeded random workload against the ledger, checking its invariants after every step:
one active run per conversation, runs start in FIFO order per conversation, a
lease is held by one worker, and everything accepted is eventually settled once."""

from __future__ import annotations

import random

import pytest

from ledger import SETTLED_STATES, LeaseLost, Ledger, cancelled, completed
from sessions import Owner, Sessions, events

OWNER = Owner("model", "u")


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_workload_keeps_invariants(db, clock, seed):
    rng = random.Random(seed)
    s = Sessions(db, clock=clock)
    L = Ledger(db, journal=s.journal, clock=clock, rng=random.Random(seed))
    convs = ["a", "b", "c"]
    submitted: dict[str, list[str]] = {c: [] for c in convs}
    leases: dict[str, object] = {}   # worker -> lease
    started: dict[str, list[str]] = {c: [] for c in convs}
    for step in range(250):
        op = rng.random()
        if op < 0.3:
            c = rng.choice(convs)
            ack = await L.submit(f"s{step}", {"step": step}, None, owner=OWNER, conversation=c, max_attempts=3)
            submitted[c].append(ack.run_id)
        elif op < 0.55:
            w = f"w{rng.randrange(4)}"
            if w not in leases:
                lease = await L.claim(w, lease_seconds=5)
                if lease is not None:
                    assert all(l.run_id != lease.run_id for l in leases.values() if l.token >= 0)  # type: ignore[attr-defined]
                    leases[w] = lease
                    if not started[lease.conversation] or started[lease.conversation][-1] != lease.run_id:
                        started[lease.conversation].append(lease.run_id)
        elif op < 0.75 and leases:
            w = rng.choice(sorted(leases))
            lease = leases.pop(w)
            action = rng.random()
            try:
                if action < 0.6:
                    await L.settle(lease, completed(step))
                elif action < 0.8:
                    await L.release(lease)
                else:
                    await L.settle(lease, cancelled("model"))
            except LeaseLost:
                pass  # expired and taken over: legitimate
        elif op < 0.85:
            clock.advance(rng.choice([1, 6]))  # sometimes every lease expires
            for w in list(leases):
                if leases[w].expires_at < clock():  # type: ignore[attr-defined]
                    leases.pop(w)  # the worker "died"
        else:
            c = rng.choice(convs)
            if submitted[c]:
                await L.cancel(rng.choice(submitted[c]), reason="model")
        # one active run per conversation, and it is the oldest unsettled one
        for c in convs:
            active = await L.active_run(OWNER, c)
            unsettled = [r for r in await L.list_runs(OWNER, c) if r.state not in SETTLED_STATES]
            assert active == (unsettled[0].id if unsettled else None)
            assert sum(r.state == "running" for r in unsettled) <= 1
            assert all(r.state == "queued" for r in unsettled[1:])

    # drain: everything accepted settles exactly once
    for w in list(leases):
        try:
            await L.settle(leases.pop(w), completed("drain"))
        except LeaseLost:
            pass
    for _ in range(2_000):
        lease = await L.claim("drain", lease_seconds=5)
        if lease is None:
            break
        await L.settle(lease, completed("drain"))
    for c in convs:
        runs = await L.list_runs(OWNER, c)
        assert [r.id for r in runs] == submitted[c]
        assert all(r.state in SETTLED_STATES for r in runs)
        # FIFO: runs started in submission order
        order = {rid: i for i, rid in enumerate(submitted[c])}
        assert [order[r] for r in started[c]] == sorted(order[r] for r in started[c])
        evs = (await s.journal.read(OWNER, c, limit=10_000)).events
        settled_events = [e.data["run_id"] for e in evs
                          if e.type in (events.RUN_COMPLETED, events.RUN_FAILED, events.RUN_CANCELLED)]
        assert sorted(settled_events) == sorted(submitted[c])  # each settled exactly once
