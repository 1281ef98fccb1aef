"""Stand-in workloads written directly on kv: they exercise the world, the faults and the oracle alone.

* ``kv-cycle`` — FoundationDB's Cycle workload (fdbserver/workloads/Cycle.cpp):
  N keys form a ring; concurrent clients relink three neighbours per
  transaction; the ring must stay one cycle of length N.
* ``kv-outbox`` — a miniature of the runtime's promises on raw kv: clients
  submit jobs under idempotency keys (guarded by a marker), a worker marks a
  job started, performs its external effect, marks it done; recovery marks
  a started-but-not-done job interrupted instead of re-running it.  Checks:
  every acknowledged submission is in the log exactly once, the log has no
  holes, every job settled, no effect happened twice.
"""

from __future__ import annotations

import struct
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

import kv

from .harness import Checker, Scenario
from .world import Process, ProcessDied, World

__all__ = ["CycleScenario", "OutboxScenario", "OutboxApp"]


def _i(n: int) -> bytes:
    return struct.pack(">q", n)


def _n(b: bytes | None) -> int:
    return struct.unpack(">q", b)[0] if b else 0


# ---------------------------------------------------------------- kv-cycle

CYCLE_PREFIX = b"cyc/"


class CycleApp:
    def __init__(self, db: kv.Database, n: int) -> None:
        self.db, self.n = db, n

    def key(self, i: int) -> bytes:
        return CYCLE_PREFIX + _i(i)

    async def setup(self) -> None:
        async def fn(tr: Any) -> None:  # idempotent: writes the same ring when absent
            if await tr.get(self.key(0)) is None:
                for i in range(self.n):
                    tr.set(self.key(i), _i((i + 1) % self.n))

        await self.db.transact(fn)

    async def relink(self, r: int) -> None:
        async def fn(tr: Any) -> None:  # not idempotent, but any replay still relinks a ring into a ring
            r2 = _n(await tr.get(self.key(r)))
            r3 = _n(await tr.get(self.key(r2)))
            r4 = _n(await tr.get(self.key(r3)))
            tr.set(self.key(r), _i(r3))
            tr.set(self.key(r2), _i(r4))
            tr.set(self.key(r3), _i(r2))

        await self.db.transact(fn)


class CycleScenario(Scenario):
    name = "kv-cycle"
    description = "FoundationDB's Cycle on raw kv: concurrent relinks keep one ring"
    N = 6
    CLIENTS = 3
    OPS = 4

    @asynccontextmanager
    async def boot(self, proc: Process) -> AsyncIterator[CycleApp]:
        app = CycleApp(proc.db, self.N)
        await app.setup()
        yield app

    resumable = True  # one process; the clients record where they are (sim.resume)

    async def drive(self) -> None:
        """CLIENTS clients, OPS relinks each: draw a key, think a little, relink (a relink cut short
        by a crash is lost, not retried).  Each records where it is (``self.client``), so a crash run
        resumed from a snapshot (sim.resume) picks every client up there: same draws, same sleeps."""
        world = self.world
        self.client("drive")  # (the clients started: a crash from now on resumes them)

        async def client(c: int) -> None:
            st = self.client(f"client {c}")
            while st.index < self.OPS:
                if st.phase == "start":
                    st.value = world.rng.randrange(self.N)
                    st.phase = "sleep"
                    await self._sleep(st, world.rng.random() * 0.01)
                elif st.phase == "sleep":  # resumed mid-sleep: what is left of it
                    await self._sleep(st, 0.0)
                r = st.value
                if st.in_call:  # resumed: the crash cut this relink short (the ProcessDied below)
                    world.trace.add("client.lost", c)
                else:
                    st.phase = "call"
                    st.in_call = True
                    try:
                        await world.call("p1", lambda app: app.relink(r))
                    except ProcessDied:
                        world.trace.add("client.lost", c)
                st.in_call = False
                st.index += 1
                st.phase = "start"

        async with trio.open_nursery() as n:
            for c in range(self.CLIENTS):
                n.start_soon(client, c)

    async def check(self, checker: Checker) -> None:

        async def read(tr: Any) -> list[bytes]:
            return [kv_.value for kv_ in await tr.get_range(CYCLE_PREFIX, CYCLE_PREFIX + b"\xff")]

        values = await checker.db.transact(read)
        checker.expect(len(values) == self.N, "cycle_intact", None, f"{len(values)} ring keys, want {self.N}")
        seen, i = set(), 0
        for _ in range(self.N):
            seen.add(i)
            i = _n(values[i]) if i < len(values) else 0
        checker.expect(i == 0 and len(seen) == self.N, "cycle_intact", None, "the ring is broken")


# ---------------------------------------------------------------- kv-outbox

OB = kv.Subspace(("outbox",))
HEAD = OB.pack(("head",))


def _span(name: str) -> tuple[bytes, bytes]:
    r = OB.range((name,))
    return r.start, r.stop


