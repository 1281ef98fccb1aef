"""A runner learns of a cancel from the lease record its every commit's lease check reads
(ledger: a cancel of a running run rewrites its lease with ``"cancel": True``; renewals keep it,
claims and takeovers set it), not from a second read of the cancel record.

The promises this rests on, through whole runtimes: a cancel made by another process reaches a
run busy in a tool at its next commit even when that process's keeper never polls it; one
committed between a commit's lease check and its commit makes that commit conflict, and its
retry settles cancelled (promise 7: an acknowledged cancel wins); the holder keeps its lease
through the rewrite (its keeper renews on, no takeover); a takeover of a cancelled run
finalises it cancelled, and the worker it took over from writes nothing (fencing).
"""

from __future__ import annotations

import trio

import kv
from loop import Agent, Runtime, ScriptedModel, ToolContext, tool
from loop.providers import reply, tool_call


def roles(msgs):
    return [m["role"] for m in msgs]


async def types(rt, conv):
    return [e.type for e in (await rt.read_events(conv, limit=10_000)).events]


def tool_then_answer(name):
    def script(messages, tools):
        return "final" if messages[-1]["role"] == "tool" else reply("", tool_call(name))

    return script


def count_cancel_record_reads(rt) -> list[str]:
    """Every read of a run's cancel record by the runtime's ledger (the runner's commits reach it
    through Store.cancel_requested -> Ledger.is_cancel_requested, the claim directly)."""
    reads: list[str] = []
    real = rt.store.ledger.is_cancel_requested

    def counting(tr, run_id):
        reads.append(run_id)
        return real(tr, run_id)

    rt.store.ledger.is_cancel_requested = counting
    return reads


async def no_poll(run_ids):  # a keeper that never learns of a cancel by polling
    return set()


async def test_a_turns_commits_read_no_cancel_record():
    """A turn with a tool (its claim with the submit, then the tool's start, its result, the
    final answer: four commits) reads the lease in each and the cancel record in none; a run
    claimed from the queue reads it once, in its claim (into the lease it writes)."""
    ran = []

    @tool
    async def t(ctx: ToolContext) -> str:
        """A tool."""
        ran.append(ctx.call_id)
        return "ok"

    agent = Agent("a", model=ScriptedModel(tool_then_answer("t")), tools=[t])
    async with Runtime.open("memory:", workers=1, agents=[agent]) as rt:  # (one claim attempt)
        reads = count_cancel_record_reads(rt)
        checks = []
        real_check = rt.store.check_lease

        def counting_check(tr, claim):
            checks.append(claim.run_id)
            return real_check(tr, claim)

        rt.store.check_lease = counting_check
        out = await rt.run(agent, "c", "go")
        assert out.ok and out.result == "final" and len(ran) == 1
        assert reads == []
        assert len(checks) >= 3 and set(checks) == {out.run_id}
        # queued behind a running run, then claimed by a worker: the claim reads it, nothing after
        release = trio.Event()

        @tool
        async def wait(ctx: ToolContext) -> str:
            """Waits."""
            await release.wait()
            return "ok"

        slow = Agent("s", model=ScriptedModel(tool_then_answer("wait")), tools=[wait])
        firsts = []
        async with trio.open_nursery() as n:
            async def first():
                firsts.append(await rt.run(slow, "q", "first"))  # (claimed with its submit)

            n.start_soon(first)
            while not rt._active:
                await trio.sleep(0.001)
            second = await rt.submit(agent, "q", "second")  # queued behind it
            release.set()
        assert firsts[0].ok and (await rt.wait(second)).ok
        assert reads == [second.run_id]


