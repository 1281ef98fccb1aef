"""``Runtime.run``'s own path (submit + claim + first writes in one commit, driven in the
submitting process) under the simulator: crashed before and after every write, then
recovered and checked against every invariant the built-in scenarios check.

The built-in scenarios submit with ``rt.submit`` (the claim loops run their turns); these
variants make their clients call ``rt.run`` instead, retrying it with the same submission id
on another process when the one they called died under them.
"""

from __future__ import annotations

from typing import Any

import pytest

from sim.harness import exhaustive, run_once, random_plan
from sim.scenarios import MultiToolTurn, PlainTurn, ToolTurn, Turn


pytestmark = pytest.mark.usefixtures("quiet_runtime_logs")  # tests/conftest.py


class _ViaRun:
    """Mixin: a turn's client calls ``rt.run`` and waits there for the outcome."""

    # A client waiting in rt.run records no ClientState (sim.scenarios) to resume it from: crash
    # runs of these scenarios start from the beginning, never from a snapshot of the world.
    resumable = False

    async def run_turn(self, turn: Turn, key: str = "") -> None:  # type: ignore[override]
        import trio

        if turn.delay:
            await trio.sleep(turn.delay)

        async def go(app: Any) -> Any:
            return await app.rt.run(app.agents[self.agent_name(turn)], turn.conversation, turn.text,  # type: ignore[attr-defined]
                                    submission_id=turn.submission_id, limits=turn.limits)

        out = await self.call(go)  # type: ignore[attr-defined]
        self.acks.setdefault(turn.submission_id, set()).add(out.run_id)  # type: ignore[attr-defined]
        self.run_of[turn.submission_id] = out.run_id  # type: ignore[attr-defined]
        self.world.trace.add("outcome", turn.submission_id, out.run_id, out.status)  # type: ignore[attr-defined]


class RunPlain(_ViaRun, PlainTurn):
    name = "run-plain"


class RunTool(_ViaRun, ToolTurn):
    name = "run-tool"
    processes = ("p1", "p2")


class RunMultiTool(_ViaRun, MultiToolTurn):
    name = "run-multi-tool"


class RunTwoInOneConversation(_ViaRun, ToolTurn):
    """Two clients of one conversation: the second queues behind the first (claim loops)."""

    name = "run-two"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "tool", "s1"), Turn("c1", "plain", "s2", delay=0.001)]


def _failures(results):
    return [(r.plan.crash_at, r.plan.crash_when, [str(v) for v in r.violations[:2]]) for r in results if not r.ok]


@pytest.mark.parametrize("scenario", [RunPlain, RunTool, RunMultiTool, RunTwoInOneConversation])
def test_run_keeps_every_promise_crashed_at_every_write(scenario):
    results = list(exhaustive(scenario, 7))
    base = results[0]
    assert base.ok, [str(v) for v in base.violations]
    assert base.writes > 0 and len(results) == 1 + 2 * base.writes  # every write was a crash point
    assert base.checks > 5
    assert not _failures(results)


def test_run_keeps_every_promise_under_random_faults():
    results = [run_once(sc, seed, random_plan(seed))
               for seed in range(20) for sc in (RunTool, RunMultiTool, RunTwoInOneConversation)]
    assert sum(r.crashes for r in results) > 0
    assert not [(r.scenario, r.seed, [str(v) for v in r.violations[:2]]) for r in results if not r.ok]
