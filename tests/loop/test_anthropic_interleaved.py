"""Anthropic interleaved thinking: the beta header, reasoning between tool calls, and the
budget rule the docs relax for it.

With ``anthropic-beta: interleaved-thinking-2025-05-14`` a Claude 4 model may think between
tool calls, so ``thinking`` / ``redacted_thinking`` blocks can follow ``tool_use`` blocks in one
response.  They must be journaled and passed back exactly where they streamed, signatures
unmodified.  The model is faked only at the wire (tests/loop/fake_providers.ThinkingServer,
whose ``ThinkingReply.interleaved`` streams reasoning among the reply's blocks), in front of
the real httpx client, SSE parser, loop and engines.
"""

from __future__ import annotations

from typing import Any

import pytest

from fake_providers import anthropic_provider, REDACTED, SIG, FakeReply, ThinkingReply, lookup_tool
from loop import Agent, Runtime
from loop import messages as M
from loop.errors import PermanentProviderError
from loop.providers import (AnthropicProvider, Finish, ResponseBuilder, TextDelta, ToolCallDelta, ToolCallStart,
                            ToolSpec)
from loop.providers.anthropic import INTERLEAVED_THINKING_BETA, MIN_THINKING_BUDGET, to_anthropic_messages
from loop.providers.base import RedactedThinking, ThinkingDelta, ThinkingSignature, capped_call_options, output_cap
from loop.retry import RetryPolicy
from loop.stream import PartCoalescer

SIG2 = "ErUBCkYIBRgCIkD2nd+signature/of+the+second+block=="
SIG3 = "EpoBCkYIBRgCIkDthird+block+signature/after+results=="
FIRST = "Two cities: look Oslo up first."
BETWEEN = "Oslo is done; now Rome."
AFTER = "Both looked up; compare them."


def anthropic(server: Any, **kw: Any) -> AnthropicProvider:
    return anthropic_provider(server, "claude-sonnet-4-test", **kw)


# ---------------------------------------------------------------------- the header


def test_the_beta_value_is_the_documented_one():
    assert INTERLEAVED_THINKING_BETA == "interleaved-thinking-2025-05-14"


async def test_the_header_is_sent_only_when_asked(server):
    server.enqueue(FakeReply("a"), FakeReply("b"))
    agent_on = Agent("on", "", anthropic(server, thinking_budget=2048, interleaved_thinking=True))
    agent_off = Agent("off", "", anthropic(server, thinking_budget=2048))
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(agent_on, "on", "hi")).ok
        assert (await rt.run(agent_off, "off", "hi")).ok
    on, off = server.requests
    assert on.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert on.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert "anthropic-beta" not in off.headers
    assert off.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}


@pytest.mark.parametrize(
    "extra, sent",
    [
        ({"anthropic-beta": "context-1m-2025-08-07"}, "context-1m-2025-08-07,interleaved-thinking-2025-05-14"),
        # another spelling of the header name: still one header, merged
        ({"Anthropic-Beta": "a-2025-01-01, b-2025-02-02"}, "a-2025-01-01,b-2025-02-02,interleaved-thinking-2025-05-14"),
        # already asked for: not twice
        ({"anthropic-beta": "interleaved-thinking-2025-05-14"}, "interleaved-thinking-2025-05-14"),
        ({"x-other": "1"}, "interleaved-thinking-2025-05-14"),
    ],
)
async def test_the_beta_merges_with_the_callers_betas_into_one_header(server, extra, sent):
    """The fake server joins a header sent twice with ", " (as HTTP reads it), so a second
    copy beside the merged one would show here."""
    server.enqueue(FakeReply("ok"))
    p = anthropic(server, thinking_budget=2048, interleaved_thinking=True, extra_headers=extra)
    agent = Agent("w", "", p)
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(agent, "c", "hi")).ok
    assert server.requests[0].headers["anthropic-beta"] == sent
    if "x-other" in extra:
        assert server.requests[0].headers["x-other"] == "1"


