"""Prefix sharing by fork (sim/fork.py): a forked crash run is the re-run crash run, result for result.

The re-run path — ``run_once(factory, seed, FaultPlan().with_crash(k, when))`` — is what
``--crash-before K`` replays, so it is the reference: for every built-in scenario the forked runs must
give identical RunResults (trace hash, violations, every count, faults, checks; only the wall time
differs).  Every scenario is compared at three crash points here (first, middle, last write); a few
small scenarios at every crash point; ``python tests/bench/bench_sim.py --fork`` prints the session
trace of all of them (equal to the bench's default, re-run, trace).
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from sim.faults import FaultPlan
from sim.fork import CHILD_FAILED, Forker, fork_available
from sim.harness import exhaustive, run_once
from sim.session import all_scenarios, run_session

pytestmark = pytest.mark.skipif(not fork_available(), reason="prefix sharing needs os.fork and trio's epoll")

SEED = 5


def _same(r) -> dict:
    d = dataclasses.asdict(r)
    d.pop("wall_seconds")
    return d


def _points(writes: int) -> list[tuple[int, str]]:
    return sorted({(1, "after"), (max(1, (writes + 1) // 2), "before"), (writes, "after")})


@pytest.mark.parametrize("name", sorted(all_scenarios()))
def test_forked_crash_runs_equal_rerun_crash_runs(name):
    factory = all_scenarios()[name]
    reference = run_once(factory, SEED)
    points = _points(reference.writes)
    forker = Forker(only=points)
    base = run_once(factory, SEED, on_world=forker.attach)
    assert _same(base) == _same(reference)  # the parent's own run is undisturbed by its children
    assert reference.ok, [str(v) for v in reference.violations]
    for k, when in points:
        rerun = run_once(factory, SEED, FaultPlan().with_crash(k, when))
        forked = forker.results.get((k, when))
        if forked is None:  # no live process at that write: the run stays fault-free
            assert rerun.crashes == 0 and rerun.trace == reference.trace
            continue
        assert forked.plan == FaultPlan().with_crash(k, when)
        assert _same(forked) == _same(rerun), (name, k, when)


@pytest.mark.parametrize("name", ["plain", "duplicate", "kv-outbox"])
def test_exhaustive_by_fork_equals_exhaustive_by_rerun_at_every_point(name):
    factory = all_scenarios()[name]
    forked = list(exhaustive(factory, SEED, fork=True))
    rerun = list(exhaustive(factory, SEED, fork=False))
    assert len(forked) == len(rerun) == 1 + 2 * rerun[0].writes
    assert [_same(r) for r in forked] == [_same(r) for r in rerun]
    assert sum(r.crashes for r in forked) >= rerun[0].writes  # crash points really crashed


def test_session_trace_and_summary_are_the_same_either_way():
    names = ["cancel", "tool"]
    a = run_session(names, SEED, exhaustive_mode=True, fork=True)
    b = run_session(names, SEED, exhaustive_mode=True, fork=False)
    assert a.trace == b.trace and a.runs == b.runs and a.crash_points == b.crash_points > 0
    assert (a.checks, a.faults, a.commits, a.task_steps) == (b.checks, b.faults, b.commits, b.task_steps)
    assert a.ok and b.ok


def test_a_spent_budget_stops_forking_and_the_results_end_there():
    factory = all_scenarios()["tool"]
    forks = []
    results = list(exhaustive(factory, SEED, fork=True, stop=lambda: (forks.append(1), len(forks) > 5)[1]))
    rerun = list(exhaustive(factory, SEED, fork=False))
    assert 1 < len(results) < len(rerun)
    assert [_same(r) for r in results] == [_same(r) for r in rerun[:len(results)]]


def _break_child_at(monkeypatch, point: tuple[int, str], how) -> None:
    start = Forker._start_child

    def broken(self, k: int, when: str, wfd: int) -> None:
        start(self, k, when, wfd)
        if (k, when) == point:
            how()

    monkeypatch.setattr(Forker, "_start_child", broken)


@pytest.mark.parametrize("how", ["raise", "signal"])
def test_a_child_that_dies_is_a_failed_run_with_its_replay_command(monkeypatch, how):
    def die() -> None:
        if how == "raise":
            raise RuntimeError("boom in the child")
        signal.raise_signal(signal.SIGKILL)

    _break_child_at(monkeypatch, (2, "before"), die)
    summary = run_session(["tool"], SEED, exhaustive_mode=True, fork=True, max_failures=10)
    assert not summary.ok and summary.invariant_failures == {CHILD_FAILED: 1}
    (failure,) = summary.failures
    assert failure.result.plan == FaultPlan().with_crash(2, "before")
    assert failure.command == f"surefoot sim --scenario tool --seed {SEED} --crash-before 2"
    detail = failure.result.violations[0].detail
    assert ("boom in the child" in detail) if how == "raise" else (f"signal {int(signal.SIGKILL)}" in detail)
    # every other crash point still ran and reported
    assert summary.runs == 1 + 2 * run_once(all_scenarios()["tool"], SEED).writes
    assert os.getpid() > 0  # (the parent is still the parent)


def test_a_child_leaves_the_parents_trio_kernel_objects_alone():
    """The child's wake-ups and epoll edits land in its private copies (sim.fork._privatize_trio).

    The child wakes the run loop through the entry queue (``run_sync_soon``: a byte into trio's
    wake-up socket, then an epoll wait re-armed) and ends its trio.run (every registration dropped).
    Without private copies the byte would be left in the parent's socket and the parent's
    EPOLLONESHOT registration of it deleted, so the parent's next ``run_sync_soon`` would never run.
    """
    import socket

    import trio
    from trio._core import _run as trio_run

    from sim.fork import _exit, _fork, _privatize_trio

    async def main() -> str:
        await trio.sleep(0)  # (the entry queue's task is waiting on its wake-up socket by now)
        runner = trio_run.GLOBAL_RUN_CONTEXT.runner
        token = trio.lowlevel.current_trio_token()
        pid = _fork()
        if pid == 0:
            status = 1
            try:
                _privatize_trio()
                done = trio.Event()
                token.run_sync_soon(done.set)
                await done.wait()  # (woken through the child's own socket and epoll)
                token.run_sync_soon(lambda: None)  # a byte left behind at the end of the run
                status = 0
            finally:
                _exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        wake = runner.entry_queue.wakeup.wakeup_sock
        try:
            left = wake.recv(16, socket.MSG_PEEK)
        except BlockingIOError:
            left = b""
        assert left == b""  # nothing the child wrote is waiting for the parent
        done = trio.Event()
        token.run_sync_soon(done.set)
        with trio.fail_after(5):  # (real time: this trio.run has the real clock)
            await done.wait()  # the parent's wake-up still reaches its epoll
        return "ok"

    assert trio.run(main) == "ok"
