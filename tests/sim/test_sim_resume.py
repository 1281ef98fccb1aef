"""Crash runs resumed from snapshots (sim.resume) start from exactly what a real crash leaves.

A resumed crash run skips re-running the history up to its crash point; these tests hold it to
the crash it stands for: at the instant the process dies, the world a crash run re-executed from
the start reaches and the world restored from the fault-free run's snapshot are the same — the
trace so far (every commit and event), the PRNG stream, the store, the oracle's model, every
acknowledgement, cursor and position of the clients, the effects counted — and the exhaustive
session's resumed run equals the replay command's.
"""

from __future__ import annotations

import copy
from contextlib import asynccontextmanager

import pytest

from sim import FaultPlan, harness, run_once
from sim.harness import exhaustive
from sim.kvworkloads import CycleScenario, OutboxScenario
from sim.resume import Recorder
from sim.scenarios import SCENARIOS
from sim.world import Process, World

# Every single-process scenario resumes (the RuntimeScenarios and the raw-kv workloads); these
# re-run their prefix (two processes: one lives on through the crash).
NOT_RESUMABLE = {"two-runtimes", "exhaustion", "stale-worker"}
KV_WORKLOADS = {"kv-cycle": CycleScenario, "kv-outbox": OutboxScenario}
# What the clients of a scenario hold (a RuntimeScenario's records; the kv workloads' acked and clients).
_CLIENT_RECORDS = ("acks", "run_of", "cancel_acked", "conflicts", "conflict_accepted", "followed", "forks",
                   "model_calls", "tools_called", "behind", "thinking_refused", "clients", "turns", "_settled",
                   "acked")


def _state_at_crash(world) -> dict:
    """What survives a crash, read off a world at the instant its process died."""
    store = world.engine.store
    sc = world.scenario
    return {
        "trace": world.trace._h.copy().hexdigest(), "trace_count": world.trace.count,
        "rng": world.rng.getstate(), "now": world.now(),
        "stats": {k: v for k, v in world.stats.items() if k != "task_steps"},
        "faults": dict(world.faults), "effects": dict(world.effects),
        "store": {k: list(h) for k, h in store._hist.items()}, "version": store._version,
        "engine": (world.engine.engine._last_version, world.engine.engine._max_read_version),
        "model": dict(world.oracle.model), "oracle_transactions": world.oracle.transactions,
        "clients": copy.deepcopy({k: getattr(sc, k) for k in _CLIENT_RECORDS if hasattr(sc, k)}),
    }


