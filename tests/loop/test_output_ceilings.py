"""Output under a usage ceiling (promise 10): a call is sent with ``max_tokens`` no larger
than what the run's ceilings leave, so a ceiling holds against the output of the call
about to be made, not only against the calls already counted.

Real memory / lmdb engines and the real loop; the hosted providers are faked at the wire
(fake_providers: Anthropic's and OpenAI's streaming formats), and the fake honours the
request's ``max_tokens`` the way the real APIs do (it stops there: ``max_tokens`` /
``length``), so what is recorded is what a real server would have reported.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

import kv

from fake_providers import anthropic_provider, FakeHang, FakeReply, overloaded
from loop import Agent, Price, Runtime, tool
from loop import messages as M
from loop.compaction import estimate_context_tokens
from loop.providers import AnthropicProvider, EchoModel, OpenAIProvider, ScriptedModel
from loop.providers.anthropic import MIN_THINKING_BUDGET
from loop.providers.base import DEFAULT_MAX_TOKENS, capped_call_options, output_cap
from loop.retry import RetryPolicy
from loop.runner import MIN_CALL_OUTPUT_TOKENS

NO_WAIT = RetryPolicy(initial_delay=0, jitter=0)


def anthropic(server: Any, **kw: Any) -> AnthropicProvider:
    return anthropic_provider(server, **kw)


def openai(server: Any, **kw: Any) -> OpenAIProvider:
    return OpenAIProvider("gpt-test", base_url=server.base_url + "/v1", api_key="sk-test", timeout=None, **kw)


def provider(dialect: str, server: Any, **kw: Any) -> Any:
    return anthropic(server, **kw) if dialect == "anthropic" else openai(server, **kw)


def cut_reason(dialect: str) -> str:
    return "max_tokens" if dialect == "anthropic" else "length"


@tool
def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city}: sunny"


# ---------------------------------------------------------------------- the providers' caps


def test_each_provider_reports_its_effective_output_cap():
    a = AnthropicProvider("m", base_url="http://127.0.0.1:9")
    assert output_cap(a, None) == DEFAULT_MAX_TOKENS  # Anthropic always sends one
    assert output_cap(a, 300) == 300
    assert output_cap(AnthropicProvider("m", base_url="http://127.0.0.1:9", max_tokens=9000), None) == 9000
    o = OpenAIProvider("m", base_url="http://127.0.0.1:9/v1")
    assert output_cap(o, None) is None  # sends none: the server decides, unbounded as far as we know
    assert output_cap(o, 300) == 300
    assert output_cap(OpenAIProvider("m", base_url="http://127.0.0.1:9/v1", max_tokens=77), None) == 77
    # the offline models honour no max_tokens: only what they were explicitly given
    assert output_cap(ScriptedModel(["x"]), None) is None and output_cap(EchoModel(), 5) == 5
    assert capped_call_options(o, 1) == {} and capped_call_options(ScriptedModel(["x"]), 1) == {}


def test_a_clamp_below_the_thinking_budget_lowers_it_for_the_call_or_refuses():
    """The API needs MIN_THINKING_BUDGET <= budget < max_tokens; thinking cannot be switched
    off mid tool-use turn, so a clamp at or below the budget lowers it to max_tokens - 1 for
    that call, and one that leaves no room for the minimum budget has no valid request."""
    p = AnthropicProvider("m", base_url="http://127.0.0.1:9", thinking_budget=2048, max_tokens=8192)
    assert capped_call_options(p, 3000) == {}
    assert capped_call_options(p, 2049) == {}
    assert capped_call_options(p, 2048) == {"thinking_budget": 2047}
    assert capped_call_options(p, MIN_THINKING_BUDGET + 1) == {"thinking_budget": MIN_THINKING_BUDGET}
    assert capped_call_options(p, MIN_THINKING_BUDGET) is None
    assert capped_call_options(p, 1) is None
    body = p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=1500, thinking_budget=1499)
    assert body["max_tokens"] == 1500 and body["thinking"] == {"type": "enabled", "budget_tokens": 1499}
    # the agent's own per-call max_tokens below the budget is still a configuration error
    from loop.errors import PermanentProviderError

    with pytest.raises(PermanentProviderError, match="less than max_tokens 1500"):
        p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=1500)
    # a per-call budget may only lower the provider's, never raise it or go below the minimum
    for bad in (4096, MIN_THINKING_BUDGET - 1):
        with pytest.raises(PermanentProviderError, match="per-call thinking_budget"):
            p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=8192, thinking_budget=bad)
    assert MIN_CALL_OUTPUT_TOKENS >= 1


# ---------------------------------------------------------------------- clamped on the wire


LONG = "A long answer about the weather in two cities. " * 4


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_max_output_tokens_holds_across_calls(dialect, fake_server, kv_url):
    """max_output_tokens=100, no Agent.max_tokens: each call is sent with what is left
    (100, then 60, then 20), the model would write 40 each time, so the third answer is cut
    at 20 by the server; the run fails usage_limit with exactly 100 output tokens recorded."""
    fake_server.enqueue(
        FakeReply("", tool_calls=[("c1", "lookup", {"city": "Oslo"})], output_tokens=40),
        FakeReply("", tool_calls=[("c2", "lookup", {"city": "Rome"})], output_tokens=40),
        FakeReply(LONG, output_tokens=40),
    )
    agent = Agent("w", "Be brief.", provider(dialect, fake_server), tools=[lookup], retry=NO_WAIT)
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, "c", "weather?", limits={"max_output_tokens": 100})
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert "cut off at 20 output tokens: more would take output_tokens" in out.error["message"]
        assert "past its ceiling of 100" in out.error["message"]
        assert [r.body["max_tokens"] for r in fake_server.requests] == [100, 60, 20]
        assert (await rt.usage(out.run_id))["output_tokens"] == 100
        msgs = await rt.transcript("c")
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "error"]
        assert msgs[5]["stop_reason"] == "max_tokens" and msgs[5]["usage"]["output_tokens"] == 20
        assert LONG.startswith(M.text_of(msgs[5])) and 0 < len(M.text_of(msgs[5])) < len(LONG)  # kept as far as it got


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_a_tool_call_cut_by_the_ceiling_is_not_run(dialect, fake_server):
    """The ceiling cuts the answer inside a tool call's arguments: the call is not run (its
    arguments are a fragment), it is answered as not run so the transcript stays a valid
    context, and the run fails usage_limit; the conversation's next run sends that context."""
    ran: list[str] = []

    @tool
    def lookup(city: str) -> str:
        """Look a city up."""
        ran.append(city)
        return f"{city}: sunny"

    args = {"city": "Oslo", "detail": "hourly"}
    text = "Let me check."
    n = len(text) + len(json.dumps(args))
    fake_server.enqueue(FakeReply(text, tool_calls=[("call_9", "lookup", args)], output_tokens=n),
                        FakeReply("Hello again."))
    agent = Agent("w", "", provider(dialect, fake_server), tools=[lookup], retry=NO_WAIT)
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "weather?", limits={"max_output_tokens": len(text) + 5})
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        msgs = await rt.transcript("c")
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "error"]
        call = M.tool_calls_of(msgs[1])[0]
        assert call["arguments"] == {"_raw": json.dumps(args)[:5]}  # the fragment the server sent
        result = msgs[2]["content"][0]
        assert result["call_id"] == call["id"] and result["is_error"] and result["reason"] == "usage_limit"
        assert ran == []
        again = await rt.run(agent, "c", "hello?")
        assert again.ok and again.result == "Hello again."
    sent = json.dumps(fake_server.requests[1].body)
    assert "this call was not run" in sent and call["id"] in sent


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_a_ceiling_used_up_exactly_refuses_the_next_call_unsent(dialect, fake_server, kv_url):
    fake_server.enqueue(
        FakeReply("", tool_calls=[("c1", "lookup", {"city": "Oslo"})], output_tokens=50),
        FakeReply("never sent"),
    )
    agent = Agent("w", "Be brief.", provider(dialect, fake_server), tools=[lookup], retry=NO_WAIT)
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, "c", "weather?", limits={"max_output_tokens": 50})
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert "output_tokens would reach 51, past its ceiling of 50" in out.error["message"]
        assert len(fake_server.requests) == 1  # the second call was never made
        assert [r.text for r in fake_server.script] == ["never sent"]
        assert [m["role"] for m in await rt.transcript("c")] == ["user", "assistant", "tool", "error"]
        # a ceiling of 0 output tokens: not even the first call
        fake_server.requests.clear()
        out = await rt.run(agent, "d", "hi", limits={"max_output_tokens": 0})
        assert out.status == "failed" and out.error["type"] == "usage_limit"
        assert fake_server.requests == []


