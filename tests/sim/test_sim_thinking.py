"""ScriptedModel's extended thinking (loop/providers/scripted.py), and the simulator's reasoning checks.

The scripted model must stream reasoning exactly as ``AnthropicProvider`` turns Anthropic's wire
format into events, or the simulator would exercise a path no real provider takes: the first test
plays the same content through both (the real provider against the loopback fake server of
tests/loop, speaking the thinking wire format) and compares the events.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "loop"))  # tests/loop/fake_providers

from fake_providers import REDACTED, SIG, ThinkingReply, ThinkingServer  # noqa: E402

from loop import Agent, Runtime, tool  # noqa: E402
from loop.errors import StreamBrokenError  # noqa: E402
from loop.providers import AnthropicProvider, ScriptedModel, stream_model  # noqa: E402
from loop.providers.base import (  # noqa: E402
    STOP_MAX_TOKENS,
    Finish,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
)
from loop.providers.scripted import BreakAfter, redacted_thinking, reply, thinking, tool_call  # noqa: E402
from loop.retry import RetryPolicy  # noqa: E402

THOUGHT = "The user wants Oslo's weather; the lookup tool answers that, so call it first."

# (reasoning blocks, text, tool calls): the shapes a reasoning answer takes
CASES = [
    ([("thinking", THOUGHT, SIG)], "Checking.", [("toolu_01", "lookup", {"city": "Oslo"})]),
    ([("thinking", THOUGHT, SIG), ("redacted_thinking", REDACTED)], "", [("toolu_02", "lookup", {"city": "Bergen"})]),
    ([("redacted_thinking", REDACTED), ("thinking", "short", SIG)], "It is sunny.", []),
    ([("thinking", THOUGHT, SIG)], "", []),
]


def _scripted_reply(blocks: list[tuple[str, ...]], text: str, calls: list[tuple[str, str, dict]]) -> Any:
    return reply(text, *[tool_call(name, args, id=cid) for cid, name, args in calls],
                 thinking=[thinking(b[1], b[2]) if b[0] == "thinking" else redacted_thinking(b[1]) for b in blocks])


def _merged(events: list[Any]) -> list[Any]:
    """Events with consecutive pieces of one block joined (the two sides chunk text and JSON
    differently; what a consumer builds from them must not differ) and usage left out."""
    out: list[Any] = []
    for ev in events:
        prev = out[-1] if out else None
        if isinstance(ev, Finish):
            out.append(("finish", ev.stop_reason))
        elif isinstance(ev, (TextDelta, ThinkingDelta)) and type(prev) is type(ev) and prev.index == ev.index:
            out[-1] = type(ev)(prev.text + ev.text, ev.index)
        elif isinstance(ev, ToolCallDelta) and isinstance(prev, ToolCallDelta) and prev.index == ev.index:
            out[-1] = ToolCallDelta(ev.index, prev.arguments + ev.arguments)
        else:
            out.append(ev)
    return out


async def _events(provider: Any) -> list[Any]:
    return [ev async for ev in stream_model(provider, system="", messages=[{"role": "user", "content": []}], tools=())]


@pytest.mark.parametrize("blocks,text,calls", CASES)
async def test_scripted_thinking_streams_what_the_anthropic_provider_streams(nursery, blocks, text, calls):
    server = ThinkingServer()
    await nursery.start(server.serve)
    server.enqueue(ThinkingReply(text, tool_calls=calls, thinking=blocks, chunk=3))
    real = await _events(AnthropicProvider("claude-test", base_url=server.base_url, api_key="k", timeout=None,
                                           thinking_budget=2048, max_tokens=8192))
    scripted = await _events(ScriptedModel([_scripted_reply(blocks, text, calls)], chunk=5))
    assert _merged(scripted) == _merged(real)
    kinds = [type(e).__name__ for e in _merged(scripted)]
    first_answer = min([kinds.index(k) for k in ("TextDelta", "ToolCallStart") if k in kinds] + [len(kinds) - 1])
    assert {"ThinkingDelta", "RedactedThinking"} & set(kinds[:first_answer])  # reasoning comes first


# (leading reasoning, text, tool calls, interleaved (position, block)): reasoning among the answer
INTERLEAVED_CASES = [
    # thinking, text, thinking, tool_use, redacted_thinking, thinking, tool_use
    ([("thinking", THOUGHT, SIG)], "Checking.", [("toolu_1", "lookup", {"city": "Oslo"}), ("toolu_2", "lookup", {"city": "Rome"})],
     [(1, ("thinking", "then the first lookup", SIG)), (2, ("redacted_thinking", REDACTED)), (2, ("thinking", "and Rome", SIG))]),
    # text, thinking, tool_use (no leading reasoning)
    ([], "Let me look.", [("toolu_3", "lookup", {"city": "Bergen"})], [(1, ("thinking", THOUGHT, SIG))]),
    # thinking, tool_use, thinking, tool_use (no text)
    ([("thinking", "first", SIG)], "", [("toolu_4", "lookup", {"city": "A"}), ("toolu_5", "lookup", {"city": "B"})],
     [(1, ("thinking", THOUGHT, SIG))]),
    # text, then reasoning after it at the end
    ([("redacted_thinking", REDACTED)], "Done.", [], [(1, ("thinking", "closing thought", SIG))]),
]


def _block(b: tuple[str, ...]) -> Any:
    return thinking(b[1], b[2]) if b[0] == "thinking" else redacted_thinking(b[1])


@pytest.mark.parametrize("lead,text,calls,among", INTERLEAVED_CASES)
async def test_scripted_interleaved_thinking_streams_what_the_anthropic_provider_streams(nursery, lead, text, calls, among):
    """Reasoning among the text and tool calls (interleaved thinking): every block numbered by its
    place in the stream, as Anthropic numbers them, and the same events as the real provider."""
    server = ThinkingServer()
    await nursery.start(server.serve)
    server.enqueue(ThinkingReply(text, tool_calls=calls, thinking=lead, interleaved=among, chunk=3))
    real = await _events(AnthropicProvider("claude-test", base_url=server.base_url, api_key="k", timeout=None,
                                           thinking_budget=2048, max_tokens=8192, interleaved_thinking=True))
    scripted = await _events(ScriptedModel([
        reply(text, *[tool_call(name, args, id=cid) for cid, name, args in calls], thinking=[_block(b) for b in lead],
              interleaved=[(pos, _block(b)) for pos, b in among])], chunk=5))
    assert _merged(scripted) == _merged(real)
    kinds = [type(e).__name__ for e in _merged(scripted) if not isinstance(e, tuple)]
    first_answer = min(kinds.index(k) for k in ("TextDelta", "ToolCallStart") if k in kinds)
    assert {"ThinkingDelta", "RedactedThinking"} & set(kinds[first_answer:])  # reasoning after the answer began


def test_interleaved_positions_are_checked():
    with pytest.raises(ValueError, match="interleaved position"):
        reply("t", tool_call("lookup"), interleaved=[(3, thinking("x", SIG))])  # two answer blocks: 0..2
    with pytest.raises(TypeError):
        reply("t", interleaved=[(0, "not a block")])
    r = reply("t", tool_call("lookup"), interleaved=[(2, thinking("b", SIG)), (1, thinking("a", SIG))])
    assert [pos for pos, _ in r.interleaved] == [1, 2]  # ordered by position


async def test_interleaved_replies_stop_at_max_tokens_in_stream_order():
    """A cut falls wherever the room runs out, interleaved reasoning included: text (4 tokens), a
    thinking block between it and the tool call (10), the call (8)."""
    r = reply("a" * 16, tool_call("lookup", {"city": "Oslo"}), interleaved=[(1, thinking("t" * 40, SIG))])
    full = [ev async for ev in ScriptedModel([r]).stream(system="", messages=[], tools=())]
    assert full[-1].usage.output_tokens == 4 + 10 + 8
    assert [type(e).__name__ for e in full][:2] == ["TextDelta", "ThinkingDelta"]
    for cap, reasoning, has_sig, started in [(8, "t" * 16, False, False), (14, "t" * 40, True, False),
                                             (18, "t" * 40, True, True)]:
        evs = [ev async for ev in ScriptedModel([r]).stream(system="", messages=[], tools=(), max_tokens=cap)]
        assert evs[-1].stop_reason == STOP_MAX_TOKENS and evs[-1].usage.output_tokens <= cap
        assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == "a" * 16
        assert "".join(e.text for e in evs if isinstance(e, ThinkingDelta)) == reasoning
        assert any(isinstance(e, ThinkingSignature) for e in evs) == has_sig
        assert any(isinstance(e, ToolCallStart) for e in evs) == started
        assert [e.index for e in evs if isinstance(e, ThinkingDelta)][0] == 1  # numbered in stream order


async def test_a_scripted_reasoning_turn_is_persisted_first_and_passed_back():
    """Through the real loop: the transcript's assistant message starts with the reasoning parts
    (signature and data unmodified), and the next model call is sent them back in that message."""
    calls: list[str] = []

    @tool
    def lookup(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return f"{city}: sunny"

    model = ScriptedModel([
        _scripted_reply([("thinking", THOUGHT, SIG), ("redacted_thinking", REDACTED)], "Checking.",
                        [("t1", "lookup", {"city": "Oslo"})]),
        reply("Sunny in Oslo.", thinking=[thinking("done", SIG)]),
    ])
    agent = Agent("w", "", model, tools=[lookup], retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c", "weather?")
        msgs = await rt.transcript("c")
    assert out.ok and out.result == "Sunny in Oslo." and calls == ["Oslo"]
    want = [{"type": "thinking", "thinking": THOUGHT, "signature": SIG}, {"type": "redacted_thinking", "data": REDACTED}]
    assert msgs[1]["content"][:2] == want and msgs[1]["content"][2] == {"type": "text", "text": "Checking."}
    assert msgs[3]["content"][0] == {"type": "thinking", "thinking": "done", "signature": SIG}
    sent = model.calls[1]["messages"][1]
    assert sent["role"] == "assistant" and sent["content"][:2] == want


async def test_a_stream_broken_mid_reasoning_is_a_broken_stream():
    """Reasoning is output: a break after it is never retried as if nothing was seen."""
    model = ScriptedModel([BreakAfter(reply("x", thinking=[thinking(THOUGHT, SIG)]), after=2)])
    with pytest.raises(StreamBrokenError):
        await _events(model)


async def test_scripted_replies_stop_at_max_tokens_like_a_provider():
    """A call's max_tokens is honoured (a ceiling the loop enforces by lowering it must hold):
    the reply is cut in stream order, stops max_tokens and reports at most that many tokens."""
    r = reply("a" * 40, tool_call("lookup", {"city": "Oslo"}), thinking=[thinking("t" * 40, SIG)])
    full = [ev async for ev in ScriptedModel([r]).stream(system="", messages=[], tools=())]
    assert full[-1].usage.output_tokens == 10 + 10 + 8 and full[-1].stop_reason == "tool_use"
    # cap -> (reasoning text, its signature sent, answer text, the tool call's arguments text or None)
    for cap, reasoning, has_sig, text, args in [(25, "t" * 40, True, "a" * 40, '{"city": "'),
                                                (21, "t" * 40, True, "a" * 40, '{"'),
                                                (15, "t" * 40, True, "a" * 20, None),
                                                (4, "t" * 16, False, "", None)]:
        evs = [ev async for ev in ScriptedModel([r]).stream(system="", messages=[], tools=(), max_tokens=cap)]
        fin = evs[-1]
        assert fin.stop_reason == STOP_MAX_TOKENS and fin.usage.output_tokens <= cap
        assert "".join(e.text for e in evs if isinstance(e, ThinkingDelta)) == reasoning
        assert any(isinstance(e, ThinkingSignature) for e in evs) == has_sig
        assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == text
        started = [e for e in evs if isinstance(e, ToolCallStart)]
        assert (args is None) == (not started)  # a call cut part-way is started, its JSON unfinished
        if args is not None:
            assert "".join(e.arguments for e in evs if isinstance(e, ToolCallDelta)) == args
    fits = [ev async for ev in ScriptedModel([r]).stream(system="", messages=[], tools=(), max_tokens=28)]
    assert fits[-1].stop_reason == "tool_use"  # exactly fits: nothing cut


def test_the_thinking_scenario_streams_reasoning_across_writes():
    """The ``thinking`` scenario's reasoning answer outlasts the loop's flush interval, so its parts
    are journaled mid-stream: exhaustive mode crashes between the first reasoning part and the
    persisted message, and between the tool call and its result."""
    from sim import run_once
    from sim.scenarios import SCENARIOS

    box: dict[str, Any] = {}

    class Probe(SCENARIOS["thinking"]):  # type: ignore[misc,valid-type]
        async def check(self, checker):
            await super().check(checker)
            rt = Runtime(checker.db)
            box["events"] = [e.type for e in (await rt.read_events("c1", None, limit=1000)).events]
            box["msgs"] = await rt.transcript("c1")

    r = run_once(Probe, 1)
    assert r.ok, r.violations
    ev = box["events"]
    first_message = ev.index("message.added", ev.index("run.started"))
    assert ev[first_message + 1] == "part.added"  # reasoning journaled before the answer was persisted
    assert [m["role"] for m in box["msgs"]] == ["user", "assistant", "tool", "assistant"]
    assert [p["type"] for p in box["msgs"][1]["content"]] == ["thinking", "redacted_thinking", "text", "tool_call"]


async def test_the_echo_model_stops_at_max_tokens_too():
    from loop.providers import EchoModel

    msgs = [{"role": "user", "content": [{"type": "text", "text": "x" * 100}]}]
    full = [ev async for ev in EchoModel().stream(system="", messages=msgs, tools=())]
    cut = [ev async for ev in EchoModel().stream(system="", messages=msgs, tools=(), max_tokens=5)]
    assert full[-1].usage.output_tokens > 5 and full[-1].stop_reason == "end_turn"
    assert cut[-1].usage.output_tokens <= 5 and cut[-1].stop_reason == STOP_MAX_TOKENS
    assert "".join(e.text for e in cut if isinstance(e, TextDelta)) == "You said: " + "x" * 10


def test_the_interleaved_scenario_streams_persists_and_passes_back_reasoning_in_place():
    """``thinking-interleaved``: three model calls of one tool loop interleave reasoning with text
    and tool calls; the transcript holds every part where it streamed, the journal numbers the parts
    in stream order while the answer is still streaming (a write to crash at between reasoning
    parts), every call of the loop is sent the loop's earlier reasoning in place, and the next
    turn's call is sent the finished turn's (an earlier turn's) unmodified."""
    from sim import run_once
    from sim.scenarios import SCENARIOS, ithink_layout, layout_parts, part_shape

    box: dict[str, Any] = {}

    class Probe(SCENARIOS["thinking-interleaved"]):  # type: ignore[misc,valid-type]
        async def check(self, checker):
            await super().check(checker)
            rt = Runtime(checker.db)
            box["events"] = [(e.type, e.data) for e in (await rt.read_events("c1", None, limit=1000)).events]
            box["msgs"] = await rt.transcript("c1")
            box["think_calls"] = self._agents["sim-think"].model.calls
            box["plain_calls"] = self._agents["sim"].model.calls

    r = run_once(Probe, 1)
    assert r.ok, r.violations
    msgs = box["msgs"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant",
                                         "user", "assistant"]
    steps = [layout_parts(ithink_layout("ithink s1", k)) for k in range(3)]
    assert [[part_shape(p) for p in msgs[i]["content"]] for i in (1, 4, 6)] == steps
    assert [p["type"] for p in msgs[1]["content"]] == ["thinking", "text", "thinking", "tool_call", "redacted_thinking",
                                                       "thinking", "tool_call"]
    # journaled as numbered parts, in stream order, before the message was persisted
    ev = box["events"]
    first_message = next(i for i, (t, d) in enumerate(ev) if t == "message.added" and i > 3)
    call1 = [(d["part"], d["kind"]) for t, d in ev[:first_message] if t == "part.added" and d["call"] == 1]
    assert call1 == [(0, "thinking"), (1, "text"), (2, "thinking"), (3, "tool_call"), (4, "redacted_thinking"),
                     (5, "thinking"), (6, "tool_call")]
    # every call of the loop was sent the loop's earlier steps as persisted
    third = box["think_calls"][2]["messages"]
    assert [m["content"] for m in third if m["role"] == "assistant"] == [msgs[1]["content"], msgs[4]["content"]]
    # the next turn's call carries the earlier turn's reasoning, unmodified and in place
    (plain,) = box["plain_calls"]
    assert [m["content"] for m in plain["messages"] if m["role"] == "assistant"] == [msgs[i]["content"] for i in (1, 4, 6)]
