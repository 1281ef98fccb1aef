"""Crash runs that start at their crash point: snapshots of the world at a write, and the resume.

A crash at write k kills the simulated process.  What survives is the
durable state of the memory engine at that instant and everything outside
the process: the clients (which acknowledgements they heard, which calls
were out, where they slept until, their journal cursors — recorded as they
go in ``Scenario.clients``, :class:`sim.harness.ClientState`), the
effects counted by the world, the virtual clock, the PRNG streams and the
trace so far.  :func:`capture` copies exactly that when a run reaches a
write; :func:`restore` builds a fresh world from it in which the process
has just died, and the harness runs it on from there: the supervisor boots
the next incarnation after the restart delay, the clients resume (a call
that was out is retried, as after a ProcessDied), recovery runs to
quiescence and every check runs as before (a kv-cycle relink that was out is
lost, as the ProcessDied would have told its client).  So crash run k does not re-run
the history up to write k: the fault-free run takes a snapshot at each write
(before and after it), and each crash run starts from its own.

Which runs can be resumed (:func:`resumable`): the scenarios with one process
whose clients record where they are (``Scenario.resumable``): the
RuntimeScenarios and the raw-kv workloads (kv-cycle, kv-outbox).  With two
processes, the other one lives on through the crash with in-memory state
(leases held, tools running, transactions in flight) no snapshot can hold;
those re-run their prefix as before.  A resumed crash run is the same crash as a
re-run one up to the crash point and a legal schedule after it, but not the
same schedule (fresh tasks, a fresh run queue), so its trace differs from a
re-run's; every crash run of a resumable scenario takes this path (the
replay command ``--crash-before K`` too), so the same seed still gives the
same trace.

The memory engine's committed state is copied with its public
``snapshot_state``/``restore_state`` (kv.memory.MemoryState says what that
holds: histories, key index, version counters; not the resolver).
A fresh resolver is exact here: after a crash no transaction of the dead
process can commit, and every later one reads at a version past the crash.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trio._core import _run as _trio_run  # private: the scheduler's PRNG (see sim.world)

from kv.memory import MemoryState

if TYPE_CHECKING:
    from .world import Process, World

__all__ = ["Snapshot", "Recorder", "capture", "restore", "resumable"]

# Scenario attributes a snapshot shares with the run it came from instead of copying (derived
# from its turns, never changed), and the ones it leaves behind: the world (replaced) and the
# agents (a new process makes its own).
_SHARED = ("_reasoning_steps",)
_NOT_COPIED = ("world", "_agents") + _SHARED


@dataclass
class Snapshot:
    """The world at the instant a write was handed to the engine (``before``) or resolved (``after``)."""

    k: int
    when: str
    process: str  # the process that dies (the one whose write it is)
    incarnation: int
    drive_started: bool  # the harness had started the clients (else they start after the next boot)
    now: float
    rng: Any
    scheduler: Any
    scheduler_steps: int
    trace: Any  # the trace's hasher (a copy)
    trace_count: int
    trace_tail: list[str]  # (kept only for --show-trace)
    stats: dict[str, int]
    faults: dict[str, int]
    effects: dict[str, int]
    violations: list[Any]
    faults_on: bool
    buggify_sites: dict[str, bool]
    random_crashes: int
    kv: MemoryState  # the memory engine's committed state
    oracle: tuple[Any, ...]
    scenario: dict[str, Any]
    shared: dict[str, Any]
    scenario_type: type
    lease_holders: dict[bytes, tuple[int, str]]  # the fence check's (SimHooks.fence)


class Recorder:
    """Which snapshots a run takes: all of them (the fault-free run of an exhaustive session) or
    the one its crash plan names (a single crash run: the run stops right there, see the harness)."""

    def __init__(self, only: tuple[int, str] | None = None) -> None:
        self.only = only
        self.snapshots: dict[tuple[int, str], Snapshot] = {}

    def wants(self, k: int, when: str) -> bool:
        return self.only is None or self.only == (k, when)


def resumable(world: "World", proc: "Process | None") -> bool:
    """Can a crash of ``proc`` here start from a snapshot?  (One process, a RuntimeScenario, the
    world not shutting down, no commit listener — that is the stale-worker fault's.)"""
    sc = getattr(world, "scenario", None)
    return (proc is not None and sc is not None and getattr(sc, "resumable", False)
            and not world.stopping and not world.commit_listeners)


def capture(world: "World", proc: "Process", k: int, when: str) -> Snapshot:
    """Copy what survives a crash of ``proc`` right now (nothing of the process itself)."""
    sc = world.scenario
    oracle = world.oracle
    scheduler = _trio_run._r
    state = {key: v for key, v in sc.__dict__.items() if key not in _NOT_COPIED}
    # The turns are never changed once made (a fork appends one: the list is copied, not they):
    # shared, not deep-copied (half the copy's cost).
    memo: dict[int, Any] = {id(t): t for t in getattr(sc, "turns", ())}
    return Snapshot(
        k=k, when=when, process=proc.name, incarnation=proc.incarnation,
        drive_started="drive" in sc.clients,
        now=world.clock._now,
        rng=world.rng.getstate(),
        scheduler=scheduler.getstate(), scheduler_steps=getattr(scheduler, "steps", 0),
        trace=world.trace._h.copy(), trace_count=world.trace.count, trace_tail=list(world.trace.tail),
        stats=dict(world.stats), faults=dict(world.faults), effects=dict(world.effects),
        violations=list(world.violations), faults_on=world.buggify.gate,
        buggify_sites=dict(world.buggify.sites), random_crashes=world.hooks.random_crashes,
        kv=world.engine.snapshot_state(),
        oracle=(oracle.model.copy(), list(oracle.problems), oracle.transactions, oracle._last),
        scenario=_copy(state, memo),
        shared={key: sc.__dict__[key] for key in _SHARED if key in sc.__dict__},
        scenario_type=type(sc),
        lease_holders=dict(world.hooks.lease_holders),
    )


# What a scenario's recorded state is made of: immutable leaves (shared, as deepcopy shares them)
# and containers of them.
_LEAVES = frozenset((str, int, float, bool, type(None), bytes))


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)`` for what a scenario records, ~4x faster (a snapshot copies
    it at every write: this copy was half a snapshot's cost).  Dicts, lists, sets and tuples of
    immutable leaves and :class:`ClientState` are copied here, with the memo (a container met
    twice is copied once, as deepcopy does; the turns, put in the memo by :func:`capture`, are
    shared), a :class:`ClientState` by its ``__deepcopy__``; anything else by ``copy.deepcopy``.
    (deepcopy also keeps every copied original alive in the memo until the copy is done: here the
    state being copied holds them all anyway.)"""
    t = type(value)
    if t in _LEAVES:
        return value
    found = memo.get(id(value))
    if found is not None:
        return found
    if t is dict:
        new: Any = {}
        memo[id(value)] = new
        for k, v in value.items():
            new[k if type(k) in _LEAVES else _copy(k, memo)] = v if type(v) in _LEAVES else _copy(v, memo)
    elif t is list:
        new = []
        memo[id(value)] = new
        new.extend([v if type(v) in _LEAVES else _copy(v, memo) for v in value])
    elif t is tuple:
        for v in value:
            if type(v) not in _LEAVES:
                break
        else:  # (the usual tuple, a follower's (cursor, type): shared, as deepcopy shares it)
            return value
        items = [v if type(v) in _LEAVES else _copy(v, memo) for v in value]
        # (a tuple whose items copy to themselves is itself, as in deepcopy)
        new = value if all(a is b for a, b in zip(items, value)) else tuple(items)
        if new is not value:
            memo[id(value)] = new
        return new
    elif t is set and all(type(v) in _LEAVES for v in value):
        new = set(value)
        memo[id(value)] = new
    else:
        copier = getattr(t, "__deepcopy__", None)
        if copier is None:  # anything else: deepcopy itself
            return copy.deepcopy(value, memo)
        new = copier(value, memo)  # ClientState: what deepcopy would call, without its dispatch
        memo[id(value)] = new
    return new


def restore(world: "World", snap: Snapshot) -> tuple[Any, "Process"]:
    """Make the fresh ``world`` (same seed and plan) the snapshot's, the crashed process dead in it;
    returns the scenario, its clients where they were.  A snapshot is restored once (its copies
    become the new world's)."""
    from .world import Process

    assert world.stats["writes"] == 0, "restore into a fresh world"
    world.clock._now = snap.now
    world.rng.setstate(snap.rng)
    world.scheduler_state = (snap.scheduler, snap.scheduler_steps)
    world.trace._h = snap.trace
    world.trace.count = snap.trace_count
    world.trace.tail = snap.trace_tail[-world.trace.keep:] if world.trace.keep else []
    world.stats.update(snap.stats)
    world.faults.update(snap.faults)
    world.effects.update(snap.effects)
    world.violations.extend(snap.violations)
    world.buggify.gate = snap.faults_on
    world.buggify.sites.update(snap.buggify_sites)
    world.hooks.random_crashes = snap.random_crashes
    world.hooks.lease_holders.update(snap.lease_holders)
    world.engine.restore_state(snap.kv)
    oracle = world.oracle
    oracle.model, oracle.problems, oracle.transactions, oracle._last = snap.oracle
    sc = snap.scenario_type.__new__(snap.scenario_type)
    sc.__dict__.update(snap.scenario)
    sc.__dict__.update(snap.shared)
    sc.world = world
    sc.resumed()  # (a RuntimeScenario's agents: the next incarnation makes its own)
    world.scenario = sc
    # The crash itself, as SimHooks and Process.kill record it.
    dead = Process(world, snap.process, snap.incarnation)
    world.processes[snap.process] = dead
    world.fault(f"crash.{snap.when}_commit", snap.k)
    dead.kill(f"{snap.when} write {snap.k}")
    return sc, dead