async def test_openai_max_total_tokens_is_sent_as_the_room_after_the_input(fake_server):
    """An OpenAI-compatible server gets max_tokens only when a ceiling bounds output: here
    the total-tokens room after the context's estimate."""
    fake_server.enqueue(FakeReply("Hello there.", input_tokens=5, output_tokens=4))
    agent = Agent("w", "Be brief.", openai(fake_server))
    in_est = estimate_context_tokens("Be brief.", [M.user("hi")])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_total_tokens": 500})
        assert out.ok, out
        assert estimate_context_tokens("Be brief.", (await rt.transcript("c"))[:1]) == in_est
    assert fake_server.requests[0].body["max_tokens"] == 500 - in_est


@pytest.mark.parametrize("limits", [None, {"max_input_tokens": 10_000}, {"max_cost_micros": 10**9}])
async def test_no_output_bounding_ceiling_sends_no_max_tokens_to_openai(limits, fake_server):
    """Without a ceiling on output (none at all; one on input only; a cost ceiling on a model
    whose output is free) the request is exactly as before: no max_tokens key, so a local
    server's own default applies; Anthropic still sends its default."""
    fake_server.enqueue(FakeReply("hi"), FakeReply("hi"))
    pricing = {"gpt-test": Price(input_tokens=1), "claude-test": Price(input_tokens=1)}
    async with Runtime.open("memory:", pricing=pricing) as rt:
        assert (await rt.run(Agent("o", model=openai(fake_server)), "o", "hi", limits=limits)).ok
        assert (await rt.run(Agent("a", model=anthropic(fake_server)), "a", "hi", limits=limits)).ok
    assert "max_tokens" not in fake_server.requests[0].body
    assert fake_server.requests[1].body["max_tokens"] == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_a_cap_inside_the_room_is_sent_unchanged_and_its_own_stop_is_no_ceiling(dialect, fake_server):
    """The agent's max_tokens fits the room: it is sent as is, and an answer its own cap
    stopped is the model's answer (the run completes), not the ceiling's."""
    fake_server.enqueue(FakeReply("A long answer, cut by the agent's own cap.", output_tokens=90))
    agent = Agent("w", "", provider(dialect, fake_server), max_tokens=30)
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_output_tokens": 1_000})
        assert out.ok, out
        msgs = await rt.transcript("c")
    assert fake_server.requests[0].body["max_tokens"] == 30
    assert msgs[1]["stop_reason"] == "max_tokens" and msgs[1]["usage"]["output_tokens"] == 30


