"""Anthropic adaptive thinking and effort: ``AnthropicProvider(thinking="adaptive",
thinking_display=..., effort=...)``.

Adaptive thinking (4.6 models and later) replaces budgeted thinking: ``"thinking": {"type":
"adaptive"}`` with no budget, optionally ``"display"``; ``"output_config": {"effort": ...}``
steers token spend with or without thinking.  On Opus 4.7+ the default display is
"omitted": thinking blocks stream signature-only (empty text) and must still be passed back
unmodified, where they streamed (adaptive thinking interleaves them among tool calls).
The model is faked only at the wire (tests/loop/fake_providers.ThinkingServer), in front of
the real httpx client, SSE parser, loop and engines.
"""

from __future__ import annotations

from typing import Any

import pytest

from fake_providers import anthropic_provider, SIG, FakeReply, ThinkingReply, budgeted_thinking_unsupported, lookup_tool
from loop import Agent, Runtime
from loop import messages as M
from loop.errors import PermanentProviderError
from loop.providers import AnthropicProvider, ToolSpec, make_provider
from loop.providers.anthropic import EFFORT_LEVELS, THINKING_DISPLAYS
from loop.providers.base import capped_call_options, output_cap
from loop.retry import RetryPolicy

SIG2 = "ErUBCkYIBRgCIkD2nd+omitted/between+tool+calls=="
SIG3 = "EpoBCkYIBRgCIkDthird+omitted+after/the+calls=="
SIG4 = "EpoBCkYIBRgCIkDfourth+omitted+final/answer=="


def anthropic(server: Any, **kw: Any) -> AnthropicProvider:
    return anthropic_provider(server, "claude-opus-4-7-test", **kw)


# ---------------------------------------------------------------------- the request body


def test_the_documented_levels():
    assert EFFORT_LEVELS == ("low", "medium", "high", "xhigh", "max")
    assert THINKING_DISPLAYS == ("summarized", "omitted")


@pytest.mark.parametrize(
    "kw, thinking, output_config",
    [
        ({"thinking": "adaptive"}, {"type": "adaptive"}, None),
        ({"thinking": "adaptive", "thinking_display": "summarized"}, {"type": "adaptive", "display": "summarized"}, None),
        ({"thinking": "adaptive", "thinking_display": "omitted"}, {"type": "adaptive", "display": "omitted"}, None),
        ({"thinking": "adaptive", "effort": "xhigh"}, {"type": "adaptive"}, {"effort": "xhigh"}),
        ({"thinking": "adaptive", "thinking_display": "summarized", "effort": "low"},
         {"type": "adaptive", "display": "summarized"}, {"effort": "low"}),
        # effort alone: no thinking field, effort still governs the response's spend
        ({"effort": "medium"}, None, {"effort": "medium"}),
        # effort beside budgeted thinking (models that take both): both sent as configured
        ({"thinking_budget": 2048, "effort": "high"}, {"type": "enabled", "budget_tokens": 2048}, {"effort": "high"}),
        ({}, None, None),
    ],
)
async def test_body_fields_for_each_combination(server, kw, thinking, output_config):
    server.enqueue(FakeReply("ok"))
    agent = Agent("w", "", anthropic(server, **kw))
    async with Runtime.open("memory:") as rt:
        assert (await rt.run(agent, "c", "hi")).ok
    (req,) = server.requests
    body = req.body
    assert body.get("thinking") == thinking
    assert body.get("output_config") == output_config
    assert body["max_tokens"] == 4096 and body["model"] == "claude-opus-4-7-test" and body["stream"] is True
    # exactly the documented fields: no budget with adaptive, no beta header, nothing else new
    assert set(body) <= {"model", "max_tokens", "messages", "stream", "system", "tools", "thinking", "output_config"}
    assert "anthropic-beta" not in req.headers


def test_make_provider_passes_the_options_through():
    p = make_provider("anthropic:claude-opus-4-7", thinking="adaptive", effort="max", thinking_display="summarized")
    body = p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=None)
    assert body["thinking"] == {"type": "adaptive", "display": "summarized"} and body["output_config"] == {"effort": "max"}