async def test_without_interleaving_the_callers_beta_passes_unchanged(server):
    server.enqueue(FakeReply("ok"))
    agent = Agent("w", "", anthropic(server, thinking_budget=2048, extra_headers={"anthropic-beta": "context-1m-2025-08-07"}))
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(agent, "c", "hi")).ok
    assert server.requests[0].headers["anthropic-beta"] == "context-1m-2025-08-07"


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw, problem",
    [
        ({"interleaved_thinking": True}, "needs extended thinking on: pass thinking_budget"),
        ({"interleaved_thinking": 1, "thinking_budget": 2048}, "must be a bool"),
        ({"interleaved_thinking": "yes", "thinking_budget": 2048}, "must be a bool"),
        ({"interleaved_thinking": True, "thinking_budget": 1023}, "below the API's minimum of 1024"),
        ({"interleaved_thinking": True, "thinking_budget": 2048.0}, "must be an int"),
        # without the beta the old rule stands, and the message says how to relax it
        ({"thinking_budget": 8000, "max_tokens": 4096}, "interleaved_thinking=True"),
    ],
)
def test_interleaved_validation(kw, problem):
    with pytest.raises(ValueError, match=problem):
        AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", **kw)


def test_the_budget_may_pass_max_tokens_only_where_the_docs_say():
    """Docs: with interleaved thinking *and tools* the budget may exceed max_tokens. A request
    with tools goes as configured; one without (the compaction summariser's) keeps the old
    rule, its budget lowered to max_tokens - 1 (refused below the minimum); a ceiling's clamp
    still lowers the budget below the clamp."""
    tools = [ToolSpec("lookup", "Look up.", {"type": "object"})]
    p = AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", thinking_budget=16_000, max_tokens=4096,
                          interleaved_thinking=True)
    with_tools = p.request_body(system="", messages=[M.user("hi")], tools=tools, max_tokens=None)
    assert with_tools["max_tokens"] == 4096 and with_tools["thinking"] == {"type": "enabled", "budget_tokens": 16_000}
    no_tools = p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=None)
    assert no_tools["max_tokens"] == 4096 and no_tools["thinking"] == {"type": "enabled", "budget_tokens": 4095}
    # the agent's per-call max_tokens below the budget: fine with tools, lowered without
    assert p.request_body(system="", messages=[M.user("hi")], tools=tools, max_tokens=2000)["thinking"]["budget_tokens"] == 16_000
    assert p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=2000)["thinking"]["budget_tokens"] == 1999
    with pytest.raises(PermanentProviderError, match="without tools: interleaved thinking does not relax this"):
        p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=MIN_THINKING_BUDGET)
    # a ceiling's clamp: the budget below the clamp, as without the beta (valid with or without tools)
    assert output_cap(p, None) == 4096
    assert capped_call_options(p, 3000) == {"thinking_budget": 2999}
    assert capped_call_options(p, MIN_THINKING_BUDGET) is None
    clamped = p.request_body(system="", messages=[M.user("hi")], tools=tools, max_tokens=3000, thinking_budget=2999)
    assert clamped["max_tokens"] == 3000 and clamped["thinking"]["budget_tokens"] == 2999
    # without the beta nothing changed: a per-call max_tokens below the budget is an error
    q = AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", thinking_budget=2048)
    with pytest.raises(PermanentProviderError, match="less than max_tokens 2000$"):
        q.request_body(system="", messages=[M.user("hi")], tools=tools, max_tokens=2000)


# ---------------------------------------------------------------------- reasoning between tool calls