async def test_a_retried_call_is_sent_with_the_same_clamp(fake_server):
    """A transient failure before output is retried with the very figures the reserve gave."""
    fake_server.enqueue(overloaded(), FakeReply("ok", output_tokens=3))
    agent = Agent("w", "", anthropic(fake_server), retry=NO_WAIT)
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_output_tokens": 77})
        assert out.ok, out
    assert [r.body["max_tokens"] for r in fake_server.requests] == [77, 77]


async def test_a_step_taken_over_after_a_crash_is_sent_with_the_same_clamp(fake_server):
    """Process A dies during the run's second model call (sent with the 60 output tokens the
    first call's 40 left of 100), its lease left to lapse; process B takes the run over and
    makes that call again with the same figures (the reserve reads the same recorded totals
    and the same context), and the run ends at exactly the ceiling."""
    hang = FakeHang()
    fake_server.enqueue(
        FakeReply("", tool_calls=[("c1", "lookup", {"city": "Oslo"})], output_tokens=40),
        hang,
        FakeReply("Sunny.", output_tokens=60),
    )
    engine = kv.MemoryEngine()
    agent = Agent("w", "Be brief.", anthropic(fake_server), tools=[lookup], retry=NO_WAIT)
    limits = {"max_output_tokens": 100}
    async with trio.open_nursery() as n:
        async def doomed() -> None:
            async with Runtime.open(db=engine.database(), workers=0, lease_seconds=0.2,
                                    release_on_shutdown=False) as rt_a:
                await rt_a.run(agent, "c", "weather?", submission_id="s", limits=limits)

        n.start_soon(doomed)
        await hang.received.wait()
        n.cancel_scope.cancel()  # the process "dies" mid-call, its lease not released
    async with Runtime.open(db=engine.database(), lease_seconds=0.2) as rt_b:
        with trio.fail_after(10):
            out = await rt_b.run(agent, "c", "weather?", submission_id="s", limits=limits)
        assert out.ok and out.result == "Sunny.", out
        assert (await rt_b.get_run(out.run_id)).attempt == 2
        assert (await rt_b.usage(out.run_id))["output_tokens"] == 100
    assert [r.body["max_tokens"] for r in fake_server.requests] == [100, 60, 60]
    assert fake_server.requests[1].body == fake_server.requests[2].body


