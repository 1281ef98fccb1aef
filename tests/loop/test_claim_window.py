"""A claim reads O(context), not O(history): the transcript from its mark (the latest
compaction's cut, moved in the transaction that appends the compaction entry) on.

Counted with a spy on the transcript's message reads (``Transcripts._read_range``, through
which every read of message keys goes), on the real memory and lmdb engines. Recovery in a
compacted conversation still finalises every dangling tool call; a fork (which starts
without a mark) still reads and repairs its whole history."""

from __future__ import annotations

import pytest
import trio

from loop import Agent, Runtime, ScriptedModel, tool
from loop import store as loop_store
from loop import messages as M
from loop.compaction import SUMMARY_PREFIX, model_context
from loop.providers import reply, tool_call
from loop.runner import _dangling_results
from sessions.transcript import Transcripts

HISTORY = 3_000  # messages already in the conversation before the runs under test


def url_of(engine, tmp_path):
    return "memory:" if engine == "memory" else f"lmdb:{tmp_path / 'data'}"


class ReadSpy:
    """Counts the transcript messages read (every message-key read goes through _read_range)."""

    def __init__(self, monkeypatch) -> None:
        self.read = 0
        orig = Transcripts._read_range
        spy = self

        async def _read_range(self, tr, tag, src, lo, hi):
            spy.read += hi - lo
            return await orig(self, tr, tag, src, lo, hi)

        monkeypatch.setattr(Transcripts, "_read_range", _read_range)


def summarising(answer="ok"):
    def script(messages, tools):
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            return "short summary of everything"
        if messages[-1]["role"] == "tool":
            return "recovered"
        if M.text_of(messages[-1]).startswith("hang"):
            return reply("", tool_call("hang"))
        return answer

    return script


async def long_conversation(rt, conv, n=HISTORY):
    t = rt.store.transcripts
    await t.create(rt.owner, conv)
    for lo in range(0, n, 500):
        batch = [M.user(f"question {i} " + "q" * 60) if i % 2 == 0 else M.assistant(f"answer {i} " + "a" * 60)
                 for i in range(lo, min(n, lo + 500))]
        await t.append(rt.owner, conv, batch)


@pytest.mark.parametrize("engine", ["memory", "lmdb"])
async def test_a_claim_on_a_long_compacted_conversation_reads_only_the_context(engine, tmp_path, monkeypatch):
    model = ScriptedModel(summarising())
    agent = Agent("t", model=model, compact_at_tokens=300, keep_recent=2)
    async with Runtime.open(url_of(engine, tmp_path)) as rt:
        await long_conversation(rt, "long")
        spy = ReadSpy(monkeypatch)
        first = await rt.run(agent, "long", "go on")  # reads it all (no mark yet), compacts
        assert first.ok
        assert spy.read >= HISTORY
        msgs = await rt.transcript("long")
        entries = [i for i, m in enumerate(msgs) if m["role"] == "compaction"]
        assert len(entries) == 1 and msgs[entries[0]]["upto"] > HISTORY - 10

        for i in range(3):  # every later claim reads the window, not the history
            spy.read = 0
            out = await rt.run(agent, "long", f"and then {i}")
            assert out.ok and out.result == "ok"
            assert 0 < spy.read < 30, spy.read
            # the model saw exactly what the whole history gives: the summary, then the recent turns
            msgs = await rt.transcript("long")
            sent = model.calls[-1]["messages"]
            assert sent == model_context(msgs[:-1])
            assert M.text_of(sent[0]).startswith(SUMMARY_PREFIX) and M.text_of(sent[-1]) == f"and then {i}"
        assert len(msgs) == HISTORY + 2 + 1 + 3 * 2 and sum(m["role"] == "compaction" for m in msgs) == 1


async def test_recovery_in_a_compacted_conversation_finalises_the_dangling_call(tmp_path, monkeypatch):
    """A run whose process dies while its tool runs, in a conversation compacted long ago:
    the takeover reads the window, finalises the call as interrupted (never runs it again),
    and the model answers."""
    effects = []

    @tool
    async def hang() -> str:
        """Never returns."""
        effects.append(1)
        await trio.sleep_forever()

    url = f"lmdb:{tmp_path / 'd'}"
    agent = Agent("t", model=ScriptedModel(summarising()), tools=[hang], compact_at_tokens=300, keep_recent=2)
    async with Runtime.open(url, lease_seconds=0.3, release_on_shutdown=False) as rt:
        await long_conversation(rt, "long")
        assert (await rt.run(agent, "long", "go on")).ok  # compacted
        ack = await rt.submit(agent, "long", "hang now")
        async for ev in rt.events("long", after=ack.cursor):
            if ev.type == "tool.started":
                call_id = ev.data["call_id"]
                break
    spy = ReadSpy(monkeypatch)
    async with Runtime.open(url, lease_seconds=0.3) as rt:
        rt.register(agent)
        with trio.fail_after(20):
            out = await rt.wait(ack)
        assert out.ok and out.result == "recovered"
        assert effects == [1]
        assert spy.read < 40, spy.read  # the takeover read the window (plus the outcome's page)
        msgs = await rt.transcript("long")
        results = [p for m in msgs if m["role"] == "tool" for p in m["content"] if p["call_id"] == call_id]
        assert len(results) == 1 and results[0]["reason"] == "interrupted"
        calls = [c["id"] for m in msgs for c in M.tool_calls_of(m)]
        answered = [p["call_id"] for m in msgs if m["role"] == "tool" for p in m["content"]]
        assert sorted(calls) == sorted(answered)