def _rerun_and_resume(monkeypatch, factory, seed: int, plan: FaultPlan, snapshot):
    """The crash run twice: re-executed from the start (crash included), and resumed from
    ``snapshot``; with the state each world was in at the instant its process died."""
    at_crash: list[dict] = []
    kill = Process.kill

    def record(self, why):
        kill(self, why)
        at_crash.append(_state_at_crash(self.world))

    monkeypatch.setattr(Process, "kill", record)
    try:
        rerun = run_once(factory, seed, plan, reexecute=True)  # the whole history, crash included
        resumed = run_once(factory, seed, plan, resume=snapshot)
    finally:
        monkeypatch.setattr(Process, "kill", kill)
    return rerun, resumed, at_crash


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - NOT_RESUMABLE - {"mix"}) + ["mix"] + sorted(KV_WORKLOADS))
def test_a_resumed_crash_run_starts_from_what_the_crash_leaves(name, monkeypatch):
    factory = KV_WORKLOADS.get(name) or SCENARIOS[name]
    seed = _one_process_mix_seed() if name == "mix" else 1
    rec = Recorder()
    base = run_once(factory, seed, recorder=rec)
    assert base.ok and base.writes >= 3
    assert set(rec.snapshots) == {(k, w) for k in range(1, base.writes + 1) for w in ("before", "after")}
    points = sorted({1, (base.writes + 1) // 2, base.writes})
    if name in KV_WORKLOADS:  # (cheap runs: every write, so a crash in every client phase and in quiesce)
        points = list(range(1, base.writes + 1))
    for k in points:
        for when in ("before", "after"):
            plan = FaultPlan().with_crash(k, when)
            rerun, resumed, at_crash = _rerun_and_resume(monkeypatch, factory, seed, plan, rec.snapshots[(k, when)])
            assert rerun.ok and resumed.ok, (k, when, rerun.violations, resumed.violations)
            assert len(at_crash) == 2, (k, when)  # the re-run's crash, then the restore's
            assert at_crash[0] == at_crash[1], (name, k, when)
            # the replay command's path (run to the crash point, snapshot, go on) is the same run
            replay = run_once(factory, seed, plan)
            assert (replay.trace, replay.violations, replay.writes, replay.commits, replay.checks) == \
                   (resumed.trace, resumed.violations, resumed.writes, resumed.commits, resumed.checks)


def test_scenarios_a_crash_leaves_running_are_re_run():
    """Two processes (one lives on through the crash): no snapshots."""
    for factory in [SCENARIOS[n] for n in sorted(NOT_RESUMABLE)]:
        rec = Recorder()
        base = run_once(factory, 1, recorder=rec)
        assert base.ok and base.writes > 0 and not rec.snapshots


def test_exhaustive_resumes_and_replays_match_and_repeat(monkeypatch):
    restored: list[int] = []
    real_restore = harness.restore

    def counting_restore(world, snapshot):
        restored.append(1)
        return real_restore(world, snapshot)

    monkeypatch.setattr(harness, "restore", counting_restore)
    runs = list(exhaustive(SCENARIOS["approval"], 3))
    assert all(r.ok for r in runs) and len(runs) == 1 + 2 * runs[0].writes
    assert len(restored) == len(runs) - 1  # every crash run started from its snapshot, none re-ran its history
    again = list(exhaustive(SCENARIOS["approval"], 3))
    assert [r.trace for r in runs] == [r.trace for r in again]
    r = runs[len(runs) // 2]
    assert run_once(SCENARIOS["approval"], 3, r.plan).trace == r.trace


def _mix_seed(processes: int) -> int:
    return next(s for s in range(1, 100) if len(SCENARIOS["mix"](World(s)).processes) == processes)


def _one_process_mix_seed() -> int:
    return _mix_seed(1)


def test_mix_with_two_processes_is_not_resumable():
    two = _mix_seed(2)
    assert not SCENARIOS["mix"](World(two)).resumable
    rec = Recorder()
    assert run_once(SCENARIOS["mix"], two, recorder=rec).ok and not rec.snapshots
    assert SCENARIOS["mix"](World(_one_process_mix_seed())).resumable


class _BootWrites(SCENARIOS["plain"]):
    """A process that writes while it boots (a crash there comes before the clients started)."""

    name = "boot-writes"

    @asynccontextmanager
    async def boot(self, proc):
        async def mark(tr):  # idempotent: the same value every boot
            tr.set(b"booted", b"1")

        await proc.db.transact(mark)
        async with super().boot(proc) as app:
            yield app


def test_a_crash_while_booting_resumes_before_the_clients_start(monkeypatch):
    rec = Recorder()
    base = run_once(_BootWrites, 1, recorder=rec)
    assert base.ok
    first = rec.snapshots[(1, "before")]
    assert not first.drive_started  # write 1 is the boot's: the harness had not started the clients
    for when in ("before", "after"):
        plan = FaultPlan().with_crash(1, when)
        rerun, resumed, at_crash = _rerun_and_resume(monkeypatch, _BootWrites, 1, plan, rec.snapshots[(1, when)])
        assert rerun.ok and resumed.ok and resumed.restarts == 1 and resumed.crashes == 1
        assert at_crash[0] == at_crash[1]
        assert run_once(_BootWrites, 1, plan).trace == resumed.trace


def test_the_summary_counts_the_resumed_crash_runs():
    """bench_sim's resumed_runs: every crash run of a resumable scenario, none of a two-process one."""
    from sim.session import run_session

    kv_cycle = run_session(["kv-cycle"], 1, exhaustive_mode=True)
    assert kv_cycle.ok and kv_cycle.resumed == kv_cycle.runs - 1 > 0  # all but the fault-free run
    assert kv_cycle.figures()["resumed_runs"] == kv_cycle.resumed
    stale = run_session(["stale-worker"], 1, exhaustive_mode=True)
    assert stale.ok and stale.runs > 1 and stale.resumed == 0
