"""Running scenarios: one run, exhaustive crash points, random seeds.

A :class:`Scenario` says how to boot a process (``boot``), what the
simulated clients do (``drive``), when the system is quiet (``quiesce``)
and what must hold afterwards (``check``).  :func:`run_once` executes it in
a fresh :class:`~sim.world.World`: processes under supervision (restarted
after every crash), the clients, then faults off and recovery to
quiescence, then the checks on a fault-free handle, then the kv oracle.

:func:`exhaustive` first runs a scenario fault-free to count its writes W,
then crashes before and after each write k in 1..W (2W runs), each on the
same seed, so crash point k is the same instant of the same history.  The
fault-free run takes a snapshot of the world at each write (sim.resume), and
a crash run of a scenario that can be resumed starts from its snapshot
instead of re-running the history up to write k.
"""

from __future__ import annotations

import functools
import gc
import time as _time
from dataclasses import dataclass
from typing import Any, AsyncContextManager, Callable, Iterator

import trio

from .faults import FaultPlan
from .resume import Recorder, Snapshot, restore
from .world import Process, Violation, World

__all__ = ["Scenario", "ClientState", "RunResult", "run_once", "exhaustive", "random_runs", "replay_command", "Checker"]


class Checker:
    """What ``Scenario.check`` gets: a fault-free database handle and the world to report into."""

    def __init__(self, world: World) -> None:
        from .oracle import RecordingDatabase

        self.world = world
        self.db = RecordingDatabase(world.engine.engine, None, stats=world.stats)
        self.checks = 0

    def expect(self, ok: bool, invariant: str, promise: int | None, detail: str) -> bool:
        """Count one invariant check; report a violation when ``ok`` is false."""
        self.checks += 1
        if not ok:
            self.world.violate(invariant, promise, detail)
        return ok


@dataclass
class ClientState:
    """Where one simulated client is, recorded as it goes, so that a snapshot of the world holds
    it (sim.resume): a crash run can start from the snapshot at its crash point instead of re-running
    the history up to it.  What each field means depends on the client (RuntimeScenario's, the kv workloads')."""

    phase: str = "start"
    wake_at: float | None = None  # asleep until then (virtual time)
    in_call: bool = False  # a call is out: a crash cuts it short, and the client retries it
    run_id: str | None = None  # the run its submission was acknowledged as
    pending: list[str] | None = None  # approvals still to give
    runs: list[str] | None = None  # the runs to wait for, and how far it got
    index: int = 0
    behind: bool = False  # a follower told it fell behind retention
    follow: list[str] | None = None  # drive: the conversations followed, and the first turns' count
    turns: int = 0
    caught: bool = False  # drive: the chaos period ran out
    value: int | None = None  # a number the client drew and still holds (kv-cycle: the key it relinks)

    def __deepcopy__(self, memo: dict[int, Any]) -> "ClientState":
        # (a snapshot copies every client at every write: field by field, not through
        # copy.deepcopy's generic reduce, which was a third of a snapshot's cost)
        new = object.__new__(ClientState)  # (copy.copy's result, without its __reduce_ex__)
        new.__dict__.update(self.__dict__)
        for name in ("pending", "runs", "follow"):
            value = getattr(self, name)
            if value is not None:
                setattr(new, name, list(value))  # (lists of str)
        return new


class Scenario:
    """A workload: processes, clients, quiescence and the invariants it checks."""

    name = "scenario"
    description = ""
    processes: tuple[str, ...] = ("p1",)
    # Whether a crash run can start from a snapshot at its crash point (sim.resume): true only for a
    # scenario whose clients record where they are (``client``) and whose crash leaves no process
    # running (one process).
    resumable = False

    def __init__(self, world: World) -> None:
        self.world = world
        self.clients: dict[str, ClientState] = {}  # where each simulated client is (resumable)

    def resumed(self) -> None:
        """Called on a scenario just restored from a snapshot (sim.resume): drop what belonged to
        the process that died (a new incarnation builds its own)."""

    def client(self, key: str) -> "ClientState":
        """The recorded position of one simulated client (see :class:`ClientState`)."""
        st = self.clients.get(key)
        if st is None:
            st = self.clients[key] = ClientState()
        return st

    async def _sleep(self, st: "ClientState", seconds: float) -> None:
        """``trio.sleep(seconds)`` with its wake-up time recorded; resumed, sleep what was left."""
        if st.wake_at is None:
            st.wake_at = self.world.now() + seconds
            await trio.sleep(seconds)
        else:  # resumed from a snapshot taken mid-sleep
            left = st.wake_at - self.world.now()
            if left > 0:
                await trio.sleep(left)
            else:
                await trio.lowlevel.checkpoint()
        st.wake_at = None

    def boot(self, proc: Process) -> AsyncContextManager[Any]:
        raise NotImplementedError

    async def drive(self) -> None:
        """The simulated clients; returns when they have done (and heard back) what they set out to."""

    async def quiesce(self) -> None:
        """Faults are off: wait until recovery has settled everything acknowledged."""

    async def check(self, checker: Checker) -> None:
        """Check the invariants against the store and what the world counted."""


