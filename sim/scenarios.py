"""The built-in scenarios: the real embedded Runtime (loop -> ledger, sessions -> kv) in the world.

Each process of a scenario is a :class:`loop.Runtime` opened on its own
database handle over the shared memory engine, with a scripted model and
scripted async tools whose external effects are counted by the world
(outside every process).  Simulated clients submit under idempotency keys
and resubmit with the same key after a lost acknowledgement, follow
journals from cursors (resuming after a crash), cancel, approve and fork.
After the clients are done, faults stop, recovery runs to quiescence (every
acknowledged run settled), and :mod:`sim.invariants` checks the promises.

The model script is keyed on the conversation's content (the turn's user
text says what to do: ``tool``, ``multi``, ``retry``...), never on a call
counter inside a process, so a restarted process replays the same script.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import trio

from loop import Agent, Clock, RetryPolicy, Runtime, ScriptedModel, ToolContext, tool
from loop import messages as M
from loop.pricing import Price
from loop.providers import BreakAfter, broken, overflow, permanent, reply, tool_call, transient
from loop.providers import anthropic as anthropic_wire  # (looked up per call: a patched runtime is seen)
from loop.providers.scripted import RedactedBlock, ThinkingBlock, redacted_thinking, thinking

from .harness import Checker, ClientState, Scenario
from .world import SIM_EPOCH, Process, ProcessDied, World

log = logging.getLogger(__name__)

__all__ = ["RuntimeScenario", "SCENARIOS", "Turn", "ClientState"]

# Lease length in the simulation (virtual seconds): short, so a crashed worker's run is re-claimed soon.
SIM_LEASE_SECONDS = 1.0
SIM_MAX_ATTEMPTS = 10
# Clients poll run state this often while waiting for quiescence (virtual seconds).
QUIESCE_POLL_SECONDS = 1.0
# Faults fire while the runs execute, for at most this long (virtual seconds); then recovery runs fault-free.
CHAOS_SECONDS = 60.0
# How long the stale-worker fault cuts a process off from the store (well past a lease).
CLOG_SECONDS = SIM_LEASE_SECONDS * 2.5
# stale-write-first: how much longer the stale worker's lease keeper is held after it is let go
# (the new owner is held 0.05 s: _unclog_on_takeover), and the keeper's task name (loop.runner)
KEEPER_LAG = 0.1
KEEPER_TASK = "loop.runner.LeaseKeeper.run"
SETTLED = ("completed", "failed", "cancelled")
_REASONING_TYPES = ("thinking", "redacted_thinking")

# The scripted model's price in priced scenarios (micro-units per million tokens: $3 in, $15 out),
# under the key ``Runtime(pricing=...)`` looks a ScriptedModel up by (its name).
SIM_PRICE = Price(input_tokens=3_000_000, output_tokens=15_000_000)
SIM_PRICING = {"scripted": SIM_PRICE}
# The priced agent's max_tokens: the loop reserves a call's output at max_tokens (no output is
# reserved without one), so a cost ceiling is a promise only when every answer fits in it. The
# scripted answers of priced turns are at most ~20 output tokens (a line of text and a tool call).
SIM_MAX_TOKENS = 64
# Seconds between the events of a reasoning answer's stream (the thinking agent): its stream
# outlasts the loop's FLUSH_INTERVAL, so parts are journaled mid-stream (a write to crash at
# between the first reasoning delta and the persisted message).
SIM_THINK_EVENT_SECONDS = 0.02

assert CLOG_SECONDS > SIM_LEASE_SECONDS and KEEPER_LAG > 0.05 and SIM_MAX_TOKENS > 0 and SIM_THINK_EVENT_SECONDS > 0


# The simulated process whose task is running (set at boot; trio tasks inherit it).
CURRENT_PROCESS: contextvars.ContextVar[Process] = contextvars.ContextVar("sim_process")


# The scenario of the run (set at boot, next to CURRENT_PROCESS): the shared agents' script and tools use it.
CURRENT_SCENARIO: contextvars.ContextVar["RuntimeScenario"] = contextvars.ContextVar("sim_scenario")

_TOOLS: list[Any] | None = None


def _shared_tools() -> list[Any]:
    """The simulation's tools, built on first use and shared by every run (deriving a tool's schema
    is not free); each finds its run's scenario and process through the context variables."""
    global _TOOLS
    if _TOOLS is not None:
        return _TOOLS

    @tool
    async def effect(n: int, ctx: ToolContext) -> str:
        """An external side effect (counted by the world)."""
        return await CURRENT_SCENARIO.get().do_effect(ctx, f"effect {n}")

    @tool(requires_approval=True)
    async def guarded(n: int, ctx: ToolContext) -> str:
        """An effect that needs a human's approval."""
        return await CURRENT_SCENARIO.get().do_effect(ctx, f"guarded {n}")

    @tool
    async def brief(n: int, ctx: ToolContext) -> str:
        """A short tool (its worker is cut off from the store right after the effect)."""
        out = await CURRENT_SCENARIO.get().do_effect(ctx, f"brief {n}")
        await trio.sleep(0.3)
        return out

    @tool
    async def cutoff(n: int, ctx: ToolContext) -> str:
        """An effect after which the worker loses the store for longer than its lease."""
        out = await CURRENT_SCENARIO.get().do_effect(ctx, f"cutoff {n}")
        CURRENT_PROCESS.get().clog(SIM_LEASE_SECONDS * 3)
        return out

    @tool
    async def slow(n: int, ctx: ToolContext) -> str:
        """A long tool that stops early when the run is cancelled."""
        out = await CURRENT_SCENARIO.get().do_effect(ctx, f"slow {n}")
        for _ in range(20):
            if ctx.cancelled:
                return "stopped early " + out
            await trio.sleep(0.1)
        return out

    _TOOLS = [effect, guarded, slow, brief, cutoff]
    return _TOOLS


