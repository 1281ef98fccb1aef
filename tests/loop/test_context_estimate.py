"""The input-token estimate behind usage ceilings and the compaction threshold
(``loop.compaction.estimate_context_tokens``): what a model call is billed as input that the
context's text does not show.

* Tool definitions: every call sends the agent's tool specs (name, description, JSON input
  schema) and the provider bills them as input, so the estimate counts their JSON (measured
  once per agent, ``Agent.tool_schema_chars``), at the pre-flight reserve and at the
  compaction threshold.
* Reasoning whose text is not at hand: with ``display: "omitted"`` a thinking part is a bare
  signature, a summary is shorter than the reasoning it stands for, yet the server
  reconstructs and bills the whole reasoning when it is passed back. An assistant message
  carrying reasoning counts at least its step's recorded output tokens (the reasoning's upper
  bound). Which turns' reasoning counts follows Anthropic's per-model rule ("keep all prior
  turns" unless the provider says ``strips_prior_thinking``).

Unit tests of the function, then end to end: the real loop and engines, the providers faked
only at the wire (fake_providers), where the clamp the fake server receives as ``max_tokens``
shows the estimate.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fake_providers import anthropic_provider, openai_provider, SIG, FakeReply, ThinkingReply
from loop import Agent, Hooks, Runtime, tool
from loop import messages as M
from loop.compaction import COMPACTION_SYSTEM, estimate_context_tokens, tools_schema_chars
from loop.providers import AnthropicProvider, OpenAIProvider, ToolSpec
from loop.retry import RetryPolicy

NO_WAIT = RetryPolicy(initial_delay=0, jitter=0)
SIG2 = "EpoBCkYIBRgCIkDsecond+omitted+block/for+the+estimate=="


@tool
def lookup(city: str, units: str = "c", detail: bool = False) -> str:
    """Look the weather up for a city: the current conditions, the temperature in the units
    asked for, and with detail the wind, humidity and a three-day outlook (a long description,
    so the schema is worth counting)."""
    return f"{city}: sunny"


@tool
def convert(amount: float, currency_from: str, currency_to: str, at_date: str | None = None) -> str:
    """Convert an amount between currencies at a given date's reference rate."""
    return "1.0"


TOOLS = [lookup, convert]


def anthropic(server: Any, **kw: Any) -> AnthropicProvider:
    return anthropic_provider(server, **kw)


def openai(server: Any, **kw: Any) -> OpenAIProvider:
    return openai_provider(server, **kw)


def ceil4(n: int) -> int:
    return (n + 3) // 4


def wire_tools_chars(body: dict[str, Any]) -> int:
    """The size of the ``tools`` a request body carried, as the estimate measures JSON."""
    return len(json.dumps(body["tools"], ensure_ascii=False, separators=(",", ":"))) - 2 - (len(body["tools"]) - 1)


def omitted_turn(output_tokens: int, *, text: str = "", call: bool = True) -> dict[str, Any]:
    """An assistant message as adaptive thinking with display omitted leaves it: signature-only
    thinking parts, a tool call, and the step's usage recorded with it."""
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": "", "signature": SIG}]
    if text:
        content.append({"type": "text", "text": text})
    if call:
        content += [{"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {"city": "Oslo"}},
                    {"type": "thinking", "thinking": "", "signature": SIG2}]
    return {"role": "assistant", "content": content, "stop_reason": "tool_use" if call else "end_turn",
            "usage": {"input_tokens": 40, "output_tokens": output_tokens}}


def without_reasoning(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [p for p in m.get("content") or () if "thinking" not in p["type"]]}
            if m["role"] == "assistant" else m for m in msgs]


RESULT = M.tool_results([M.tool_result("t1", "lookup", "Oslo: sunny")])


# ---------------------------------------------------------------------- tool definitions


def test_a_tool_set_adds_the_json_of_what_the_provider_sends():
    """The schema's characters are those of the ``tools`` array the Anthropic provider puts in
    the request body; the OpenAI-compatible wrapper adds a few characters a tool, no more; the
    estimate grows by those characters at 4 a token."""
    specs = [t.spec() for t in TOOLS]
    chars = tools_schema_chars(specs)
    body = AnthropicProvider("m", base_url="http://127.0.0.1:9").request_body(
        system="", messages=[M.user("hi")], tools=specs, max_tokens=100)
    assert chars == wire_tools_chars(body) > 400  # the long docstring and two schemas
    oa = OpenAIProvider("m", base_url="http://127.0.0.1:9/v1").request_body(
        system="", messages=[M.user("hi")], tools=specs, max_tokens=100)
    assert 0 < wire_tools_chars(oa) - chars <= 40 * len(specs)
    ctx = [M.user("weather in Oslo?")]
    assert estimate_context_tokens("sys", ctx, chars) - estimate_context_tokens("sys", ctx) == ceil4(chars)
    assert tools_schema_chars([]) == 0


