"""The simulated world: determinism, process-state hygiene, crash semantics, BUGGIFY, the kv oracle."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from trio._core import _run as trio_run

import kv
from sim import FaultPlan, Scenario, run_once
from sim.faults import BUGGIFY_ENABLE, BUGGIFY_FIRE, Buggify
from sim.harness import random_plan
from sim.kvworkloads import CycleScenario, OutboxScenario
from sim.scenarios import SCENARIOS
from sim.world import ProcessDied


@pytest.mark.parametrize("name", ["kv-cycle", "kv-outbox", "tool", "concurrent", "stale-worker", "cost-ceiling", "thinking",
                                  "thinking-interleaved"])
def test_same_seed_same_trace_different_seed_different_trace(name):
    factory = {"kv-cycle": CycleScenario, "kv-outbox": OutboxScenario}.get(name) or SCENARIOS[name]
    a = run_once(factory, 11, random_plan(11))
    b = run_once(factory, 11, random_plan(11))
    c = run_once(factory, 12, random_plan(12))
    assert a.trace == b.trace and a.commits == b.commits and a.faults == b.faults
    assert a.trace != c.trace


def test_determinism_across_processes_and_hash_seeds():
    """The private trio scheduler hooks (pinned trio range) give byte-identical traces in fresh processes."""
    code = ("import logging; logging.disable(logging.CRITICAL)\n"
            "from sim import run_once; from sim.harness import random_plan; from sim.scenarios import SCENARIOS\n"
            "for n in ('concurrent', 'thinking', 'thinking-interleaved', 'cost-ceiling'):\n"
            "    print(run_once(SCENARIOS[n], 5, random_plan(5)).trace)\n"
            # (a compaction moving several tool-call ids out of the window: loop.store wrote their
            # index keys in set order, which differs between hash seeds)
            "print(run_once(SCENARIOS['mix'], 13, random_plan(13)).trace)\n"
            # (a crash run resumed from its snapshot: sim.resume deep-copies the clients' records)
            "from sim import FaultPlan\n"
            "print(run_once(SCENARIOS['concurrent'], 5, FaultPlan().with_crash(9, 'after')).trace)")
    outs = set()
    for hashseed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert out.returncode == 0, out.stderr
        outs.add(out.stdout.strip())
    assert len(outs) == 1


def test_process_globals_are_restored_after_a_run():
    import sniffio

    def state():
        return (os.urandom, time.time, time.monotonic, random.Random.seed, trio_run._ALLOW_DETERMINISTIC_SCHEDULING,
                trio.sleep, trio_run._r, trio_run._r.getstate(), trio_run.TheIOManager, trio_run.Instruments,
                sys.get_asyncgen_hooks(), sniffio.thread_local.name, trio_run.Runner.reschedule,
                trio._core._traps.WaitTaskRescheduled, trio_run.CancelScope._might_change_registered_deadline,
                trio_run.current_time)

    saved = state()
    run_once(OutboxScenario, 3, random_plan(3))
    assert state() == saved
    assert len({os.urandom(8) for _ in range(3)}) == 3
    # between runs the thread is in no trio run (the runs' host, sim.world._TrioHost, is paused):
    # a plain trio.run works, and sees its own clock and async generators
    assert not hasattr(trio_run.GLOBAL_RUN_CONTEXT, "runner")

    async def plain():
        async def agen():
            yield trio.current_time()

        async for t in agen():
            return t

    assert trio.run(plain, clock=trio.testing.MockClock(rate=0, autojump_threshold=0)) == 0.0
    saved = state()  # (that run drew from trio's own scheduler PRNG)
    run_once(OutboxScenario, 3, random_plan(3))
    assert state() == saved


@pytest.mark.skipif(not __import__("sim.world").world.HOST_AVAILABLE,
                    reason="the sim's trio host copies trio 0.32's internals; other trios use a fresh trio.run")
def test_a_hosted_run_is_the_run_a_fresh_trio_run_gives():
    """The runs of a session share one trio.run (sim.world._TrioHost: its set-up and tear-down were
    ~5% of the bench); each run is step for step what it is in a fresh trio.run, including resumed
    crash runs and crash runs that stop at their crash point and go on from their snapshot, and a
    run that raises retires the host without affecting the next."""
    import sim.world
    from sim.harness import exhaustive

    def runs(name, seed):
        out = [(r.trace, r.writes, r.commits, r.checks, r.transactions, r.faults, r.violations)
               for r in exhaustive(SCENARIOS[name], seed, limit=3)]
        out.append(run_once(SCENARIOS[name], seed, FaultPlan().with_crash(2, "after")).trace)
        out.append(run_once(SCENARIOS[name], seed, random_plan(seed)).trace)
        return out

    hosted = {name: runs(name, 5) for name in ("tool", "two-runtimes", "thinking")}
    assert sim.world._hosts  # (the runs above were hosted)
    saved = sim.world._TRIO_RUN
    sim.world._TRIO_RUN = None  # every run in a fresh trio.run, as before the host
    try:
        assert {name: runs(name, 5) for name in hosted} == hosted
    finally:
        sim.world._TRIO_RUN = saved

    from sim.world import World

    async def boom(world):
        await trio.sleep(1)
        raise ValueError("boom")

    # what one run leaves in trio's Runner (a RunVar, an instrument) the next does not see
    var = trio.lowlevel.RunVar("sim_test_var", default="unset")
    seen = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task):
            seen.append(task)

    async def leaves(world):
        var.set("set")
        trio.lowlevel.add_instrument(Steps())
        await trio.sleep(1)

    async def looks(world):
        seen.clear()
        await trio.sleep(1)
        assert var.get() == "unset" and not seen

    World(1).run(leaves)
    assert seen
    World(1).run(looks)

    host = sim.world._host()
    with pytest.raises(BaseExceptionGroup) as raised:  # noqa: F821 - py311 builtin
        World(1).run(boom)
    assert raised.group_contains(ValueError, match="boom")
    assert sim.world._hosts.get(host.thread) is not host and host.closed  # (retired)
    assert runs("tool", 5) == hosted["tool"]


def test_trios_entry_queue_still_runs_in_the_world():
    """run_sync_soon (an async generator's finalizer, a signal) still wakes the run at once: the world's
    I/O manager skips the per-tick poll only while the entry queue is empty."""
    from sim.world import World

    seen = []

    async def main(world):
        done = trio.Event()
        trio.lowlevel.current_trio_token().run_sync_soon(done.set)
        for ticks in range(1, 100):  # (scheduler ticks, not waits: the clock stands still meanwhile)
            await trio.lowlevel.checkpoint()
            if done.is_set():
                seen.append((ticks, trio.current_time()))
                return

    w = World(1)
    w.run(main)
    assert seen and seen[0][0] <= 2 and seen[0][1] == 0.0 and not w.violations


def test_a_run_frees_its_world_when_it_ends_and_restores_the_collector():
    """The collector waits for the end of a run (sim.harness.RUN_GC_GEN0_THRESHOLD), then frees the
    world (cyclic garbage) at once: a session of many runs does not accumulate worlds."""
    import gc
    import weakref

    box = {}
    before = gc.get_threshold()
    r = run_once(SCENARIOS["tool"], 3, on_world=lambda w: box.setdefault("w", weakref.ref(w)))
    assert r.ok and r.commits > 0
    assert box["w"]() is None  # collected by run_once itself, not by this test
    assert gc.get_threshold() == before


def test_a_runs_cost_figures_are_deterministic():
    """Transactions and task steps per run (the bench's deterministic cost figures): same seed, same
    counts."""
    a = run_once(SCENARIOS["tool"], 5, random_plan(5))
    b = run_once(SCENARIOS["tool"], 5, random_plan(5))
    assert (a.transactions, a.task_steps, a.trace) == (b.transactions, b.task_steps, b.trace)
    assert a.task_steps > a.transactions > a.commits > 0


@pytest.mark.parametrize("name", ["tool", "cancel", "two-runtimes"])
def test_task_steps_counted_by_the_scheduler_prng_are_the_steps_trio_takes(monkeypatch, name):
    """The task-step figure (summed batch sizes of the scheduler's seeded shuffle) equals what a
    trio Instrument's before_task_step counts, and counting that way leaves the trace alone."""
    import sim.world

    plain = run_once(SCENARIOS[name], 7, random_plan(7))
    seen = {"steps": 0}

    class Count(trio.abc.Instrument):
        def before_task_step(self, task):
            seen["steps"] += 1

    real_run = trio.run
    # (a patched trio.run: the run is not hosted, sim.world._TrioHost, but given a fresh trio.run)
    monkeypatch.setattr(sim.world.trio, "run", lambda *a, **kw: real_run(*a, instruments=[Count()], **kw))
    counted = run_once(SCENARIOS[name], 7, random_plan(7))
    assert seen["steps"] == counted.task_steps > 0
    # a hosted run takes the same steps but for a fresh trio.run's own 8 (its init task's, the
    # run_sync_soon task's), and the same trace
    assert plain.task_steps == counted.task_steps - 8
    assert counted.trace == plain.trace


def test_buggify_enables_a_quarter_of_sites_and_fires_a_quarter_of_the_time():
    b = Buggify(random.Random(1), enabled=True)
    fired = [sum(b(f"site-{i}") for _ in range(200)) for i in range(400)]
    on = [n for n in fired if n > 0]
    assert abs(len(on) / 400 - BUGGIFY_ENABLE) < 0.07
    assert abs(sum(on) / (len(on) * 200) - BUGGIFY_FIRE) < 0.03
    off = Buggify(random.Random(1), enabled=False)
    assert not any(off("x") for _ in range(100))


class _OneWrite(Scenario):
    """A client writes one key through the process; used to pin crash semantics."""

    name = "one-write"

    def __init__(self, world):
        super().__init__(world)
        self.outcome = None

    @asynccontextmanager
    async def boot(self, proc):
        yield proc.db

    async def drive(self):
        async def write(db):
            async def fn(tr):  # idempotent: a blind set
                tr.set(b"k", b"v")
            await db.transact(fn)

        try:
            await self.world.call("p1", write)
            self.outcome = "acknowledged"
        except ProcessDied:
            self.outcome = "died"

    async def check(self, checker):
        async def read(tr):
            return await tr.get(b"k")
        self.stored = await checker.db.transact(read)


@pytest.mark.parametrize("when,stored", [("before", None), ("after", b"v")])
def test_crash_before_a_write_loses_it_and_after_keeps_it_unheard(when, stored):
    seen = {}

    def factory(world):
        seen["s"] = _OneWrite(world)
        return seen["s"]

    r = run_once(factory, 1, FaultPlan().with_crash(1, when))
    s = seen["s"]
    assert s.outcome == "died" and s.stored == stored
    assert r.crashes == 1 and r.restarts == 1 and r.ok
    r0 = run_once(factory, 1)
    assert seen["s"].outcome == "acknowledged" and seen["s"].stored == b"v" and r0.writes == 1


def test_exhaustive_counts_every_write_and_crashes_at_each(monkeypatch):
    from sim import exhaustive

    results = list(exhaustive(OutboxScenario, 2))
    base, crashes = results[0], results[1:]
    assert len(crashes) == 2 * base.writes and base.writes > 5
    assert [r.plan.crash_at for r in crashes] == [k for k in range(1, base.writes + 1) for _ in (0, 1)]
    assert all(r.ok for r in results) and all(r.crashes == 1 for r in crashes)


def test_oracle_names_a_broken_resolver_with_its_seed(monkeypatch):
    monkeypatch.setattr(kv.resolver.Resolver, "conflicts", lambda self, *a: False)
    bad = [r for s in range(1, 9) if not (r := run_once(CycleScenario, s, random_plan(s))).ok]
    assert bad, "lost conflicts went unnoticed"
    names = {v.invariant for r in bad for v in r.violations}
    assert "kv_serializable" in names and "cycle_intact" in names


def test_an_application_that_dies_on_its_own_is_reported():
    class Broken(_OneWrite):
        @asynccontextmanager
        async def boot(self, proc):
            if proc.incarnation == 1:
                raise ValueError("boom at boot")
            yield proc.db

    r = run_once(Broken, 1)
    assert [v.invariant for v in r.violations] == ["no_unexpected_exception"]
    assert "ValueError: boom at boot" in r.violations[0].detail and r.restarts == 1


def test_a_run_that_never_quiesces_is_a_liveness_failure():
    class Stuck(_OneWrite):
        async def quiesce(self):
            await trio.sleep_forever()

    r = run_once(Stuck, 1)
    assert [v.invariant for v in r.violations] == ["quiescence"]


def test_virtual_clock_keeps_mockclock_time_and_its_sleep_matches_trio_sleep():
    """The world's clock jumps like MockClock(autojump_threshold=0); its cheap sleep wakes when
    trio.sleep would, and is cancellable like it."""
    from sim.world import VirtualClock

    def program(clock_sleep):
        log = []

        async def main():
            async def sleeper(name, delays):
                for d in delays:
                    await clock_sleep(d)
                    log.append((name, trio.current_time()))

            async with trio.open_nursery() as n:
                n.start_soon(sleeper, "a", [0.3, 0.001, 1e-9])
                n.start_soon(sleeper, "b", [0.1, 0.2, 0.5])
                with trio.move_on_after(0.25) as cs:
                    await clock_sleep(10)
                log.append(("cancelled", cs.cancelled_caught, trio.current_time()))
            return log

        return main

    mock = trio.run(program(trio.sleep), clock=trio.testing.MockClock(autojump_threshold=0))
    vc = VirtualClock()
    virtual = trio.run(program(lambda d: vc.sleep(d)), clock=vc)
    assert len(virtual) == 7 and sorted(virtual) == sorted(mock)
    assert ("cancelled", True, 0.25) in virtual and ("b", 0.8) in virtual


def test_oracle_overlay_ranges_match_a_brute_force_model():
    """The oracle replays range reads with limit/direction shortcuts; they must give what a plain
    dict of the same state gives."""
    from sim.oracle import _Model, _Overlay

    r = random.Random(7)
    for _ in range(2000):
        state = {bytes([r.randrange(20)]): b"v%d" % r.randrange(9) for _ in range(r.randrange(15))}
        model = _Model()
        for k, v in state.items():
            model.put(k, v)
        ov = _Overlay(model)
        for _ in range(r.randrange(4)):
            a, z = sorted([bytes([r.randrange(20)]), bytes([r.randrange(20)])])
            c = r.random()
            if c < 0.5:
                ov.apply(("set", a, b"w"))
                state[a] = b"w"
            elif c < 0.8:
                ov.apply(("clear", a, z))
                state = {k: v for k, v in state.items() if not a <= k < z}
            else:
                ov.apply(("atomic", kv.atomic.ADD, a, b"\x01"))
                state[a] = kv.atomic.apply_atomic(kv.atomic.ADD, state.get(a), b"\x01")
        b, e = sorted([bytes([r.randrange(21)]), bytes([r.randrange(21)])])
        limit, reverse = r.choice([0, 1, 2, 5]), r.random() < 0.5
        want = sorted((k, v) for k, v in state.items() if b <= k < e)
        if reverse:
            want.reverse()
        assert ov.range(b, e, limit, reverse) == (want[:limit] if limit else want)


def test_oracle_model_applies_mutations_as_a_plain_dict_does():
    """The oracle's model (a dict with its keys kept in order for range reads) must hold what a
    plain dict given the same mutations holds, its key order sorted, its copies independent."""
    from sim.oracle import _apply, _Model

    r = random.Random(11)
    for _ in range(500):
        model, state = _Model(), {}
        for _ in range(r.randrange(30)):
            a, z = sorted([bytes([r.randrange(20)]), bytes([r.randrange(20)])])
            c = r.random()
            if c < 0.5:
                m: tuple = ("set", a, b"v%d" % r.randrange(3))
                state[a] = m[2]
            elif c < 0.7:
                m = ("clear", a, z)
                state = {k: v for k, v in state.items() if not a <= k < z}
            else:
                op = r.choice([kv.atomic.ADD, kv.atomic.COMPARE_AND_CLEAR])
                m = ("atomic", op, a, bytes([r.randrange(2)]))
                v = kv.atomic.apply_atomic(op, state.get(a), m[3])
                if v is None:
                    state.pop(a, None)
                else:
                    state[a] = v
            _apply(model, m)
            if r.random() < 0.2:
                copy = model.copy()
                model.put(b"\xfe", b"only in the original")
                model.discard(b"\xfe")
                assert copy.order is not model.order and dict(copy) == dict(model)
                model = copy
            assert dict(model) == state and model.order == sorted(state)
            b, e = sorted([bytes([r.randrange(21)]), bytes([r.randrange(21)])])
            assert model.keys_in(b, e) == sorted(k for k in state if b <= k < e)


# ---- the fence check and the poison's notion of a claim (sim.faults.SimHooks)


class _Tr:
    """What SimHooks reads of a committed transaction: its process, mutations and read keys."""

    def __init__(self, label, mutations, reads=(), committed=True):
        import types

        self.db = types.SimpleNamespace(process=types.SimpleNamespace(label=label))
        self._mutations = mutations
        self._read_points = set(reads)
        self._committed_version = 7 if committed else None


def _lease_set(run: str, token: int, **more):
    import cbor2
    from ledger.keyspace import LedgerKeyspace

    return ("set", LedgerKeyspace().lease(run), cbor2.dumps({"token": token, "expires_us": 1, **more}))


def test_the_fence_check_names_a_loop_state_write_by_anyone_but_the_lease_holder():
    from loop.keyspace import LoopKeyspace
    from sim.faults import FaultPlan
    from sim.world import World

    world = World(1, FaultPlan())
    hooks, state = world.hooks, ("set", LoopKeyspace().state("r1"), b"state")
    lease_key = _lease_set("r1", 1)[1]
    hooks.fence([_lease_set("r1", 1), state], "p1#1")  # a claim with its first writes
    hooks.fence([_lease_set("r1", 1, cancel=True)], "p2#1")  # rewritten under its token elsewhere
    hooks.fence([state], "p1#1")  # the holder: fine
    assert not world.violations
    hooks.fence([_lease_set("r1", 2)], "p2#1")  # taken over
    hooks.fence([state], "p1#1")  # the stale worker's write got through
    assert [v.invariant for v in world.violations] == ["no_stale_lease_writes"]
    assert "p1#1 wrote the loop state of run r1 while p2#1's claim (lease token 2) held it" in world.violations[0].detail
    hooks.fence([state, ("clear", lease_key, lease_key + b"\x00")], "p2#1")  # the holder settles
    hooks.fence([state], "p3#1")  # no lease (parked: an approval): anyone
    assert len(world.violations) == 1 and not hooks.lease_holders


def test_the_poison_takes_no_notice_of_a_lease_rewritten_by_another_process():
    """A cancel carried by the lease record (docs/loop.md, measured and not landed) rewrites the
    lease under its holder's token from the cancelling process: not a claim or a renewal (depth
    0 would kill the canceller) nor a step of progress (depth >= 1 would count it)."""
    from sim.faults import FaultPlan
    from sim.world import World

    world = World(1, FaultPlan(poison=0))
    hooks = world.hooks
    claim, cancel = _lease_set("r1", 2), _lease_set("r1", 2, cancel=True)
    hooks.fence([claim], "p1#1")
    assert not hooks._poisoned(_Tr("p2#1", [cancel], reads=[cancel[1]])) and hooks.poison is None
    assert hooks._poisoned(_Tr("p1#1", [claim])) and hooks.poison == claim[1]  # the holder's own write
    assert not hooks._poisoned(_Tr("p2#1", [cancel], reads=[cancel[1]]))
    assert hooks._poisoned(_Tr("p2#1", [claim], committed=False))  # a racing claim, refused: as before

    world = World(1, FaultPlan(poison=1))
    hooks = world.hooks
    hooks.fence([claim], "p1#1")
    assert not hooks._poisoned(_Tr("p1#1", [claim])) and hooks.poison == claim[1]  # picked, depth 1
    assert not hooks._poisoned(_Tr("p2#1", [cancel], reads=[cancel[1]])) and not hooks.poison_steps
    assert hooks._poisoned(_Tr("p1#1", [], reads=[claim[1]]))  # p1's first step of progress