def _script(messages: list, tools: list) -> Any:
    return CURRENT_SCENARIO.get().model_script(messages, tools)


def _sign(*parts: str) -> str:
    """The simulated provider's signature over a reasoning block (opaque to the loop, checkable here)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()


def think_reply_text(turn_text: str, step: int) -> str:
    """The answer text of step ``step`` (0: the tool call, 1: the final answer) of a ``think`` turn."""
    return f"{turn_text}: using a tool" if step == 0 else f"{turn_text}: thought it through"


def think_blocks(turn_text: str, step: int) -> tuple[ThinkingBlock | RedactedBlock, ...]:
    """The reasoning of step ``step`` of a ``think`` turn: a signed thinking block (several deltas
    long), and in the tool-calling step a redacted block after it — a function of the turn's text,
    so a model call replayed after a crash streams the same blocks."""
    text = f"reasoning about {turn_text!r} at step {step}: " + "why " * 12
    blocks: list[ThinkingBlock | RedactedBlock] = [thinking(text, "sig-" + _sign(text))]
    if step == 0:
        blocks.append(redacted_thinking("redacted-" + _sign("redacted", turn_text, str(step))))
    return tuple(blocks)


def reasoning_parts(blocks: tuple[ThinkingBlock | RedactedBlock, ...]) -> list[dict[str, Any]]:
    """The parts the loop persists for ``blocks`` (loop.providers.base.ResponseBuilder's shape)."""
    return [{"type": "thinking", "thinking": b.text, "signature": b.signature} if isinstance(b, ThinkingBlock)
            else {"type": "redacted_thinking", "data": b.data} for b in blocks]


# An interleaved reasoning answer, in stream order: reasoning blocks, ("text", str) and
# ("call", tool name, arguments).
Layout = tuple[Any, ...]

# The answer texts of the steps of an ``ithink`` turn (each step's text names it: a persisted or
# sent-back assistant turn is matched to its step by it).
ITHINK_TEXTS = ("planning two lookups", "one more lookup", "all looked up")


def ithink_layout(turn_text: str, step: int) -> Layout:
    """Step ``step`` of an ``ithink`` turn (a model thinking between tool calls, as Claude 4 does
    with interleaved thinking), in stream order — a function of the turn's text, so a model call
    replayed after a crash streams the same blocks:

    0. thinking, text, thinking, tool_use(effect 1), redacted_thinking, thinking, tool_use(effect 2)
    1. (after both results) redacted_thinking, thinking, text, thinking, tool_use(effect 3)
    2. (after the third result) thinking, text: the answer.
    """
    def th(tag: str) -> ThinkingBlock:
        text = f"{turn_text} step {step} {tag}: " + "hmm " * 6
        return thinking(text, "sig-" + _sign(text))

    def red(tag: str) -> RedactedBlock:
        return redacted_thinking("redacted-" + _sign("redacted", turn_text, str(step), tag))

    text = ("text", f"{turn_text}: {ITHINK_TEXTS[step]}")
    if step == 0:
        return (th("a"), text, th("b"), ("call", "effect", {"n": 1}), red("c"), th("d"), ("call", "effect", {"n": 2}))
    if step == 1:
        return (red("a"), th("b"), text, th("c"), ("call", "effect", {"n": 3}))
    return (th("a"), text)


def think_layout(turn_text: str, step: int) -> Layout:
    """Step ``step`` of a ``think`` turn (reasoning first, then the answer), in stream order."""
    answer: tuple[Any, ...] = (("text", think_reply_text(turn_text, step)),)
    if step == 0:
        answer += (("call", "effect", {"n": 1}),)
    return think_blocks(turn_text, step) + answer


def reply_of(layout: Layout) -> Any:
    """The scripted reply that streams ``layout``: the reasoning before the first answer block as
    ``thinking``, every later block ``interleaved`` at its place among the text and tool calls."""
    text, calls, lead, among = "", [], [], []
    answers = 0
    for b in layout:
        if isinstance(b, (ThinkingBlock, RedactedBlock)):
            (among.append((answers, b)) if answers else lead.append(b))
        elif b[0] == "text":
            assert answers == 0, "the text comes before the tool calls"
            text, answers = b[1], answers + 1
        else:
            calls.append(tool_call(b[1], b[2]))
            answers += 1
    return reply(text, *calls, thinking=lead, interleaved=among)


def layout_parts(layout: Layout) -> list[dict[str, Any]]:
    """The shape of the assistant message the loop persists for ``layout`` (tool calls without
    their ids, which the loop may rename): see :func:`part_shape`."""
    out: list[dict[str, Any]] = []
    for b in layout:
        if isinstance(b, (ThinkingBlock, RedactedBlock)):
            out.extend(reasoning_parts((b,)))
        elif b[0] == "text":
            out.append({"type": "text", "text": b[1]})
        else:
            out.append({"type": "tool_call", "name": b[1], "arguments": b[2]})
    return out


def part_shape(p: dict[str, Any]) -> dict[str, Any]:
    """A persisted part, or an Anthropic wire block, as :func:`layout_parts` shapes it: reasoning
    whole (text, signature, data), text, a tool call by name and arguments."""
    t = p.get("type")
    if t == "tool_call":
        return {"type": "tool_call", "name": p.get("name"), "arguments": p.get("arguments")}
    if t == "tool_use":
        return {"type": "tool_call", "name": p.get("name"), "arguments": p.get("input")}
    return p


class SimClock(Clock):
    """The runtime's wall clock on the world's virtual time."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world

    def now(self) -> float:
        return SIM_EPOCH + self.world.clock._now  # (world.wall() inlined: ~30 calls a run)


@dataclass
class Turn:
    """One client submission: a conversation, what the model should do, and follow-up actions."""

    conversation: str
    mode: str
    submission_id: str
    delay: float = 0.0  # client think time before submitting (virtual seconds)
    cancel_after: float | None = None
    approve: bool | None = None  # approve (True) / deny (False) once parked
    resubmit: bool = False  # submit the same id again after the ack (a duplicate)
    conflict: bool = False  # then submit the same id with a different request
    expect_error: str | None = None  # the run must settle failed with this error type
    limits: dict[str, int] | None = None  # usage ceilings (max_total_tokens, max_cost_micros)

    @property
    def text(self) -> str:
        return f"{self.mode} {self.submission_id}"


@dataclass
class App:
    """What a client talks to: one process's runtime and its agents."""

    rt: Runtime
    agents: dict[str, Agent]
    proc: Process


class RuntimeScenario(Scenario):
    """A scenario over real Runtimes; subclasses list their turns (and maybe processes and faults)."""

    name = "runtime"
    processes: tuple[str, ...] = ("p1",)
    follow = True  # a journal follower per conversation (replay == live, no gap)
    clog: bool = False  # cut the worker driving a slow tool off from the store (stale worker)
    # ... and when it is let go at the takeover, its lease keeper's requests wait this much longer
    # (stale-write-first): its pending write goes first, whatever the schedule
    keeper_lag = 0.0
    max_attempts = SIM_MAX_ATTEMPTS
    journal_retention: int | None = None  # None: the runtime's default
    follower_pause = 0.0  # a slow reader (virtual seconds per event) falls behind retention
    pricing: dict[str, Price] | None = None  # the runtimes' pricing (SIM_PRICING: the scripted model priced)

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.turns = self.make_turns()
        self.acks: dict[str, set[str]] = {}  # submission id -> run ids it was acknowledged with
        self.run_of: dict[str, str] = {}  # submission id -> run id
        self.cancel_acked: dict[str, str] = {}  # run id -> run status when a cancel was acknowledged
        self.conflicts: dict[str, int] = {}  # submission id -> conflicting submits refused
        self.conflict_accepted: dict[str, str] = {}
        self.followed: dict[str, list[tuple[str, str]]] = {}  # conversation -> (cursor, type) seen live
        self.forks: list[tuple[str, str, int]] = []
        self.model_calls: dict[Any, int] = {}
        self.tools_called: dict[str, int] = {}
        self._clog_done = False
        self._agents: dict[str, Agent] | None = None
        self._settled = False  # every acknowledged run was seen settled (runs never unsettle)
        self.behind: dict[str, int] = {}  # conversation -> times its follower was told it fell behind
        # What the scripted "API" refused as Anthropic would (400): a request whose reasoning was not
        # passed back unmodified where it streamed (_check_reasoning_sent).
        self.thinking_refused: list[str] = []
        # The scenario's reasoning steps (answer text -> (turn text, persisted shape)); None when it
        # has no reasoning turns (then the scripted "API" checks nothing).
        self._reasoning_steps: dict[str, tuple[str, list[dict[str, Any]]]] | None = None
        if any(self.step_layouts(t) for t in self.turns):
            self.reasoning_steps()

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "plain", "s1")]

    @property
    def resumable(self) -> bool:
        """Whether a crash run can start from a snapshot at its crash point (sim.resume): with one
        process, everything that survives a crash is outside it (a second process would live on
        through the crash with in-memory state no snapshot holds)."""
        return len(self.processes) == 1 and not self.clog

    def resumed(self) -> None:
        self._agents = None  # the next incarnation makes its own (a new process)

    @property
    def conversations(self) -> list[str]:
        convs = sorted({t.conversation for t in self.turns})
        return convs + [f for _, f, _ in self.forks if f not in convs]

    # ------------------------------------------------------------------ the process

    def model_script(self, messages: list, tools: list) -> Any:
        """What the scripted model answers (keyed on the conversation's content, never on a counter)."""
        world, calls = self.world, self.model_calls
        if messages and "Summarise this conversation" in M.text_of(messages[-1]):
            return "summary of the earlier turns"
        i = max((j for j, m in enumerate(messages) if m.get("role") == "user"), default=0)
        text = M.text_of(messages[i]) if messages else ""
        mode = text.split(" ", 1)[0]
        after = messages[i + 1 :]
        results = sum(1 for m in after if m.get("role") == "tool"
                      for p in m.get("content", ()) if p.get("type") == "tool_result")
        key = (text, len(messages))
        calls[key] = calls.get(key, 0) + 1
        b = world.buggify
        if b("provider.transient"):
            world.fault("provider.transient")
            return transient("overloaded", retry_after=world.rng.choice([None, 0.5, 3.0]))
        if b("provider.overflow", 0.1):
            world.fault("provider.overflow")
            return overflow()
        if b("provider.permanent", 0.05):
            world.fault("provider.permanent")
            return permanent("invalid request")
        if b("provider.broken", 0.1):
            world.fault("provider.broken")
            return broken("a partial answer that breaks", after=1)
        if self._reasoning_steps is not None:  # a scenario with reasoning turns: the "API" checks the request
            refused = self._check_reasoning_sent(text, messages)
            if refused is not None:
                return refused
        if mode == "think":
            return self._think_script(text, messages, results)
        if mode == "ithink":
            return self._ithink_script(text, results)
        if mode == "retry" and calls[key] <= 2:
            return transient("overloaded", retry_after=1.0 if calls[key] == 1 else None)
        if mode in ("tool", "approve", "cancel", "stale"):
            name = {"tool": "effect", "approve": "guarded", "cancel": "slow", "stale": "brief"}[mode]
            return reply("using a tool", tool_call(name, {"n": 1})) if results == 0 else f"{mode} done"
        if mode == "exhaust":  # a tool every attempt, each cutting its worker off past the lease
            return reply("again", tool_call("cutoff", {"n": results + 1}))
        if mode == "spend":  # tools forever: only the usage ceiling stops it
            return reply("more " + "y" * 40, tool_call("effect", {"n": results + 1}))
        if mode == "multi":
            if results == 0:
                return reply("two tools", tool_call("effect", {"n": 1}), tool_call("effect", {"n": 2}))
            if results == 2:
                return reply("one more", tool_call("effect", {"n": 3}))
            return "multi done"
        if mode == "compact":
            return "a long answer " + "x" * 300
        return f"answer to {text}"

    def reasoning_steps(self) -> dict[str, tuple[str, list[dict[str, Any]]]]:
        """Every reasoning step of the scenario's turns: its answer text -> (the turn's text, the
        shape of the message it persists), built on first use."""
        if self._reasoning_steps is None:
            steps: dict[str, tuple[str, list[dict[str, Any]]]] = {}
            for t in self.turns:
                for layout in self.step_layouts(t):
                    text = "".join(b[1] for b in layout if isinstance(b, tuple) and b and b[0] == "text")
                    steps[text] = (t.text, layout_parts(layout))
            self._reasoning_steps = steps
        return self._reasoning_steps

    @staticmethod
    def step_layouts(turn: Turn) -> list[Layout]:
        """The reasoning steps of ``turn``, in order (none for a turn without reasoning)."""
        if turn.mode == "think":
            return [think_layout(turn.text, step) for step in (0, 1)]
        if turn.mode == "ithink":
            return [ithink_layout(turn.text, step) for step in range(len(ITHINK_TEXTS))]
        return []

    def _check_reasoning_sent(self, text: str, messages: list) -> Any:
        """The request as Anthropic's API with tools checks it (400 otherwise): every assistant turn
        of the tool-use loop under way (after the last user turn) carries its reasoning unmodified,
        exactly where it streamed among its text and tool_use blocks — first, or interleaved.  An
        earlier turn's reasoning may be left out (Anthropic's docs allow it) but, when sent, it too
        is unmodified and in place (newer models check a block sent back from an earlier turn by
        its signature and what precedes it: "preserved thinking").  Checked on the wire form
        (``to_anthropic_messages``, looked up on its module at each call); a refusal is recorded
        for ``thinking_passed_back``."""
        steps = self.reasoning_steps()
        wire = anthropic_wire.to_anthropic_messages(messages)
        last_user = max((i for i, t in enumerate(wire) if t["role"] == "user"
                         and any(b["type"] == "text" for b in t["content"])), default=-1)
        for i, turn in enumerate(wire):
            if turn["role"] != "assistant":
                continue
            said = "".join(b.get("text", "") for b in turn["content"] if b["type"] == "text")
            if said not in steps:
                continue
            sent = [part_shape(b) for b in turn["content"]]
            want = steps[said][1]
            if sent == want:
                continue
            if i < last_user and sent == [p for p in want if p["type"] not in _REASONING_TYPES]:
                continue  # an earlier turn's reasoning left out entirely: allowed
            where = "the tool-use loop under way" if i > last_user else "an earlier turn"
            self.thinking_refused.append(f"{text!r}: {where}'s assistant turn {said!r} was sent as "
                                         f"{[b['type'] for b in turn['content']]}, streamed as {[p['type'] for p in want]}")
            return permanent("messages: thinking blocks must be passed back unmodified, where they were")
        return None

    def _think_script(self, text: str, messages: list, results: int) -> Any:
        """A reasoning model: step 0 thinks, then calls a tool; step 1 thinks again and answers.
        (Like Anthropic's API with tools it refuses a request whose reasoning was not passed back
        unmodified where it streamed: :meth:`_check_reasoning_sent`.)"""
        step = 1 if results else 0
        r = reply_of(think_layout(text, step))
        if self.world.buggify("provider.broken.thinking", 0.1):  # the stream breaks mid-reasoning
            self.world.fault("provider.broken")
            return BreakAfter(r, after=2)
        return r

    def _ithink_script(self, text: str, results: int) -> Any:
        """A model thinking between tool calls (interleaved thinking): step 0 (two tool calls with
        reasoning between them), step 1 after both results (a third call), step 2 the answer —
        see :func:`ithink_layout`."""
        step = 0 if results < 2 else 1 if results < 3 else 2
        r = reply_of(ithink_layout(text, step))
        if self.world.buggify("provider.broken.thinking", 0.1):  # breaks mid-stream, past interleaved reasoning
            self.world.fault("provider.broken")
            return BreakAfter(r, after=self.world.rng.choice((2, 7, 11)))
        return r

    async def do_effect(self, ctx: ToolContext, what: str) -> str:
        """A tool's external side effect, counted by the world outside every process."""
        world = self.world
        proc = CURRENT_PROCESS.get()
        key = f"{ctx.run_id}/{ctx.call_id}"
        self.tools_called[key] = self.tools_called.get(key, 0) + 1
        await trio.sleep(world.rng.random() * 0.01)
        if world.buggify("tool.exception.before"):
            world.fault("tool.exception")
            raise RuntimeError("tool failed before its effect")
        world.effect(proc, key)
        if self.clog and what.startswith("brief") and not self._clog_done:
            self._clog_done = True
            proc.clog(CLOG_SECONDS)
            world.commit_listeners.append(self._unclog_on_takeover(proc, world.now()))
        await trio.sleep(world.rng.random() * 0.01)
        if world.buggify("tool.exception.after"):
            world.fault("tool.exception")
            raise RuntimeError("tool failed after its effect")
        return f"{what} ok [{key}]"

    def make_agents(self) -> dict[str, Agent]:
        """The scenario's agents, built once per run and shared by its processes, over tools built
        once per Python process; the script and the tools find the run's scenario and process
        through :data:`CURRENT_SCENARIO` and :data:`CURRENT_PROCESS`.  (Agents are per run: a
        RetryPolicy's jitter PRNG is seeded from the world's when it is made, and a ScriptedModel
        keeps every request it was sent.)"""
        tools = _shared_tools()
        agents = {
            "sim": Agent("sim", "You are simulated.", ScriptedModel(_script), tools=tools, retry=RetryPolicy()),
            "sim-compact": Agent("sim-compact", "You are simulated.", ScriptedModel(_script), tools=tools,
                                 retry=RetryPolicy(), compact_at_tokens=150, keep_recent=2),
        }
        # (Made only where used: each agent's RetryPolicy draws its seed from the world's PRNG, so an
        # extra agent would shift every other scenario's schedule.)
        if self.pricing:
            agents["sim-priced"] = Agent("sim-priced", "You are simulated.", ScriptedModel(_script), tools=tools,
                                         retry=RetryPolicy(), max_tokens=SIM_MAX_TOKENS)
        if any(t.mode in ("think", "ithink") for t in self.turns):
            agents["sim-think"] = Agent("sim-think", "You are simulated.",
                                        ScriptedModel(_script, delay=SIM_THINK_EVENT_SECONDS), tools=tools,
                                        retry=RetryPolicy())
        return agents

    def agent_name(self, turn: Turn) -> str:
        if turn.mode == "compact":
            return "sim-compact"
        if turn.mode in ("think", "ithink"):
            return "sim-think"
        return "sim-priced" if self.pricing else "sim"

    @asynccontextmanager
    async def boot(self, proc: Process) -> AsyncIterator[App]:
        if self._agents is None:
            self._agents = self.make_agents()
        agents = self._agents
        CURRENT_PROCESS.set(proc)  # inherited by every task the runtime starts
        CURRENT_SCENARIO.set(self)
        async with Runtime.open(
            db=proc.db, clock=SimClock(self.world), lease_seconds=SIM_LEASE_SECONDS,
            max_attempts=self.max_attempts, agents=list(agents.values()),
            journal_retention=self.journal_retention, pricing=self.pricing,
        ) as rt:
            yield App(rt, agents, proc)

    # ------------------------------------------------------------------ clients

    async def call(self, fn: Callable[[App], Any], proc: str | None = None, st: "ClientState | None" = None) -> Any:
        """A client call, retried on a process that died under it (the caller's code must be idempotent).

        With ``st``, the call is recorded as in flight until it returns: a client resumed from a
        snapshot taken meanwhile lost it to the crash, as a ProcessDied would tell it, and retries.
        """
        if st is not None:
            if st.in_call:  # resumed: the crash cut this call short
                self.world.trace.add("client.retry")
            st.in_call = True
        while True:
            name = proc or self.world.rng.choice(self.processes)
            try:
                result = await self.world.call(name, fn)
            except ProcessDied:
                self.world.trace.add("client.retry")
                continue
            except BaseException:
                if st is not None:
                    st.in_call = False
                raise
            if st is not None:
                st.in_call = False
            return result

    async def submit(self, turn: Turn, text: str | None = None, st: "ClientState | None" = None) -> Any:
        text = text or turn.text

        async def go(app: App) -> Any:
            return await app.rt.submit(app.agents[self.agent_name(turn)], turn.conversation, text,
                                       submission_id=turn.submission_id, limits=turn.limits)

        ack = await self.call(go, st=st)
        self.acks.setdefault(turn.submission_id, set()).add(ack.run_id)
        self.run_of[turn.submission_id] = ack.run_id
        self.world.trace.add("ack", turn.submission_id, ack.run_id, ack.duplicate)
        return ack

    async def run_turn(self, turn: Turn, key: str) -> None:
        """One turn's client, from wherever ``self.client(key)`` says it is (the start, at first)."""
        world = self.world
        st = self.client(key)
        if st.phase == "start":
            if turn.delay:
                await self._sleep(st, turn.delay)
            st.phase = "submit"
        if st.phase == "submit":
            ack = await self.submit(turn, st=st)
            st.run_id = ack.run_id
            st.phase = "resubmit"
        if st.phase == "resubmit":
            if turn.resubmit:
                await self.submit(turn, st=st)
            st.phase = "conflict"
        if st.phase == "conflict":
            if turn.conflict:
                try:
                    await self.submit(turn, text=turn.text + " (changed)", st=st)
                    self.conflict_accepted[turn.submission_id] = "accepted"
                except Exception as e:  # noqa: BLE001 - the ledger's SubmissionConflict is the expected refusal
                    if type(e).__name__ == "SubmissionConflict":
                        self.conflicts[turn.submission_id] = self.conflicts.get(turn.submission_id, 0) + 1
                    else:
                        raise
            st.phase = "cancel"
        run_id = st.run_id
        if st.phase == "cancel":
            if turn.cancel_after is not None:
                if not st.in_call:
                    await self._sleep(st, turn.cancel_after)
                info = await self.call(lambda app: app.rt.cancel(run_id), st=st)
                self.cancel_acked[run_id] = info.status
                world.trace.add("cancel", run_id, info.status)
            st.phase = "approve"
        if st.phase == "approve":
            if turn.approve is not None:
                await self.approve_when_parked(run_id, turn.approve, st)
            st.phase = "done"

    async def approve_when_parked(self, run_id: str, allow: bool, st: "ClientState") -> None:
        """Poll the run; approve (or deny) what it waits for; until it settled.  ``st.pending``: the
        call ids still to answer, ``st.wake_at``: the poll's pause (resumable at any of these)."""
        while True:
            if st.pending is None and st.wake_at is None:
                info = await self.call(lambda app: app.rt.get_run(run_id), st=st)
                if info.status in SETTLED:
                    return
                st.pending = list(info.pending_approvals) if info.status == "parked" and info.pending_approvals else []
            while st.pending:
                call_id = st.pending[0]
                await self.call(lambda app: app.rt.approve(run_id, call_id, allow, "simulated human"), st=st)
                self.world.trace.add("approve", run_id, call_id, allow)
                del st.pending[0]
            st.pending = None
            await self._sleep(st, 0.5 + self.world.rng.random() if st.wake_at is None else 0.0)

    async def follower(self, conversation: str) -> None:
        """Follow a conversation's journal live, resuming from the last cursor after a crash; told it
        fell behind retention, start again from the oldest retained event, de-duplicating by position."""
        seen = self.followed.setdefault(conversation, [])
        st = self.client("follow " + conversation)  # st.behind: told it fell behind (start from the oldest)

        async def go(app: App) -> None:
            after = None if st.behind or not seen else seen[-1][0]
            st.behind = False
            async for ev in app.rt.events(conversation, after=after):
                if seen and ev.cursor <= seen[-1][0]:
                    continue  # already seen before a restart from the oldest retained event
                seen.append((ev.cursor, ev.type))
                if self.follower_pause:
                    await trio.sleep(self.follower_pause)

        while True:
            if st.wake_at is not None:  # resumed in the pause after a NotFound
                await self._sleep(st, 0.0)
            try:
                await self.world.call(self.processes[0], go)
            except ProcessDied:
                continue
            except Exception as e:  # noqa: BLE001 - e.g. the conversation does not exist yet
                name = type(e).__name__
                if name == "CursorBehind":
                    st.behind = True
                    self.world.trace.add("behind", conversation, getattr(e, "first_retained", None))
                    self.behind[conversation] = self.behind.get(conversation, 0) + 1
                    continue
                if name not in ("NotFound", "KVError"):
                    raise
                await self._sleep(st, 0.01)

    async def drive(self) -> None:
        """The clients, from wherever ``self.client("drive")`` says they are (the start, at first)."""
        d = self.client("drive")
        if d.phase == "start":
            d.follow = sorted({t.conversation for t in self.turns}) if self.follow else []
            d.turns = len(self.turns)
            d.phase = "turns"
        if d.phase == "done":
            return
        async with trio.open_nursery() as followers:
            for conv in d.follow:
                followers.start_soon(self.follower, conv)
            if d.phase == "turns":
                async with trio.open_nursery() as clients:
                    for i, turn in enumerate(self.turns[:d.turns]):
                        if self.client(f"turn {i}").phase != "done":
                            clients.start_soon(self.run_turn, turn, f"turn {i}")
                d.phase = "after"
            if d.phase == "after":
                await self.after_turns()
                d.phase = "chaos"
            if d.phase == "chaos":
                # Faults keep firing while the runs execute (for a while), then recovery to quiescence
                # runs fault-free; the followers keep following until it is over.
                if d.wake_at is None:
                    d.wake_at = self.world.now() + CHAOS_SECONDS  # (the same float as move_on_after's)
                    chaos = trio.move_on_after(CHAOS_SECONDS)
                else:  # resumed
                    chaos = trio.move_on_at(d.wake_at)
                with chaos:
                    await self._settle_all("settle chaos")
                d.wake_at = None
                self.world.faults_on = False
                d.caught = chaos.cancelled_caught
                d.phase = "settle"
            if d.phase == "settle":
                if d.caught:  # (a settled run stays settled: no second round otherwise)
                    await self._settle_all("settle again")
                self._settled = True
                d.phase = "catch up"
            if d.phase == "catch up":
                await self._sleep(d, 0.1 + self.follower_pause * 20)  # let followers catch up with the last events
                d.phase = "done"
            followers.cancel_scope.cancel()

    async def after_turns(self) -> None:
        """Scenario-specific client work once every turn was submitted (e.g. a fork)."""

    def _unclog_on_takeover(self, victim: Process, clogged_at: float) -> Callable[[Any], bool]:
        """A commit listener: the first commit by another process after the clog is the takeover
        claim (the scenario has one run); let the victim go right then, so its pending write races the
        new owner's first write (a stale worker whose next write the ledger's fencing must refuse)."""

        def listener(proc: Any) -> bool:
            if proc is None or proc.name == victim.name:
                return False
            victim.unclog(KEEPER_TASK if self.keeper_lag else None, self.keeper_lag)
            proc.clog(0.05)  # the new owner's next requests are slow: the stale write goes first
            return True

        return listener

    async def _settle_all(self, key: str) -> None:
        """Wait (as clients following each run's journal) until every acknowledged run settled."""
        st = self.client(key)
        if st.runs is None:
            st.runs = [run_id for _, run_id in sorted(self.run_of.items())]  # (in submission order)
        while st.index < len(st.runs):
            run_id = st.runs[st.index]
            await self.call(lambda app: app.rt.wait(run_id), st=st)
            st.index += 1

    async def quiesce(self) -> None:
        if not self._settled:  # drive saw every acknowledged run settled already
            await self._settle_all("quiesce")

    async def check(self, checker: Checker) -> None:
        from .invariants import check_runtime

        await check_runtime(self, checker)