@pytest.mark.parametrize(
    "kw, problem",
    [
        ({"thinking": "enabled"}, "thinking must be one of 'adaptive' or None, not 'enabled'"),
        ({"thinking": True}, "thinking must be one of 'adaptive'"),
        ({"thinking": "adaptive", "thinking_budget": 2048}, "exclusive"),
        ({"thinking": "adaptive", "interleaved_thinking": True}, "interleaves reasoning between tool calls by itself"),
        ({"thinking_display": "summarized"}, "thinking_display needs thinking='adaptive'"),
        ({"thinking_display": "omitted", "thinking_budget": 2048}, "thinking_display needs thinking='adaptive'"),
        ({"thinking": "adaptive", "thinking_display": "full"}, "thinking_display must be one of 'summarized', 'omitted'"),
        ({"effort": "extreme"}, "effort must be one of 'low', 'medium', 'high', 'xhigh', 'max' or None, not 'extreme'"),
        ({"effort": "HIGH", "thinking": "adaptive"}, "effort must be one of"),
        ({"effort": 3}, "effort must be one of"),
    ],
)
def test_adaptive_validation(kw, problem):
    with pytest.raises(ValueError, match=problem):
        AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", **kw)


def test_no_budget_rule_applies_to_adaptive_thinking():
    """Budgeted thinking needs budget < max_tokens (and >= 1024); adaptive has no budget, so
    any max_tokens is a valid request, the agent's small per-call cap and a tiny clamp too."""
    p = AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", thinking="adaptive", max_tokens=600)
    tools = [ToolSpec("lookup", "Look up.", {"type": "object"})]
    for mt, t in ((None, tools), (100, tools), (5, ())):
        body = p.request_body(system="", messages=[M.user("hi")], tools=t, max_tokens=mt)
        assert body["max_tokens"] == (mt or 600) and body["thinking"] == {"type": "adaptive"}
    assert output_cap(p, None) == 600
    for room in (1, 2, 500, 1023, 1024):
        assert capped_call_options(p, room) == {}
    # a per-call budget (what a clamp gives budgeted thinking) is not for adaptive thinking
    with pytest.raises(PermanentProviderError, match="per-call thinking_budget"):
        p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=500, thinking_budget=1024)


# ---------------------------------------------------------------------- a tool turn, display omitted


async def test_omitted_thinking_around_tool_calls_is_passed_back_unmodified_in_order(server, kv_url):
    """Response 1 (display omitted): thinking(empty, SIG), tool_use(Oslo), thinking(empty, SIG2),
    tool_use(Rome), thinking(empty, SIG3) — adaptive thinking interleaves by itself; response 2:
    thinking(empty, SIG4), the answer. The transcript and journal hold the empty-text blocks
    with their signatures in stream order, and each later request passes them back so."""
    server.enqueue(
        ThinkingReply(tool_calls=[("toolu_1", "lookup", {"city": "Oslo"}), ("toolu_2", "lookup", {"city": "Rome"})],
                      thinking=[("omitted_thinking", SIG)],
                      interleaved=[(1, ("omitted_thinking", SIG2)), (2, ("omitted_thinking", SIG3))]),
        ThinkingReply("Both sunny.", thinking=[("omitted_thinking", SIG4)]),
        FakeReply("Yes."),
    )
    calls: list[str] = []
    provider = anthropic(server, thinking="adaptive", effort="high", max_tokens=4096)
    agent = Agent("w", "Be brief.", provider, tools=[lookup_tool(calls)], retry=RetryPolicy(jitter=0))
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, "c", "weather in Oslo and Rome?")
        assert out.ok and out.result == "Both sunny.", out
        again = await rt.run(agent, "c", "sure?")
        assert again.ok and again.result == "Yes."
        msgs = await rt.transcript("c")
        page = await rt.read_events("c", limit=1000)
    assert calls == ["Oslo", "Rome"]
    first_turn = [
        {"type": "thinking", "thinking": "", "signature": SIG},
        {"type": "tool_call", "id": "toolu_1", "name": "lookup", "arguments": {"city": "Oslo"}},
        {"type": "thinking", "thinking": "", "signature": SIG2},
        {"type": "tool_call", "id": "toolu_2", "name": "lookup", "arguments": {"city": "Rome"}},
        {"type": "thinking", "thinking": "", "signature": SIG3},
    ]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == first_turn
    assert msgs[4]["content"] == [{"type": "thinking", "thinking": "", "signature": SIG4},
                                  {"type": "text", "text": "Both sunny."}]
    finals = [e.data["message"] for e in page.events if e.type == "message.added" and e.data.get("role") == "assistant"]
    assert finals[0]["content"] == first_turn
    wire_turn = [
        {"type": "thinking", "thinking": "", "signature": SIG},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"city": "Oslo"}},
        {"type": "thinking", "thinking": "", "signature": SIG2},
        {"type": "tool_use", "id": "toolu_2", "name": "lookup", "input": {"city": "Rome"}},
        {"type": "thinking", "thinking": "", "signature": SIG3},
    ]
    second, third = server.requests[1].body, server.requests[2].body
    assert second["messages"][1] == {"role": "assistant", "content": wire_turn}
    assert [b["type"] for b in second["messages"][2]["content"]] == ["tool_result", "tool_result"]
    assert third["messages"][1] == {"role": "assistant", "content": wire_turn}
    assert third["messages"][3]["content"] == [{"type": "thinking", "thinking": "", "signature": SIG4},
                                               {"type": "text", "text": "Both sunny."}]
    for r in server.requests:
        assert r.body["thinking"] == {"type": "adaptive"} and r.body["output_config"] == {"effort": "high"}
        assert r.body["max_tokens"] == 4096 and "anthropic-beta" not in r.headers