async def test_reasoning_between_tool_calls_is_kept_and_passed_back_in_place(server, kv_url):
    """Response 1: thinking, tool_use(Oslo), thinking, redacted_thinking, tool_use(Rome) — both
    tools run; response 2 (after the results): thinking, text. The transcript, the journal's
    parts and the next requests hold every block exactly where it streamed, signatures and
    redacted data unmodified."""
    server.enqueue(
        ThinkingReply(tool_calls=[("toolu_1", "lookup", {"city": "Oslo"}), ("toolu_2", "lookup", {"city": "Rome"})],
                      thinking=[("thinking", FIRST, SIG)],
                      interleaved=[(1, ("thinking", BETWEEN, SIG2)), (1, ("redacted_thinking", REDACTED))]),
        ThinkingReply("Both sunny.", thinking=[("thinking", AFTER, SIG3)]),
        FakeReply("Yes, both."),
    )
    calls: list[str] = []
    provider = anthropic(server, thinking_budget=8000, max_tokens=4096, interleaved_thinking=True)
    agent = Agent("w", "Be brief.", provider, tools=[lookup_tool(calls)], retry=RetryPolicy(jitter=0))
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, "c", "weather in Oslo and Rome?")
        assert out.ok and out.result == "Both sunny.", out
        again = await rt.run(agent, "c", "both sunny?")
        assert again.ok and again.result == "Yes, both."
        msgs = await rt.transcript("c")
        page = await rt.read_events("c", limit=1000)
    assert calls == ["Oslo", "Rome"]
    first_turn = [
        {"type": "thinking", "thinking": FIRST, "signature": SIG},
        {"type": "tool_call", "id": "toolu_1", "name": "lookup", "arguments": {"city": "Oslo"}},
        {"type": "thinking", "thinking": BETWEEN, "signature": SIG2},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "tool_call", "id": "toolu_2", "name": "lookup", "arguments": {"city": "Rome"}},
    ]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == first_turn
    assert msgs[4]["content"] == [{"type": "thinking", "thinking": AFTER, "signature": SIG3},
                                  {"type": "text", "text": "Both sunny."}]
    # the journal's message.added holds the same order (streamed parts: the next test)
    finals = [e.data["message"] for e in page.events if e.type == "message.added" and e.data.get("role") == "assistant"]
    assert finals[0]["content"] == first_turn
    # the wire: every later request carries the turn's blocks in the original order
    wire_turn = [
        {"type": "thinking", "thinking": FIRST, "signature": SIG},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"city": "Oslo"}},
        {"type": "thinking", "thinking": BETWEEN, "signature": SIG2},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "tool_use", "id": "toolu_2", "name": "lookup", "input": {"city": "Rome"}},
    ]
    second, third = server.requests[1].body, server.requests[2].body
    assert second["messages"][1] == {"role": "assistant", "content": wire_turn}
    assert [b["type"] for b in second["messages"][2]["content"]] == ["tool_result", "tool_result"]
    assert third["messages"][1] == {"role": "assistant", "content": wire_turn}
    assert third["messages"][3]["content"][0] == {"type": "thinking", "thinking": AFTER, "signature": SIG3}
    for r in server.requests:
        assert r.headers["anthropic-beta"] == INTERLEAVED_THINKING_BETA
        # with tools the budget goes as configured, past max_tokens (the documented relaxation)
        assert r.body["thinking"] == {"type": "enabled", "budget_tokens": 8000} and r.body["max_tokens"] == 4096


async def test_interleaved_reasoning_streams_to_the_journal_in_place(server):
    """A slow thinker (the pause after the leading block makes the loop journal parts):
    thinking, text, thinking, tool_use arrive as parts 0..3 in that order."""
    server.enqueue(
        ThinkingReply("Let me check.", tool_calls=[("toolu_9", "lookup", {"city": "Oslo"})],
                      thinking=[("thinking", FIRST, SIG)], interleaved=[(1, ("thinking", BETWEEN, SIG2))], pause=0.3),
        FakeReply("Sunny."),
    )
    calls: list[str] = []
    agent = Agent("w", "", anthropic(server, thinking_budget=2048, interleaved_thinking=True), tools=[lookup_tool(calls)])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "j", "Oslo?")
        assert out.ok, out
        page = await rt.read_events("j", limit=1000)
        msgs = await rt.transcript("j")
    parts = [(e.type, e.data) for e in page.events if e.type in ("part.added", "part.updated") and e.data["call"] == 1]
    added = [(d["part"], d["kind"]) for t, d in parts if t == "part.added"]
    assert added == [(0, "thinking"), (1, "text"), (2, "thinking"), (3, "tool_call")]
    assert "".join(d.get("thinking", "") for _, d in parts if d["part"] == 2) == BETWEEN
    assert all("text" not in d for _, d in parts if d["part"] in (0, 2))
    assert [p["type"] for p in msgs[1]["content"]] == ["thinking", "text", "thinking", "tool_call"]
    assert msgs[1]["content"][2] == {"type": "thinking", "thinking": BETWEEN, "signature": SIG2}
    assert [b["type"] for b in server.requests[1].body["messages"][1]["content"]] == ["thinking", "text", "thinking", "tool_use"]


