"""Cost ceilings that work (promise 10): prices, the cost recorded per model step (once, like
its tokens), the pre-flight reserve clamping a call's max_tokens to what ``max_cost_micros``
leaves and refusing one it leaves no room for, the
compaction's summariser priced too, and a ceiling that cannot be enforced refused, never run.

Real memory and lmdb engines; the only fake is the hosted provider, at the wire
(fake_providers: Anthropic's and OpenAI's streaming formats, usage included)."""

from __future__ import annotations

import json

import pytest
import trio

import kv
from fake_providers import FakeReply
from kv.engine import FaultHooks
from kv.errors import KVError
from loop import Agent, MissingPrice, Price, Runtime, ScriptedModel, tool
from loop import messages as M
from loop.compaction import estimate_context_tokens
from loop.pricing import FREE, cost_micros, estimate_cost_micros, price_for
from loop.providers import AnthropicProvider, OpenAIProvider, Usage, reply, tool_call

# $3 / $15 / $0.30 / $3.75 per million tokens, in micro-dollars per million tokens.
SONNET = Price(input_tokens=3_000_000, output_tokens=15_000_000, cache_read_tokens=300_000,
               cache_write_tokens=3_750_000)


def url_of(engine, tmp_path):
    return "memory:" if engine == "memory" else f"lmdb:{tmp_path / 'data'}"


async def all_events(rt, conv):
    return (await rt.read_events(conv, limit=10_000)).events


# ---------------------------------------------------------------------- arithmetic


def test_cost_is_exact_integer_arithmetic_rounded_up_once():
    usage = {"input_tokens": 1234, "output_tokens": 567, "cache_read_tokens": 10_000, "cache_write_tokens": 2_000}
    # 1234*3 + 567*15 + 10000*0.3 + 2000*3.75 = 3702 + 8505 + 3000 + 7500 micro-dollars
    assert cost_micros(SONNET, usage) == 22_707
    assert cost_micros(SONNET, {}) == 0
    assert cost_micros(FREE, usage) == 0
    # rounded up (never in the caller's favour), once over the sum, not per field
    assert cost_micros(Price(input_tokens=1), {"input_tokens": 1}) == 1
    assert cost_micros(Price(input_tokens=1), {"input_tokens": 1_000_000}) == 1
    assert cost_micros(Price(input_tokens=1), {"input_tokens": 1_000_001}) == 2
    assert cost_micros(Price(input_tokens=1, output_tokens=1), {"input_tokens": 500_000, "output_tokens": 500_000}) == 1
    # no float drift at sizes where a float would lose units
    big = Price(input_tokens=10**15 - 1)
    assert cost_micros(big, {"input_tokens": 10**9 + 7}) == -(-(10**15 - 1) * (10**9 + 7) // 10**6)
    # fields a price doesn't name are ignored; a bad figure is refused, never guessed at
    assert cost_micros(SONNET, {"input_tokens": 1_000_000, "cost_micros": 99, "total_tokens": 5}) == 3_000_000
    with pytest.raises(ValueError, match="output_tokens"):
        cost_micros(SONNET, {"output_tokens": -1})
    assert estimate_cost_micros(SONNET, 1000, 100) == 3000 + 1500


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"])
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None, 10**16])
def test_bad_prices_are_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=f"Price.{field}"):
        Price(**{field: bad})


def test_bad_pricing_tables_are_refused():
    with pytest.raises(ValueError, match="loop.Price"):
        Runtime(None, pricing={"anthropic:m": 3})
    with pytest.raises(ValueError, match="pricing key"):
        Runtime(None, pricing={"": SONNET})
    with pytest.raises(ValueError, match="mapping"):
        Runtime(None, pricing=[("m", SONNET)])


def test_a_model_is_priced_by_its_spec_or_name_most_specific_first():
    local = Price(input_tokens=1)
    pricing = {"openai:llama3@http://gpu:8000/v1": local, "openai:gpt-x": SONNET, "claude-y": SONNET}
    assert price_for(pricing, "openai:llama3@http://gpu:8000/v1") is local
    assert price_for(pricing, "openai:llama3@http://other:8000/v1") is None
    assert price_for(pricing, "openai:gpt-x@http://proxy/v1") is SONNET  # provider:model, base URL aside
    assert price_for(pricing, "anthropic:claude-y") is SONNET  # the bare model name
    assert price_for(pricing, AnthropicProvider("claude-y", base_url="http://x", api_key="k")) is SONNET
    assert price_for(pricing, OpenAIProvider("gpt-x", base_url="http://x", api_key="k")) is SONNET
    assert price_for(pricing, "anthropic:unknown") is None
    # the offline models are free unless priced
    assert price_for({}, "echo") is FREE and price_for({}, ScriptedModel(["x"])) is FREE
    assert price_for({"scripted": local}, ScriptedModel(["x"])) is local
    assert price_for({"mine": local}, ScriptedModel(["x"], name="mine")) is local


