"""The simulated world: one seeded PRNG, virtual time, a seeded scheduler, the memory engine as the disk.

Everything a simulation run does happens inside one ``trio.run`` on a
virtual clock (:class:`VirtualClock`, MockClock's autojump), with trio's scheduler made deterministic
from the seed (two private names: ``trio._core._run._r`` and
``_ALLOW_DETERMINISTIC_SCHEDULING``; pyproject pins ``trio>=0.25,<0.33`` and
tests/sim checks that a seed replays byte for byte).  The sources of
randomness and time the code under test uses are routed to the world for the
duration of the run (:func:`deterministic_process_state`): ``os.urandom``
(and so ``uuid.uuid4``), unseeded ``random.Random()``, ``time.time`` and
``time.monotonic``.  There are no threads and no real I/O.

A *process* is one incarnation of an application (a Runtime) over its own
:class:`kv.Database` handle on the shared :class:`kv.MemoryEngine`.  A crash
marks the process dead, cancels everything it runs (and every client call in
flight against it), and from then on every kv operation from its handle
raises :class:`Crash`; the supervisor then boots a new incarnation on what
survived.  Side effects of tools are counted by the world, outside any
process, so a crash cannot hide one.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import hashlib
import heapq
import logging
import operator
import os
import random
import sys
import threading
import time
import types
import warnings
from time import process_time as _process_time  # (bound at import: the run patches time.time/monotonic)
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncContextManager, Awaitable, Callable, Iterator, TypeVar

import outcome
from sniffio import thread_local as _sniffio_library
import trio
from trio._core import _run as _trio_run  # private: the scheduler's PRNG and determinism flag
from trio._core import _traps as _trio_traps  # private: the wait trap's message class (see _WaitTaskRescheduled)

import kv

# The private names the deterministic scheduler relies on (pyproject pins trio>=0.25,<0.33).
if not (isinstance(getattr(_trio_run, "_r", None), random.Random)
        and hasattr(_trio_run, "_ALLOW_DETERMINISTIC_SCHEDULING")
        and isinstance(getattr(_trio_run, "TheIOManager", None), type)
        and isinstance(getattr(_trio_run, "Instruments", None), type)
):  # pragma: no cover - a trio outside the pin
    raise ImportError(f"sim needs trio's _core._run._r, _ALLOW_DETERMINISTIC_SCHEDULING, TheIOManager and Instruments "
                      f"(trio {trio.__version__})")

from .faults import Buggify, Crash, FaultPlan, SimHooks
from .oracle import Oracle, RecordingDatabase

log = logging.getLogger(__name__)

__all__ = ["World", "Process", "ProcessDied", "Violation", "SIM_EPOCH", "deterministic_process_state"]

T = TypeVar("T")

# Virtual wall time starts here (2026-01-01T00:00:00Z) so records look like real timestamps.
SIM_EPOCH = 1_767_225_600.0
# The pid every simulated process reports (worker ids embed it).
SIM_PID = 4242
# A restarted process comes back after this much virtual time (a supervisor's restart delay).
RESTART_DELAY_SECONDS = 0.5
# Hard stop for one run in virtual time: a run that has not quiesced by then is a liveness failure.
MAX_VIRTUAL_SECONDS = 6 * 3600.0
# Crash/restart cycles allowed per run (random mode can chain crashes; bound the work).
MAX_RESTARTS = 64

assert RESTART_DELAY_SECONDS > 0 and MAX_VIRTUAL_SECONDS > 0 and MAX_RESTARTS > 0


class ProcessDied(Exception):
    """A client's call was cut short because the process it talked to crashed."""


@dataclass(frozen=True)
class Violation:
    """A broken promise: the invariant's name, the promise number it guards, and what was seen."""

    invariant: str
    promise: int | None
    detail: str

    def __str__(self) -> str:
        p = f" (promise {self.promise})" if self.promise else ""
        return f"{self.invariant}{p}: {self.detail}"


@contextmanager
def deterministic_process_state(world: "World") -> Iterator[None]:
    """Route process-global randomness and time to ``world`` for the duration of one run.

    Why global patches: the code under test (sessions, ledger, loop) draws
    ids from ``os.urandom`` / ``uuid.uuid4`` and default ``random.Random()``
    instances, and some records take ``time.time()``.  The simulation owns the
    whole (single-threaded) process while it runs, so it swaps these for
    seeded / virtual versions and restores them afterwards.

    ``trio.sleep`` (every wait of the code under test and of the simulated
    clients: lease ticks, backoffs, think times) becomes the world clock's
    :meth:`VirtualClock.sleep`: the same wake-up tick for the same deadline,
    without a cancel scope, a deadline registration and a ``Cancelled``
    raised and caught per sleep (~40 sleeps per run; that machinery was ~5%
    of a run's CPU).  One legal difference: a sleep that ends in the tick its
    task is also cancelled returns and the cancellation is delivered at the
    task's next checkpoint, as for any other wake-up in trio (``trio.sleep``
    would raise it at once) — deterministic either way.
    """
    saved = (os.urandom, random.Random.seed, time.time, time.monotonic,
             _trio_run._ALLOW_DETERMINISTIC_SCHEDULING, _trio_run._r, os.getpid, trio.sleep,
             _trio_run.TheIOManager, _trio_run.Instruments)
    scheduler = _SchedulerRandom(world.seed)  # (the same sequence as trio's _r seeded with world.seed)
    if world.scheduler_state is not None:  # a run resumed from a snapshot (sim.resume)
        scheduler.setstate(world.scheduler_state[0])
        scheduler.steps = world.scheduler_state[1]
    orig_seed = random.Random.seed
    orig_sleep = trio.sleep
    rng = world.rng
    clock_sleep = world.clock.sleep

    def sleep(seconds: float) -> Awaitable[None]:
        if 0 < seconds < _INF:
            return clock_sleep(seconds)
        return orig_sleep(seconds)  # (0: a checkpoint; inf: forever; negative: trio's ValueError)

    def urandom(n: int) -> bytes:
        return rng.randbytes(n)

    def seed(self: random.Random, a: Any = None, version: int = 2) -> None:
        if a is None:  # an unseeded Random(): give it a seed from the world
            a = rng.getrandbits(64)
        orig_seed(self, a, version)

    vclock = world.clock

    def wall() -> float:
        return SIM_EPOCH + vclock._now  # (world.wall() inlined: ~30 calls a run)

    # time.monotonic reads the virtual clock's time with no Python frame (~40 calls a run)
    mono = _now_reader(vclock)

    os.urandom = urandom
    os.getpid = lambda: SIM_PID  # ids that embed the pid (worker names) must not differ between replays
    random.Random.seed = seed  # type: ignore[method-assign]
    time.time = wall
    time.monotonic = mono
    _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _trio_run._r = scheduler
    trio.sleep = sleep  # type: ignore[assignment]
    _trio_run.TheIOManager = _SimIOManager  # type: ignore[misc]
    _trio_run.Instruments = _SimInstruments  # type: ignore[misc]
    try:
        yield
    finally:
        os.urandom, random.Random.seed, time.time, time.monotonic = saved[:4]  # type: ignore[method-assign]
        _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = saved[4]  # type: ignore[misc]
        _trio_run._r = saved[5]
        os.getpid = saved[6]
        trio.sleep = saved[7]  # type: ignore[assignment]
        _trio_run.TheIOManager = saved[8]  # type: ignore[misc]
        _trio_run.Instruments = saved[9]  # type: ignore[misc]
        world.stats["task_steps"] += scheduler.steps


