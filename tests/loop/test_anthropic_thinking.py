"""Anthropic extended thinking: enabling it, streaming it, and passing it back.

With thinking on and tools in use, Anthropic's API requires the assistant turn's
``thinking`` blocks (``signature`` unmodified) and ``redacted_thinking`` blocks
(``data``) back, first in that turn, on the next request, or it answers 400.  The
model is faked only at the wire: a subclass of the local fake server
(tests/loop/fake_providers.py) that streams thinking blocks exactly as the API
does (``content_block_start`` ``thinking`` -> ``thinking_delta``s ->
``signature_delta`` -> ``content_block_stop``; ``redacted_thinking`` whole in its
start event), in front of the real httpx client, SSE parser, loop and engines.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from fake_providers import (REDACTED, SIG, anthropic_provider, FakeBreak, FakeReply, ThinkingReply, ThinkingServer, lookup_tool,
                            _sse, anthropic_events)
from loop import Agent, Runtime
from loop import messages as M
from loop.cli import render_event
from loop.compaction import choose_cut, estimate_context_tokens, model_context, summary_request
from loop.errors import PermanentProviderError, StreamBrokenError
from loop.providers import AnthropicProvider, OpenAIProvider, ResponseBuilder, ToolSpec, stream_model
from loop.providers.anthropic import MIN_THINKING_BUDGET, to_anthropic_messages
from loop.providers.base import RedactedThinking, ThinkingDelta, ThinkingSignature
from loop.providers.openai import to_openai_messages
from loop.retry import RetryPolicy
from loop.stream import PartCoalescer

TOOLS = [ToolSpec("lookup", "Look a city up.", {"type": "object", "properties": {"city": {"type": "string"}}})]


def anthropic(server: Any, **kw: Any) -> AnthropicProvider:
    return anthropic_provider(server, **kw)


THOUGHT = "The user wants Oslo's weather; the lookup tool answers that. Call it."


async def test_thinking_and_tool_use_round_trip(server, kv_url):
    """The thinking block (with its signature, unmodified) goes back first in the assistant
    turn of the request after the tool ran; the transcript holds it; the first request
    enabled thinking with the budget."""
    server.enqueue(
        ThinkingReply("Checking.", tool_calls=[("toolu_01", "lookup", {"city": "Oslo"})], thinking=[("thinking", THOUGHT, SIG)]),
        FakeReply("It is sunny in Oslo."),
    )
    calls: list[str] = []
    provider = anthropic(server, thinking_budget=2048, max_tokens=8192)
    agent = Agent("w", "Be brief.", provider, tools=[lookup_tool(calls)], retry=RetryPolicy(jitter=0))
    async with Runtime.open(kv_url) as rt:
        out = await rt.run(agent, "think", "weather in Oslo?")
        assert out.ok and out.result == "It is sunny in Oslo."
        msgs = await rt.transcript("think")
    assert calls == ["Oslo"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == [
        {"type": "thinking", "thinking": THOUGHT, "signature": SIG},
        {"type": "text", "text": "Checking."},
        {"type": "tool_call", "id": "toolu_01", "name": "lookup", "arguments": {"city": "Oslo"}},
    ]
    assert len(server.requests) == 2
    first, second = (r.body for r in server.requests)
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert first["max_tokens"] == 8192
    assert second["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    turn = second["messages"][1]
    assert turn["role"] == "assistant"
    assert turn["content"] == [
        {"type": "thinking", "thinking": THOUGHT, "signature": SIG},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {"city": "Oslo"}},
    ]
    assert second["messages"][2]["content"][0]["type"] == "tool_result"


async def test_redacted_thinking_round_trips(server):
    """A redacted block's data goes back unmodified, in its place among the reasoning blocks."""
    server.enqueue(
        ThinkingReply(tool_calls=[("toolu_02", "lookup", {"city": "Bergen"})],
                      thinking=[("thinking", "First, consider", SIG), ("redacted_thinking", REDACTED)]),
        FakeReply("Bergen is sunny."),
    )
    calls: list[str] = []
    agent = Agent("w", "", anthropic(server, thinking_budget=MIN_THINKING_BUDGET), tools=[lookup_tool(calls)])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "redacted", "Bergen?")
        assert out.ok and out.result == "Bergen is sunny."
        msgs = await rt.transcript("redacted")
    assert calls == ["Bergen"]
    assert msgs[1]["content"][:2] == [
        {"type": "thinking", "thinking": "First, consider", "signature": SIG},
        {"type": "redacted_thinking", "data": REDACTED},
    ]
    turn = server.requests[1].body["messages"][1]
    assert turn["content"] == [
        {"type": "thinking", "thinking": "First, consider", "signature": SIG},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "tool_use", "id": "toolu_02", "name": "lookup", "input": {"city": "Bergen"}},
    ]