# ---------------------------------------------------------------------- thinking


@pytest.mark.parametrize(
    "ceiling, sent",
    [
        (5_000, (5_000, 2_048)),  # clamped, the budget still fits below it
        (2_000, (2_000, 1_999)),  # clamped at or below the budget: the budget is lowered for the call
        (MIN_THINKING_BUDGET + 1, (MIN_THINKING_BUDGET + 1, MIN_THINKING_BUDGET)),
        (MIN_THINKING_BUDGET, None),  # no valid request fits: refused, nothing sent
    ],
)
async def test_the_thinking_budget_stays_valid_under_a_clamp(ceiling, sent, fake_server):
    fake_server.enqueue(FakeReply("ok", output_tokens=10))
    agent = Agent("w", "", anthropic(fake_server, thinking_budget=2048, max_tokens=8192))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_output_tokens": ceiling})
    if sent is None:
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert f"room for {ceiling} output tokens" in out.error["message"]
        assert fake_server.requests == []
        return
    assert out.ok, out
    body = fake_server.requests[0].body
    assert (body["max_tokens"], body["thinking"]["budget_tokens"]) == sent
    assert body["thinking"]["budget_tokens"] < body["max_tokens"]


async def test_the_compaction_summariser_is_clamped_too(fake_server):
    """The summariser's call counts against the ceiling like any other: sent with the room
    (max_output_tokens=60, nothing used yet), then the model step with what it left."""
    from loop.compaction import COMPACTION_SYSTEM

    agent = Agent("t", "", anthropic(fake_server), compact_at_tokens=150, keep_recent=2)
    async with Runtime.open("memory:") as rt:
        for i in range(2):  # a history long enough that the next step compacts first
            fake_server.enqueue(FakeReply("ok " + "x" * 200))
            assert (await rt.run(agent, "c", f"question {i} " + "y" * 100)).ok
        fake_server.requests.clear()
        fake_server.enqueue(FakeReply("short summary", output_tokens=15), FakeReply("fine", output_tokens=2))
        out = await rt.run(agent, "c", "one more " + "z" * 100, limits={"max_output_tokens": 60})
        assert out.ok, out
        assert (await rt.usage(out.run_id))["output_tokens"] == 17
    assert [r.body.get("system") == COMPACTION_SYSTEM for r in fake_server.requests] == [True, False]
    assert [r.body["max_tokens"] for r in fake_server.requests] == [60, 45]