def test_an_agent_measures_its_tool_specs_once_and_a_hooks_own_each_time():
    """``Agent.tool_specs()`` hands out the same spec objects every call (a fresh list), and
    ``tool_schema_chars`` measures them once; a list a ``before_model_call`` hook changed (a
    spec dropped, another added) is measured as it is."""
    agent = Agent("a", "", tools=TOOLS)
    specs = agent.tool_specs()
    assert specs is not agent.tool_specs() and all(a is b for a, b in zip(specs, agent.tool_specs()))
    full = tools_schema_chars(specs)
    assert agent.tool_schema_chars() == agent.tool_schema_chars(specs) == full
    assert agent._schema_chars == full  # cached: not walked again per call
    assert agent.tool_schema_chars(specs[:1]) == tools_schema_chars(specs[:1]) < full
    extra = ToolSpec("more", "x" * 300, {"type": "object", "properties": {}})
    assert agent.tool_schema_chars([*specs, extra]) == full + tools_schema_chars([extra])
    assert Agent("b").tool_schema_chars() == 0


# ---------------------------------------------------------------------- reasoning without its text


def test_signature_only_reasoning_in_the_tool_loop_counts_the_steps_recorded_output():
    """Display omitted: the thinking parts have no text, yet the server reconstructs and bills
    the whole reasoning when they are passed back. The estimate counts the step's recorded
    output tokens for it (an upper bound: reasoning, text and the call's arguments together)."""
    ctx = [M.user("weather in Oslo?"), omitted_turn(1500), RESULT]
    base = estimate_context_tokens("sys", without_reasoning(ctx))
    assert estimate_context_tokens("sys", ctx) == base + 1500
    # counted once a message, however many reasoning parts it has
    assert estimate_context_tokens("sys", ctx, prior_reasoning=True) == base + 1500


def test_reasoning_counts_the_larger_of_its_text_and_the_recorded_output():
    """A summary (or a redacted block's data) shorter than the step's output: the output; a
    reasoning text longer than the recorded output (a provider reporting little): the text;
    no usage recorded: the text, as before."""
    ctx = [M.user("q"), RESULT]
    summarized = {"role": "assistant", "usage": {"output_tokens": 900}, "content": [
        {"type": "thinking", "thinking": "s" * 400, "signature": SIG},
        {"type": "redacted_thinking", "data": "d" * 40},
        {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {}}]}
    base = estimate_context_tokens("sys", without_reasoning([ctx[0], summarized, ctx[1]]))
    assert estimate_context_tokens("sys", [ctx[0], summarized, ctx[1]]) == base + 900
    wordy = {**summarized, "usage": {"output_tokens": 20}}
    assert estimate_context_tokens("sys", [ctx[0], wordy, ctx[1]]) == base + 100 + 10
    unrecorded = {k: v for k, v in summarized.items() if k != "usage"}
    assert estimate_context_tokens("sys", [ctx[0], unrecorded, ctx[1]]) == base + 100 + 10
    bare = {k: v for k, v in omitted_turn(700).items() if k != "usage"}
    assert estimate_context_tokens("sys", [ctx[0], bare, ctx[1]]) == \
        estimate_context_tokens("sys", without_reasoning([ctx[0], bare, ctx[1]]))


def test_earlier_turns_reasoning_counts_only_where_the_model_keeps_it():
    """Last-turn-only models (``prior_reasoning=False``) strip earlier turns' thinking: it adds
    nothing, recorded usage or not; keep-all models bill it as history: it adds each step's."""
    earlier = [M.user("first"), omitted_turn(1200), RESULT, omitted_turn(300, text="Sunny.", call=False)]
    under_way = [M.user("second"), omitted_turn(800), RESULT]
    plain = estimate_context_tokens("sys", without_reasoning(earlier + under_way))
    assert estimate_context_tokens("sys", earlier + under_way) == plain + 800
    assert estimate_context_tokens("sys", earlier + under_way, prior_reasoning=True) == plain + 1200 + 300 + 800
    # once the next user message starts a turn, the last one is history too
    closed = earlier + under_way + [M.user("third")]
    assert estimate_context_tokens("sys", closed) == estimate_context_tokens("sys", without_reasoning(closed))
    assert estimate_context_tokens("sys", closed, prior_reasoning=True) == \
        estimate_context_tokens("sys", without_reasoning(closed)) + 1200 + 300 + 800