# ---------------------------------------------------------------- the built-in scenarios


class PlainTurn(RuntimeScenario):
    name = "plain"
    description = "one turn, no tools"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "plain", "s1")]


class ToolTurn(RuntimeScenario):
    name = "tool"
    description = "one turn with one tool call (an external effect)"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "tool", "s1")]


class MultiToolTurn(RuntimeScenario):
    name = "multi-tool"
    description = "two tool calls in one message, then a third"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "multi", "s1")]


class RetryTurn(RuntimeScenario):
    name = "retry"
    description = "transient provider errors (retry-after honoured) before the answer"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "retry", "s1")]


class CompactionTurns(RuntimeScenario):
    name = "compaction"
    description = "three long turns past the compaction threshold"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "compact", f"s{i}", delay=i * 0.01) for i in range(3)]


class ApprovalTurn(RuntimeScenario):
    name = "approval"
    description = "a tool that parks for approval; one approved, one denied"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "approve", "s1", approve=True), Turn("c2", "approve", "s2", approve=False)]


class CancelTurn(RuntimeScenario):
    name = "cancel"
    description = "cancel a run mid-tool and a queued run behind it"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "cancel", "s1", cancel_after=0.3), Turn("c1", "plain", "s2", delay=0.01, cancel_after=0.0)]