def test_the_input_estimate_counts_the_reasoning_passed_back_in_the_turn_under_way():
    """The older rule, ``estimate_context_tokens``'s default (``prior_reasoning=False``): only the
    thinking blocks of the tool-use loop under way count as input (models that keep only the
    last turn strip earlier turns'), text and redacted data. The runner counts every turn's
    reasoning unless its provider says it strips them (see test_context_estimate.py)."""
    def answer(reasoning: str, redacted: str, *calls: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": [
            {"type": "thinking", "thinking": reasoning, "signature": "S" * 300},
            {"type": "redacted_thinking", "data": redacted},
            {"type": "text", "text": "ok"}, *calls]}

    call = {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {}}
    earlier = [M.user("first"), answer("a" * 400, "b" * 200)]
    under_way = [M.user("second"), answer("c" * 800, "d" * 400, call),
                 M.tool_results([M.tool_result("t1", "lookup", "found")])]

    def stripped(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**m, "content": [p for p in m.get("content") or () if "thinking" not in p["type"]]}
                if m["role"] == "assistant" else m for m in msgs]

    plain = estimate_context_tokens("sys", stripped(earlier + under_way))
    # 800 + 400 characters of this turn's reasoning at 4 a token; the earlier turn's and every
    # signature count for nothing
    assert estimate_context_tokens("sys", earlier + under_way) == plain + 200 + 100
    # once a new user message starts a turn, that reasoning is history too
    assert estimate_context_tokens("sys", earlier + under_way + [M.user("third")]) == \
        estimate_context_tokens("sys", stripped(earlier + under_way) + [M.user("third")])


# ---------------------------------------------------------------------- OpenAI's max_completion_tokens


def test_the_openai_cap_goes_under_the_configured_name():
    """max_tokens by default (local servers know only it); max_completion_tokens when asked
    (OpenAI's current name); never both; none at all when nothing caps the call."""
    msgs = [M.user("hi")]
    classic = OpenAIProvider("m", base_url="http://127.0.0.1:9/v1")
    assert classic.max_tokens_param == "max_tokens"
    body = classic.request_body(system="", messages=msgs, tools=(), max_tokens=300)
    assert body["max_tokens"] == 300 and "max_completion_tokens" not in body
    new = OpenAIProvider("m", base_url="http://127.0.0.1:9/v1", max_tokens_param="max_completion_tokens")
    body = new.request_body(system="", messages=msgs, tools=(), max_tokens=300)
    assert body["max_completion_tokens"] == 300 and "max_tokens" not in body
    assert "max_completion_tokens" not in new.request_body(system="", messages=msgs, tools=(), max_tokens=None)
    own = OpenAIProvider("m", base_url="http://127.0.0.1:9/v1", max_tokens_param="max_completion_tokens", max_tokens=77)
    assert own.request_body(system="", messages=msgs, tools=(), max_tokens=None)["max_completion_tokens"] == 77
    # the cap and the clamp are the same figures whatever the name
    assert output_cap(new, 300) == 300 and output_cap(new, None) is None and capped_call_options(new, 1) == {}


@pytest.mark.parametrize("bad", ["max_output_tokens", "MAX_TOKENS", "", None, 1])
def test_an_unknown_max_tokens_param_is_refused(bad):
    with pytest.raises(ValueError, match="max_tokens_param must be one of 'max_tokens', 'max_completion_tokens'"):
        OpenAIProvider("m", base_url="http://127.0.0.1:9/v1", max_tokens_param=bad)


