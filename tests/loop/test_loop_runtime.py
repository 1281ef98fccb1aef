"""The durable loop through the embedded Runtime, on the real memory and lmdb engines."""

from __future__ import annotations


import pytest
import trio

from loop import (Agent, ApprovalError, Hooks, NotFound, RetryPolicy, Runtime, ScriptedModel, SubmissionConflict,
                  ToolContext, tool)
from loop import messages as M
from loop.providers import broken, overflow, permanent, reply, tool_call, transient
from loop.compaction import SUMMARY_PREFIX


def roles(msgs):
    return [m["role"] for m in msgs]


async def all_events(rt, conv):
    page = await rt.read_events(conv, limit=10_000)
    return page.events


def types(events):
    return [e.type for e in events]


def tool_then_answer(name, args, answer="done"):
    """A script: call ``name`` once, then answer (keyed on the context, so replayable)."""

    def script(messages, tools):
        if messages[-1]["role"] == "tool":
            return answer
        return reply("working", tool_call(name, args))

    return script


@pytest.fixture(params=["memory", "lmdb", "fdb-capi"])
async def rt(request, tmp_path):
    """A Runtime on the memory engine, on LMDB in a temp dir, and on the FoundationDB backend
    through the real ``fdb`` bindings over the stand-in libfdb_c (docs/fdb-testing.md): the
    whole loop -- claims, leases, watches for follow, versionstamped journal keys -- on the
    backend that has no cluster here."""
    if request.param == "fdb-capi":
        from kvtest_helpers import stand_in_database

        async with stand_in_database(tmp_path / "cluster") as database, Runtime.open(db=database) as rt:
            yield rt
        return
    url = "memory:" if request.param == "memory" else f"lmdb:{tmp_path / 'data'}"
    async with Runtime.open(url) as rt:
        yield rt


async def test_turn_with_tool_persists_and_journals_everything(rt):
    effects = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        effects.append((a, b))
        return a + b

    agent = Agent("calc", "You add.", ScriptedModel(tool_then_answer("add", {"a": 2, "b": 3}, "5")), tools=[add])
    out = await rt.run(agent, "c1", "2+3?")
    assert out.ok and out.result == "5" and out.text == "5"
    assert effects == [(2, 3)]
    msgs = await rt.transcript("c1")
    assert roles(msgs) == ["user", "assistant", "tool", "assistant"]
    assert msgs[2]["content"][0] == {"type": "tool_result", "call_id": "call_1_0", "name": "add", "content": "5", "is_error": False}
    evs = await all_events(rt, "c1")
    t = types(evs)
    assert t[0] == "run.queued" and t[1] == "run.started" and t[-1] == "run.completed"
    assert t.index("tool.started") < t.index("tool.completed")
    assert t.count("message.added") == 4 and t.count("usage.updated") == 2
    assert "part.added" not in t  # a fast answer is journaled whole by message.added, no extra commits
    done = evs[-1].data
    assert done["run_id"] == out.run_id and done["result"] == "5"
    info = await rt.get_run(out.run_id)
    assert info.status == "completed" and info.attempt == 1 and info.agent == "calc"


async def test_slow_stream_is_journaled_in_coalesced_parts(autojump_clock):
    text = "".join(f"word{i} " for i in range(200))
    model = ScriptedModel([text], chunk=5, delay=0.01)  # 240 deltas over 2.4 virtual seconds
    async with Runtime.open("memory:") as rt:
        out = await rt.run(Agent("s", model=model), "slow", "talk")
        assert out.ok and out.result == text
        evs = await all_events(rt, "slow")
        parts = [e for e in evs if e.type in ("part.added", "part.updated")]
        assert parts[0].type == "part.added" and parts[0].data["kind"] == "text"
        assert "".join(e.data.get("text", "") for e in parts) == text  # nothing lost, nothing reordered
        assert 5 <= len(parts) <= 60  # coalesced: far fewer events than deltas
        assert types(evs).index("message.added", 3) > evs.index(parts[-1])


async def test_submit_ack_cursor_and_live_events(rt):
    agent = Agent("e", model="echo")
    ack = await rt.submit(agent, "c2", "hello", submission_id="sub-1")
    assert ack.run_id and ack.cursor and ack.submission_id == "sub-1" and not ack.duplicate
    seen = []
    async for ev in rt.events("c2", after=ack.cursor):
        seen.append(ev)
        if ev.type == "run.completed":
            break
    assert seen[0].type == "run.started"  # strictly after the run.queued cursor
    assert seen[-1].data["result"] == "You said: hello"
    # replayed positions equal the live ones
    replay = [e for e in await all_events(rt, "c2") if e.cursor > ack.cursor]
    assert [e.cursor for e in replay] == [e.cursor for e in seen]


async def test_duplicate_submission_returns_the_same_run(rt):
    agent = Agent("e", model="echo")
    out = await rt.run(agent, "c3", "once", submission_id="dup")
    ack2 = await rt.submit(agent, "c3", "once", submission_id="dup")
    assert ack2.duplicate and ack2.run_id == out.run_id and ack2.outcome["status"] == "completed"
    assert (await rt.wait(ack2)).result == out.result
    with pytest.raises(SubmissionConflict):
        await rt.submit(agent, "c3", "twice", submission_id="dup")
    assert roles(await rt.transcript("c3")) == ["user", "assistant"]  # one run only