class _SimInstruments(dict):  # type: ignore[type-arg]
    """trio's ``Instruments`` (the run's instruments by hook) as a dict, so that ``hook in it``
    is the dict's C-level lookup.

    trio asks ``"before_task_step" in runner.instruments`` (and the same for four other hooks)
    on every task step and tick: ~700 times a run, each a Python-level call of ``UserDict``'s
    ``__contains__`` (trio's class is a UserDict).  The simulation installs no instrument, so
    the answer is always no.  Same contents as trio's (``{"_all": {}}`` and one dict per hook
    with instruments), the same methods (trio's own functions, which reach the contents through
    ``.data``: here the dict itself), so an instrument a test adds still works.
    """

    __slots__ = ()

    def __init__(self, incoming: Any) -> None:
        super().__init__({"_all": {}})
        for instrument in incoming:
            self.add_instrument(instrument)

    @property
    def data(self) -> dict[str, Any]:
        return self

    add_instrument = _trio_run.Instruments.add_instrument
    remove_instrument = _trio_run.Instruments.remove_instrument
    call = _trio_run.Instruments.call


class _SimIOManager(_trio_run.TheIOManager):  # type: ignore[misc,valid-type]
    """trio's I/O manager, polled only when something can be ready.

    trio polls its I/O manager once per scheduler tick (~160 ticks a run).  In
    the simulated world nothing does real I/O: the only file descriptor
    registered is the wake-up socket of trio's entry queue (``run_sync_soon``:
    an async generator's finalizer, a KeyboardInterrupt), and the world's clock
    always asks for a zero timeout (it jumps virtual time instead of waiting).
    So the poll (a syscall, ~2 us with its Python around it) is made only
    when the entry queue holds work — then the socket is readable and the
    same poll as before wakes the queue's task in the same tick — or when a
    wait is asked for (never here; real waits behave as before).
    """

    _entry: Any = None

    def get_events(self, timeout: float) -> Any:
        entry = self._entry
        if entry is None:
            entry = self._entry = _trio_run.GLOBAL_RUN_CONTEXT.runner.entry_queue
        if timeout or entry.queue or entry.idempotent_queue:
            return super().get_events(timeout)
        return ()


class _SchedulerRandom(random.Random):
    """trio's scheduler PRNG for one run, counting the task steps it schedules.

    With deterministic scheduling trio shuffles each batch of runnable tasks
    with ``_r.shuffle`` and then steps every task in it, so the batch sizes
    add up to the run's task steps — a deterministic cost figure, counted
    here for free (a trio Instrument's ``before_task_step`` cost ~1.5% of a
    run).  The shuffle itself is ``random.Random``'s: same seed, same order.
    """

    steps = 0

    def shuffle(self, x: list[Any]) -> None:  # type: ignore[override]
        n = len(x)
        self.steps += n
        if n > 1:  # (most batches hold one task: Random.shuffle would draw nothing for it either)
            random.Random.shuffle(self, x)


_INF = float("inf")


_ABORT_SUCCEEDED = trio.lowlevel.Abort.SUCCEEDED


@types.coroutine
def _sleep_trap(cell: list[Any]) -> Any:
    """``trio.lowlevel.wait_task_rescheduled`` for :meth:`VirtualClock.sleep`, in one generator frame
    (trio's is a coroutine awaiting a generator): the same message — trio's ``WaitTaskRescheduled``
    as looked up now, i.e. the host's plain one during a hosted run — and the same unwrap of what
    the task is woken with."""

    def abort(_: Any) -> trio.lowlevel.Abort:
        cell[0] = None  # cancelled: the wake-up finds nobody
        return _ABORT_SUCCEEDED

    return (yield _trio_traps.WaitTaskRescheduled(abort)).unwrap()