# ---------------------------------------------------------------------- end to end: the clamp sent


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_the_clamp_sent_with_tools_is_lower_by_the_schema(dialect, fake_server, kv_url):
    """One call under max_total_tokens, with and without the two tools: the ``max_tokens`` the
    server receives is lower with them by the schema's characters / 4 — as measured on the
    request the server received (Anthropic: exactly; OpenAI: its wrapper's few characters a
    tool aside)."""
    fake_server.enqueue(FakeReply("Hi."), FakeReply("Hi."))
    make = anthropic if dialect == "anthropic" else openai
    with_tools = Agent("t", "Be brief.", make(fake_server), tools=TOOLS, retry=NO_WAIT)
    bare = Agent("b", "Be brief.", make(fake_server), retry=NO_WAIT)
    async with Runtime.open(kv_url) as rt:
        assert (await rt.run(with_tools, "c1", "hi", limits={"max_total_tokens": 3000})).ok
        assert (await rt.run(bare, "c2", "hi", limits={"max_total_tokens": 3000})).ok
    tooled, plain = fake_server.requests
    assert "tools" in tooled.body and "tools" not in plain.body
    assert plain.body["max_tokens"] == 3000 - estimate_context_tokens("Be brief.", [M.user("hi")])
    drop = plain.body["max_tokens"] - tooled.body["max_tokens"]
    assert drop == ceil4(with_tools.tool_schema_chars()) > 100
    sent = wire_tools_chars(tooled.body)
    assert abs(drop - sent / 4) <= (1 if dialect == "anthropic" else 10 * len(TOOLS)), (drop, sent)


async def test_a_hook_that_drops_the_tools_is_reserved_without_them(fake_server):
    """The reserve measures the tools the call actually sends: a ``before_model_call`` hook
    that sends none gets the no-tools clamp."""
    def no_tools(info: Any) -> None:
        info.tools = []

    fake_server.enqueue(FakeReply("Hi."), FakeReply("Hi."))
    hooked = Agent("h", "Be brief.", anthropic(fake_server), tools=TOOLS, hooks=Hooks(before_model_call=no_tools))
    plain = Agent("p", "Be brief.", anthropic(fake_server), tools=TOOLS)
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(hooked, "c1", "hi", limits={"max_total_tokens": 3000})).ok
        assert (await rt.run(plain, "c2", "hi", limits={"max_total_tokens": 3000})).ok
    hooked_req, plain_req = fake_server.requests
    assert "tools" not in hooked_req.body and "tools" in plain_req.body
    assert hooked_req.body["max_tokens"] == 3000 - estimate_context_tokens("Be brief.", [M.user("hi")])
    assert hooked_req.body["max_tokens"] - plain_req.body["max_tokens"] == ceil4(plain.tool_schema_chars())


async def test_the_compaction_threshold_counts_the_tool_schema(fake_server):
    """The same history under the same ``compact_at_tokens``: without tools it fits and no
    summary is made; with them the estimate passes the threshold and the next call compacts
    first (the summariser's request carries no tools, the model call after it does)."""
    async def run(agent: Agent) -> list[Any]:
        fake_server.requests.clear()
        async with Runtime.open("memory:") as rt:
            for i in range(3):
                fake_server.enqueue(FakeReply("Summary.", output_tokens=5), FakeReply("ok " + "x" * 40))
                assert (await rt.run(agent, "c", f"question {i} " + "y" * 40)).ok
        fake_server.script.clear()
        return fake_server.requests

    schema_tokens = ceil4(tools_schema_chars([t.spec() for t in TOOLS]))
    threshold = 60 + schema_tokens // 2  # between the history alone (~55 tokens at most here) and with the schema
    plain = await run(Agent("p", "", anthropic(fake_server), compact_at_tokens=threshold, keep_recent=2))
    assert not any(r.body.get("system") == COMPACTION_SYSTEM for r in plain)
    tooled = await run(Agent("t", "", anthropic(fake_server), tools=TOOLS, compact_at_tokens=threshold, keep_recent=2))
    summaries = [r for r in tooled if r.body.get("system") == COMPACTION_SYSTEM]
    assert summaries and all("tools" not in r.body for r in summaries)
    assert all("tools" in r.body for r in tooled if r.body.get("system") != COMPACTION_SYSTEM)