async def test_thinking_streams_to_the_journal_as_thinking_parts(server):
    """A slow thinker: the reasoning is journaled as a part of kind ``thinking`` (text in the
    ``thinking`` field, never ``text``, so the CLI does not print it as the answer) before
    the answer's parts, and message.added carries the whole message, signature included."""
    server.enqueue(ThinkingReply("Done thinking.", thinking=[("thinking", THOUGHT, SIG)], pause=0.3))
    agent = Agent("w", "", anthropic(server, thinking_budget=1500))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "journal", "think first")
        assert out.ok and out.result == "Done thinking."
        page = await rt.read_events("journal", limit=1000)
    parts = [(e.type, e.data) for e in page.events if e.type in ("part.added", "part.updated")]
    added = [d for t, d in parts if t == "part.added"]
    assert [d["kind"] for d in added] == ["thinking", "text"]
    assert [d["part"] for d in added] == [0, 1]
    thinking_text = "".join(d.get("thinking", "") for _, d in parts if d["part"] == 0)
    assert thinking_text == THOUGHT
    assert all("text" not in d for _, d in parts if d["part"] == 0)
    assert "".join(d.get("text", "") for _, d in parts if d["part"] == 1) == "Done thinking."
    # the thinking part was committed before the answer's first part (stream order kept)
    order = [e.data.get("part") for e in page.events if e.type == "part.added"]
    assert order == [0, 1]
    for e in page.events:
        if e.type in ("part.added", "part.updated") and e.data.get("part") == 0:
            assert render_event(e) is None  # the CLI shows no reasoning as answer text
    final = [e.data for e in page.events if e.type == "message.added" and e.data.get("role") == "assistant"]
    assert len(final) == 1
    assert final[0]["message"]["content"][0] == {"type": "thinking", "thinking": THOUGHT, "signature": SIG}
    # the journal's part events came before the message they stream (nothing reordered)
    types = [e.type for e in page.events]
    assert types.index("part.added") < len(types) - 1 - types[::-1].index("message.added")


async def test_stream_broken_after_thinking_is_not_retried(server):
    """Reasoning is output: a stream dropped after it is a StreamBrokenError."""
    reply = ThinkingReply("never", thinking=[("thinking", THOUGHT, SIG)])
    server.enqueue(FakeBreak(reply, after=5))  # message_start, ping, block start, two thinking deltas
    p = anthropic(server, thinking_budget=2000)
    seen = []
    with pytest.raises(StreamBrokenError):
        async for ev in stream_model(p, system="", messages=[M.user("hi")], tools=TOOLS):
            seen.append(ev)
    await p.aclose()
    assert seen and all(isinstance(e, ThinkingDelta) for e in seen)


@pytest.mark.parametrize(
    "budget, kw, problem",
    [
        (1023, {}, "below the API's minimum of 1024"),
        (0, {}, "below the API's minimum"),
        (2048.0, {}, "must be an int"),
        ("2048", {}, "must be an int"),
        (True, {}, "must be an int"),
        (4096, {}, "less than max_tokens 4096"),  # the default max_tokens
        (5000, {"max_tokens": 5000}, "less than max_tokens 5000"),
    ],
)
def test_thinking_budget_validation(budget, kw, problem):
    with pytest.raises(ValueError, match=problem):
        AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", thinking_budget=budget, **kw)


def test_thinking_budget_against_a_per_call_max_tokens():
    """The agent's max_tokens (passed per call) below the budget fails the call clearly
    (permanent: retrying cannot help) rather than sending a request the API refuses."""
    p = AnthropicProvider("claude-test", base_url="http://127.0.0.1:9", thinking_budget=2048)
    body = p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=3000)
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048} and body["max_tokens"] == 3000
    with pytest.raises(PermanentProviderError, match="less than max_tokens 2000"):
        p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=2000)


def test_no_thinking_key_without_a_budget():
    p = AnthropicProvider("claude-test", base_url="http://127.0.0.1:9")
    assert p.thinking_budget is None
    assert "thinking" not in p.request_body(system="", messages=[M.user("hi")], tools=(), max_tokens=None)


def _thinking_history() -> list[dict[str, Any]]:
    return [
        M.user("weather in Oslo?"),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": SIG},
            {"type": "redacted_thinking", "data": REDACTED},
            {"type": "text", "text": "Checking."},
            {"type": "tool_call", "id": "toolu_01", "name": "lookup", "arguments": {"city": "Oslo"}},
        ], "stop_reason": "tool_use"},
        M.tool_results([M.tool_result("toolu_01", "lookup", "Oslo: sunny")]),
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        M.user("and Bergen?"),
    ]