# ---------------------------------------------------------------------- recorded per step


def provider_for(dialect, server):
    if dialect == "anthropic":
        return AnthropicProvider("claude-test", base_url=server.base_url, api_key="sk-ant-test", timeout=None)
    return OpenAIProvider("gpt-test", base_url=server.base_url + "/v1", api_key="sk-test", timeout=None)


@tool
def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city}: sunny"


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_each_model_step_records_its_cost_beside_its_tokens(dialect, fake_server):
    """Two model calls priced from the provider's own usage figures (cache reads and writes at
    their own prices; OpenAI's cached tokens taken out of its prompt tokens, not billed twice)."""
    write = 2_000 if dialect == "anthropic" else 0  # OpenAI reports no cache writes
    fake_server.enqueue(
        FakeReply("", tool_calls=[("call_1", "lookup", {"city": "Oslo"})], input_tokens=1_234, output_tokens=56,
                  cache_read_tokens=10_000, cache_write_tokens=write),
        FakeReply("Sunny in Oslo.", input_tokens=1_300, output_tokens=9, cache_read_tokens=12_000),
    )
    agent = Agent("w", "Be brief.", provider_for(dialect, fake_server), tools=[lookup])
    name = f"{dialect}:{'claude-test' if dialect == 'anthropic' else 'gpt-test'}"
    async with Runtime.open("memory:", pricing={name: SONNET}) as rt:
        out = await rt.run(agent, "c", "weather?")
        assert out.ok, out
        step1 = 1_234 * 3_000_000 + 56 * 15_000_000 + 10_000 * 300_000 + write * 3_750_000
        step2 = 1_300 * 3_000_000 + 9 * 15_000_000 + 12_000 * 300_000
        expected = [-(-step1 // 10**6), -(-step2 // 10**6)]
        assert expected == ([3_702 + 840 + 3_000 + 7_500] if write else [3_702 + 840 + 3_000]) + [3_900 + 135 + 3_600]
        updates = [e.data for e in await all_events(rt, "c") if e.type == "usage.updated"]
        assert [u["step"] for u in updates] == ["model-1", "model-2"]
        assert [u["usage"]["cost_micros"] for u in updates] == expected
        assert updates[0]["usage"]["input_tokens"] == 1_234 and updates[0]["usage"]["cache_read_tokens"] == 10_000
        totals = await rt.usage(out.run_id)
        assert totals["cost_micros"] == sum(expected)
        assert totals["input_tokens"] == 1_234 + 1_300 and totals["cache_read_tokens"] == 22_000


class _Report1021OnCost(FaultHooks):
    """The first commit that adds to a cost total applies, then reports commit_unknown_result:
    the runner retries the very commit that recorded the step's usage."""

    def __init__(self) -> None:
        self.injected = 0

    def after_apply(self, version, batch):
        out = {}
        for req in batch:
            # (the step's usage marker, a set whose value names cost_micros: the totals' key no
            # longer does since they are one packed record, session 17)
            if not self.injected and any(m[0] == "set" and b"cost_micros" in bytes(m[2]) for m in req.mutations):
                out[req] = KVError(1021)
                self.injected += 1
        return out


def tool_then_answer(usage1, usage2):
    def script(messages, tools):
        if messages[-1]["role"] == "tool":
            return reply("done", usage=usage2)
        return reply("working", tool_call("noop", {}), usage=usage1)

    return script


@tool
def noop() -> str:
    """Nothing."""
    return "ok"


@pytest.mark.parametrize("engine", ["memory", "lmdb"])
async def test_cost_is_counted_once_per_step_when_the_steps_commit_is_retried(engine, tmp_path):
    price = Price(input_tokens=2_000_000, output_tokens=10_000_000)
    u1, u2 = Usage(100, 10), Usage(150, 5)
    agent = Agent("s", model=ScriptedModel(tool_then_answer(u1, u2)), tools=[noop])
    async with Runtime.open(url_of(engine, tmp_path), pricing={"scripted": price}) as rt:
        hooks = _Report1021OnCost()
        rt.db.engine.hooks = hooks
        out = await rt.run(agent, "c", "go")
        assert out.ok and hooks.injected == 1
        totals = await rt.usage(out.run_id)
        assert totals["cost_micros"] == (100 * 2 + 10 * 10) + (150 * 2 + 5 * 10)  # 300 + 350, not 600 + 350
        assert totals["input_tokens"] == 250 and totals["output_tokens"] == 15
        # and recording the same step again counts nothing
        assert not await rt.store.ledger.usage.record(out.run_id, "model-1", {**u1.to_dict(), "cost_micros": 300})
        assert (await rt.usage(out.run_id))["cost_micros"] == 650


# ---------------------------------------------------------------------- enforced


async def test_a_cost_ceiling_clamps_the_last_call_to_what_it_can_pay_for(fake_server):
    """Output priced at 1 micro a token, input free: the first call (100 out) leaves 50 micros
    of a 150 ceiling, so the second is sent with max_tokens=50 although the agent asks for
    100 (the old reserve refused it outright; without max_tokens it let any output through).
    The server stops there (stop_reason max_tokens), the answer cut by the ceiling fails the
    run ``usage_limit`` with the cut message kept, and the cost lands exactly on the ceiling."""
    fake_server.enqueue(
        FakeReply("", tool_calls=[("call_1", "lookup", {"city": "Oslo"})], input_tokens=1_000, output_tokens=100),
        FakeReply("Sunny in Oslo, and a long story about it. " * 5, input_tokens=1_000, output_tokens=100),
    )
    agent = Agent("w", "Be brief.", provider_for("anthropic", fake_server), tools=[lookup], max_tokens=100)
    price = Price(output_tokens=1_000_000)
    async with Runtime.open("memory:", pricing={"claude-test": price}) as rt:
        out = await rt.run(agent, "c", "weather?", limits={"max_cost_micros": 150})
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert "cut off at 50 output tokens" in out.error["message"] and "cost_micros past its ceiling of 150" in out.error["message"]
        assert [r.body["max_tokens"] for r in fake_server.requests] == [100, 50]
        assert (await rt.usage(out.run_id))["cost_micros"] == 150
        msgs = await rt.transcript("c")
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "error"]
        assert msgs[3]["stop_reason"] == "max_tokens" and msgs[3]["usage"]["output_tokens"] == 50

        # the same ceiling with room for both calls completes, each sent with the agent's own cap
        fake_server.requests.clear()
        fake_server.enqueue(
            FakeReply("", tool_calls=[("call_2", "lookup", {"city": "Rome"})], input_tokens=1_000, output_tokens=100),
            FakeReply("Sunny.", input_tokens=1_000, output_tokens=100),
        )
        ok = await rt.run(agent, "c2", "weather?", limits={"max_cost_micros": 5_000})
        assert ok.ok and (await rt.usage(ok.run_id))["cost_micros"] == 200
        assert [r.body["max_tokens"] for r in fake_server.requests] == [100, 100]


async def test_a_cost_ceiling_clamps_by_price_after_the_input_estimate(fake_server):
    """Input at 1 and output at 3 micros a token: a ceiling of (input estimate + 100) micros
    leaves floor(100 / 3) = 33 output tokens, rounded down (34 would cost 102)."""
    fake_server.enqueue(FakeReply("x" * 400, output_tokens=500))
    agent = Agent("w", "Be brief.", provider_for("anthropic", fake_server))  # no max_tokens: 4096 sent
    price = Price(input_tokens=1_000_000, output_tokens=3_000_000)
    in_est = estimate_context_tokens("Be brief.", [M.user("hi")])
    async with Runtime.open("memory:", pricing={"claude-test": price}) as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_cost_micros": in_est + 100})
        msgs = await rt.transcript("c")
        assert estimate_context_tokens("Be brief.", msgs[:1]) == in_est  # the context the reserve saw
        assert [r.body["max_tokens"] for r in fake_server.requests] == [33]
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert (await rt.usage(out.run_id))["output_tokens"] == 33


async def test_a_call_is_refused_before_it_is_made_when_the_ceiling_leaves_no_room(fake_server):
    """Refused, nothing sent: the input estimate alone passes the ceiling; or it fits and no
    output token does (room below MIN_CALL_OUTPUT_TOKENS)."""
    agent = Agent("w", "Be brief.", provider_for("anthropic", fake_server), max_tokens=1_000)
    price = Price(input_tokens=1_000_000, output_tokens=1_000_000)
    in_est = estimate_context_tokens("Be brief.", [M.user("hi")])
    async with Runtime.open("memory:", pricing={"claude-test": price}) as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_cost_micros": in_est - 1})
        assert out.status == "failed" and out.error["type"] == "usage_limit"
        assert f"would reach {in_est}, past its ceiling of {in_est - 1}" in out.error["message"]
        out = await rt.run(agent, "d", "hi", limits={"max_cost_micros": in_est})
        assert out.status == "failed" and out.error["type"] == "usage_limit"
        assert f"would reach {in_est + 1}, past its ceiling of {in_est}" in out.error["message"]
        assert "room for 0 output tokens" in out.error["message"]
        assert fake_server.requests == []
        assert [m["role"] for m in await rt.transcript("d")] == ["user", "error"]


def _compacting_agent() -> tuple[Agent, list[int]]:
    """An agent that compacts every few turns: the summariser's calls use 400 + 20 tokens
    (recorded in the returned list), every other call 50 + 60."""
    summaries: list[int] = []

    def script(messages, tools):
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            summaries.append(1)
            return reply("short summary", usage=Usage(400, 20))
        return reply("ok " + "x" * 200, usage=Usage(50, 60))

    return Agent("t", model=ScriptedModel(script), compact_at_tokens=150, keep_recent=2), summaries


async def test_the_compaction_summariser_is_priced_and_counted():
    price = Price(input_tokens=1_000_000, output_tokens=2_000_000)
    agent, summaries = _compacting_agent()
    async with Runtime.open("memory:", pricing={"scripted": price}) as rt:
        for i in range(3):
            assert (await rt.run(agent, "c", f"question {i} " + "y" * 100)).ok
        assert summaries, "the scenario must compact"
        runs = await rt.runs("c")
        steps = {}
        for e in await all_events(rt, "c"):
            if e.type == "usage.updated":
                steps[(e.data["run_id"], e.data["step"])] = e.data["usage"]["cost_micros"]
        compact_steps = [k for k in steps if k[1].startswith("compact@")]
        assert len(compact_steps) == len(summaries)
        assert all(steps[k] == 400 + 40 for k in compact_steps)
        assert all(v == 50 + 120 for k, v in steps.items() if k[1].startswith("model-"))
        for r in runs:
            mine = sum(v for (run, _), v in steps.items() if run == r.run_id)
            assert (await rt.usage(r.run_id))["cost_micros"] == mine


async def test_a_cost_ceiling_counts_the_summariser_before_it_runs():
    price = Price(input_tokens=1_000_000, output_tokens=1_000_000)
    agent, summaries = _compacting_agent()
    async with Runtime.open("memory:", pricing={"scripted": price}) as rt:
        for i in range(2):
            assert (await rt.run(agent, "c", f"question {i} " + "y" * 100)).ok
        summaries.clear()
        out = await rt.run(agent, "c", "one more", limits={"max_cost_micros": 100})
        assert out.status == "failed" and out.error["type"] == "usage_limit" and out.error["during"] == "compaction"
        assert summaries == []
        assert (await rt.usage(out.run_id)).get("cost_micros", 0) == 0


# ---------------------------------------------------------------------- unenforceable ceilings


async def test_a_cost_ceiling_on_an_unpriced_model_is_refused_at_submit(fake_server):
    agent = Agent("w", model=provider_for("anthropic", fake_server))
    async with Runtime.open("memory:", pricing={"some-other-model": SONNET}) as rt:
        with pytest.raises(MissingPrice, match="anthropic:claude-test") as e:
            await rt.submit(agent, "c", "hi", limits={"max_cost_micros": 10})
        assert "no price" in str(e.value) and isinstance(e.value, ValueError)
        with pytest.raises(MissingPrice, match="anthropic:claude-test"):
            await rt.run(agent, "c", "hi", limits={"max_cost_micros": 10})
        spec_agent = Agent("s", model="anthropic:claude-nope")
        with pytest.raises(MissingPrice, match="anthropic:claude-nope"):
            await rt.submit(spec_agent, "c", "hi", limits={"max_cost_micros": 10})
        assert await rt.conversations() == []  # nothing was written
        assert fake_server.requests == []
        # without a cost ceiling an unpriced model runs (tokens are recorded, no cost)
        fake_server.enqueue(FakeReply("hello"))
        out = await rt.run(agent, "c", "hi", limits={"max_total_tokens": 1_000})
        assert out.ok and "cost_micros" not in await rt.usage(out.run_id)
        # the offline models are free: a cost ceiling holds trivially
        echo = await rt.run(Agent("e", model="echo"), "e", "hi", limits={"max_cost_micros": 1})
        assert echo.ok and (await rt.usage(echo.run_id)).get("cost_micros", 0) == 0


async def test_a_worker_without_the_price_fails_the_run_instead_of_running_it(fake_server):
    """Submitted by a runtime that prices the model, claimed by one that does not: the claiming
    worker is what enforces the ceiling, so it fails the run ``missing_price`` before any call."""
    agent = Agent("w", model=provider_for("anthropic", fake_server))
    db = await kv.open("memory:")
    try:
        async with Runtime.open(db=db, workers=0, pricing={"claude-test": SONNET}) as submitter:
            ack = await submitter.submit(agent, "c", "hi", limits={"max_cost_micros": 1_000_000})
        async with Runtime.open(db=db, workers=1, agents=[agent]) as worker:
            with trio.fail_after(10):
                out = await worker.wait(ack)
            assert out.status == "failed" and out.error["type"] == "missing_price", out
            assert "anthropic:claude-test" in out.error["message"]
            assert fake_server.requests == []
    finally:
        await db.close()


# ---------------------------------------------------------------------- inspect


def test_inspect_shows_a_runs_cost_beside_its_tokens(tmp_path, capsys):
    from loop.cli import main

    data = tmp_path / "data"
    price = Price(input_tokens=2_000_000, output_tokens=10_000_000)

    async def setup():
        agent = Agent("s", model=ScriptedModel([reply("hi", usage=Usage(100, 10))]))
        async with Runtime.open(f"lmdb:{data}", pricing={"scripted": price}) as rt:
            out = await rt.run(agent, "main", "hello")
            assert out.ok
            return out.run_id

    run_id = trio.run(setup)
    assert main(["inspect", "--data", str(data), "main"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if run_id in line)
    assert "tokens 100 in / 10 out" in line and "cost 300 micros" in line, line
    assert main(["inspect", "--data", str(data), "--json", "main"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"][0]["usage"]["cost_micros"] == 300


async def test_a_threshold_and_an_overflow_compaction_in_one_step_both_count():
    """Both compactions of one model step record their usage and cost (they shared one usage
    step name, so the second was refused as a conflicting record: lost, and the turn aborted)."""
    price = Price(input_tokens=1_000_000, output_tokens=1_000_000)
    state = {"overflowed": False}

    def script(messages, tools):
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            return reply("short summary", usage=Usage(100 + len(messages[-1]["content"][0]["text"]) % 7, 5))
        if not state["overflowed"] and M.text_of(messages[-1]).startswith("now"):
            state["overflowed"] = True
            from loop.providers import overflow

            return overflow()
        return reply("ok " + "x" * 200, usage=Usage(50, 60))

    agent = Agent("t", model=ScriptedModel(script), compact_at_tokens=150, keep_recent=2)
    async with Runtime.open("memory:", pricing={"scripted": price}) as rt:
        for i in range(3):
            assert (await rt.run(agent, "c", f"question {i} " + "y" * 100)).ok
        out = await rt.run(agent, "c", "now " + "z" * 100)
        assert out.ok and state["overflowed"]
        assert (await rt.get_run(out.run_id)).attempt == 1  # no aborted turn
        steps = {e.data["step"]: e.data["usage"] for e in await all_events(rt, "c")
                 if e.type == "usage.updated" and e.data["run_id"] == out.run_id}
        compactions = [k for k in steps if k.startswith("compact@")]
        assert len(compactions) >= 2, steps
        totals = await rt.usage(out.run_id)
        assert totals["cost_micros"] == sum(u["cost_micros"] for u in steps.values())
        assert totals["input_tokens"] == sum(u["input_tokens"] for u in steps.values())
