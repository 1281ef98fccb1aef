"""A `surefoot serve` process with a tool-using agent, for the kill-and-restart tests.

    python serve_child.py DATA_DIR PORT EFFECTS_FILE

The agent's scripted model calls the ``tick`` tool a few times per turn; each
execution appends its call's idempotency key to EFFECTS_FILE (flushed and
fsynced) *before* sleeping, so a SIGKILL mid-tool leaves the effect recorded
without a result: exactly the case that must not run the tool again.

Options from the environment (each unset = the behaviour above, which
test_server_process relies on):

* ``SUREFOOT_TEST_TICK_SECONDS`` — how long a tick sleeps (0.15).
* ``SUREFOOT_TEST_TICKS`` — tool calls per turn (4).
* ``SUREFOOT_TEST_LEASE_SECONDS`` — the runs' lease (the runtime's 10 s): after a SIGKILL
  nothing resumes until the dead process's leases lapse, so the chaos soak (chaos.py), which
  kills many times, shortens it.
* ``SUREFOOT_TEST_SEGMENT_BYTES`` — the write-ahead log's segment size (8 MiB): small, the
  checkpointer process empties sealed segments into LMDB every few seconds, so kills land
  around its passes too.
* ``SUREFOOT_TEST_EFFECTS_DETAIL=1`` — each effect line is ``KEY CALL_ID RUN_ID CONVERSATION``
  (space-separated) instead of the key alone, so a checker can find the call's result.
"""

from __future__ import annotations

import logging
import os
import sys

import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loop import Agent, ScriptedModel, ToolContext  # noqa: E402
from loop.providers.scripted import reply, tool_call  # noqa: E402
from server.auth import AuthConfig, Authenticator  # noqa: E402
from server.serve import serve_store  # noqa: E402

TICKS = int(os.environ.get("SUREFOOT_TEST_TICKS", "4"))
TICK_SECONDS = float(os.environ.get("SUREFOOT_TEST_TICK_SECONDS", "0.15"))
LEASE_SECONDS = os.environ.get("SUREFOOT_TEST_LEASE_SECONDS")
SEGMENT_BYTES = os.environ.get("SUREFOOT_TEST_SEGMENT_BYTES")
EFFECTS_DETAIL = os.environ.get("SUREFOOT_TEST_EFFECTS_DETAIL") == "1"
assert TICKS >= 1 and TICK_SECONDS >= 0


def main() -> int:
    data, port, effects = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.WARNING)
    if SEGMENT_BYTES:
        # kv.open constructs the store with the default segment size (a keyword-only default).
        import kv.lmdb_engine

        kv.lmdb_engine.LmdbStore.__init__.__kwdefaults__["segment_bytes"] = int(SEGMENT_BYTES)

    def script(messages, tools):
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        done = sum(1 for m in messages[last_user:] if m.get("role") == "tool")
        if done >= TICKS:
            return "done"
        return reply(f"tick {done}", tool_call("tick", {"i": done}))

    async def tick(i: int, ctx: ToolContext) -> str:
        """Record the effect, then take a while (the kill lands here)."""
        line = ctx.idempotency_key
        if EFFECTS_DETAIL:
            line = f"{line} {ctx.call_id} {ctx.run_id} {ctx.conversation}"
        with open(effects, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        await trio.sleep(TICK_SECONDS)
        return f"ok {i}"

    agent = Agent("default", "tick", ScriptedModel(script), tools=[tick])
    auth = Authenticator(AuthConfig(mode="token", token=os.environ["SUREFOOT_TOKEN"]))
    return trio.run(lambda: serve_store(f"lmdb:{data}", authenticator=auth, agent=agent, workers=4,
                                        host="127.0.0.1", port=port,
                                        lease_seconds=float(LEASE_SECONDS) if LEASE_SECONDS else None))


if __name__ == "__main__":
    sys.exit(main())
