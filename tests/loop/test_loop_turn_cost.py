"""What an agent turn costs in storage work: commits per turn, and idle workers' wake-ups.

These pin the performance-relevant shape of a turn (tests/bench/bench_turns.py
measures its speed): the run's first writes ride on its claim, ``rt.run``
submits and claims in that same commit, and a submission does not wake every
idle worker of a runtime.
"""

from __future__ import annotations

import trio
import trio.testing

from loop import Runtime
from loop.runtime import CLAIMERS
from sessions.journal import decode_cursor
from turn_helpers import noop_tool_agent


async def test_tool_turn_through_run_commits_four_times_submitting_and_beginning_in_one(tmp_path):
    agent = noop_tool_agent("cost")
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}", agents=[agent]) as rt:
        assert (await rt.run(agent, "warm", "go")).ok
        before = rt.db.engine.stats["commits"]
        out = await rt.run(agent, "c1", "go")
        assert out.ok and out.result == "done"
        # submit + claim + user message; assistant + tool.started; tool result; final answer + settle
        assert rt.db.engine.stats["commits"] - before == 4
        events = (await rt.read_events("c1")).events
        assert [e.type for e in events] == [
            "run.queued", "run.started", "message.added", "message.added", "usage.updated", "tool.started",
            "tool.completed", "message.added", "message.added", "usage.updated", "run.completed"]
        # the first three in one commit (the first 10 cursor bytes are the commit's versionstamp)
        assert len({decode_cursor(e.cursor)[:10] for e in events[:3]}) == 1
        assert decode_cursor(events[3].cursor)[:10] != decode_cursor(events[2].cursor)[:10]
        assert events[1].data == {"run_id": out.run_id, "attempt": 1, "max_attempts": 10,
                                  "takeover": False}
        assert [m["role"] for m in await rt.transcript("c1")] == ["user", "assistant", "tool", "assistant"]
        info = await rt.get_run(out.run_id)
        assert info.status == "completed" and info.attempt == 1


async def test_tool_turn_submitted_to_an_idle_worker_commits_four_times(tmp_path):
    """rt.submit with a claim loop idle: the run is claimed for that worker in the submitting
    commit and handed over in memory (no ready entry, no claim or wait transaction)."""
    agent = noop_tool_agent("cost")
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}", workers=2, agents=[agent]) as rt:
        assert (await rt.run(agent, "warm", "go")).ok
        await trio.testing.wait_all_tasks_blocked()
        assert len(rt._idle) == 2  # both seated claim loops wait for work
        calls = _count_claims(rt, taken_only=True)
        before = rt.db.engine.stats["commits"]
        ack = await rt.submit(agent, "c1", "go")
        assert ack.status == "running" and len(rt._idle) == 1
        out = await rt.wait(ack)
        assert out.ok and out.result == "done"
        # submit + claim + user message; assistant + tool.started; tool result; final answer + settle
        assert rt.db.engine.stats["commits"] - before == 4
        assert calls[0] == 0
        events = (await rt.read_events("c1")).events
        assert [e.type for e in events[:3]] == ["run.queued", "run.started", "message.added"]
        assert len({decode_cursor(e.cursor)[:10] for e in events[:3]}) == 1
        info = await rt.get_run(out.run_id)
        assert info.status == "completed" and info.attempt == 1
        await trio.testing.wait_all_tasks_blocked()
        assert len(rt._idle) == 2  # the worker is back, waiting


async def test_tool_turn_claimed_from_the_ready_index_commits_five_times_and_begins_with_its_claim(tmp_path):
    agent = noop_tool_agent("cost")
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}", workers=0, agents=[agent]) as rt:
        assert (await rt.run(agent, "warm", "go")).ok
        before = rt.db.engine.stats["commits"]
        ack = await rt.submit(agent, "c1", "go")  # no idle worker here: into the ready index
        assert ack.status == "queued"
        async with trio.open_nursery() as n:
            n.start_soon(rt.serve, 1)
            out = await rt.wait(ack)
            n.cancel_scope.cancel()
        assert out.ok and out.result == "done"
        # submit; claim + user message; assistant + tool.started; tool result; final answer + settle
        assert rt.db.engine.stats["commits"] - before == 5
        events = (await rt.read_events("c1")).events
        started = next(e for e in events if e.type == "run.started")
        user = next(e for e in events if e.type == "message.added" and e.data["role"] == "user")
        # the same commit (the first 10 cursor bytes are the commit's versionstamp), started first
        assert decode_cursor(started.cursor)[:10] == decode_cursor(user.cursor)[:10]
        assert started.cursor < user.cursor
        assert [m["role"] for m in await rt.transcript("c1")] == ["user", "assistant", "tool", "assistant"]


def _count_claims(rt: Runtime, *, taken_only: bool = False) -> list[int]:
    """Counts ``ledger.claim`` calls; with ``taken_only`` only those that took a run (the worker
    that drove a handed-over run looks for more work as soon as it is done, which may or may
    not happen before the test's next check: a race, not a cost of the handover)."""
    calls = [0]
    real_claim = rt.store.ledger.claim

    async def counting_claim(*a, **kw):
        if not taken_only:
            calls[0] += 1
        lease = await real_claim(*a, **kw)
        if taken_only and lease is not None:
            calls[0] += 1
        return lease

    rt.store.ledger.claim = counting_claim  # type: ignore[method-assign]
    return calls


async def test_a_submission_does_not_wake_every_idle_worker():
    import kv

    agent = noop_tool_agent("cost")
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), workers=16, agents=[agent]) as rt, \
            Runtime.open(db=engine.database(), workers=0, agents=[agent]) as front:
        calls = _count_claims(rt)
        await trio.testing.wait_all_tasks_blocked()
        calls[0] = 0
        # submitted by another runtime (no idle worker of its own): the ready index and its signal
        assert (await rt.wait(await front.submit(agent, "c1", "go"))).ok
        await trio.testing.wait_all_tasks_blocked()
        # Only the seated claimers look (a claim each, plus one more after the run ends),
        # not all 16 idle workers.
        assert calls[0] <= 2 * CLAIMERS + 1 and calls[0] < 16, calls


async def test_run_wakes_no_idle_worker():
    """rt.run claims its own run in the submitting transaction: no ready entry, no signal."""
    agent = noop_tool_agent("cost")
    async with Runtime.open("memory:", workers=16, agents=[agent]) as rt:
        calls = _count_claims(rt)
        waits = [0]
        real_wait = rt.store.ledger.wait_for_work

        async def counting_wait(*a, **kw):
            waits[0] += 1
            return await real_wait(*a, **kw)

        rt.store.ledger.wait_for_work = counting_wait  # type: ignore[method-assign]
        await trio.testing.wait_all_tasks_blocked()
        calls[0] = waits[0] = 0
        for i in range(3):
            assert (await rt.run(agent, f"c{i}", "go")).ok
        await trio.testing.wait_all_tasks_blocked()
        assert calls[0] == 0 and waits[0] == 0, (calls, waits)


async def test_a_burst_of_runs_is_claimed_by_more_than_the_two_seats(tmp_path):
    agent = noop_tool_agent("cost")
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}", workers=8, agents=[agent]) as rt:
        acks = [await rt.submit(agent, f"b{i}", "go") for i in range(24)]
        outs = [await rt.wait(a) for a in acks]
        assert all(o.ok for o in outs)
        assert len({o.run_id for o in outs}) == 24