class OutboxApp:
    """The miniature runtime.  ``recover_reruns`` breaks promise 3 on purpose (tests only)."""

    recover_reruns = False
    skip_marker = False

    def __init__(self, world: World, proc: Process | None, db: kv.Database) -> None:
        self.world, self.proc, self.db = world, proc, db
        self.wake = trio.Event()
        self.me = (proc.label if proc else "-").encode()

    async def submit(self, sub_id: str, payload: str) -> int:
        async def fn(tr: Any) -> int:  # guarded: the marker turns a replay after 1021 into a read
            if not self.skip_marker:
                mark = await tr.get(OB.pack(("mark", sub_id)))
                if mark is not None:
                    return _n(mark)
            n = _n(await tr.get(HEAD))
            tr.set(OB.pack(("log", n)), sub_id.encode())
            tr.set(OB.pack(("job", n)), b"queued")
            tr.set(OB.pack(("mark", sub_id)), _i(n))
            tr.set(HEAD, _i(n + 1))
            return n

        n = await self.db.transact(fn)
        self.wake.set()
        return n

    async def recover(self) -> None:
        async def fn(tr: Any) -> None:  # idempotent: started -> interrupted is a fixed point
            for row in await tr.get_range(*_span("job")):
                if row.value.startswith(b"started"):
                    tr.set(row.key, b"queued" if self.recover_reruns else b"interrupted")

        await self.db.transact(fn)

    async def work(self) -> None:
        while True:
            mine = b"started:" + self.me

            async def claim(tr: Any) -> int | None:
                # Guarded: a replay after commit_unknown_result finds the job it already claimed.
                rows = await tr.get_range(*_span("job"))
                for row in rows:
                    if row.value == mine:
                        return OB.unpack(row.key)[1]
                for row in rows:
                    if row.value == b"queued":
                        tr.set(row.key, mine)
                        return OB.unpack(row.key)[1]
                return None

            n = await self.db.transact(claim)
            if n is None:
                self.wake = trio.Event()
                with trio.move_on_after(1.0):
                    await self.wake.wait()
                continue
            await trio.sleep(self.world.rng.random() * 0.01)
            self.world.effect(self.proc, f"job-{n}")

            async def done(tr: Any) -> None:  # idempotent: sets a final state
                tr.set(OB.pack(("job", n)), b"done")

            await self.db.transact(done)

    async def pending(self) -> int:
        async def fn(tr: Any) -> int:  # read-only
            return sum(1 for row in await tr.get_range(*_span("job")) if not row.value.startswith((b"done", b"interrupted")))

        return await self.db.transact(fn)


class OutboxScenario(Scenario):
    name = "kv-outbox"
    description = "idempotent submissions, a worker with an external effect, recovery that never re-runs"
    CLIENTS = 2
    OPS = 2

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.acked: dict[str, int] = {}

    @asynccontextmanager
    async def boot(self, proc: Process) -> AsyncIterator[OutboxApp]:
        app = OutboxApp(self.world, proc, proc.db)
        await app.recover()
        async with trio.open_nursery() as n:
            n.start_soon(app.work)
            yield app
            n.cancel_scope.cancel()

    resumable = True  # one process; the clients record where they are (sim.resume)

    async def drive(self) -> None:
        """CLIENTS clients submit OPS jobs each; a lost acknowledgement is retried with the same
        idempotency key.  Each records where it is, so a resumed crash run picks it up there."""
        world = self.world
        self.client("drive")  # (the clients started: a crash from now on resumes them)

        async def client(c: int) -> None:
            st = self.client(f"client {c}")
            while st.index < self.OPS:
                sub = f"c{c}-{st.index}"
                if st.in_call:  # resumed: the crash cut this submit short (the ProcessDied below)
                    world.trace.add("client.retry", sub)
                st.in_call = True
                while True:
                    try:
                        self.acked[sub] = await world.call("p1", lambda app: app.submit(sub, "x"))
                        break
                    except ProcessDied:
                        world.trace.add("client.retry", sub)
                st.in_call = False
                st.index += 1

        async with trio.open_nursery() as n:
            for c in range(self.CLIENTS):
                n.start_soon(client, c)

    async def quiesce(self) -> None:
        """Poll until no job is pending (the worker keeps writing meanwhile: a crash may come here,
        so the poll records where it is too)."""
        q = self.client("quiesce")
        while True:
            if q.wake_at is None:  # (else resumed in the pause)
                if q.in_call:  # resumed: the crash cut the poll short (a ProcessDied)
                    q.in_call = False
                else:
                    q.in_call = True
                    try:
                        pending = await self.world.call("p1", lambda app: app.pending())
                    except ProcessDied:
                        pending = None
                    q.in_call = False
                    if pending == 0:
                        return
            await self._sleep(q, 0.5)

    async def check(self, checker: Checker) -> None:
        async def read(tr: Any) -> tuple[int, list[Any], list[Any]]:
            return (_n(await tr.get(HEAD)), await tr.get_range(*_span("log")),
                    await tr.get_range(*_span("job")))

        head, log, jobs = await checker.db.transact(read)
        positions = [OB.unpack(r.key)[1] for r in log]
        checker.expect(positions == list(range(head)), "log_contiguous", 2, f"log positions {positions}, head {head}")
        ids = [r.value.decode() for r in log]
        for sub, pos in sorted(self.acked.items()):
            checker.expect(ids.count(sub) == 1, "acknowledged_exactly_once", 1,
                           f"acknowledged submission {sub} appears {ids.count(sub)} times in the log")
            checker.expect(pos < len(ids) and ids[pos] == sub, "acknowledged_position", 1,
                           f"{sub} was acknowledged at {pos}")
        for r in jobs:
            checker.expect(r.value in (b"done", b"interrupted"), "every_job_settled", 4,
                           f"job {OB.unpack(r.key)[1]} ended {r.value!r}")
        for key, n in sorted(self.world.effects.items()):
            checker.expect(n <= 1, "tool_at_most_once", 3, f"{key} executed {n} times")
