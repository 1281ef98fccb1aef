"""A child process for the crash tests: runs the embedded runtime on a data directory.

    python loop_crash_child.py SCENARIO PHASE DATA_DIR EFFECTS_FILE

SCENARIO: tool | stream | backoff | approval.  PHASE: ``first`` submits the run
and prints marker lines (JSON) as it goes, so the parent can SIGKILL it at the
right moment; ``resume`` opens the same directory, resubmits the same
submission id (which finds the run), approves if needed, waits for the outcome
and prints one JSON line with the outcome, transcript and journal.

The tool's external effect is a line appended (and fsynced) to EFFECTS_FILE
before the tool returns, carrying its call id: the parent counts executions.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root

from loop import Agent, RetryPolicy, Runtime, ScriptedModel, ToolContext, tool  # noqa: E402
from loop.providers import reply, tool_call, transient  # noqa: E402

SUBMISSION = "crash-test-submission"
CONV = "crash-conv"
LEASE_SECONDS = 1.0


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    scenario, phase, data, effects = sys.argv[1:5]
    model_calls_file = effects + ".model-calls"

    async def record_effect(ctx: ToolContext, what: str) -> None:
        with open(effects, "a") as f:
            f.write(json.dumps({"call_id": ctx.call_id, "key": ctx.idempotency_key, "what": what, "pid": os.getpid()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @tool(requires_approval=(scenario == "approval"))
    async def effect(what: str, ctx: ToolContext) -> str:
        """Do something with an external effect."""
        await record_effect(ctx, what)
        if scenario == "tool" and phase == "first":
            emit({"marker": "effect-done", "call_id": ctx.call_id})
            await trio.sleep_forever()  # killed here: after the effect, before the result
        return f"did {what}"

    def script(messages, tools):
        with open(model_calls_file, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "phase": phase}) + "\n")
        if scenario == "backoff" and phase == "first":
            # Long enough that a parent slowed by a loaded machine still kills
            # this process inside the wait (at 2 s one run in a loaded suite
            # made its second call first); the resume waits out what is left.
            return transient("overloaded", retry_after=4.0)
        if messages[-1]["role"] == "tool":
            return "final answer"
        text = "Let me think about this carefully. " * (20 if scenario == "stream" else 1)
        return reply(text, tool_call("effect", {"what": "charge-card"}))

    delay = 0.05 if (scenario == "stream" and phase == "first") else 0.0
    model = ScriptedModel(script, delay=delay, chunk=8)
    agent = Agent("crashy", "Test agent.", model, tools=[effect], retry=RetryPolicy(jitter=0))

    async def run() -> None:
        async with Runtime.open(f"lmdb:{data}", lease_seconds=LEASE_SECONDS, agents=[agent]) as rt:
            ack = await rt.submit(agent, CONV, "please do it", submission_id=SUBMISSION)
            if phase == "first":
                emit({"marker": "submitted", "run_id": ack.run_id})
                async for ev in rt.events(CONV):
                    d = ev.data or {}
                    if scenario == "stream" and ev.type == "part.updated":
                        emit({"marker": "streaming", "cursor": ev.cursor})
                    if scenario == "backoff" and ev.type == "run.retry-pending":
                        emit({"marker": "backoff", "next": d.get("nextAttemptAt")})
                    if scenario == "approval" and ev.type == "approval.requested":
                        emit({"marker": "parked", "call_id": d.get("call_id")})
                await trio.sleep_forever()
            if scenario == "approval":
                info = await rt.get_run(ack.run_id)
                while not info.pending_approvals:
                    await trio.sleep(0.05)
                    info = await rt.get_run(ack.run_id)
                for cid in info.pending_approvals:
                    await rt.approve(ack.run_id, cid, True, "ok after restart")
            outcome = await rt.wait(ack)
            page = await rt.read_events(CONV, limit=10_000)
            emit({
                "outcome": {"status": outcome.status, "result": outcome.result, "error": outcome.error},
                "run": (await rt.get_run(ack.run_id)).attempt,
                "transcript": await rt.transcript(CONV),
                "journal": [{"type": e.type, "data": e.data} for e in page.events],
            })

    trio.run(run)


if __name__ == "__main__":
    main()