class ForkTurns(RuntimeScenario):
    name = "fork"
    description = "fork a finished conversation and continue the fork"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "plain", "s1")]

    async def after_turns(self) -> None:
        st = self.client("fork")
        if st.phase == "start":
            await self._settle_all("settle before the fork")
            st.phase = "fork"
        if st.phase == "fork":
            async def fork(app: Any) -> tuple[Any, int]:
                # At the first answer; short of it when the turn failed (a run that random
                # crashes and a poison run exhausted ends retry_exhausted, its answer never written).
                at = min(2, len(await app.rt.transcript("c1")))
                return await app.rt.fork("c1", at, new_conversation="c1-fork"), at

            new, at = await self.call(fork, st=st)
            self.forks.append(("c1", new, at))
            self.turns.append(Turn(new, "plain", "s2"))
            st.phase = "turn"
        if st.phase == "turn":
            await self.run_turn(self.turns[-1], "fork turn")
            st.phase = "done"


class ConcurrentConversations(RuntimeScenario):
    name = "concurrent"
    description = "three conversations, two turns each, submitted concurrently (FIFO per conversation)"

    def make_turns(self) -> list[Turn]:
        modes = ["plain", "tool", "plain"]
        return [Turn(f"c{c}", modes[(c + i) % 3], f"s{c}-{i}", delay=i * 0.002) for c in range(3) for i in range(2)]