async def test_a_cancel_from_another_process_reaches_a_commit_through_the_lease():
    """The runner's keeper never polls (the cancel is not noticed in memory): the tool's result
    commit learns of it from the lease the cancel rewrote, and the run settles cancelled with
    no further model call."""
    entered, release = trio.Event(), trio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Slow."""
        entered.set()
        await release.wait()
        return "slow done"

    model = ScriptedModel(tool_then_answer("slow"))
    agent = Agent("x", model=model, tools=[slow])
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), agents=[agent]) as rt_a, \
            Runtime.open(db=engine.database(), workers=0) as rt_b:
        rt_a.store.cancels_requested_now = no_poll
        ack = await rt_a.submit(agent, "x", "go")
        await entered.wait()
        info = await rt_b.cancel(ack.run_id)
        assert info.status == "running" and info.cancel_requested
        runner = rt_a._active[ack.run_id]
        assert not runner._cancel_noted
        release.set()
        out = await rt_a.wait(ack)
        assert out.status == "cancelled"
        assert len(model.calls) == 1
        evs = await types(rt_a, "x")
        assert "run.completed" not in evs and evs[-1] == "run.cancelled"
        assert roles(await rt_a.transcript("x")) == ["user", "assistant", "tool"]


async def test_a_cancel_committed_inside_the_settling_commit_wins():
    """The cancel commits after the final commit's lease check read the lease, before it
    commits: that commit conflicts, and its retry settles the run cancelled, never completed."""
    agent = Agent("f", model=ScriptedModel(["the final answer"]))
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), agents=[agent]) as rt_a, \
            Runtime.open(db=engine.database(), workers=0) as rt_b:
        rt_a.store.cancels_requested_now = no_poll
        real_settle = rt_a.store.settle
        outcomes = []

        async def settle_after_a_cancel(tr, claim, outcome, **kw):
            outcomes.append(outcome["status"])
            if len(outcomes) == 1:
                await rt_b.store.ledger.cancel(claim.run_id)  # commits now, in between
            return await real_settle(tr, claim, outcome, **kw)

        rt_a.store.settle = settle_after_a_cancel
        out = await rt_a.run(agent, "f", "go")
        assert out.status == "cancelled"
        assert outcomes == ["completed", "cancelled"]  # the first attempt conflicted
        evs = await types(rt_a, "f")
        assert "run.completed" not in evs and evs[-1] == "run.cancelled"


async def test_the_holder_keeps_its_lease_after_a_cancel_and_its_keeper_learns_of_it(autojump_clock):
    """A run busy in a long tool, cancelled by another process: its keeper's poll tells the tool
    (ctx.cancelled), its renewals go on over the rewritten lease (the tool runs for many leases
    after the cancel; no takeover), and the run settles cancelled in its first attempt."""
    seen = []

    @tool
    async def long(ctx: ToolContext) -> str:
        """Works on, a while after a cancel too."""
        for _ in range(100):
            await trio.sleep(0.1)
            if ctx.cancelled and not seen:
                seen.append(trio.current_time())
        return "stopped"

    agent = Agent("k", model=ScriptedModel(tool_then_answer("long")), tools=[long])
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt, \
            Runtime.open(db=engine.database(), workers=0) as other:
        renewed = []
        real_renew = rt.store.renew_many

        async def counting(claims):
            lost = await real_renew(claims)
            renewed.append(lost)
            return lost

        rt.store.renew_many = counting
        ack = await rt.submit(agent, "k", "go")
        await trio.sleep(0.5)
        await other.cancel(ack.run_id)
        n = len(renewed)
        out = await rt.wait(ack)
        assert out.status == "cancelled" and len(seen) == 1
        assert len(renewed) - n >= 20 and all(lost == set() for lost in renewed)  # ~9 s on a 0.3 s lease
        info = await rt.get_run(ack.run_id)
        assert info.attempt == 1
        starts = [e for e in (await rt.read_events("k")).events if e.type == "run.started"]
        assert len(starts) == 1


async def test_a_takeover_of_a_cancelled_run_finalises_it_and_fences_the_old_worker():
    """A stalls in a tool without renewing or polling; B's process cancels the run (rewriting A's
    lease) and takes it over once the lease lapses: the takeover's lease carries the cancel (B's
    every commit finds it there), B finalises A's call and settles cancelled without a model
    call, and A's late result is refused by its lease check (nothing of it stored)."""
    effects = []
    release_a = trio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Slow effect."""
        effects.append(ctx.call_id)
        await release_a.wait()
        return "A's result"

    model = ScriptedModel(tool_then_answer("slow"))
    agent = Agent("t", model=model, tools=[slow])
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt_a:
        async def no_renew(claims):
            return set()

        rt_a.store.renew_many = no_renew
        rt_a.store.cancels_requested_now = no_poll
        ack = await rt_a.submit(agent, "t", "go")
        while not effects:
            await trio.sleep(0.01)
        async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt_b:
            reads = count_cancel_record_reads(rt_b)
            flags = []
            real_check = rt_b.store.check_lease

            async def recording_check(tr, claim):
                rec = await real_check(tr, claim)
                flags.append(rec.get("cancel", False))
                return rec

            rt_b.store.check_lease = recording_check
            info = await rt_b.cancel(ack.run_id)
            assert info.status == "running" and info.cancel_requested
            out = await rt_b.wait(ack)
            assert out.status == "cancelled"
            assert (await rt_b.get_run(ack.run_id)).attempt == 2
            assert len(model.calls) == 1 and len(effects) == 1
            # B's commits learnt of the cancel from the lease its takeover wrote; the cancel record
            # was read once, by the runner's read-only start (loop state, transcript) on a takeover
            assert flags and all(flags)
            assert reads == [ack.run_id]
            before = await rt_b.transcript("t")
            journal_before = (await rt_b.read_events("t", limit=10_000)).events
            assert roles(before) == ["user", "assistant", "tool"]
            assert before[2]["content"][0]["reason"] == "interrupted"  # (B's recovery, as ever)
            release_a.set()  # A's tool returns; A tries to persist its result
            await trio.sleep(0.3)
            assert await rt_b.transcript("t") == before
            assert (await rt_b.read_events("t", limit=10_000)).events == journal_before
            assert not any("A's result" in repr(m) for m in before)


async def test_renewals_after_a_cancel_keep_it_for_the_next_commit(autojump_clock):
    """The same with a keeper that renews but never polls: the lease is renewed many times over
    between the cancel and the tool's end, and the tool's result commit still finds the cancel
    in the lease (a renewal that wrote the record without it would let the run go on to its
    final answer and complete)."""

    @tool
    async def long(ctx: ToolContext) -> str:
        """Works for a while, whatever happens."""
        await trio.sleep(5)
        return "long done"

    model = ScriptedModel(tool_then_answer("long"))
    agent = Agent("r", model=model, tools=[long])
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt, \
            Runtime.open(db=engine.database(), workers=0) as other:
        rt.store.cancels_requested_now = no_poll
        renewed = []
        real_renew = rt.store.renew_many

        async def counting(claims):
            lost = await real_renew(claims)
            renewed.append(lost)
            return lost

        rt.store.renew_many = counting
        ack = await rt.submit(agent, "r", "go")
        await trio.sleep(0.5)
        await other.cancel(ack.run_id)
        n = len(renewed)
        out = await rt.wait(ack)
        assert out.status == "cancelled"
        assert len(renewed) - n >= 20 and all(lost == set() for lost in renewed)
        assert len(model.calls) == 1 and (await rt.get_run(ack.run_id)).attempt == 1
        assert roles(await rt.transcript("r")) == ["user", "assistant", "tool"]
