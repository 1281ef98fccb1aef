"""The benchmark's turn shape as an agent: one no-op tool call, then a final answer.

Shared by the tests that pin what such a turn stores and costs (tests/bench/bench_turns.py
runs the same shape for speed)."""

from __future__ import annotations

from loop import Agent, ScriptedModel, tool
from loop.providers import reply, tool_call


def noop_tool_agent(name: str) -> Agent:
    """An agent whose model calls ``noop`` once, then answers "done"."""

    @tool
    async def noop() -> str:
        """Does nothing."""
        return "ok"

    def script(messages, tools):
        return "done" if messages[-1]["role"] == "tool" else reply("", tool_call("noop"))

    return Agent(name, f"{name.capitalize()} agent.", ScriptedModel(script), tools=[noop])