class TwoRuntimes(ConcurrentConversations):
    name = "two-runtimes"
    description = "the concurrent conversations over two runtimes on one store (clients use either)"
    processes = ("p1", "p2")


class AttemptsExhausted(RuntimeScenario):
    name = "exhaustion"
    description = "two runtimes; every attempt loses its worker past the lease; the run fails retry_exhausted"
    processes = ("p1", "p2")
    max_attempts = 3

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "exhaust", "s1", expect_error="retry_exhausted"), Turn("c1", "plain", "s2", delay=0.01)]


class UsageCeiling(RuntimeScenario):
    name = "usage-ceiling"
    description = "a run that would loop forever is stopped by its token ceiling"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "spend", "s1", limits={"max_total_tokens": 600}, expect_error="usage_limit")]


class CostCeiling(RuntimeScenario):
    name = "cost-ceiling"
    description = ("a priced model: a run that would loop forever is stopped by its cost ceiling, "
                   "a tool turn beside it is billed")
    pricing = SIM_PRICING
    # (The spending run's last step is clamped to the room left and cut inside its tool call's
    # arguments, so the loop's cut-answer path runs too; at 2,000 that step was refused unsent
    # instead. 2,480 did it until the estimate counted the tool schema as input, which leaves the
    # clamp too little room to reach the call.)

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "spend", "s1", limits={"max_cost_micros": 2_600}, expect_error="usage_limit"),
                Turn("c2", "tool", "s2", delay=0.01)]