async def test_a_ceiling_clamps_an_interleaved_call_with_a_valid_budget(server):
    """Budget 8000 past max_tokens 4096 (allowed with the beta and tools): under
    max_output_tokens 2000 the call goes with max_tokens 2000 and the budget lowered to 1999,
    the header still on."""
    server.enqueue(ThinkingReply("Short.", thinking=[("thinking", FIRST, SIG)], output_tokens=50))
    calls: list[str] = []
    agent = Agent("w", "", anthropic(server, thinking_budget=8000, max_tokens=4096, interleaved_thinking=True),
                  tools=[lookup_tool(calls)])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_output_tokens": 2000})
        assert out.ok, out
    (req,) = server.requests
    assert req.body["max_tokens"] == 2000 and req.body["thinking"] == {"type": "enabled", "budget_tokens": 1999}
    assert req.headers["anthropic-beta"] == INTERLEAVED_THINKING_BETA


# ---------------------------------------------------------------------- the pieces


def test_builder_and_coalescer_keep_reasoning_after_a_tool_call_in_place():
    events = [
        ThinkingDelta("a", 0), ThinkingSignature(0, SIG),
        ToolCallStart(1, "t1", "lookup"), ToolCallDelta(1, '{"city": "X"}'),
        ThinkingDelta("b", 2), ThinkingDelta("c", 2), ThinkingSignature(2, SIG2),
        RedactedThinking(3, REDACTED),
        TextDelta("then", 4),
        ThinkingSignature(5, "sig-empty"),
        ToolCallStart(6, "t2", "lookup"), ToolCallDelta(6, '{"city": "Y"}'),
        Finish("tool_use"),
    ]
    b = ResponseBuilder()
    c = PartCoalescer("run", 1)
    for ev in events:
        b.add(ev)
        c.add(ev)
    assert b.message()["content"] == [
        {"type": "thinking", "thinking": "a", "signature": SIG},
        {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {"city": "X"}},
        {"type": "thinking", "thinking": "bc", "signature": SIG2},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "text", "text": "then"},
        {"type": "thinking", "thinking": "", "signature": "sig-empty"},
        {"type": "tool_call", "id": "t2", "name": "lookup", "arguments": {"city": "Y"}},
    ]
    items = c.take()
    assert [(d["part"], d.get("kind")) for t, d in items if t == "part.added"] == [
        (0, "thinking"), (1, "tool_call"), (2, "thinking"), (3, "redacted_thinking"), (4, "text"),
        (5, "thinking"), (6, "tool_call"),
    ]
    assert [d.get("thinking") for t, d in items if d["part"] == 2] == ["bc"]


def test_merged_assistant_turns_hoist_only_leading_reasoning():
    """Two assistant messages in a row become one wire turn: the reasoning that opens the
    second still leads the turn (as before), but reasoning it streamed after a tool call
    stays after that call."""
    msgs = [
        M.user("hi"),
        {"role": "assistant", "content": [{"type": "text", "text": "partial"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "first", "signature": SIG},
            {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {}},
            {"type": "thinking", "thinking": "between", "signature": SIG2},
            {"type": "redacted_thinking", "data": REDACTED},
            {"type": "tool_call", "id": "t2", "name": "lookup", "arguments": {}},
        ]},
    ]
    wire = to_anthropic_messages(msgs)
    assert [(b["type"], b.get("thinking")) for b in wire[1]["content"]] == [
        ("thinking", "first"), ("text", None), ("tool_use", None), ("thinking", "between"),
        ("redacted_thinking", None), ("tool_use", None),
    ]
    # a single interleaved message is passed as it is
    single = to_anthropic_messages([M.user("hi"), msgs[2]])
    assert [b["type"] for b in single[1]["content"]] == ["thinking", "tool_use", "thinking", "redacted_thinking", "tool_use"]
