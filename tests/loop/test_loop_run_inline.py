"""``Runtime.run`` drives its own run: submitted and claimed in one commit (the ledger's
``submit_and_claim``), executed in a task of the runtime, its outcome taken from the runner.

Every way that fast path can be left is checked here: a busy conversation (the run queues
for the claim loops), a reused submission id, a caller that stops waiting, a run that parks
for approval, a crash, a ``commit_unknown_result`` on the submitting commit, and a run
whose first writes cannot be prepared inside the claim.  tests/loop/test_loop_run_sim.py
crashes it at every write.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

import kv
from kv.engine import FaultHooks
from kv.errors import KVError
from loop import Agent, Runtime, ScriptedModel, ToolContext, tool
from loop.providers import reply, tool_call


def roles(msgs):
    return [m["role"] for m in msgs]


def types(events):
    return [e.type for e in events]


def tool_then_answer(name, args, answer="done"):
    def script(messages, tools):
        if messages[-1]["role"] == "tool":
            return answer
        return reply("working", tool_call(name, args))

    return script


@pytest.fixture(params=["memory", "lmdb"])
async def rt(request, tmp_path):
    url = "memory:" if request.param == "memory" else f"lmdb:{tmp_path / 'data'}"
    async with Runtime.open(url) as rt:
        yield rt


async def test_run_behind_an_active_run_queues_for_the_workers(rt):
    gate = trio.Event()

    @tool
    async def wait_gate() -> str:
        """Wait."""
        await gate.wait()
        return "open"

    first_agent = Agent("g", model=ScriptedModel(tool_then_answer("wait_gate", {}, "first done")), tools=[wait_gate])
    outs = {}

    async def run(name, agent, text):
        outs[name] = await rt.run(agent, "busy", text)

    async with trio.open_nursery() as n:
        n.start_soon(run, "first", first_agent, "one")
        while not rt._active:
            await trio.sleep(0.001)
        n.start_soon(run, "second", Agent("e", model="echo"), "two")
        await trio.sleep(0.05)
        assert "second" not in outs  # queued behind the first (FIFO), not started beside it
        gate.set()
    assert outs["first"].ok and outs["first"].result == "first done"
    assert outs["second"].ok and outs["second"].result == "You said: two"
    assert roles(await rt.transcript("busy")) == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    first, second = await rt.runs("busy")
    assert first.run_id == outs["first"].run_id and second.run_id == outs["second"].run_id
    assert second.attempt == 1


async def test_run_with_a_used_submission_id_returns_the_first_outcome(rt):
    agent = Agent("e", model="echo")
    a = await rt.run(agent, "dup", "hello", submission_id="same")
    b = await rt.run(agent, "dup", "hello", submission_id="same")
    assert a == b and a.ok and a.result == "You said: hello"
    assert len(await rt.runs("dup")) == 1
    assert roles(await rt.transcript("dup")) == ["user", "assistant"]


async def test_a_caller_that_stops_waiting_neither_stops_nor_interrupts_the_run(rt):
    started, release = trio.Event(), trio.Event()
    effects = []

    @tool
    async def job(ctx: ToolContext) -> str:
        """A tool that takes a while."""
        effects.append(ctx.call_id)
        started.set()
        await release.wait()
        return "finished"

    agent = Agent("j", model=ScriptedModel(tool_then_answer("job", {}, "all done")), tools=[job])
    with trio.move_on_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(lambda: rt.run(agent, "walk-away", "go", submission_id="wa"))
            await started.wait()
            n.cancel_scope.cancel()  # the caller gives up waiting, mid-tool
    release.set()
    ack = await rt.submit(agent, "walk-away", "go", submission_id="wa")  # the same submission: its run
    out = await rt.wait(ack)
    assert out.ok and out.result == "all done"
    assert len(effects) == 1  # ran once, never interrupted
    msgs = await rt.transcript("walk-away")
    assert msgs[2]["content"][0]["content"] == "finished"


async def test_run_that_parks_for_approval_returns_once_approved_and_resumed(rt):
    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        """Pay."""
        return f"paid {amount}"

    agent = Agent("a", model=ScriptedModel(tool_then_answer("pay", {"amount": 3}, "paid")), tools=[pay])
    outs = []

    async def run() -> None:
        outs.append(await rt.run(agent, "park", "pay 3"))

    async with trio.open_nursery() as n:
        n.start_soon(run)
        while not await rt.conversations():
            await trio.sleep(0.001)
        async for ev in rt.events("park"):
            if ev.type == "approval.requested":
                run_id, call_id = ev.data["run_id"], ev.data["call_id"]
                break
        assert (await rt.get_run(run_id)).status == "parked"
        await rt.approve(run_id, call_id, True)
    out = outs[0]
    assert out.ok and out.result == "paid" and out.run_id == run_id
    assert "approval.resolved" in types((await rt.read_events("park", limit=1000)).events)


class _Report1021Once(FaultHooks):
    """The first commit writing a submission record applies, then reports commit_unknown_result."""

    def __init__(self) -> None:
        self.injected = 0

    def after_apply(self, version, batch):
        out = {}
        for req in batch:
            if not self.injected and any(m[0] == "set" and b"sub" in bytes(m[1]) for m in req.mutations):
                out[req] = KVError(1021)
                self.injected += 1
        return out


@pytest.mark.parametrize("engine", ["memory", "lmdb"])
async def test_commit_unknown_result_on_the_submitting_commit_still_makes_one_run(engine, tmp_path):
    """The retry finds its own submission and its own lease (nonce) and drives that run: one run,
    one user message, one run.started, no second claim."""
    url = "memory:" if engine == "memory" else f"lmdb:{tmp_path / 'data'}"
    effects = []

    @tool
    def once() -> str:
        """An effect."""
        effects.append(1)
        return "ok"

    agent = Agent("u", model=ScriptedModel(tool_then_answer("once", {}, "fine")), tools=[once])
    async with Runtime.open(url, workers=0) as rt:  # no claim loop: only rt.run's own claim can run it
        hooks = _Report1021Once()
        rt.db.engine.hooks = hooks
        out = await rt.run(agent, "u1021", "go", submission_id="k")
        assert hooks.injected == 1
        assert out.ok and out.result == "fine" and effects == [1]
        assert roles(await rt.transcript("u1021")) == ["user", "assistant", "tool", "assistant"]
        t = types((await rt.read_events("u1021", limit=1000)).events)
        assert t.count("run.queued") == 1 and t.count("run.started") == 1 and t[-1] == "run.completed"
        info = await rt.get_run(out.run_id)
        assert info.attempt == 1 and len(await rt.runs("u1021")) == 1


async def test_a_run_whose_first_writes_fail_in_the_claim_is_submitted_again_without_them():
    """A user message the loop cannot use fails ``prepare`` inside the submitting transaction:
    nothing of that transaction commits, the submission is made again without it, and the run
    then fails its attempts in the runner (as a worker-claimed run would), bounded."""
    agent = Agent("bad", model="echo")
    async with Runtime.open("memory:", lease_seconds=0.05, max_attempts=2) as rt:
        with trio.fail_after(30):
            out = await rt.run(agent, "bad", {"role": "assistant", "content": "not a user message"})
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        assert len(await rt.runs("bad")) == 1
        t = types((await rt.read_events("bad", limit=1000)).events)
        assert t.count("run.queued") == 1 and t[-1] == "run.failed"


async def test_a_run_left_by_a_dead_process_is_taken_over_by_another(tmp_path):
    """The run rt.run drives is leased like any other: a process that dies (its lease left to
    lapse) hands it to the next process's claim loop, which finalises the started tool call."""
    engine = kv.MemoryEngine()
    started = trio.Event()
    effects = []

    @tool
    async def hang(ctx: ToolContext) -> str:
        """Starts, then hangs until the process dies."""
        effects.append(ctx.call_id)
        started.set()
        await trio.sleep_forever()

    agent = Agent("h", model=ScriptedModel(tool_then_answer("hang", {}, "recovered")), tools=[hang])
    async with trio.open_nursery() as n:
        async def doomed() -> None:
            async with Runtime.open(db=engine.database(), workers=0, lease_seconds=0.2,
                                    release_on_shutdown=False) as rt_a:
                await rt_a.run(agent, "dead", "go", submission_id="d")

        n.start_soon(doomed)
        await started.wait()
        n.cancel_scope.cancel()  # the process "dies" mid-tool, lease not released
    async with Runtime.open(db=engine.database(), lease_seconds=0.2) as rt_b:
        with trio.fail_after(10):
            out = await rt_b.run(agent, "dead", "go", submission_id="d")
        assert out.ok and out.result == "recovered"
        assert len(effects) == 1  # never re-run
        msgs = await rt_b.transcript("dead")
        assert msgs[2]["content"][0]["reason"] == "interrupted"
        assert (await rt_b.get_run(out.run_id)).attempt == 2