class ThinkingTurn(RuntimeScenario):
    name = "thinking"
    description = "extended thinking: a reasoning answer with a tool call (reasoning streamed, then passed back), then a reasoning answer"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "think", "s1")]


class InterleavedThinkingTurns(RuntimeScenario):
    name = "thinking-interleaved"
    description = ("interleaved thinking: reasoning between text and tool calls over a three-step tool loop "
                   "(persisted, journaled and passed back in place), then a plain turn after it")

    def make_turns(self) -> list[Turn]:
        # The second turn's model call is sent the first turn's reasoning as an earlier turn's.
        return [Turn("c1", "ithink", "s1"), Turn("c1", "plain", "s2", delay=0.01)]


class DuplicateSubmission(RuntimeScenario):
    name = "duplicate"
    description = "the same submission id twice (one run) and with a different request (conflict)"

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "tool", "s1", resubmit=True, conflict=True)]


class StaleWorker(RuntimeScenario):
    name = "stale-worker"
    description = "two runtimes on one store; a worker is cut off after a tool's effect until its run is taken over"
    processes = ("p1", "p2")
    clog = True

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "stale", "s1")]


class StaleWriteFirst(StaleWorker):
    """Targeted (tests/sim's bite tests; not in the default searches, see TARGETED): in
    ``stale-worker`` the stale worker's pending write and its lease keeper race once they are let
    go at the takeover; when the keeper's renewal finds the lease lost first, the runner is
    stopped before its write is handed over, and a broken fence is never tried (at 5614f65
    about half of the seeds: tests/sim/test_sim_bites.py).  Here the keeper's requests wait
    KEEPER_LAG longer (the new owner's are held 0.05 s: the stale write has the store to itself),
    so every run has a stale worker that tries to write after the takeover."""

    name = "stale-write-first"
    description = "stale-worker with the stale worker's lease keeper lagging: its write after the takeover is tried every run"
    keeper_lag = KEEPER_LAG