@dataclass
class RunResult:
    scenario: str
    seed: int
    plan: FaultPlan
    violations: list[Violation]
    trace: str
    writes: int
    commits: int
    crashes: int
    restarts: int
    faults: dict[str, int]
    checks: int
    virtual_seconds: float
    wall_seconds: float
    transactions: int = 0  # kv transactions created (processes and checks)
    task_steps: int = 0  # trio task steps
    # Process CPU seconds of the whole run, and of its prefix (until the first crash; 0.0 when
    # nothing crashed): what sharing prefixes between crash runs could save at most (bench_sim).
    cpu_seconds: float = 0.0
    prefix_cpu_seconds: float = 0.0
    resumed: bool = False  # started at its crash point from a snapshot (sim.resume), no prefix re-run

    @property
    def ok(self) -> bool:
        return not self.violations


ScenarioFactory = Callable[[World], Scenario]

# The collector's young-generation threshold while a run executes.  A run's objects mostly die by
# reference count (a bench run ends with at most ~3,500 more tracked objects than it began with,
# median ~850), so a collection in mid-run examines thousands of live objects (the world, its
# tasks and coroutines) to free little: with the session-wide threshold of 10,000 used before, the
# bench paid ~95 such collections at ~7 ms each, ~7% of its CPU.  No bench run reaches this
# threshold (it only bounds the memory of a pathological run); instead the end of each run
# collects generations 0-1 once (~0.7 ms: by then the world is garbage).  Measured on the bench:
# GC 7% -> 2.5% of its CPU, ~10% less CPU in all; traces unchanged (the bench's session hashes
# are byte-identical: runs do not depend on when the collector runs).
RUN_GC_GEN0_THRESHOLD = 100_000
assert RUN_GC_GEN0_THRESHOLD > 0


def run_once(factory: ScenarioFactory, seed: int, plan: FaultPlan | None = None, *, trace_keep: int = 0,
             on_world: Callable[[World], Any] | None = None, recorder: Recorder | None = None,
             resume: Snapshot | None = None, reexecute: bool = False) -> RunResult:
    """One complete run: boot, drive, recover to quiescence, check.

    A crash run (``plan`` crashing at an exact write) of a scenario that can be resumed
    (sim.resume) starts at its crash point: from ``resume`` (the snapshot an exhaustive session's
    fault-free run took there), or else it runs up to the crash point, takes the snapshot and
    stops, then goes on from it — the same run either way.  ``recorder``: the snapshots this run
    takes (the fault-free run of an exhaustive session takes one at every write).  ``reexecute``:
    a crash run re-runs its history up to the crash point and goes on in the same world, as before
    snapshots (tests/sim compares the two at the crash point).

    The cyclic garbage collector waits for the end of the run (see RUN_GC_GEN0_THRESHOLD): then
    the whole world is garbage and one young-generation collection frees it.
    """
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], RUN_GC_GEN0_THRESHOLD), *threshold[1:])
    try:
        plan = plan or FaultPlan()
        if (resume is None and recorder is None and not reexecute and plan.crash_at is not None
                and not plan.buggify):
            recorder = Recorder(only=(plan.crash_at, plan.crash_when))
        result = _run_once(factory, seed, plan, trace_keep, on_world, recorder, resume)
        if isinstance(result, Snapshot):  # stopped at its crash point: go on from there
            gc.collect(1)  # (the stopped world)
            result = _run_once(factory, seed, plan, trace_keep, on_world, None, result)
        assert isinstance(result, RunResult)
        return result
    finally:  # (this run's frames are gone: its world is unreachable)
        gc.set_threshold(*threshold)
        if gc.isenabled():
            gc.collect(1)