def test_openai_ignores_thinking_parts():
    with_thinking = _thinking_history()
    without = [dict(m, content=[p for p in m["content"] if p["type"] not in ("thinking", "redacted_thinking")])
               for m in with_thinking]
    assert to_openai_messages("sys", with_thinking) == to_openai_messages("sys", without)
    body = OpenAIProvider("gpt-test", base_url="http://127.0.0.1:9/v1").request_body(
        system="", messages=with_thinking, tools=(), max_tokens=None)
    assert SIG not in json.dumps(body) and REDACTED not in json.dumps(body) and THOUGHT not in json.dumps(body)


def test_merged_assistant_turns_keep_reasoning_first():
    """Two assistant messages in a row become one wire turn; its reasoning still leads it."""
    msgs = [
        M.user("hi"),
        {"role": "assistant", "content": [{"type": "text", "text": "partial"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "again", "signature": SIG},
            {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {}},
        ]},
    ]
    wire = to_anthropic_messages(msgs)
    assert [b["type"] for b in wire[1]["content"]] == ["thinking", "text", "tool_use"]


def test_compaction_and_estimates_survive_thinking_parts():
    history = _thinking_history()
    ctx = model_context(history)
    assert estimate_context_tokens("sys", ctx) > 0
    cut = choose_cut(history, keep_recent=1)
    assert cut is not None
    req = summary_request(history, cut)
    text = M.text_of(req[0])
    assert "Checking." in text and SIG not in text and REDACTED not in text


def test_builder_and_coalescer_keep_stream_order():
    """Reasoning parts land where they streamed; a block signed without text still gets
    its part (and part number); consecutive thinking deltas extend one part."""
    from loop.providers import Finish, TextDelta, ToolCallDelta, ToolCallStart

    events = [
        ThinkingDelta("a", 0), ThinkingDelta("b", 0), ThinkingSignature(0, SIG),
        ThinkingSignature(1, "sig-empty"),
        RedactedThinking(2, REDACTED),
        TextDelta("hi", 3), ToolCallStart(4, "t1", "lookup"), ToolCallDelta(4, '{"city": "X"}'),
        Finish("tool_use"),
    ]
    b = ResponseBuilder()
    c = PartCoalescer("run", 1)
    for ev in events:
        b.add(ev)
        c.add(ev)
    assert b.message()["content"] == [
        {"type": "thinking", "thinking": "ab", "signature": SIG},
        {"type": "thinking", "thinking": "", "signature": "sig-empty"},
        {"type": "redacted_thinking", "data": REDACTED},
        {"type": "text", "text": "hi"},
        {"type": "tool_call", "id": "t1", "name": "lookup", "arguments": {"city": "X"}},
    ]
    assert b.text == "hi"
    items = c.take()
    assert [(t, d["part"], d.get("kind")) for t, d in items] == [
        ("part.added", 0, "thinking"), ("part.added", 1, "thinking"), ("part.added", 2, "redacted_thinking"),
        ("part.added", 3, "text"), ("part.added", 4, "tool_call"),
    ]
    assert items[0][1]["thinking"] == "ab" and "data" not in items[2][1]


async def test_thinking_delta_for_a_text_block_is_refused(server):
    """A malformed stream (a thinking delta for a text block) fails permanently, before output."""
    raw = anthropic_events(FakeReply("x"))
    bad = _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "thinking_delta", "thinking": "?"}})

    class Bad(ThinkingServer):
        def _events(self, dialect, r):  # type: ignore[override]
            return raw[:3] + [bad] + raw[3:]

    s = Bad()
    async with trio.open_nursery() as n:
        await n.start(s.serve)
        s.enqueue(FakeReply("x"))
        p = anthropic(s, thinking_budget=2000)
        with pytest.raises(PermanentProviderError, match="thinking_delta for non-thinking block 0"):
            async for _ in stream_model(p, system="", messages=[M.user("hi")], tools=()):
                pass
        await p.aclose()
        n.cancel_scope.cancel()


async def test_long_reasoning_fits_the_journal(server, autojump_clock):
    """Reasoning of ~30k tokens (a common budget) must not abort the turn."""
    big = "step. " * 20_000  # 120,000 characters
    server.enqueue(ThinkingReply("ok", thinking=[("thinking", big, SIG)], thinking_chunk=4000))
    agent = Agent("w", "", anthropic(server, thinking_budget=32_000, max_tokens=40_000))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "long", "think hard")
        assert out.ok and out.result == "ok"
        msgs = await rt.transcript("long")
    assert msgs[1]["content"][0]["thinking"] == big