class ExhaustionAlone(AttemptsExhausted):
    """Targeted (see TARGETED): ``exhaustion`` without its second turn, whose claim would finalise
    what the exhausted run left dangling (an ``interrupted`` result for its open call) and so hide
    a finaliser that did not.  With a sure poison at depth 0 (``--poison 0``: every claim of the
    run dies right after it commits, the finalisers' too) the ledger's backstop settles the run,
    every seed, and what the finalisers left is what the checks see."""

    name = "exhaustion-alone"
    description = "exhaustion's exhausted run alone (no later turn repairs what it leaves)"

    def make_turns(self) -> list[Turn]:
        return super().make_turns()[:1]


class Retention(RuntimeScenario):
    name = "retention"
    description = "a journal keeping 6 events and a slow follower that falls behind and catches up"
    journal_retention = 6
    follower_pause = 0.2

    def make_turns(self) -> list[Turn]:
        return [Turn("c1", "multi", "s1"), Turn("c1", "tool", "s2", delay=0.01)]


class Mix(RuntimeScenario):
    name = "mix"
    description = "a generated mix: 1-2 runtimes, 1-3 conversations, random turns, cancels and approvals"

    def __init__(self, world: World) -> None:
        self.processes = ("p1", "p2") if world.rng.random() < 0.4 else ("p1",)
        self.pricing = SIM_PRICING if world.rng.random() < 0.3 else None
        super().__init__(world)

    def make_turns(self) -> list[Turn]:
        rng = self.world.rng
        turns = []
        for i in range(rng.randint(2, 6)):
            conv = f"c{rng.randrange(3)}"
            mode = rng.choice(["plain", "tool", "multi", "retry", "approve", "cancel", "compact", "spend", "think"])
            t = Turn(conv, mode, f"s{i}", delay=rng.random() * 0.5)
            if mode == "approve":
                t.approve = rng.random() < 0.7
            if mode == "spend":
                if self.pricing and rng.random() < 0.7:
                    t.limits = {"max_cost_micros": rng.choice([1_500, 3_000, 6_000])}
                else:
                    t.limits = {"max_total_tokens": rng.choice([300, 600, 1200])}
            if mode == "cancel" or rng.random() < 0.15:
                t.cancel_after = rng.random() * 1.5
            if rng.random() < 0.15:
                t.resubmit = True
            turns.append(t)
        return turns


SCENARIOS: dict[str, type[Scenario]] = {
    s.name: s for s in (PlainTurn, ToolTurn, MultiToolTurn, RetryTurn, CompactionTurns, ApprovalTurn,
                        CancelTurn, ForkTurns, ConcurrentConversations, TwoRuntimes, AttemptsExhausted, UsageCeiling,
                        CostCeiling, ThinkingTurn, InterleavedThinkingTurns, DuplicateSubmission, StaleWorker, Retention, Mix)
}
# Targeted variants: each reaches one path a default scenario reaches only on some schedules (for
# tests/sim's bite tests).  Runnable by name (``surefoot sim --scenario NAME``) but not in the
# default searches (CI, soaks, bench_sim: its traces stay those of SCENARIOS).
TARGETED: dict[str, type[Scenario]] = {s.name: s for s in (StaleWriteFirst, ExhaustionAlone)}