async def test_a_fork_of_a_compacted_conversation_reads_its_whole_history(monkeypatch):
    model = ScriptedModel(summarising())
    agent = Agent("t", model=model, compact_at_tokens=300, keep_recent=2)
    async with Runtime.open("memory:") as rt:
        await long_conversation(rt, "long", n=400)
        assert (await rt.run(agent, "long", "go on")).ok
        n = len(await rt.transcript("long"))
        fork = await rt.fork("long", at=n)
        spy = ReadSpy(monkeypatch)
        out = await rt.run(agent, fork, "in the fork")
        assert out.ok and spy.read >= n  # no mark in a fork: read from 0 (correct, O(history))
        msgs = await rt.transcript(fork)
        assert model.calls[-1]["messages"] == model_context(msgs[:-1])
        spy.read = 0
        assert (await rt.run(agent, "long", "in the parent")).ok
        assert spy.read < 30  # the parent keeps its mark


def test_a_reused_call_id_after_its_result_still_counts_as_dangling():
    """Call ids are unique within a window, not a whole history (a fork reads all of it): a
    result answers the latest earlier call with its id, so a reused id is not taken as answered."""
    msgs = [
        M.user("a"),
        M.assistant("", [{"id": "call_0", "name": "f", "arguments": {}}]),
        M.tool_results([M.tool_result("call_0", "f", "done")]),
        M.assistant("", [{"id": "call_0", "name": "f", "arguments": {}}, {"id": "call_1", "name": "g", "arguments": {}}]),
        M.tool_results([M.tool_result("call_1", "g", "done")]),
    ]
    out = _dangling_results(msgs, 0, reason="interrupted")
    assert [m["content"][0]["call_id"] for m in out] == ["call_0"]
    assert _dangling_results(msgs[:3], 0, reason="interrupted") == []


async def test_the_transcript_mark_moves_only_forward_with_its_append():
    import kv

    db = await kv.open("memory:")
    try:
        t = Transcripts(db)
        await t.create("local/default", "s")
        await t.append("local/default", "s", [{"i": i} for i in range(10)])
        page = await db.transact(lambda tr: t.read_tail_tr(tr, "local/default", "s", 100))
        assert page.start == 0 and [m.data["i"] for m in page.messages] == list(range(10))

        async def mark(tr, at, msgs):
            return await t.append_tr(tr, "local/default", "s", msgs, mark=at)

        await db.transact(lambda tr: mark(tr, 6, [{"i": 10}]))
        page = await db.transact(lambda tr: t.read_tail_tr(tr, "local/default", "s", 100))
        assert page.start == 6 and [m.seq for m in page.messages] == list(range(6, 11)) and page.head == 11
        await t.append("local/default", "s", [{"i": 11}])  # an append without a mark keeps it
        page = await db.transact(lambda tr: t.read_tail_tr(tr, "local/default", "s", 2))
        assert page.start == 6 and [m.seq for m in page.messages] == [6, 7] and page.next_seq == 8
        with pytest.raises(ValueError, match="mark 3 outside"):
            await db.transact(lambda tr: mark(tr, 3, [{"i": 12}]))
        with pytest.raises(ValueError, match="outside"):
            await db.transact(lambda tr: mark(tr, 14, [{"i": 12}]))
        assert (await t.read("local/default", "s", 0, 100)).head == 12  # nothing of the refused appends
    finally:
        await db.close()


@pytest.mark.parametrize("batch", [None, 1])
async def test_call_ids_stay_unique_in_the_whole_transcript_though_claims_read_only_the_window(batch, monkeypatch):
    """A model that numbers its calls per response (``call_0`` every time, as local servers do):
    the ids before the mark are not in memory, but the compactions recorded them, so every id
    in the whole transcript stays unique (results pair with their calls) while claims still
    read only the window. (``batch=1``: the ids are recorded in transactions of their own
    before the compaction's, as for a long unmarked history.)"""
    if batch is not None:
        import loop.runner
        import loop.store

        monkeypatch.setattr(loop.runner, "MAX_CALL_ID_BATCH", batch)
        monkeypatch.setattr(loop.store, "MAX_CALL_ID_BATCH", batch)
    early = []
    real_now = loop_store.Store.note_call_ids_now

    async def note_now(self, owner, conv, ids):
        early.append(len(ids))
        return await real_now(self, owner, conv, ids)

    monkeypatch.setattr(loop_store.Store, "note_call_ids_now", note_now)

    @tool
    def noop() -> str:
        """Nothing."""
        return "ok"

    def script(messages, tools):
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            return "short summary"
        if messages[-1]["role"] == "tool":
            return "done " + "d" * 300
        return reply("calling", tool_call("noop", id="call_0"))

    agent = Agent("u", model=ScriptedModel(script), tools=[noop], compact_at_tokens=500, keep_recent=2)
    async with Runtime.open("memory:") as rt:
        await long_conversation(rt, "ids", n=300)
        spy = ReadSpy(monkeypatch)
        for i in range(8):
            spy.read = 0
            out = await rt.run(agent, "ids", f"turn {i} " + "t" * 300)
            assert out.ok, out
            if i:
                assert spy.read < 40, spy.read
        msgs = await rt.transcript("ids")
        assert sum(m["role"] == "compaction" for m in msgs) >= 3
        calls = [c["id"] for m in msgs for c in M.tool_calls_of(m)]
        results = [p["call_id"] for m in msgs if m["role"] == "tool" for p in m["content"]]
        assert len(calls) == 8 and len(set(calls)) == 8 and sorted(calls) == sorted(results)
        keys = rt.store.loop_keys
        indexed = [c for c in calls if await rt.db.transact(
            lambda tr, c=c: tr.get(keys.call_id_used(rt.owner, "ids", c))) is not None]
        assert len(indexed) >= 3  # the ids before the mark are recorded
        assert (batch is None) == (not early), early