class VirtualClock(trio.abc.Clock):
    """Virtual time for one run: exactly what ``MockClock(autojump_threshold=0)`` does, for less.

    Time stands still while any task can run; when none can, it jumps straight
    to the next deadline.  MockClock spends an idle scheduler tick per jump (a
    zero-timeout poll, then ``_autojump`` asking the run loop for its full
    statistics, epoll included) and reads ``time.perf_counter`` on every
    ``current_time`` even at rate 0 — every tick, every ``trio.sleep``, every
    kv read version.  trio asks a clock for ``deadline_to_sleep_time`` only
    when no task is runnable, so this clock jumps right there and answers 0:
    the same virtual times (MockClock's jump arithmetic, so the same floats),
    one tick fewer per jump.

    The one thing that could still wake a task in that idle tick is trio's
    entry queue (``run_sync_soon``: the finalizer of an async generator
    dropped unfinished, e.g. a journal follower cut short by ``CursorBehind``).
    MockClock lets it run before the jump, so this clock does not jump while
    that queue holds work (private run-loop state, like the scheduler seed;
    pinned trio range).

    :meth:`sleep` is ``trio.sleep`` for the simulation's own waits (network
    latency on most kv requests): the task parks on this clock's heap, and
    the jump that reaches its deadline reschedules it — into the tick in
    which trio would have expired a ``trio.sleep``'s cancel scope (time only
    moves in the jump; trio sorts each tick's batch by task before the seeded
    shuffle, so the order of wake-ups within a tick does not matter) —
    without a cancel scope, a deadline registration and a ``Cancelled``
    raised and caught per sleep.  Traces are byte-identical to MockClock with
    ``trio.sleep``.
    """

    def __init__(self) -> None:
        self._now = 0.0
        self._sleepers: list[tuple[float, int, list[Any]]] = []  # (deadline, seq, [task or None])
        self._seq = 0
        # trio reads the time ~200 times a run (every tick, every trio.sleep): an attribute read
        # through a C callable, with no Python frame for it (shadows the method below)
        self.current_time = _now_reader(self)  # type: ignore[method-assign]

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        sleepers = self._sleepers
        while sleepers and sleepers[0][2][0] is None:  # cancelled sleeps
            heapq.heappop(sleepers)
        if sleepers and sleepers[0][0] < deadline:
            deadline = sleepers[0][0]
        jump = deadline - self._now
        if 0 < jump < _INF:
            entry = _trio_run.GLOBAL_RUN_CONTEXT.runner.entry_queue
            if not (entry.queue or entry.idempotent_queue):
                self._now += jump  # MockClock.jump's arithmetic: the same floats, so the same expiries
                now = self._now
                while sleepers and sleepers[0][0] <= now:  # due: into this tick's batch
                    cell = heapq.heappop(sleepers)[2]
                    task = cell[0]
                    if task is not None:
                        cell[0] = None
                        trio.lowlevel.reschedule(task)
        return 0.0

    async def sleep(self, seconds: float) -> None:
        """``trio.sleep(seconds)`` (a checkpoint; cancellable), for ``seconds > 0``."""
        now = self._now
        deadline = now + seconds
        if deadline <= now:  # too small to move the clock: trio.sleep's scope would expire at once
            await trio.lowlevel.checkpoint()
            return
        cell: list[Any] = [_current_task()]
        seq = self._seq
        self._seq = seq + 1
        _heappush(self._sleepers, (deadline, seq, cell))
        await _sleep_trap(cell)


def _now_reader(clock: VirtualClock) -> Callable[[], float]:
    """``clock.current_time`` as a C callable (``getattr(clock, "_now")``): the same float, no frame."""
    return functools.partial(getattr, clock, "_now")


# (bound once: VirtualClock.sleep runs ~100 times a run)
_current_task = trio.lowlevel.current_task
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled
_heappush = heapq.heappush
_heappop = heapq.heappop


