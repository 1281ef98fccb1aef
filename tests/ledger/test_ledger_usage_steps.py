"""Usage (once per step, ceilings) and durable steps."""

from __future__ import annotations

import pytest

from ledger import (LeaseLost, Ledger, StepNameReused, UsageConflict, UsageLimitExceeded, completed,
                    idempotency_key)
from sessions import Owner, Sessions

OWNER = Owner("test", "u1")


async def _claimed(db, limits=None, clock=None):
    s = Sessions(db)
    L = Ledger(db, journal=s.journal, **({"clock": clock} if clock else {}))
    await L.submit("k", {}, None, owner=OWNER, conversation="c", limits=limits)
    return L, await L.claim("w", lease_seconds=10)


async def test_usage_recorded_twice_is_counted_once(db, inject_1021):
    L, lease = await _claimed(db)
    u = {"input_tokens": 100, "output_tokens": 20, "cost_micros": 1_500}
    assert await L.usage.record(lease.run_id, "call-1", u, lease=lease) is True
    assert await L.usage.record(lease.run_id, "call-1", u, lease=lease) is False
    hooks = inject_1021(db, b"u", n=1)
    assert await L.usage.record(lease.run_id, "call-2", {"input_tokens": 1}) is False  # retry found its marker
    assert hooks.injected == 1
    totals = await L.usage.totals(lease.run_id)
    assert totals == {"input_tokens": 101, "output_tokens": 20, "cost_micros": 1_500, "total_tokens": 121}
    with pytest.raises(UsageConflict):
        await L.usage.record(lease.run_id, "call-1", {"input_tokens": 5})
    with pytest.raises(ValueError):
        await L.usage.record(lease.run_id, "call-3", {"input_tokens": -1})


async def test_reserve_past_the_ceiling_is_refused(db):
    L, lease = await _claimed(db, limits={"max_total_tokens": 1_000, "max_cost_micros": 10_000})
    assert await L.usage.reserve(lease.run_id, {"input_tokens": 900}) == {"total_tokens": 1_000,
                                                                           "cost_micros": 10_000}
    await L.usage.record(lease.run_id, "s1", {"input_tokens": 600, "output_tokens": 100, "cost_micros": 9_000})
    with pytest.raises(UsageLimitExceeded) as info:
        await L.usage.reserve(lease.run_id, {"input_tokens": 301})
    assert info.value.field == "total_tokens" and info.value.used == 700 and info.value.ceiling == 1_000
    with pytest.raises(UsageLimitExceeded) as info:
        await L.usage.reserve(lease.run_id, {"input_tokens": 1, "cost_micros": 1_001})
    assert info.value.field == "cost_micros"
    assert await L.usage.reserve(lease.run_id, {"input_tokens": 300}) == {"total_tokens": 300,
                                                                           "cost_micros": 1_000}


async def _all_keys(db) -> list[bytes]:
    tr = db.create_transaction()
    return [r.key for r in await tr.get_range(b"", b"\xff")]


@pytest.mark.parametrize("limits, problem", [
    ({"max_total_tokens": "100"}, "must be a non-negative int"),
    ({"max_total_tokens": -1}, "must be a non-negative int"),
    ({"max_total_tokens": 1.5}, "must be a non-negative int"),
    ({"max_total_tokens": True}, "must be a non-negative int"),
    ({"total_tokens": 100}, "bad usage limit name"),
    ({"max_": 100}, "bad usage limit name"),
    ({"max_Total": 100}, "bad usage limit name"),
    ({7: 100}, "bad usage limit name"),
    ([("max_total_tokens", 1)], "must be a mapping"),
    ({f"max_f{i}": 1 for i in range(33)}, "at most 32"),
])
async def test_malformed_limits_are_refused_before_anything_is_written(db, limits, problem):
    s = Sessions(db)
    L = Ledger(db, journal=s.journal)
    before = await _all_keys(db)
    with pytest.raises(ValueError, match=problem):
        await L.submit("k", {}, None, owner=OWNER, conversation="c", limits=limits)
    with pytest.raises(ValueError, match=problem):
        await L.submit_and_claim("k2", {}, None, owner=OWNER, conversation="c", worker_id="w", limits=limits)
    assert await _all_keys(db) == before


async def test_a_ceiling_of_none_is_no_ceiling(db):
    L, lease = await _claimed(db, limits={"max_total_tokens": None, "max_cost_micros": 5})
    assert (await L.get_run(lease.run_id)).limits == {"max_cost_micros": 5}
    assert await L.usage.reserve(lease.run_id, {"input_tokens": 10**9}) == {"cost_micros": 5}


async def test_usage_with_lost_lease_is_refused(db, clock):
    L, lease = await _claimed(db, clock=clock)
    clock.advance(11)
    await L.claim("other")
    with pytest.raises(LeaseLost):
        await L.usage.record(lease.run_id, "x", {"input_tokens": 1}, lease=lease)
    assert (await L.usage.totals(lease.run_id))["total_tokens"] == 0


async def test_durable_step_recorded_once_and_names_not_reused(db, clock):
    L, lease = await _claimed(db, clock=clock)
    calls = []

    async def charge():
        calls.append(1)
        return {"charge": "ch_1", "key": L.idempotency_key(lease.run_id, "charge")}

    first = await L.step(lease, "charge", charge)
    assert first["key"] == idempotency_key(lease.run_id, "charge") and first["key"].startswith("sf-")
    with pytest.raises(StepNameReused):
        await L.step(lease, "charge", charge)
    assert await L.steps.step(lease, "sync", lambda: 7) == 7
    # the worker dies; a new execution replays the steps without running them
    clock.advance(11)
    lease2 = await L.claim("w2", lease_seconds=10)
    assert await L.step(lease2, "charge", charge) == first
    assert await L.step(lease2, "sync", lambda: 8) == 7
    assert calls == [1]
    # a failing step is not recorded: it runs again next time
    with pytest.raises(RuntimeError):
        await L.step(lease2, "flaky", lambda: (_ for _ in ()).throw(RuntimeError("x")))
    assert await L.steps.get(lease2.run_id, "flaky") == (False, None)
    # the stale execution cannot record anything
    lease.step_names.clear()
    with pytest.raises(LeaseLost):
        await L.step(lease, "late", lambda: 1)
    await L.settle(lease2, completed())