def _run_once(factory: ScenarioFactory, seed: int, plan: FaultPlan, trace_keep: int,
              on_world: Callable[[World], Any] | None, recorder: Recorder | None,
              snapshot: Snapshot | None) -> RunResult | Snapshot:
    world = World(seed, plan, trace_keep=trace_keep)
    world.recorder = recorder
    t0 = _time.perf_counter()
    c0 = _time.process_time()
    if on_world is not None:
        on_world(world)
    dead: Any = None
    if snapshot is None:
        scenario = world.scenario = factory(world)
    else:
        scenario, dead = restore(world, snapshot)
    checker = Checker(world)

    async def main(world: World) -> None:
        async with trio.open_nursery() as nursery:
            for name in scenario.processes:
                if dead is not None and name == dead.name:  # resumed: it just died
                    await nursery.start(functools.partial(world.supervise, after_crash=dead,
                                                          started=snapshot.drive_started), name, scenario.boot)
                else:
                    await nursery.start(world.supervise, name, scenario.boot)
            await scenario.drive()
            world.faults_on = False
            await scenario.quiesce()
            world.stopping = True
            nursery.cancel_scope.cancel()
        world.trace.add("checks", f"{world.now():.6f}")
        await scenario.check(checker)
        problems = world.oracle.check(world.engine)
        checker.checks += 1
        for p in problems:
            world.violate("kv_serializable", None, p)

    world.run(main)
    if world.aborted:
        assert recorder is not None and recorder.only is not None
        return recorder.snapshots[recorder.only]
    return RunResult(
        scenario=scenario.name,
        seed=seed,
        plan=plan,
        violations=list(world.violations),
        trace=world.trace.hexdigest(),
        writes=world.stats["writes"],
        commits=world.stats["commits"],
        crashes=world.stats["crashes"],
        restarts=world.stats["restarts"],
        faults=dict(world.faults),
        checks=checker.checks,
        virtual_seconds=world.finished_at,
        wall_seconds=_time.perf_counter() - t0,
        transactions=world.stats["transactions"],
        task_steps=world.stats["task_steps"],
        cpu_seconds=_time.process_time() - c0,
        prefix_cpu_seconds=(world.first_crash_cpu - c0) if world.first_crash_cpu is not None else 0.0,
        resumed=snapshot is not None,
    )


def exhaustive(factory: ScenarioFactory, seed: int, *, limit: int | None = None) -> Iterator[RunResult]:
    """The fault-free run, then a crash before and after every write k in 1..W."""
    recorder = Recorder()  # the fault-free run takes a snapshot at every write (sim.resume)
    base = run_once(factory, seed, recorder=recorder)
    yield base
    if base.violations:
        return
    total = base.writes if limit is None else min(base.writes, limit)
    for k in range(1, total + 1):
        for when in ("before", "after"):
            # (no snapshot: a scenario that cannot be resumed re-runs its history up to write k)
            yield run_once(factory, seed, FaultPlan().with_crash(k, when),
                           resume=recorder.snapshots.pop((k, when), None))


def random_runs(factories: list[ScenarioFactory], seed: int, runs: int) -> Iterator[RunResult]:
    """Seeded random runs: scenario picked by the seed, BUGGIFY faults and random crashes on."""
    for i in range(runs):
        s = seed + i
        factory = factories[s % len(factories)]
        yield run_once(factory, s, random_plan(s))


def random_plan(seed: int, poison: int | None = None) -> FaultPlan:
    """A random-mode run's plan; ``poison``: a sure poison run at that depth (FaultPlan.poison)."""
    return FaultPlan(buggify=True, crash_rate=0.25, poison=poison)


def replay_command(result: RunResult) -> str:
    """The exact command that reproduces ``result``."""
    cmd = f"surefoot sim --scenario {result.scenario} --seed {result.seed}"
    p = result.plan
    if p.crash_at is not None:
        cmd += f" --crash-{p.crash_when} {p.crash_at}"
    elif p.buggify:
        cmd += " --buggify"
    if p.poison is not None:
        cmd += f" --poison {p.poison}"
    return cmd