async def test_runs_queue_fifo_per_conversation(rt):
    agent = Agent("e", model="echo")
    acks = [await rt.submit(agent, "c4", f"m{i}") for i in range(4)]
    outs = [await rt.wait(a) for a in acks]
    assert [o.result for o in outs] == [f"You said: m{i}" for i in range(4)]
    msgs = await rt.transcript("c4")
    assert [M.text_of(m) for m in msgs] == [x for i in range(4) for x in (f"m{i}", f"You said: m{i}")]
    started = [e.data["run_id"] for e in await all_events(rt, "c4") if e.type == "run.started"]
    assert started == [a.run_id for a in acks]


async def test_transient_retries_are_journaled_not_recorded(autojump_clock):
    model = ScriptedModel([transient("overloaded", retry_after=5), transient("busy", status=503), "finally"])
    agent = Agent("r", model=model, retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        t0 = trio.current_time()
        out = await rt.run(agent, "c5", "hi")
        elapsed = trio.current_time() - t0
        assert out.ok and out.result == "finally"
        evs = await all_events(rt, "c5")
        retries = [e.data for e in evs if e.type == "run.retry-pending"]
        assert [(r["attempt"], r["maxAttempts"]) for r in retries] == [(2, 4), (3, 4)]
        assert [r["delay"] for r in retries] == [5.0, 4.0]  # retry-after honoured, then 2 s doubling
        assert retries[0]["error"]["type"] == "transient" and retries[1]["error"]["status"] == 503
        assert retries[1]["nextAttemptAt"] > retries[0]["nextAttemptAt"]
        assert elapsed >= 9.0
        # the errors never reached the transcript
        assert roles(await rt.transcript("c5")) == ["user", "assistant"]
        assert len(model.calls) == 3


async def test_retries_exhausted_fail_the_run(autojump_clock):
    model = ScriptedModel([transient()] * 4)
    agent = Agent("r", model=model, retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c6", "hi")
        assert out.status == "failed" and out.error["type"] == "transient"
        msgs = await rt.transcript("c6")
        assert roles(msgs) == ["user", "error"]
        assert len([e for e in await all_events(rt, "c6") if e.type == "run.retry-pending"]) == 3
        assert len(model.calls) == 4


async def test_permanent_error_is_recorded_and_fails_the_run(rt):
    model = ScriptedModel([permanent("invalid x-api-key", status=401)])
    out = await rt.run(Agent("p", model=model), "c7", "hi")
    assert out.status == "failed" and out.error == {"type": "permanent", "message": "invalid x-api-key", "status": 401, "provider": "scripted"}
    msgs = await rt.transcript("c7")
    assert msgs[-1] == {"role": "error", "error": out.error}
    evs = await all_events(rt, "c7")
    assert evs[-1].type == "run.failed" and "run.retry-pending" not in types(evs)


async def test_stream_broken_after_output_is_not_retried(rt):
    model = ScriptedModel([broken("partial answer that breaks", after=1), "never"])
    out = await rt.run(Agent("b", model=model), "c8", "hi")
    assert out.status == "failed" and out.error["type"] == "stream_broken"
    assert len(model.calls) == 1
    evs = await all_events(rt, "c8")
    assert "part.added" in types(evs)  # what streamed stays visible
    assert roles(await rt.transcript("c8")) == ["user", "error"]


async def test_overflow_compacts_once_then_retries(rt):
    calls = []

    def script(messages, tools):
        calls.append(messages)
        if len(calls) == 1:
            return overflow()
        if len(calls) == 2:
            return "SUMMARY: the user said many things"
        return "answer after compaction"

    agent = Agent("o", model=ScriptedModel(script), keep_recent=2)
    # some history first
    for i in range(3):
        await rt.run(Agent("e", model="echo"), "c9", f"earlier {i}")
    out = await rt.run(agent, "c9", "now")
    assert out.ok and out.result == "answer after compaction"
    msgs = await rt.transcript("c9")
    entry = next(m for m in msgs if m["role"] == "compaction")
    assert entry["summary"] == "SUMMARY: the user said many things" and entry["reason"] == "overflow"
    last_call = calls[-1]
    assert M.text_of(last_call[0]).startswith(SUMMARY_PREFIX)
    assert M.text_of(last_call[-1]) == "now"
    assert len(last_call) < len([m for m in msgs if m["role"] in ("user", "assistant")])
    assert "context.compacted" in types(await all_events(rt, "c9"))
    # the full history is still there
    assert sum(1 for m in msgs if m["role"] == "user") == 4


async def test_second_overflow_fails(rt):
    for i in range(3):
        await rt.run(Agent("e", model="echo"), "c10", f"earlier {i}")
    model = ScriptedModel([overflow(), "summary", overflow()])
    out = await rt.run(Agent("o", model=model, keep_recent=2), "c10", "now")
    assert out.status == "failed" and out.error["type"] == "overflow"


async def test_threshold_compaction(rt):
    seen = []

    def script(messages, tools):
        seen.append(messages)
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            return "short summary"
        return "ok " + "x" * 200

    agent = Agent("t", model=ScriptedModel(script), compact_at_tokens=150, keep_recent=2)
    for i in range(4):
        out = await rt.run(agent, "c11", f"question {i} " + "y" * 100)
        assert out.ok
    msgs = await rt.transcript("c11")
    assert any(m["role"] == "compaction" and m["reason"] == "threshold" for m in msgs)
    assert M.text_of(seen[-1][0]).startswith(SUMMARY_PREFIX)


async def test_a_compaction_past_the_usage_ceiling_is_refused_before_the_summariser_runs(rt):
    """The summariser is a model call: reserved against the run's ceiling like the others, so
    its usage can never carry the run past it (found by the simulator: a threshold compaction
    ran unreserved and the run recorded 307 tokens against a ceiling of 300)."""
    summaries = []

    def script(messages, tools):
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            summaries.append(messages)
            return "short summary"
        return "ok " + "x" * 200

    agent = Agent("t", model=ScriptedModel(script), compact_at_tokens=150, keep_recent=2)
    for i in range(2):  # a transcript long enough that the next model step compacts first
        assert (await rt.run(agent, "c11b", f"question {i} " + "y" * 100)).ok
    summaries.clear()
    ceiling = 120  # room for the run's own turn, not for summarising the history first
    out = await rt.run(agent, "c11b", "one more", limits={"max_total_tokens": ceiling})
    assert out.status == "failed" and out.error["type"] == "usage_limit", out
    assert out.error.get("during") == "compaction"
    assert summaries == []  # refused before the call, not after it
    used = await rt.store.ledger.usage.totals(out.run_id)
    assert used.get("total_tokens", 0) <= ceiling


async def test_approval_parks_then_approve_resumes(rt):
    effects = []

    @tool(requires_approval=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay someone."""
        effects.append((amount, ctx.idempotency_key))
        return "paid"

    agent = Agent("a", model=ScriptedModel(tool_then_answer("pay", {"amount": 7}, "all paid")), tools=[pay])
    ack = await rt.submit(agent, "c12", "pay 7")
    async for ev in rt.events("c12", after=ack.cursor):
        if ev.type == "approval.requested":
            req = ev.data
            break
    info = await rt.get_run(ack.run_id)
    assert info.status == "parked" and list(info.pending_approvals) == [req["call_id"]]
    assert req["name"] == "pay" and req["arguments"] == {"amount": 7}
    assert effects == []
    with pytest.raises(ApprovalError):
        await rt.approve(ack.run_id, "no-such-call")
    await rt.approve(ack.run_id, req["call_id"], True, "looks right")
    out = await rt.wait(ack)
    assert out.ok and out.result == "all paid"
    assert effects == [(7, rt.store.idempotency_key(ack.run_id, f"tool/{req['call_id']}"))]
    assert effects[0][1].startswith("sf-")
    t = types(await all_events(rt, "c12"))
    assert t.index("approval.requested") < t.index("approval.resolved") < t.index("tool.started")
    await rt.approve(ack.run_id, req["call_id"], True)  # the same decision again: harmless


async def test_denial_is_an_error_result_the_model_sees(rt):
    effects = []

    @tool(requires_approval=True)
    def delete_all() -> str:
        """Delete everything."""
        effects.append(1)
        return "deleted"

    seen = []

    def script(messages, tools):
        seen.append(messages[-1])
        if messages[-1]["role"] == "tool":
            return "ok, I will not"
        return reply("", tool_call("delete_all"))

    ack = await rt.submit(Agent("d", model=ScriptedModel(script), tools=[delete_all]), "c13", "wipe")
    async for ev in rt.events("c13", after=ack.cursor):
        if ev.type == "approval.requested":
            await rt.approve(ack.run_id, ev.data["call_id"], False, "too dangerous")
            break
    out = await rt.wait(ack)
    assert out.ok and effects == []
    result = seen[-1]["content"][0]
    assert result["is_error"] and result["reason"] == "denied" and "too dangerous" in result["content"]


async def test_cancel_during_a_tool_is_cooperative(rt):
    started = trio.Event()

    @tool
    async def long_job(ctx: ToolContext) -> str:
        """Work until cancelled."""
        started.set()
        while not ctx.cancelled:
            await trio.sleep(0.01)
        return "stopped early"

    model = ScriptedModel(tool_then_answer("long_job", {}, "should not be asked"))
    ack = await rt.submit(Agent("c", model=model, tools=[long_job]), "c14", "go")
    await started.wait()
    await rt.cancel(ack.run_id)
    out = await rt.wait(ack)
    assert out.status == "cancelled"
    assert len(model.calls) == 1  # no model call after the cancel
    msgs = await rt.transcript("c14")
    assert msgs[-1]["content"][0]["content"] == "stopped early"  # the tool's own result is kept
    assert types(await all_events(rt, "c14"))[-1] == "run.cancelled"


async def test_cancel_a_queued_run(rt):
    gate = trio.Event()

    @tool
    async def wait_gate() -> str:
        """Wait."""
        await gate.wait()
        return "open"

    agent = Agent("g", model=ScriptedModel(tool_then_answer("wait_gate", {}, "first done")), tools=[wait_gate])
    first = await rt.submit(agent, "c15", "one")
    second = await rt.submit(Agent("e", model="echo"), "c15", "two")
    info = await rt.cancel(second.run_id)
    assert info.status == "cancelled"
    gate.set()
    assert (await rt.wait(first)).ok
    assert (await rt.wait(second)).status == "cancelled"
    assert roles(await rt.transcript("c15")) == ["user", "assistant", "tool", "assistant"]


async def test_usage_ceiling_stops_the_run(rt):
    model = ScriptedModel(lambda m, t: reply("again", tool_call("noop")) if len(m) < 20 else "end")

    @tool
    def noop() -> str:
        """Nothing."""
        return "ok"

    out = await rt.run(Agent("u", model=model, tools=[noop]), "c16", "loop", limits={"max_total_tokens": 60})
    assert out.status == "failed" and out.error["type"] == "usage_limit"
    assert "past its ceiling of 60" in out.error["message"]
    assert 1 <= len(model.calls) < 10


async def test_result_schema(rt):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    good = await rt.run(Agent("s", model=ScriptedModel(['```json\n{"n": 4}\n```'])), "c17", "count", result_schema=schema)
    assert good.ok and good.result == {"n": 4}
    bad = await rt.run(Agent("s2", model=ScriptedModel(['{"n": "four"}'])), "c17", "count", result_schema=schema)
    assert bad.status == "failed" and bad.error["type"] == "result_schema"
    assert "$.n: expected integer" in bad.error["message"]
    not_json = await rt.run(Agent("s3", model=ScriptedModel(["four"])), "c17", "count", result_schema=schema)
    assert not_json.status == "failed" and "not JSON" in not_json.error["message"]
    msgs = await rt.transcript("c17")
    assert roles(msgs)[-2:] == ["assistant", "error"]


async def test_unknown_tool_and_bad_arguments_become_results(rt):
    @tool
    def square(x: int) -> int:
        """Square."""
        return x * x

    script = ScriptedModel([
        reply("", tool_call("cube", {"x": 2}), tool_call("square", {"x": "two"}), tool_call("square", {"x": 3})),
        "done",
    ])
    out = await rt.run(Agent("t", model=script, tools=[square]), "c18", "go")
    assert out.ok
    results = [m["content"][0] for m in await rt.transcript("c18") if m["role"] == "tool"]
    assert [(r["reason"] if r["is_error"] else r["content"]) for r in results] == ["unknown_tool", "invalid_arguments", "9"]


async def test_hooks_rewrite_the_request_and_the_result(rt):
    def before(info):
        info.system = "REWRITTEN " + info.system

    def after(info):
        info.content = info.content.upper()

    @tool
    def shout() -> str:
        """Say it."""
        return "quiet"

    model = ScriptedModel(tool_then_answer("shout", {}, "ok"))
    agent = Agent("h", "base", model, tools=[shout], hooks=Hooks(before_model_call=before, after_tool=after))
    await rt.run(agent, "c19", "go")
    assert all(c["system"] == "REWRITTEN base" for c in model.calls)
    tool_msg = next(m for m in await rt.transcript("c19") if m["role"] == "tool")
    assert tool_msg["content"][0]["content"] == "QUIET"


async def test_durable_steps_and_tool_errors(rt):
    charges = []

    @tool
    async def charge(ctx: ToolContext) -> str:
        """Charge once."""
        a = await ctx.step("charge", lambda: charges.append(ctx.idempotency_key) or len(charges))
        with pytest.raises(ValueError):
            await ctx.step("charge", lambda: None)
        return f"charge #{a}"

    @tool
    def explode() -> str:
        """Fail."""
        raise RuntimeError("kaboom")

    model = ScriptedModel([reply("", tool_call("charge"), tool_call("explode")), "done"])
    out = await rt.run(Agent("st", model=model, tools=[charge, explode]), "c20", "go")
    assert out.ok and len(charges) == 1
    results = [m["content"][0] for m in await rt.transcript("c20") if m["role"] == "tool"]
    assert results[0]["content"] == "charge #1"
    assert results[1]["is_error"] and results[1]["content"] == "RuntimeError: kaboom"


async def test_max_model_calls(rt):
    @tool
    def again() -> str:
        """Again."""
        return "again"

    model = ScriptedModel(lambda m, t: reply("", tool_call("again")))
    out = await rt.run(Agent("m", model=model, tools=[again], max_model_calls=3), "c21", "go")
    assert out.status == "failed" and out.error["type"] == "max_model_calls"
    assert len(model.calls) == 3


async def test_fork_and_not_found(rt):
    agent = Agent("e", model="echo")
    await rt.run(agent, "c22", "one")
    await rt.run(agent, "c22", "two")
    new = await rt.fork("c22", 2, new_conversation="c22-fork")
    assert new == "c22-fork"
    assert [M.text_of(m) for m in await rt.transcript("c22-fork")] == ["one", "You said: one"]
    out = await rt.run(agent, "c22-fork", "three")
    assert out.ok and len(await rt.transcript("c22-fork")) == 4 and len(await rt.transcript("c22")) == 4
    with pytest.raises(NotFound):
        await rt.get_run("nope")
    with pytest.raises(NotFound):
        await rt.get_run(out.run_id, owner="other/user")  # a foreign run is a missing run
    for read in (lambda o: rt.transcript("c22", owner=o), lambda o: rt.read_events("c22", owner=o),
                 lambda o: rt.fork("c22", 1, owner=o)):
        with pytest.raises(NotFound):
            await read("other/user")
    with pytest.raises(NotFound):
        async for _ in rt.events("c22", owner="other/user"):
            pass
    with pytest.raises(NotFound):
        await rt.transcript("never-used")


async def test_retry_exhausted_after_repeated_crashes(tmp_path):
    """Each takeover after a 'crash' (a runtime closed mid-run without releasing) is a new
    attempt; past the max, the run fails with retry_exhausted."""
    model = ScriptedModel(lambda m, t: reply("", tool_call("hang")))

    @tool
    async def hang() -> str:
        """Never returns."""
        await trio.sleep_forever()

    url = f"lmdb:{tmp_path / 'd'}"
    agent = Agent("x", model=model, tools=[hang])
    run_id = None
    for attempt in range(1, 3):
        async with Runtime.open(url, max_attempts=2, lease_seconds=0.3, release_on_shutdown=False) as rt:
            rt.register(agent)
            if run_id is None:
                run_id = (await rt.submit(agent, "c23", "go")).run_id
            while (await rt.get_run(run_id)).attempt < attempt:
                await trio.sleep(0.01)
            async for ev in rt.events("c23"):
                if ev.type == "tool.started" and ev.data.get("call_id") and attempt == 1:
                    break
                if attempt == 2 and ev.type == "run.started" and ev.data["attempt"] == 2:
                    break
    async with Runtime.open(url, max_attempts=2, lease_seconds=0.3) as rt:
        rt.register(agent)
        out = await rt.wait(await rt.submit(agent, "c23", "go", submission_id=(await rt.get_run(run_id)).submission_id))
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        msgs = await rt.transcript("c23")
        # the first attempt's started call was finalised as interrupted by the second, and the
        # last one's by the claim that settled the run: no call is left without a result
        calls = [p["id"] for m in msgs for p in M.tool_calls_of(m)]
        results = [m["content"][0] for m in msgs if m["role"] == "tool"]
        assert calls and sorted(calls) == sorted(r["call_id"] for r in results)
        assert all(r["reason"] == "interrupted" for r in results)
        assert (await rt.get_run(run_id)).attempt == 2


async def _exhaust_with_a_call_out(url: str, conv: str) -> tuple[Agent, str]:
    """A run (max_attempts=1) whose only attempt started a tool call and then 'crashed' (its
    runtime closed without releasing): the next claim is the exhausted run's finaliser."""

    @tool
    async def hang() -> str:
        """Never returns."""
        await trio.sleep_forever()

    agent = Agent("x", model=ScriptedModel(lambda m, t: reply("", tool_call("hang"))), tools=[hang])
    # (a lease long enough that this runtime's keeper never lets it lapse on a loaded machine: its
    # own worker would then finalise the run; the next runtime waits this long for the takeover)
    async with Runtime.open(url, max_attempts=1, lease_seconds=1.0, release_on_shutdown=False) as rt:
        rt.register(agent)
        run_id = (await rt.submit(agent, conv, "go")).run_id
        async for ev in rt.events(conv):
            if ev.type == "tool.started":
                break
    return agent, run_id


def _finalised_once(msgs: list[dict], events: list) -> None:
    """Every call has exactly one result (interrupted), journaled as tool.completed and
    message.added in the very commit that journaled run.failed (the journal position's
    first 8 bytes are its commit version)."""
    from sessions.journal import decode_cursor

    calls = [p["id"] for m in msgs for p in M.tool_calls_of(m)]
    results = [m["content"][0] for m in msgs if m["role"] == "tool"]
    assert calls and sorted(calls) == sorted(r["call_id"] for r in results)
    assert all(r["reason"] == "interrupted" for r in results)
    tail = [e for e in events if e.type in ("tool.completed", "run.failed")
            or (e.type == "message.added" and e.data["role"] == "tool")]
    assert [e.type for e in tail] == ["tool.completed", "message.added", "run.failed"]
    assert len({decode_cursor(e.cursor)[:8] for e in tail}) == 1


async def test_the_exhausted_run_finaliser_commits_with_its_claim(tmp_path, monkeypatch):
    """The claim past the last attempt finalises the run (an interrupted result for the call
    that was out, tool.completed, retry_exhausted) in the claiming transaction itself: once
    that claim has committed, the run is already settled with its transcript tidied, so a
    finaliser process that dies right after its claim leaves nothing half done. (As two
    commits, the sim's soak found runs where every finaliser died in between and the ledger's
    backstop settled the run with the call left without a result: test_sim_known_bugs.)"""
    url = f"lmdb:{tmp_path / 'd'}"
    agent, run_id = await _exhaust_with_a_call_out(url, "cx")
    from loop.store import Store

    at_claim = []
    claim = Store.claim

    async def watching_claim(self, worker, prepare=None):
        c = await claim(self, worker, prepare)
        if c is not None and c.lease.exhausted:  # committed; the runner has not run yet
            info = await self.ledger.get_run(c.run_id)
            at_claim.append((info.state, [m["role"] for m in await self.read_transcript(c.owner, c.conversation)]))
        return c

    monkeypatch.setattr(Store, "claim", watching_claim)
    async with Runtime.open(url, max_attempts=1, lease_seconds=0.2) as rt:
        rt.register(agent)
        out = await rt.wait(await rt.submit(agent, "cx", "go", submission_id=(await rt.get_run(run_id)).submission_id))
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        with trio.fail_after(10):  # (the settle commit may wake the wait before the claim returns)
            while not at_claim:
                await trio.sleep(0.01)
        assert at_claim == [("failed", ["user", "assistant", "tool"])]
        _finalised_once(await rt.transcript("cx"), (await rt.read_events("cx", limit=1000)).events)


async def test_the_exhausted_run_finaliser_reads_a_context_longer_than_a_page(tmp_path, monkeypatch):
    """The finaliser reads the whole context inside the claim, page after page (a page here is
    one message, so the two-message context takes two reads): the call is found and answered."""
    import loop.runner

    url = f"lmdb:{tmp_path / 'd'}"
    agent, run_id = await _exhaust_with_a_call_out(url, "cp")
    monkeypatch.setattr(loop.runner, "MAX_READ_PAGE", 1)
    async with Runtime.open(url, max_attempts=1, lease_seconds=0.2, agents=[agent]) as rt:
        out = await rt.wait(await rt.submit(agent, "cp", "go", submission_id=(await rt.get_run(run_id)).submission_id))
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        _finalised_once(await rt.transcript("cp"), (await rt.read_events("cp", limit=1000)).events)


async def test_an_exhausted_run_finaliser_failing_in_its_claim_finalises_in_a_commit_of_its_own(tmp_path, monkeypatch):
    """A finaliser that raises inside the claim aborts that transaction (nothing of it
    commits); the claim is made again without it and the runner finalises the run in a
    transaction of its own: the same result, the same events, the same outcome."""
    from loop.runner import Runner

    url = f"lmdb:{tmp_path / 'd'}"
    agent, run_id = await _exhaust_with_a_call_out(url, "cy")
    failed = []

    async def broken_finaliser(store, tr, claim):
        failed.append(claim.run_id)
        raise RuntimeError("finaliser bug")

    monkeypatch.setattr(Runner, "finish_exhausted_in_claim", staticmethod(broken_finaliser))
    async with Runtime.open(url, max_attempts=1, lease_seconds=0.2) as rt:
        rt.register(agent)
        out = await rt.wait(await rt.submit(agent, "cy", "go", submission_id=(await rt.get_run(run_id)).submission_id))
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        assert failed == [run_id]
        _finalised_once(await rt.transcript("cy"), (await rt.read_events("cy", limit=1000)).events)


async def test_an_exhausted_run_with_a_cancel_requested_ends_cancelled(tmp_path):
    """A cancel acknowledged while the run's process was dying ends the run cancelled (promise
    7), also when the claim that finds it is the exhausted run's finaliser: the call that was
    out gets the cancelled result saying it may have taken effect, the outcome is cancelled."""
    url = f"lmdb:{tmp_path / 'd'}"
    agent, run_id = await _exhaust_with_a_call_out(url, "cz")
    async with Runtime.open(url, max_attempts=1, lease_seconds=0.2, workers=0) as rt:
        assert (await rt.cancel(run_id)).status == "running"  # recorded; nobody drives it
    async with Runtime.open(url, max_attempts=1, lease_seconds=0.2, agents=[agent]) as rt:
        out = await rt.wait(await rt.submit(agent, "cz", "go", submission_id=(await rt.get_run(run_id)).submission_id))
        assert out.status == "cancelled"
        msgs = await rt.transcript("cz")
        results = [m["content"][0] for m in msgs if m["role"] == "tool"]
        assert [r["reason"] for r in results] == ["cancelled"] and "may have taken effect" in str(results[0]["content"])
        events = (await rt.read_events("cz", limit=1000)).events
        types = [e.type for e in events]
        assert types[-1] == "run.cancelled" and "run.failed" not in types
        # the started call's end is journaled too (a follower sees every tool.started end)
        done = [e.data for e in events if e.type == "tool.completed"]
        started = [e.data["call_id"] for e in events if e.type == "tool.started"]
        assert [(d["call_id"], d["reason"]) for d in done] == [(started[0], "cancelled")]


@pytest.fixture(params=["memory", "fdb-capi"])
async def handles(request, tmp_path):
    """``await handles()`` -> another kv database handle on one shared store, as separate
    processes have: ``engine.database()`` on one memory engine, or (fdb-capi) another
    ``kv.open("fdb:CLUSTER_FILE")`` through the FoundationDB backend and the real bindings, on
    one stand-in cluster -- FoundationDB's deployment, where each process is a client."""
    import contextlib

    import kv

    if request.param == "memory":
        engine = kv.MemoryEngine()

        async def handle():
            return engine.database()

        yield handle
        return
    from kvtest_helpers import stand_in_database

    shared: list = []

    def one_cluster():  # (called on the stand-in's network thread, once per handle)
        if not shared:
            shared.append(kv.MemoryEngine())
        return shared[0]

    async with contextlib.AsyncExitStack() as opened:
        async def handle():
            return await opened.enter_async_context(stand_in_database(tmp_path / "cluster", factory=one_cluster))

        yield handle


async def test_stale_worker_is_fenced_off_and_the_new_one_recovers(handles):
    """Two runtimes on one store (two processes): A stalls past its lease, B takes the run
    over; A's next write fails (LeaseLost) and A stops; the tool A started is reported as
    interrupted by B, never run twice, and the transcript has no interleaving."""
    effects = []
    release_a = trio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Slow effect."""
        effects.append(ctx.call_id)
        if len(effects) == 1:
            await release_a.wait()  # worker A stalls here, holding the tool
        return "slow done"

    model_calls = []

    def script(messages, tools):
        model_calls.append(messages[-1]["role"])
        return "final" if messages[-1]["role"] == "tool" else reply("", tool_call("slow"))

    agent = Agent("f", model=ScriptedModel(script), tools=[slow])
    async with Runtime.open(db=await handles(), lease_seconds=0.3) as rt_a:
        async def no_renew(claims):  # A stops renewing (a long GC pause, a partition...)
            return set()

        rt_a.store.renew_many = no_renew
        ack = await rt_a.submit(agent, "fence", "go")
        while not effects:
            await trio.sleep(0.01)
        async with Runtime.open(db=await handles(), lease_seconds=0.3, agents=[agent]) as rt_b:
            out = await rt_b.wait(ack)
            assert out.ok and out.result == "final"
            release_a.set()  # A wakes up and tries to persist its result
            await trio.sleep(0.2)
            msgs = await rt_b.transcript("fence")
            assert roles(msgs) == ["user", "assistant", "tool", "assistant"]
            (res,) = [m["content"][0] for m in msgs if m["role"] == "tool"]
            assert res["reason"] == "interrupted"  # B never re-ran A's tool
            assert effects == [res["call_id"]]
            info = await rt_b.get_run(ack.run_id)
            assert info.status == "completed" and info.attempt == 2
            assert roles(await rt_b.transcript("fence")) == roles(msgs)  # A wrote nothing after


async def test_cancel_from_another_process_during_the_final_answer_wins(handles):
    """A cancel acknowledged while the final answer streams ends the run cancelled, never completed
    (the runner sees the cancel record in the settling transaction, or polls it first)."""
    model = ScriptedModel(["a long final answer " * 20], chunk=4, delay=0.01)
    agent = Agent("c", model=model)
    async with Runtime.open(db=await handles()) as rt_a, Runtime.open(db=await handles(), workers=0) as rt_b:
        ack = await rt_a.submit(agent, "xproc", "go")
        while not model.calls:
            await trio.sleep(0.001)
        info = await rt_b.cancel(ack.run_id)  # another process: no in-process notice to rt_a
        assert info.status == "running" and info.cancel_requested
        out = await rt_a.wait(ack)
        assert out.status == "cancelled"
        evs = await all_events(rt_a, "xproc")
        assert "run.completed" not in types(evs) and types(evs)[-1] == "run.cancelled"


async def test_failed_compaction_fails_the_run(rt):
    for i in range(3):
        await rt.run(Agent("e", model="echo"), "cfail", f"earlier {i}")
    model = ScriptedModel([overflow(), permanent("summariser down", status=400)])
    out = await rt.run(Agent("o", model=model, keep_recent=2), "cfail", "now")
    assert out.status == "failed" and out.error["type"] == "permanent" and out.error["during"] == "compaction"


async def test_a_crashing_hook_is_retried_then_exhausted():
    """A bug in user code (a hook that raises) aborts the turn without taking the runtime down;
    each takeover is an attempt, so it ends in retry_exhausted rather than looping."""
    calls = []

    def bad_hook(info):
        calls.append(1)
        raise RuntimeError("hook bug")

    agent = Agent("h", model="echo", hooks=Hooks(before_model_call=bad_hook))
    async with Runtime.open("memory:", lease_seconds=0.2, max_attempts=3) as rt:
        out = await rt.run(agent, "hookfail", "hi")
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        assert len(calls) == 3
        # the runtime is still serving
        assert (await rt.run(Agent("fine", model="echo"), "other", "hi")).ok


async def test_max_attempts_means_attempts_in_the_event_the_ledger_and_the_outcome():
    """``max_attempts`` (default 10, DESIGN promise 4) is the number of attempts at the work:
    run.started, the ledger's run record and the retry_exhausted outcome all report that bound
    (run.started used to say 11 for the default: the loop's finalising claim was counted in it),
    and the claim that only finalises an exhausted run journals no run.started of its own."""
    import ledger as L

    agent = Agent("d", model="echo")
    async with Runtime.open("memory:", agents=[agent]) as rt:
        out = await rt.run(agent, "c-default", "hi")
        started = [e.data for e in (await rt.read_events("c-default")).events if e.type == "run.started"]
        assert [(s["attempt"], s["max_attempts"]) for s in started] == [(1, L.DEFAULT_MAX_ATTEMPTS)]
        assert (await rt.store.ledger.get_run(out.run_id)).max_attempts == L.DEFAULT_MAX_ATTEMPTS == 10

    bad = Agent("bad", model="echo")
    async with Runtime.open("memory:", lease_seconds=0.05, max_attempts=2) as rt:
        with trio.fail_after(30):
            out = await rt.run(bad, "c2", {"role": "assistant", "content": "not a user message"})
        assert out.status == "failed" and out.error["type"] == "retry_exhausted"
        assert out.error["attempts"] == 2 and "after 2 attempts" in out.error["message"]
        events = (await rt.read_events("c2", limit=1000)).events
        started = [(e.data["attempt"], e.data["max_attempts"]) for e in events if e.type == "run.started"]
        assert started == [(1, 2), (2, 2)]
        rec = await rt.store.ledger.get_run(out.run_id)
        assert rec.max_attempts == 2 and rec.attempt == 2
        assert (await rt.get_run(out.run_id)).attempt == 2


async def test_the_lease_keeper_renews_long_runs_polls_cancels_and_idles_without_runs(autojump_clock):
    """One keeper task per runtime (not one per run): runs much longer than their lease keep
    it (renewed together, attempt 1, no takeover), a cancel made by another process reaches a
    run busy in a tool through the keeper's poll, and with nothing to drive it makes no
    transactions at all."""
    import kv

    engine = kv.MemoryEngine()
    seen_cancel = []

    @tool
    async def long(ctx: ToolContext) -> str:
        """Works for a while (virtual time)."""
        for _ in range(40):
            await trio.sleep(0.1)
            if ctx.cancelled:
                seen_cancel.append(ctx.call_id)
                return "stopped"
        return "long done"

    agent = Agent("k", model=ScriptedModel(tool_then_answer("long", {})), tools=[long])
    async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt, \
            Runtime.open(db=engine.database(), workers=0) as other:
        outs = []

        async def one(conv):
            outs.append(await rt.run(agent, conv, "go"))

        async with trio.open_nursery() as n:
            for conv in ("k1", "k2"):
                n.start_soon(one, conv)
        assert [o.result for o in outs] == ["done", "done"] and not seen_cancel
        for o in outs:  # 4 s of tool on a 0.3 s lease: renewed all along
            assert (await rt.get_run(o.run_id)).attempt == 1
        conv_of = {o.run_id: c for o, c in zip(outs, ("k1", "k2"))}
        for run_id, conv in conv_of.items():
            starts = [e for e in await all_events(rt, conv) if e.type == "run.started"]
            assert len(starts) == 1 and not starts[0].data["takeover"]

        ack = await rt.submit(agent, "k3", "go")
        while not rt._active:
            await trio.sleep(0.01)
        await trio.sleep(0.5)
        await other.cancel(ack.run_id)  # another process: rt hears of it only through its keeper
        out = await rt.wait(ack)
        assert out.status == "cancelled" and len(seen_cancel) == 1

        calls = []
        for name in ("cancels_requested_now", "renew_many"):
            async def counting(*a, _name=name, _real=getattr(rt.store, name), **kw):
                calls.append(_name)
                return await _real(*a, **kw)

            setattr(rt.store, name, counting)
        await trio.sleep(30)  # idle: no renewals, no cancel polls
        assert calls == []
        await rt.run(agent, "k4", "go")  # and it wakes up for the next run
        assert "renew_many" in calls


async def test_runs_and_get_run_read_each_conversation_in_one_transaction(rt):
    """rt.runs(conv) reads the runs and their loop states together (it made one transaction
    per run more, two for a parked one); rt.get_run is one transaction too."""
    agent = Agent("lr", model="echo")
    outs = [await rt.run(agent, "lr1", f"m{i}") for i in range(5)]
    calls = [0]
    real = rt.store.db.transact

    async def counting(fn, *a, **kw):
        calls[0] += 1
        return await real(fn, *a, **kw)

    rt.store.db.transact = counting
    try:
        runs = await rt.runs("lr1")
        assert calls[0] == 1
        assert [r.run_id for r in runs] == [o.run_id for o in outs]
        assert all(r.status == "completed" and r.agent == "lr" and r.attempt == 1 for r in runs)
        calls[0] = 0
        info = await rt.get_run(outs[0].run_id)
        assert calls[0] == 1 and info.agent == "lr" and info.status == "completed"
    finally:
        rt.store.db.transact = real
    with pytest.raises(NotFound):
        await rt.get_run(outs[0].run_id, owner="other/owner")


async def test_the_parked_record_lives_exactly_while_a_call_awaits_approval(rt):
    """Written with the approval request, cleared by the decision — or by the settle of a run
    cancelled while parked; a run that never parked has none to clear (its settle skips it)."""
    from loop.store import may_be_parked

    @tool(requires_approval=True)
    def risky() -> str:
        """Needs a yes."""
        return "done it"

    agent = Agent("p", model=ScriptedModel(tool_then_answer("risky", {})), tools=[risky])

    async def parked_ids():
        start, stop = rt.store.loop_keys.parked_range()
        rows = await rt.db.transact(lambda tr: tr.get_range(start, stop))  # read-only
        return [rt.store.loop_keys.base.unpack(r.key)[1] for r in rows]

    async def park(conv):
        ack = await rt.submit(agent, conv, "go")
        async for ev in rt.events(conv, after=ack.cursor):
            if ev.type == "approval.requested":
                return ack, ev.data["call_id"]

    a, call_a = await park("pk1")
    b, _ = await park("pk2")
    assert sorted(await parked_ids()) == sorted([a.run_id, b.run_id])
    await rt.approve(a.run_id, call_a, True)
    assert (await rt.wait(a)).ok
    await rt.cancel(b.run_id)
    assert (await rt.wait(b)).status == "cancelled"
    assert await parked_ids() == []
    assert may_be_parked((await rt.store.loop_state(a.run_id)))  # its call was decided ("allow")
    plain = await rt.run(Agent("np", model="echo"), "pk3", "hi")
    assert not may_be_parked(await rt.store.loop_state(plain.run_id))
    assert await parked_ids() == []


@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), float("inf"), "10"])
async def test_a_bad_lease_or_pricing_is_refused_before_storage_is_opened(tmp_path, bad):
    data = tmp_path / "data"
    with pytest.raises(ValueError, match="lease_seconds must be a positive number of seconds"):
        async with Runtime.open(str(data), lease_seconds=bad):
            pass
    with pytest.raises(ValueError, match="pricing"):
        async with Runtime.open(str(data), pricing={"echo": "free"}):
            pass
    assert not data.exists()  # nothing created, nothing locked
    async with Runtime.open(str(data), lease_seconds=0.5) as rt:
        assert rt.store.lease_seconds == 0.5