class Trace:
    """Every commit and every simulation event, hashed incrementally (the determinism witness)."""

    def __init__(self, keep: int = 0) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.count = 0
        self.keep = keep
        self.tail: list[str] = []

    def add(self, *parts: Any) -> None:
        line = "|".join([p.hex() if isinstance(p, (bytes, bytearray)) else str(p) for p in parts])
        self._h.update((line + "\n").encode())  # (one update: the same bytes hashed)
        self.count += 1
        if self.keep:
            self.tail.append(line)
            if len(self.tail) > self.keep:
                del self.tail[0]

    def add_line(self, line: str) -> None:
        """:meth:`add` of a line its caller joined (the commit line, ~11 a run: one f-string)."""
        self._h.update((line + "\n").encode())
        self.count += 1
        if self.keep:
            self.tail.append(line)
            if len(self.tail) > self.keep:
                del self.tail[0]

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Process:
    """One incarnation of an application process over its own database handle."""

    def __init__(self, world: "World", name: str, incarnation: int) -> None:
        self.world = world
        self.name = name
        self.incarnation = incarnation
        self.label = f"{name}#{incarnation}"  # (in every trace line the process writes: built once)
        self.db = RecordingDatabase(world.engine.engine, self)
        self.dead = False
        self.clogged_until = 0.0  # kv requests wait until then (a partition: the stale-worker fault)
        self.clog_only: str | None = None  # ... only those of tasks of this name wait (unclog's hold)
        self._unclogged = trio.Event()
        self.app: Any = None
        self.ready = trio.Event()
        self.stopped = trio.Event()
        self._scopes: set[trio.CancelScope] = set()

    def kill(self, why: str) -> None:
        """The process dies here: everything it runs, and every client call into it, is cancelled."""
        if self.dead:
            return
        self.dead = True
        world = self.world
        if world.first_crash_cpu is None:
            world.first_crash_cpu = _process_time()
        world.trace.add("crash", self.label, why, f"{world.now():.6f}")
        self.world.stats["crashes"] += 1
        for s in list(self._scopes):
            s.cancel()
        self.ready.set()  # whoever waits for this incarnation to come up must look again

    @contextmanager
    def attached(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that dies with this process (for the process's own tasks and client calls)."""
        with trio.CancelScope() as scope:
            if self.dead:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def clog(self, seconds: float) -> None:
        """Cut this process off from the store: its kv requests wait (a partition, FDB's clogging)."""
        self.clogged_until = self.world.now() + seconds
        self.clog_only = None
        self._unclogged = trio.Event()
        self.world.fault("clog", self.label)

    def unclog(self, hold: str | None = None, hold_seconds: float = 0.0) -> None:
        """Let the process's kv requests go — except, with ``hold``, those of its tasks named so,
        which wait ``hold_seconds`` more (the stale-write-first scenario holds the lease keeper:
        the stale worker's pending write goes before the keeper can learn of the takeover)."""
        woken = self._unclogged
        if hold is not None and hold_seconds > 0:
            self.clogged_until = self.world.now() + hold_seconds
            self.clog_only = hold
            self._unclogged = trio.Event()  # (the held wait on a fresh one)
        else:
            self.clogged_until = 0.0
        woken.set()
        self.world.trace.add("unclog", self.label)

    async def wait_unclogged(self) -> None:
        while self.clogged_until > self.world.now():
            if self.clog_only is not None:
                if trio.lowlevel.current_task().name != self.clog_only:
                    return  # (not a held task)
                self.world.fault("clog.held", self.label)  # (a held request: the hold took effect)
            with trio.move_on_after(self.clogged_until - self.world.now()):
                await self._unclogged.wait()

    def check_alive(self) -> None:
        if self.dead:
            raise Crash(f"{self.label} is dead")


Boot = Callable[[Process], AsyncContextManager[Any]]


class World:
    """One simulation run's universe.  Build, then :meth:`run` a scenario coroutine in it."""

    def __init__(self, seed: int, plan: FaultPlan | None = None, *, trace_keep: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.plan = plan or FaultPlan()
        self.buggify = Buggify(self.rng, enabled=self.plan.buggify)
        self.trace = Trace(trace_keep)
        # transactions: every kv transaction created by a process or the checks (RecordingDatabase);
        # task_steps: trio task steps (counted by the scheduler's PRNG, _SchedulerRandom)
        self.stats: dict[str, int] = {"crashes": 0, "restarts": 0, "commits": 0, "writes": 0,
                                      "transactions": 0, "task_steps": 0}
        self.faults: dict[str, int] = {}
        self.violations: list[Violation] = []
        self.clock = VirtualClock()
        self.oracle = Oracle()
        self.hooks = SimHooks(self)
        # kv's backoff jitter draws from the world's PRNG too (one PRNG for every choice).
        # (the engine reads its clock on every read version and commit, ~170 times a run: the
        # virtual time through a C callable, no Python frame; the same float as self.now())
        self.engine = kv.MemoryEngine(clock=_now_reader(self.clock), hooks=self.hooks, rng=self.rng)
        self.processes: dict[str, Process] = {}
        self._booted: dict[str, trio.Event] = {}
        self.stopping = False
        self.effects: dict[str, int] = {}  # external effects, counted outside every process
        # called with the committing process after each applied commit; True removes the listener
        self.commit_listeners: list[Callable[[Any], bool]] = []
        self.finished_at = 0.0
        # Process CPU time (time.process_time) when the first process died: a run's CPU before it is
        # its prefix, the part a prefix-sharing scheme (forking, snapshots) could skip.  Measured,
        # never part of the trace.
        self.first_crash_cpu: float | None = None
        # Snapshots for crash runs that start at their crash point (sim.resume): the recorder says
        # which to take, ``scenario`` is what they hold of the clients.
        self.recorder: Any = None
        self.scenario: Any = None
        self.scheduler_state: tuple[Any, int] | None = None  # a resumed run's scheduler PRNG
        self._root: trio.CancelScope | None = None
        self.aborted = False  # stopped at its crash point: it goes on from the snapshot (sim.resume)

    @property
    def faults_on(self) -> bool:
        """BUGGIFY sites fire only while this is true (off for recovery to quiescence)."""
        return self.buggify.gate

    @faults_on.setter
    def faults_on(self, on: bool) -> None:
        self.buggify.gate = on
        self.trace.add("faults", on)

    # -- time and randomness --------------------------------------------

    def now(self) -> float:
        return self.clock._now  # VirtualClock.current_time, minus a call (0.0 until the run starts)

    def wall(self) -> float:
        return SIM_EPOCH + self.now()

    def latency(self, commit: bool) -> float | None:
        """Seconds a simulated kv request takes: None (answered at once), 0 (a yield) or a little.

        Commits always yield (so transactions interleave and conflict); reads
        mostly answer at once, as the memory engine's do, and sometimes yield
        or wait a little, so read versions and commits interleave too.
        (Called on every kv request: the BUGGIFY site is only consulted when
        BUGGIFY is on.)
        """
        b = self.buggify
        if b.enabled and b.gate and b("kv.latency"):
            return self.rng.random() * 0.05
        r = self.rng.random()
        if r < 0.3:
            return r * 0.006  # 0 - 1.8 ms
        if commit or r < 0.5:
            return 0.0
        return None

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    # -- bookkeeping -----------------------------------------------------

    def fault(self, kind: str, *detail: Any) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.trace.add("fault", kind, *detail)

    def violate(self, invariant: str, promise: int | None, detail: str) -> None:
        v = Violation(invariant, promise, detail)
        if v not in self.violations:
            self.violations.append(v)
            self.trace.add("violation", invariant)

    def effect(self, proc: Process | None, key: str) -> int:
        """Record one external side effect (a tool's far end); refused if the process is dead."""
        if proc is not None:
            proc.check_alive()
        n = self.effects.get(key, 0) + 1
        self.effects[key] = n
        self.trace.add("effect", key, n, proc.label if proc else "-")
        return n

    def snapshot(self, proc: "Process | None", k: int, when: str) -> None:
        """At write k (``before``: handed to the engine; ``after``: resolved): record a snapshot if
        the recorder wants this one and a crash of ``proc`` here can be resumed (sim.resume).  A run
        whose crash plan names this point stops here: it goes on from the snapshot instead."""
        from . import resume

        rec = self.recorder
        if not rec.wants(k, when) or not resume.resumable(self, proc):
            return
        rec.snapshots[(k, when)] = resume.capture(self, proc, k, when)
        if rec.only is not None:
            self.aborted = True
            assert self._root is not None
            self._root.cancel()

    # -- processes -------------------------------------------------------

    async def supervise(self, name: str, boot: Boot, *, task_status: Any = trio.TASK_STATUS_IGNORED,
                        after_crash: "Process | None" = None, started: bool = False) -> None:
        """Keep process ``name`` running: boot it, and after each crash boot it again on what survived.

        ``after_crash``: a run resumed from a snapshot (sim.resume) starts with that incarnation just
        dead, so the supervisor's first act is the restart; ``started``: whether the harness had
        already been told the process was up (else it is told at the next boot, as at a first boot).
        """
        incarnation = 0
        if after_crash is not None:
            incarnation = after_crash.incarnation
            if started:
                task_status.started(after_crash)
            self.stats["restarts"] += 1
            await trio.sleep(RESTART_DELAY_SECONDS)
        while True:
            incarnation += 1
            proc = Process(self, name, incarnation)
            self.processes[name] = proc
            self._booted.pop(name, trio.Event()).set()
            self.trace.add("boot", proc.label, f"{self.now():.6f}")
            try:
                with proc.attached():
                    async with boot(proc) as app:
                        proc.app = app
                        proc.ready.set()
                        if not started:
                            started = True
                            task_status.started(proc)
                        await trio.sleep_forever()
            except BaseException as exc:  # noqa: BLE001 - a crashed process unwinds with anything
                if not proc.dead:
                    if self.stopping:
                        raise  # the world is shutting down
                    # The application died on its own: that is a finding, and the process restarts.
                    self.violate("no_unexpected_exception", None, f"{proc.label}: {_describe(exc)}")
                    proc.kill("unexpected exception")
            finally:
                proc.stopped.set()
            if self.stats["restarts"] >= MAX_RESTARTS:
                self.violate("bounded_restarts", None, f"more than {MAX_RESTARTS} restarts")
                if not started:
                    task_status.started(proc)
                await trio.sleep_forever()
            self.stats["restarts"] += 1
            await trio.sleep(RESTART_DELAY_SECONDS)

    def current(self, name: str) -> Process:
        return self.processes[name]

    async def call(self, name: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """A client call into process ``name``'s app; :class:`ProcessDied` if it crashes meanwhile."""
        while True:
            proc = self.processes[name]
            if proc.dead:  # wait for the supervisor to boot the next incarnation
                if self.processes[name] is proc:
                    await self._booted.setdefault(name, trio.Event()).wait()
                continue
            if not proc.ready.is_set():  # (Event.wait is a schedule point even when set: skip it)
                await proc.ready.wait()
                if proc.dead:
                    continue
            break
        result: Any = None
        finished = False
        scope = trio.CancelScope()  # (proc.attached() inlined: one per client call; proc is alive here)
        scopes = proc._scopes
        try:
            with scope:
                scopes.add(scope)
                try:
                    result = await fn(proc.app)
                    finished = True
                finally:
                    scopes.discard(scope)
        except Crash:
            pass
        except BaseExceptionGroup as eg:  # noqa: F821 - py311 builtin
            if not (proc.dead and _only_crashes(eg)):
                raise
        if not finished:
            raise ProcessDied(proc.label)
        return result

    # -- running ---------------------------------------------------------

    def run(self, main: Callable[["World"], Awaitable[None]]) -> None:
        """Run ``main(world)`` to completion in virtual time, deterministically from the seed."""

        async def entry() -> None:
            stuck: list[str] = []

            async def watchdog() -> None:
                await trio.sleep(MAX_VIRTUAL_SECONDS - 1 - self.now())  # (a resumed run starts later)
                stuck.extend(_stuck_tasks())
                self.stopping = True

            with trio.move_on_at(MAX_VIRTUAL_SECONDS) as cs:
                self._root = cs
                async with trio.open_nursery() as n:
                    n.start_soon(watchdog)
                    await main(self)
                    n.cancel_scope.cancel()
            if self.aborted:
                return
            if cs.cancelled_caught:
                self.violate("quiescence", 4, f"the run did not quiesce within {MAX_VIRTUAL_SECONDS / 3600:.0f} "
                             f"virtual hours; waiting: {'; '.join(stuck[:8])}")
            self.finished_at = self.now()

        with deterministic_process_state(self):
            host = _host() if trio.run is _TRIO_RUN else None  # (a patched trio.run: a test's instrument)
            if host is not None:
                host.run(entry, self.clock)
            else:
                trio.run(entry, clock=self.clock, strict_exception_groups=True)
        if not self.aborted:
            self.trace.add("end", f"{self.finished_at:.6f}", self.stats["commits"])


_TRIO_RUN = trio.run
# The trio whose internals _TrioHost copies (its event loop, Runner.reschedule, a cancel scope's
# deadline update, current_time). pyproject allows older trios for the rest of surefoot; on any
# other trio the sim runs each run in a fresh trio.run, as before the host: slower, the same runs.
HOSTED_TRIO = "0.32."
HOST_AVAILABLE = trio.__version__.startswith(HOSTED_TRIO)
# A hosted run that leaves work behind in trio (a task in its system nursery, a run_sync_soon
# callback) is given at most this many more scheduler ticks to finish it before the host is retired.
HOST_DRAIN_TICKS = 1_000
assert HOST_DRAIN_TICKS > 0


class _NoneValue:
    """What trio's ``reschedule`` sends a woken task by default — ``outcome.Value(None)`` — made
    once: every trap that waits (``wait_task_rescheduled``, ``cancel_shielded_checkpoint``)
    ``unwrap``s what it is sent, which is None here.  (``Value`` is a frozen attrs class whose
    construction and once-only ``unwrap`` were ~1.1% of the bench; a task is woken ~170 times a run.)"""

    __slots__ = ()

    def unwrap(self) -> None:
        return None

    def __repr__(self) -> str:
        return "Value(None)"


_NONE_VALUE = _NoneValue()


class _WaitTaskRescheduled:
    """trio's ``WaitTaskRescheduled`` trap message (a frozen attrs class: its ``__init__`` sets its one
    field through ``object.__setattr__``) as a plain slotted object, during hosted runs; the host's
    loop takes either."""

    __slots__ = ("abort_func",)

    def __init__(self, abort_func: Callable[[Any], Any]) -> None:
        self.abort_func = abort_func


def _reschedule(self: Any, task: Any, next_send: Any = _trio_run._NO_SEND) -> None:
    """``Runner.reschedule`` during hosted runs: trio's, less its guest-mode test and its check that
    the task belongs to this Runner (there is one), with the default wake-up value made once."""
    if next_send is _TRIO_NO_SEND:
        next_send = _NONE_VALUE
    assert task._next_send_fn is None
    task._next_send_fn = task.coro.send
    task._next_send = next_send
    task._abort_func = None
    task.custom_sleep_data = None
    self.runq.append(task)
    if "task_scheduled" in self.instruments:
        self.instruments.call("task_scheduled", task)


class _DeadlineUpdate:
    """``CancelScope._might_change_registered_deadline`` during hosted runs: trio's is a
    ``@contextmanager`` generator (a generator and a ``_GeneratorContextManager`` for every cancel
    scope entered, exited or cancelled: ~1.5% of the bench); this is the same ``finally`` as a
    plain context manager — on exit, re-register the scope's deadline with the Runner if it
    changed (no guest mode here)."""

    __slots__ = ("scope",)

    def __init__(self, scope: Any) -> None:
        self.scope = scope

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        scope = self.scope
        old = scope._registered_deadline
        new = _INF if scope._cancel_status is None or scope._cancel_called else scope._deadline
        if old != new:
            scope._registered_deadline = new
            deadlines = _trio_run.GLOBAL_RUN_CONTEXT.runner.deadlines
            if old != _INF:
                deadlines.remove(old, scope)
            if new != _INF:
                deadlines.add(new, scope)
        return False


def _deadline_update(self: Any) -> _DeadlineUpdate:
    return _DeadlineUpdate(self)


_TRIO_DEADLINE_UPDATE = _trio_run.CancelScope._might_change_registered_deadline
_TRIO_CURRENT_TIME = _trio_run.current_time  # type: ignore[attr-defined]
_TRIO_NO_SEND = _trio_run._NO_SEND
_TRIO_RESCHEDULE = _trio_run.Runner.reschedule
_TRIO_WAIT_MESSAGE = _trio_traps.WaitTaskRescheduled


class _TrioHost:
    """One trio run that hosts the simulation's runs one after another.

    Why: a fresh ``trio.run`` per simulated run costs ~0.7 ms of set-up and tear-down (the Runner,
    its I/O manager's epoll and wake-up sockets, the signal set-up, trio's init task and three
    nurseries, the run_sync_soon task, the async-generator hooks, and all of it torn down again),
    ~5% of the bench's CPU, the same in every run.  The host does that once per thread and runs
    each simulated run's ``entry`` inline in its main task, stepping trio's event loop itself
    (:meth:`_loop`, trio's ``unrolled_run``), and pausing it when the run is over.

    The same run, step for step (the trace witnesses it; tests/sim compares hosted runs with runs
    in a fresh ``trio.run``).  What a run meets in trio is what a fresh run gives it:

    * the scheduler: each run's seeded PRNG (``_r``) is installed around it as before, and a fresh
      run's only scheduling before ``entry`` starts — its second tick, which steps the main task and
      the run_sync_soon task in one shuffled batch — is drawn from it exactly (``_START_BATCH``);
      trio sorts a batch by task creation order before shuffling, and here as there the main task
      was created before the run_sync_soon task and both before any task of the run;
    * the clock: the Runner's clock is the run's ``VirtualClock`` for the run;
    * the main task's context: a copy of the caller's, as ``trio.run`` takes it;
    * what a fresh run's tear-down does after ``entry`` returns — close the async generators still
      alive (the run's, e.g. a model stream dropped unfinished), let the run_sync_soon callbacks
      and the system tasks they start finish — is done before the run returns, inside its world,
      so nothing of one run reaches the next.  If a run leaves more than that behind (or raises),
      the host is retired and the next run gets a new one.

    Between runs the thread is not in trio (``GLOBAL_RUN_CONTEXT`` and the async-generator hooks are
    put back), so synchronous code and other ``trio.run`` calls (tests) see no run.  The host
    installs no SIGINT handler (trio's KeyboardInterrupt protection): Ctrl-C interrupts a hosted run
    as it interrupts any Python code.
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.idle_clock = VirtualClock()
        self.context = contextvars.copy_context()
        self.broken = False
        self.closed = False
        self.idle = False
        self.task: Any = None
        self.result: Any = None
        saved_r, saved_hooks = _trio_run._r, sys.get_asyncgen_hooks()
        _trio_run._r = _SchedulerRandom(0)  # (the host's own start draws from no run's PRNG)
        try:
            runner = self.runner = _trio_run.Runner(
                clock=self.idle_clock, instruments=_SimInstruments(()), io_manager=_SimIOManager(),
                system_context=contextvars.copy_context(), ki_manager=_trio_run.KIManager(),
                strict_exception_groups=True)
            runner.asyncgens.install_hooks(runner)
            self.hooks = sys.get_asyncgen_hooks()
            _trio_run.GLOBAL_RUN_CONTEXT.runner = runner
            # (unrolled_run's start, without its signal wake-up fd: no SIGINT handler here)
            runner.clock.start_clock()
            runner.init_task = runner.spawn_impl(runner.init, (self._main, ()), None, "<init>", system_task=True)
            self._loop()  # to the main task's first wait for a run
        finally:
            _trio_run._r = saved_r
            sys.set_asyncgen_hooks(*saved_hooks)
            _trio_run.GLOBAL_RUN_CONTEXT.__dict__.pop("runner", None)
            _trio_run.GLOBAL_RUN_CONTEXT.__dict__.pop("task", None)
        assert self.idle and self.task is not None and not self.broken

    async def _main(self) -> None:
        self.task = _current_task()
        while True:
            self.idle = True
            entry = await _wait_task_rescheduled(_never_abort)
            self.idle = False
            if entry is None:
                return
            self.result = await outcome.acapture(entry)
            del entry
            # a fresh run's tear-down: close the async generators still alive (its finalize_remaining)
            alive = self.runner.asyncgens.alive
            for agen in list(alive):
                alive.discard(agen)
                try:
                    await agen.aclose()
                except BaseException:  # noqa: BLE001 - as trio's finaliser, which logs and goes on
                    pass
                del agen

    def _quiet(self) -> bool:
        runner = self.runner
        entry = runner.entry_queue
        return (self.idle and not runner.runq and not entry.queue and not entry.idempotent_queue
                and not runner.system_nursery.child_tasks)

    def _loop(self, until_idle: bool = True) -> None:
        """trio's event loop (``trio._core._run.unrolled_run``, trio 0.32), run here until the main
        task waits for the next run and nothing else is left to do (``until_idle``), or until no
        task is left (the end of the host); a host that does not get quiet is retired (``broken``).

        The same ticks in the same order as trio's: each tick computes the I/O timeout (asking the
        clock, which jumps virtual time, when nothing is runnable), polls, expires deadlines, then
        steps every task runnable at its start, in the order the seeded PRNG shuffles them after
        sorting them by creation.  Leaner where the simulation allows it: no guest mode, no
        KeyboardInterrupt delivery (none is installed), the I/O manager polled only when the entry
        queue holds work or a wait is asked for (what ``_SimIOManager.get_events`` decides), the
        deadline heap consulted only when due (or due a prune), and a batch of one task neither
        sorted nor shuffled (sorting and shuffling one item draws nothing: ``_SchedulerRandom``
        counts its step).  Instruments are still called (a test may add one during a run).
        """
        runner = self.runner
        runq = runner.runq
        deadlines = runner.deadlines
        heap = deadlines._heap
        io_manager = runner.io_manager
        entry = runner.entry_queue
        instruments = runner.instruments
        reschedule = runner.reschedule
        ctx = _trio_run.GLOBAL_RUN_CONTEXT
        drain = 0
        while runner.tasks:
            if until_idle and self.idle:
                if self._quiet():
                    return
                drain += 1
                if drain > HOST_DRAIN_TICKS:
                    self.broken = True
                    return
            if runq:
                timeout: float = 0
            elif type(runner.clock) is VirtualClock:
                # VirtualClock.deadline_to_sleep_time inlined (the same jump, the same floats; keep
                # the two in step — tests/sim compares hosted runs with fresh trio.run ones): when
                # nothing is runnable, time jumps to the next deadline or sleeper and wakes the due
                # sleepers into this tick, unless the entry queue holds work; the answer is 0
                clock = runner.clock
                deadline = _INF  # (Deadlines.next_deadline inlined: drop stale entries, take the first live one)
                while heap:
                    first = heap[0]
                    if first[0] == first[2]._registered_deadline:
                        deadline = first[0]
                        break
                    _heappop(heap)
                sleepers = clock._sleepers
                while sleepers and sleepers[0][2][0] is None:  # cancelled sleeps
                    _heappop(sleepers)
                if sleepers and sleepers[0][0] < deadline:
                    deadline = sleepers[0][0]
                jump = deadline - clock._now
                if 0 < jump < _INF and not (entry.queue or entry.idempotent_queue):
                    clock._now += jump
                    now = clock._now
                    while sleepers and sleepers[0][0] <= now:
                        cell = _heappop(sleepers)[2]
                        sleeper = cell[0]
                        if sleeper is not None:
                            cell[0] = None
                            reschedule(sleeper)
                timeout = 0
            else:
                timeout = runner.clock.deadline_to_sleep_time(deadlines.next_deadline())
                timeout = min(max(0, timeout), _TRIO_MAX_TIMEOUT)
            idle_primed = None
            if runner.waiting_for_idle:
                cushion, _ = runner.waiting_for_idle.keys()[0]
                if cushion < timeout:
                    timeout = cushion
                    idle_primed = _trio_run.IdlePrimedTypes.WAITING_FOR_IDLE
            elif runner.clock_autojump_threshold < timeout:
                timeout = runner.clock_autojump_threshold
                idle_primed = _trio_run.IdlePrimedTypes.AUTOJUMP_CLOCK
            if "before_io_wait" in instruments:
                instruments.call("before_io_wait", timeout)
            events: Any = ()
            if timeout or entry.queue or entry.idempotent_queue:
                events = io_manager.get_events(timeout)
                if events:
                    io_manager.process_events(events)
            if "after_io_wait" in instruments:
                instruments.call("after_io_wait", timeout)
            if heap and (heap[0][0] <= runner.clock.current_time()
                         or len(heap) > deadlines._active * 2 + _trio_run.DEADLINE_HEAP_MIN_PRUNE_THRESHOLD):
                if deadlines.expire(runner.clock.current_time()):
                    idle_primed = None
            if idle_primed is not None and not runq and not events:
                if idle_primed is _trio_run.IdlePrimedTypes.WAITING_FOR_IDLE:
                    while runner.waiting_for_idle:
                        key, task = runner.waiting_for_idle.peekitem(0)
                        if key[0] == cushion:
                            del runner.waiting_for_idle[key]
                            runner.reschedule(task)
                        else:
                            break
                else:
                    runner.clock._autojump()
            batch = list(runq)
            runq.clear()
            r = _trio_run._r
            if _trio_run._ALLOW_DETERMINISTIC_SCHEDULING:
                if len(batch) > 1 or type(r) is not _SchedulerRandom:
                    batch.sort(key=_TASK_ORDER)
                    r.shuffle(batch)
                elif batch:
                    r.steps += 1
            elif r.random() < 0.5:
                batch.reverse()
            while batch:
                task = batch.pop()
                ctx.task = task
                if "before_task_step" in instruments:
                    instruments.call("before_task_step", task)
                next_send_fn = task._next_send_fn
                next_send = task._next_send
                task._next_send_fn = task._next_send = None
                final_outcome: Any = None
                try:
                    msg = task.context.run(next_send_fn, next_send)
                except StopIteration as stop_iteration:
                    final_outcome = outcome.Value(stop_iteration.value)
                except BaseException as task_exc:
                    tb = task_exc.__traceback__
                    for _ in range(1 + _trio_run.CONTEXT_RUN_TB_FRAMES):
                        if tb is not None:
                            tb = tb.tb_next
                    final_outcome = outcome.Error(task_exc.with_traceback(tb))
                    del tb
                if final_outcome is not None:
                    runner.task_exited(task, final_outcome)
                    final_outcome = None
                else:
                    task._schedule_points += 1
                    if msg is _trio_run.CancelShieldedCheckpoint:
                        runner.reschedule(task)
                    elif type(msg) is _WaitTaskRescheduled or type(msg) is _trio_run.WaitTaskRescheduled:
                        task._cancel_points += 1
                        task._abort_func = msg.abort_func
                        if task._cancel_status.effectively_cancelled:  # (its method's own first test)
                            task._attempt_delivery_of_any_pending_cancel()
                    elif type(msg) is _trio_run.PermanentlyDetachCoroutineObject:
                        runner.task_exited(task, msg.final_outcome)
                    else:
                        exc = TypeError(f"trio.run received unrecognized yield message {msg!r}.")
                        runner.reschedule(task, exc)  # type: ignore[arg-type]
                        task._next_send_fn = task.coro.throw
                    del msg
                if "after_task_step" in instruments:
                    instruments.call("after_task_step", task)
                del ctx.task
                del task, next_send, next_send_fn

    def run(self, entry: Callable[[], Awaitable[None]], clock: VirtualClock) -> None:
        """``trio.run(entry, clock=clock)``, hosted; inside :func:`deterministic_process_state`."""
        runner = self.runner
        # a fresh run's second tick (see above): its draws, not its steps (the task steps counted are
        # the run's own; a fresh trio.run adds 8 of its own start and tear-down)
        random.Random.shuffle(_trio_run._r, _START_BATCH.copy())
        saved_hooks = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(*self.hooks)
        _trio_run.GLOBAL_RUN_CONTEXT.runner = runner
        saved_lib, _sniffio_library.name = _sniffio_library.name, "trio"
        runner.clock = clock
        # what a fresh trio.run starts without: RunVar values and instruments an earlier run left
        if runner._locals:
            runner._locals.clear()
        if len(runner.instruments) > 1 or runner.instruments["_all"]:
            runner.instruments = _SimInstruments(())
        task = self.task
        task.context = contextvars.copy_context()  # (the caller's, as trio.run gives its main task)
        self.idle = False
        _trio_run.Runner.reschedule = _reschedule  # type: ignore[method-assign]
        _trio_traps.WaitTaskRescheduled = _WaitTaskRescheduled  # type: ignore[misc]
        _trio_run.CancelScope._might_change_registered_deadline = _deadline_update  # type: ignore[method-assign]
        # (trio's cancel scopes read the time through current_time(): a wrapper, the Runner's method,
        # then the clock; here the run's clock read directly, the same float, no Python frame)
        _trio_run.current_time = _now_reader(clock)  # type: ignore[attr-defined]
        runner.reschedule(task, outcome.Value(entry))
        try:
            self._loop()
        except BaseException:
            self.broken = True
            raise
        finally:
            _trio_run.Runner.reschedule = _TRIO_RESCHEDULE  # type: ignore[method-assign]
            _trio_traps.WaitTaskRescheduled = _TRIO_WAIT_MESSAGE  # type: ignore[misc]
            _trio_run.CancelScope._might_change_registered_deadline = _TRIO_DEADLINE_UPDATE  # type: ignore[method-assign]
            _trio_run.current_time = _TRIO_CURRENT_TIME  # type: ignore[attr-defined]
            runner.clock = self.idle_clock
            task.context = self.context  # (drop the run's context: nothing of it lives on)
            _sniffio_library.name = saved_lib
            _trio_run.GLOBAL_RUN_CONTEXT.__dict__.pop("runner", None)
            _trio_run.GLOBAL_RUN_CONTEXT.__dict__.pop("task", None)
            sys.set_asyncgen_hooks(*saved_hooks)
            if self.broken:
                _retire(self)
        result, self.result = self.result, None
        if result is None:
            raise RuntimeError("a hosted simulation run did not finish")
        if isinstance(result, outcome.Error):  # (the host is sound, but start the next run afresh)
            _retire(self)
        result.unwrap()

    def close(self) -> None:
        """End the hosted run as ``trio.run`` ends: the main task returns, trio's init task shuts
        the system tasks down and closes what is left, then the Runner closes."""
        if self.closed:
            return
        self.closed = True
        runner = self.runner
        saved_hooks = sys.get_asyncgen_hooks()
        try:
            sys.set_asyncgen_hooks(*self.hooks)
            _trio_run.GLOBAL_RUN_CONTEXT.runner = runner
            if not self.broken and self.idle:
                runner.reschedule(self.task, outcome.Value(None))
                self._loop(until_idle=False)
            else:  # (the loop is in no state to finish: drop what is left)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for task in list(runner.tasks):
                        try:
                            task.coro.close()
                        except BaseException:  # noqa: BLE001
                            pass
            runner.close()
        finally:
            _trio_run.GLOBAL_RUN_CONTEXT.__dict__.clear()
            sys.set_asyncgen_hooks(*saved_hooks)


def _never_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # (the host's main task is never cancelled while it waits)


# (what trio shuffles in a fresh run's second tick: the main task and the run_sync_soon task)
_START_BATCH = [0, 1]
_TASK_ORDER = operator.attrgetter("_counter")  # (trio's batch.sort key, without a lambda)
_TRIO_MAX_TIMEOUT = _trio_run._MAX_TIMEOUT
_hosts: dict[int, _TrioHost] = {}


def _host() -> "_TrioHost | None":
    """This thread's host (made on first use), or None where a fresh ``trio.run`` must be used: a
    trio other than the one the host copies (``HOSTED_TRIO``), or inside a trio run already (nested
    runs are refused as ``trio.run`` refuses them)."""
    if not HOST_AVAILABLE or _trio_run.GLOBAL_RUN_CONTEXT.__dict__.get("runner") is not None:
        return None
    host = _hosts.get(threading.get_ident())
    if host is None or host.broken:
        host = _hosts[threading.get_ident()] = _TrioHost()
    return host


def _retire(host: _TrioHost) -> None:
    """Close ``host``; the thread's next run gets a new one."""
    if _hosts.get(host.thread) is host:
        del _hosts[host.thread]
    try:
        host.close()
    except BaseException:  # noqa: BLE001 - a retired host's leftovers are dropped
        pass


@atexit.register
def _close_hosts() -> None:
    for host in list(_hosts.values()):
        _retire(host)


def _stuck_tasks() -> list[str]:
    """Where every task is parked (the innermost frame of interest), for a liveness report."""
    out: list[str] = []

    def walk(task: Any) -> None:
        frames = []
        coro = task.coro
        while coro is not None:
            f = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if f is not None:
                frames.append(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}:{f.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        interesting = [x for x in frames if not x.startswith(("_run.py", "_core", "_timeouts.py", "contextlib.py"))]
        if not task.child_nurseries:
            out.append(f"{task.name.rsplit('.', 1)[-1]} @ {' > '.join(interesting[-3:])}")
        for n in task.child_nurseries:
            for t in n.child_tasks:
                walk(t)

    walk(trio.lowlevel.current_root_task())
    return out


def _only_crashes(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):  # noqa: F821
        return all(_only_crashes(e) for e in exc.exceptions)
    return isinstance(exc, (Crash, trio.Cancelled, ProcessDied))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):  # noqa: F821
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        return "; ".join(_describe(e) for e in inner) or "cancelled"
    import traceback

    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 2)[-2:]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