async def _second_clamp(server: Any, kv_url: str, first_output: int) -> int:
    """The max_tokens of the second call of a tool loop whose first answer (signature-only
    thinking around a tool call) recorded ``first_output`` output tokens."""
    server.requests.clear()
    server.enqueue(
        ThinkingReply(tool_calls=[("toolu_1", "lookup", {"city": "Oslo"})], thinking=[("omitted_thinking", SIG)],
                      output_tokens=first_output),
        ThinkingReply("Sunny.", thinking=[("omitted_thinking", SIG2)], output_tokens=5),
    )
    provider = anthropic(server, thinking="adaptive", max_tokens=8000)
    agent = Agent("w", "Be brief.", provider, tools=[lookup], retry=NO_WAIT)
    conv = f"c{first_output}"  # (the lmdb directory is shared by the test's two loops)
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, conv, "weather in Oslo?", limits={"max_total_tokens": 5000})
        assert out.ok, out
        msgs = await rt.transcript(conv)
    assert msgs[1]["content"][0] == {"type": "thinking", "thinking": "", "signature": SIG}
    assert msgs[1]["usage"]["output_tokens"] == first_output  # what the estimate reads
    first, second = server.requests
    assert first.body["max_tokens"] < 8000 and second.body["max_tokens"] < 8000  # both clamped
    return second.body["max_tokens"]


async def test_signature_only_reasoning_lowers_the_next_clamp_by_its_recorded_output(server, kv_url):
    """A tool loop whose first step reasoned (display omitted, so nothing but a signature came
    back) for 1,500 output tokens against one that reasoned for 300: the second call's room is
    lower by 2 × 1,200 — once for the output already recorded, once for that reasoning passed
    back as input (counted as nothing before, so the difference was 1,200)."""
    heavy = await _second_clamp(server, kv_url, 1500)
    light = await _second_clamp(server, kv_url, 300)
    assert light - heavy == 2 * 1200


async def test_earlier_turns_reasoning_is_reserved_unless_the_provider_strips_it(server):
    """A second turn after a tool loop that reasoned (signature-only) for 1,500 output tokens:
    a provider that does not say counts that reasoning as history (keep-all models bill it);
    one with ``strips_prior_thinking`` (last-turn-only models) counts nothing for it."""
    async def second_turn_clamp(strips: bool | None) -> int:
        server.requests.clear()
        server.enqueue(
            ThinkingReply(tool_calls=[("toolu_1", "lookup", {"city": "Oslo"})], thinking=[("omitted_thinking", SIG)],
                          output_tokens=1500),
            ThinkingReply("Sunny.", thinking=[("omitted_thinking", SIG2)], output_tokens=5),
            FakeReply("Yes.", output_tokens=2),
        )
        kw = {} if strips is None else {"strips_prior_thinking": strips}
        provider = anthropic(server, thinking="adaptive", max_tokens=8000, **kw)
        agent = Agent("w", "Be brief.", provider, tools=[lookup], retry=NO_WAIT)
        async with Runtime.open("memory:") as rt:
            assert (await rt.run(agent, "c", "weather in Oslo?")).ok
            out = await rt.run(agent, "c", "sure?", limits={"max_total_tokens": 6000})
            assert out.ok, out
        return server.requests[-1].body["max_tokens"]

    kept = await second_turn_clamp(None)
    assert await second_turn_clamp(False) == kept
    stripped = await second_turn_clamp(True)
    assert stripped - kept == 1500 + 5  # both earlier steps' reasoning: their recorded output


async def test_strips_prior_thinking_is_a_bool_option_of_the_anthropic_provider(server):
    assert anthropic(server).strips_prior_thinking is False
    assert anthropic(server, strips_prior_thinking=True).strips_prior_thinking is True
    with pytest.raises(ValueError, match="strips_prior_thinking must be a bool"):
        anthropic(server, strips_prior_thinking="yes")