def test_the_spec_string_is_unchanged():
    """No spec syntax for it: make_provider passes the keyword through to a provider object."""
    from loop.providers import make_provider, parse_model_spec

    assert str(parse_model_spec("openai:o4-mini@http://127.0.0.1:9/v1")) == "openai:o4-mini@http://127.0.0.1:9/v1"
    p = make_provider("openai:o4-mini@http://127.0.0.1:9/v1", max_tokens_param="max_completion_tokens")
    assert isinstance(p, OpenAIProvider) and p.max_tokens_param == "max_completion_tokens"


async def test_a_reasoning_model_refuses_max_tokens_and_takes_max_completion_tokens(fake_server, kv_url):
    """A server that refuses max_tokens, as OpenAI's reasoning models do: the default provider's
    clamped call is refused (400 unsupported_parameter: a permanent failure, nothing retried);
    with max_tokens_param="max_completion_tokens" the ceiling holds as with max_tokens — each
    call sent with what is left (100, 60, 20), the third cut there, exactly 100 recorded."""
    fake_server.refuse_max_tokens = True
    fake_server.enqueue(FakeReply("never sent"))
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(Agent("w", "", openai(fake_server), retry=NO_WAIT), "old", "hi",
                           limits={"max_output_tokens": 100})
        assert out.status == "failed" and out.error["type"] == "permanent", out
        assert "max_completion_tokens" in out.error["message"]
        assert len(fake_server.requests) == 1 and fake_server.requests[0].body["max_tokens"] == 100
        assert [r.text for r in fake_server.script] == ["never sent"]  # the refusal consumed nothing

        fake_server.requests.clear()
        fake_server.script.clear()
        fake_server.enqueue(
            FakeReply("", tool_calls=[("c1", "lookup", {"city": "Oslo"})], output_tokens=40),
            FakeReply("", tool_calls=[("c2", "lookup", {"city": "Rome"})], output_tokens=40),
            FakeReply(LONG, output_tokens=40),
        )
        agent = Agent("w", "Be brief.", openai(fake_server, max_tokens_param="max_completion_tokens"),
                      tools=[lookup], retry=NO_WAIT)
        out = await rt.run(agent, "new", "weather?", limits={"max_output_tokens": 100})
        assert out.status == "failed" and out.error["type"] == "usage_limit", out
        assert "past its ceiling of 100" in out.error["message"]
        assert [r.body["max_completion_tokens"] for r in fake_server.requests] == [100, 60, 20]
        assert all("max_tokens" not in r.body for r in fake_server.requests)
        assert (await rt.usage(out.run_id))["output_tokens"] == 100
        msgs = await rt.transcript("new")
        assert msgs[5]["stop_reason"] == "max_tokens" and msgs[5]["usage"]["output_tokens"] == 20


async def test_max_completion_tokens_carries_the_total_tokens_room_and_the_agents_cap(fake_server):
    """The room a total-tokens ceiling leaves after the input, and the agent's own cap when it
    fits, both go under max_completion_tokens; without an output-bounding ceiling nothing is
    sent, as with max_tokens."""
    fake_server.refuse_max_tokens = True
    fake_server.enqueue(FakeReply("Hello there.", input_tokens=5, output_tokens=4), FakeReply("hi"),
                        FakeReply("A long answer, cut by the agent's own cap.", output_tokens=90))
    p = openai(fake_server, max_tokens_param="max_completion_tokens")
    in_est = estimate_context_tokens("Be brief.", [M.user("hi")])
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(Agent("w", "Be brief.", p), "c", "hi", limits={"max_total_tokens": 500})).ok
        assert (await rt.run(Agent("w", "Be brief.", p), "d", "hi")).ok
        out = await rt.run(Agent("w", "", p, max_tokens=30), "e", "hi", limits={"max_output_tokens": 1_000})
        assert out.ok, out
        assert (await rt.transcript("e"))[1]["usage"]["output_tokens"] == 30  # the fake honoured it
    first, second, third = (r.body for r in fake_server.requests)
    assert first["max_completion_tokens"] == 500 - in_est
    assert "max_completion_tokens" not in second and "max_tokens" not in second
    assert third["max_completion_tokens"] == 30
