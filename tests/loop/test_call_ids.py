"""Tool-call ids stay unique within a run's transcript when a provider repeats them (local
OpenAI-compatible servers number calls per response): the runner renames a repeated id, and
its index of the ids in memory (Runner._call_ids_in_memory) is kept incrementally, step by step."""

from __future__ import annotations

from loop import Agent, Runtime, ScriptedModel, tool
from loop.providers import reply, tool_call


async def test_ids_repeated_by_the_provider_are_renamed_uniquely_step_after_step():
    effects: list[str] = []

    @tool
    async def note(text: str) -> str:
        """Notes a text."""
        effects.append(text)
        return "noted " + text

    def script(messages, tools):
        steps = sum(1 for m in messages if m["role"] == "assistant")
        if steps == 4:
            return "done"
        # the same two ids every step, and twice within one message
        return reply("", tool_call("note", {"text": f"s{steps}a"}, id="call_x"),
                     tool_call("note", {"text": f"s{steps}b"}, id="call_x"))

    agent = Agent("ids", "Ids agent.", ScriptedModel(script), tools=[note])
    async with Runtime.open("memory:") as rt:
        out = await rt.run(agent, "c1", "go")
        assert out.ok and out.result == "done"
        msgs = await rt.transcript("c1")
    calls = [p for m in msgs if m["role"] == "assistant" for p in m["content"] if p["type"] == "tool_call"]
    results = [p for m in msgs if m["role"] == "tool" for p in m["content"] if p["type"] == "tool_result"]
    ids = [c["id"] for c in calls]
    assert len(ids) == 8 and len(set(ids)) == 8 and ids[0] == "call_x"
    # every call answered by its own result, in order, each tool run once
    assert [r["call_id"] for r in results] == ids
    assert [r["content"] for r in results] == ["noted " + c["arguments"]["text"] for c in calls]
    assert effects == [c["arguments"]["text"] for c in calls]