async def test_submits_handed_to_idle_workers_queue_and_refuse_as_before():
    """rt.submit hands a run to an idle claim loop only when it can start; a run that must
    queue, or a refused submit, leaves the worker idle and looking for work as before."""
    from loop import ConversationBusy

    gate = trio.Event()

    @tool
    async def wait_gate() -> str:
        """Wait."""
        await gate.wait()
        return "open"

    agent = Agent("g", model=ScriptedModel(tool_then_answer("wait_gate", {}, "first done")), tools=[wait_gate])
    echo = Agent("e", model="echo")
    async with Runtime.open("memory:", workers=2, agents=[agent, echo]) as rt:
        await trio.testing.wait_all_tasks_blocked()
        assert len(rt._idle) == 2
        first = await rt.submit(agent, "h", "one")
        assert first.status == "running"
        second = await rt.submit(echo, "h", "two")  # behind the first: queued, for the claim loops
        assert second.status == "queued"
        with pytest.raises(ConversationBusy):
            await rt.submit(echo, "h", "three", policy="reject")
        await trio.testing.wait_all_tasks_blocked()
        assert len(rt._idle) == 1  # one worker drives the first run, the other waits again
        again = await rt.submit(agent, "h", "one", submission_id=first.submission_id)
        assert again.duplicate and again.run_id == first.run_id
        gate.set()
        assert (await rt.wait(first)).result == "first done"
        assert (await rt.wait(second)).result == "You said: two"
        assert [r.run_id for r in await rt.runs("h")] == [first.run_id, second.run_id]
        await trio.testing.wait_all_tasks_blocked()
        assert len(rt._idle) == 2