# ---------------------------------------------------------------------- a usage ceiling's clamp


@pytest.mark.parametrize("room", [2000, 600])
async def test_a_ceiling_clamps_an_adaptive_call_to_max_tokens_alone(server, room):
    """Under max_output_tokens the call goes with max_tokens lowered to the room and thinking
    still adaptive, no budget anywhere; a room below budgeted thinking's 1024 minimum is not
    refused (adaptive has none). The fake honours the cap: the run stays within the ceiling."""
    server.enqueue(ThinkingReply("A long answer " * 40, thinking=[("omitted_thinking", SIG)], output_tokens=5000))
    calls: list[str] = []
    agent = Agent("w", "", anthropic(server, thinking="adaptive", effort="low", max_tokens=8000),
                  tools=[lookup_tool(calls)])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi", limits={"max_output_tokens": room})
        usage = await rt.usage(out.run_id)
    (req,) = server.requests
    assert req.body["max_tokens"] == room
    assert req.body["thinking"] == {"type": "adaptive"} and req.body["output_config"] == {"effort": "low"}
    assert "budget_tokens" not in repr(req.body)
    # the fake stopped at the cap as the API does (usage reports exactly the cap)
    assert usage["output_tokens"] == room, (out, usage)


# ---------------------------------------------------------------------- Opus 4.7 refusing budgeted thinking


async def test_a_model_refusing_budgeted_thinking_fails_permanent_with_a_hint(server):
    server.enqueue(budgeted_thinking_unsupported(), FakeReply("never sent"))
    agent = Agent("w", "", anthropic(server, thinking_budget=2048), retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi")
    assert out.status == "failed" and out.error["type"] == "permanent" and out.error["status"] == 400
    assert "thinking.type.enabled" in out.error["message"]  # the API's own words are kept
    assert "thinking='adaptive'" in out.error["message"]
    assert len(server.requests) == 1  # not retried


async def test_an_unrelated_400_gets_no_hint(server):
    server.enqueue(budgeted_thinking_unsupported())
    agent = Agent("w", "", anthropic(server, thinking="adaptive"), retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "hi")
    assert out.status == "failed" and out.error["type"] == "permanent"
    assert "thinking='adaptive'" not in out.error["message"]  # adaptive is already on: no advice to give


async def test_omitted_thinking_streams_to_the_journal_as_textless_parts_in_place(server):
    """A slow thinker (a pause after the leading block, so the loop journals parts before the
    answer ends): signature-only thinking, text, signature-only thinking, tool_use arrive as
    parts 0..3 in that order, the thinking parts carrying no text at all (nothing to show)."""
    server.enqueue(
        ThinkingReply("Let me check.", tool_calls=[("toolu_9", "lookup", {"city": "Oslo"})],
                      thinking=[("omitted_thinking", SIG)], interleaved=[(1, ("omitted_thinking", SIG2))], pause=0.3),
        FakeReply("Sunny."),
    )
    calls: list[str] = []
    agent = Agent("w", "", anthropic(server, thinking="adaptive"), tools=[lookup_tool(calls)])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "j", "Oslo?")
        assert out.ok, out
        page = await rt.read_events("j", limit=1000)
        msgs = await rt.transcript("j")
    parts = [(e.type, e.data) for e in page.events if e.type in ("part.added", "part.updated") and e.data["call"] == 1]
    assert [(d["part"], d["kind"]) for t, d in parts if t == "part.added"] == [
        (0, "thinking"), (1, "text"), (2, "thinking"), (3, "tool_call")]
    assert all("thinking" not in d and "text" not in d for _, d in parts if d["part"] in (0, 2))
    assert msgs[1]["content"] == [
        {"type": "thinking", "thinking": "", "signature": SIG},
        {"type": "text", "text": "Let me check."},
        {"type": "thinking", "thinking": "", "signature": SIG2},
        {"type": "tool_call", "id": "toolu_9", "name": "lookup", "arguments": {"city": "Oslo"}},
    ]
    assert server.requests[1].body["messages"][1]["content"][2] == {"type": "thinking", "thinking": "", "signature": SIG2}
