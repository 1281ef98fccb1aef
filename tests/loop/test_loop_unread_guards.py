"""A runner's commits take the session head, the run record and a new step's usage marker from
what its own commits wrote, not from storage; the lease check (and the cancel record) is still
read in every commit. These tests hold the promises that rests on: a worker whose lease was
taken over writes nothing (not over the new worker's messages either), a commit retried
after ``commit_unknown_result`` neither appends nor counts usage twice, and a run's
transcript, journal and usage are what a reading runner stored.
"""

from __future__ import annotations

import pytest
import trio

import kv
from kv.engine import FaultHooks
from kv.errors import KVError
from loop import Agent, Runtime, ScriptedModel, ToolContext, tool
from loop.providers import reply, tool_call
from loop.providers.base import Usage


def roles(msgs):
    return [m["role"] for m in msgs]


async def test_a_fenced_worker_writes_nothing_over_the_new_workers_transcript():
    """A stalls in a tool past its lease; B takes the run over, finalises A's call as
    interrupted and completes the run. A's cached head still says the tool result goes at
    seq 2, where B's interrupted result now is: A's commit is refused by its lease check,
    and every stored message (not only the roles) is B's, the journal has nothing of A's."""
    effects = []
    release_a = trio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Slow effect."""
        effects.append(ctx.call_id)
        if len(effects) == 1:
            await release_a.wait()
        return "A's result"

    def script(messages, tools):
        return "final" if messages[-1]["role"] == "tool" else reply("", tool_call("slow"))

    agent = Agent("f", model=ScriptedModel(script), tools=[slow])
    engine = kv.MemoryEngine()
    async with Runtime.open(db=engine.database(), lease_seconds=0.3) as rt_a:
        async def no_renew(claims):  # A stops renewing
            return set()

        rt_a.store.renew_many = no_renew
        ack = await rt_a.submit(agent, "fence", "go")
        while not effects:
            await trio.sleep(0.01)
        async with Runtime.open(db=engine.database(), lease_seconds=0.3, agents=[agent]) as rt_b:
            out = await rt_b.wait(ack)
            assert out.ok and out.result == "final"
            before = await rt_b.transcript("fence")
            journal_before = (await rt_b.read_events("fence", limit=10_000)).events
            assert roles(before) == ["user", "assistant", "tool", "assistant"]
            release_a.set()  # A's tool returns; A tries to persist its result
            await trio.sleep(0.3)
            assert await rt_b.transcript("fence") == before
            assert (await rt_b.read_events("fence", limit=10_000)).events == journal_before
            assert before[2]["content"][0]["reason"] == "interrupted"
            assert not any("A's result" in repr(m) for m in before)
            assert effects == [before[2]["content"][0]["call_id"]]  # never run twice


class _Inject1021(FaultHooks):
    """As tests/conftest.py's ``inject_1021`` (the fixture takes a ``db`` parameter these
    tests do not have): the next ``n`` commits writing a key or value containing ``needle``
    apply, then report 1021 to their caller."""

    def __init__(self, needle: bytes, n: int = 1) -> None:
        self.needle, self.n, self.injected = needle, n, 0

    def after_apply(self, version, batch):
        out = {}
        for req in batch:
            if self.injected < self.n and any(self.needle in _written(m) for m in req.mutations):
                out[req] = KVError(1021)
                self.injected += 1
        return out


def _written(m: tuple) -> bytes:
    """A mutation's key (and a set's value): ("set", k, v), ("clear", b, e), ("atomic", op, k, p)."""
    if m[0] == "set":
        return bytes(m[1]) + bytes(m[2])
    return bytes(m[2]) if m[0] == "atomic" else bytes(m[1])


@pytest.mark.parametrize("needle", [b"tool result", b"model-1", b"model-2"])
async def test_a_commit_retried_after_1021_appends_and_counts_once(needle):
    """A runner commit that landed but reported 1021 is retried: the retry reads the head and
    the state (it recognises its own commit), and the next commit reads the head again
    instead of appending from the one the unsure attempt wrote. Every message once, at
    consecutive seqs; each model step's usage counted once."""
    runs = []

    @tool
    def probe() -> str:
        """Probe."""
        runs.append(1)
        return "tool result"

    def script(messages, tools):
        if messages[-1]["role"] == "tool":
            return reply("done", usage=Usage(input_tokens=7, output_tokens=3))
        return reply("", tool_call("probe"), usage=Usage(input_tokens=5, output_tokens=2))

    engine = kv.MemoryEngine()
    db = engine.database()
    async with Runtime.open(db=db) as rt:
        agent = Agent("r", model=ScriptedModel(script), tools=[probe])
        assert (await rt.run(agent, "warm", "go")).ok
        hooks = _Inject1021(needle, 1)
        engine.engine.hooks = hooks
        out = await rt.run(agent, "c1021", "go")
        assert hooks.injected == 1
        assert out.ok and out.result == "done"
        msgs = await rt.transcript("c1021")
        assert roles(msgs) == ["user", "assistant", "tool", "assistant"]
        assert runs == [1, 1]  # once per run (the warm-up's and this one's)
        assert await rt.usage(out.run_id) == {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17}
        assert (await rt.run(agent, "c1021", "again")).ok  # the head as stored: appends go on
        assert roles(await rt.transcript("c1021"))[4:] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("url", ["memory:", "lmdb"])
async def test_turns_store_what_reading_runners_stored(url, tmp_path):
    """Several turns in one conversation (each run's first commit reads the head; its later
    ones append from memory): the stored head counts every message, messages are at
    consecutive seqs, and each run's usage steps and totals are there once."""

    def script(messages, tools):
        if messages[-1]["role"] == "tool":
            return reply("done", usage=Usage(input_tokens=2, output_tokens=1))
        return reply("", tool_call("noop"), usage=Usage(input_tokens=1, output_tokens=1))

    @tool
    def noop() -> str:
        """No-op."""
        return "ok"

    agent = Agent("t", model=ScriptedModel(script), tools=[noop])
    async with Runtime.open(url if url == "memory:" else f"lmdb:{tmp_path / 'data'}") as rt:
        outs = [await rt.run(agent, "multi", f"go {i}") for i in range(4)]
        assert all(o.ok for o in outs)
        msgs = await rt.transcript("multi")
        assert roles(msgs) == ["user", "assistant", "tool", "assistant"] * 4
        assert await rt.store.transcripts.head(rt.owner, "multi") == 16
        assert [m["content"] for m in msgs if m["role"] == "user"] == [f"go {i}" for i in range(4)] or all(
            f"go {i}" in repr(msgs[4 * i]) for i in range(4))
        for o in outs:
            assert await rt.usage(o.run_id) == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
            info = await rt.get_run(o.run_id)
            assert info.status == "completed" and info.attempt == 1