async def test_a_stopped_claim_loop_is_never_handed_a_run():
    agent = Agent("e", model="echo")
    async with Runtime.open("memory:", workers=0, agents=[agent]) as rt:
        async with trio.open_nursery() as n:
            n.start_soon(rt.serve, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert len(rt._idle) == 1
            n.cancel_scope.cancel()
        assert len(rt._idle) == 0  # it left the offer when it stopped
        ack = await rt.submit(agent, "s", "hi")
        assert ack.status == "queued"  # into the ready index, for whoever claims next
        async with trio.open_nursery() as n:
            n.start_soon(rt.serve, 1)
            assert (await rt.wait(ack)).result == "You said: hi"
            n.cancel_scope.cancel()


async def test_a_claim_loop_stopped_while_a_submit_hands_it_a_run_gives_the_run_back():
    """The handover is one shielded commit: if the worker's runtime task is cancelled meanwhile,
    the run claimed for it is released (not left to a lease that would take a minute to lapse)."""
    agent = Agent("e", model="echo")
    async with Runtime.open("memory:", workers=0, agents=[agent], lease_seconds=60) as rt:
        acks = []
        async with trio.open_nursery() as n:
            n.start_soon(rt.serve, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert len(rt._idle) == 1

            async def submit():
                acks.append(await rt.submit(agent, "r", "hi"))

            n.start_soon(submit)
            await trio.sleep(0)  # the submit takes the worker and starts its commit...
            n.cancel_scope.cancel()  # ...and the claim loops stop meanwhile
        assert len(acks) == 1 and acks[0].status == "running"  # claimed for the stopped worker
        info = await rt.get_run(acks[0].run_id)
        assert info.status in ("queued", "completed")  # given back (or finished), not held
        with trio.fail_after(5):  # far less than the 60 s lease
            async with trio.open_nursery() as n:
                n.start_soon(rt.serve, 1)
                assert (await rt.wait(acks[0])).result == "You said: hi"
                n.cancel_scope.cancel()
