"""A simulation session: many runs (exhaustive crash points and/or random seeds), one summary.

Used by ``surefoot sim`` (sim/cli.py), the CI test (tests/sim) and the
benchmark (tests/bench/bench_sim.py).  A session stops starting runs when
its time budget is spent; the summary says how far it got.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .faults import FaultPlan
from .harness import RunResult, exhaustive, random_plan, replay_command, run_once

__all__ = ["Summary", "Failure", "all_scenarios", "plan_runs", "run_session", "shrink"]

def all_scenarios(targeted: bool = False) -> dict[str, type]:
    """The scenarios of the default searches; ``targeted``: with sim.scenarios.TARGETED's too
    (runnable by name, never searched by default)."""
    from .kvworkloads import CycleScenario, OutboxScenario
    from .scenarios import SCENARIOS, TARGETED

    out: dict[str, type] = dict(SCENARIOS)
    out[CycleScenario.name] = CycleScenario
    out[OutboxScenario.name] = OutboxScenario
    if targeted:
        out.update(TARGETED)
    return out


@dataclass
class Failure:
    result: RunResult
    shrunk: RunResult | None = None

    @property
    def command(self) -> str:
        return replay_command(self.shrunk or self.result)


@dataclass
class Summary:
    seed: int
    runs: int = 0
    crash_points: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    checks: int = 0
    invariant_failures: dict[str, int] = field(default_factory=dict)
    virtual_seconds: float = 0.0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0  # process CPU time: the rate on a shared (loaded) machine
    prefix_cpu_seconds: float = 0.0  # of the runs' CPU, the part before their first crash
    resumed: int = 0  # crash runs started from a snapshot at their crash point (sim.resume)
    commits: int = 0
    transactions: int = 0
    task_steps: int = 0
    failures: list[Failure] = field(default_factory=list)
    by_scenario: dict[str, int] = field(default_factory=dict)
    budget_exhausted: bool = False
    _hash: "hashlib._Hash" = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def add(self, r: RunResult) -> None:
        self.runs += 1
        # a crash point: an exact one (exhaustive) or a random one (BUGGIFY), each followed by recovery
        faults = r.faults
        self.crash_points += (faults.get("crash.before_commit", 0) + faults.get("crash.after_commit", 0)
                              + faults.get("crash.poison_run", 0))
        for k, v in r.faults.items():
            self.faults[k] = self.faults.get(k, 0) + v
        self.checks += r.checks
        self.virtual_seconds += r.virtual_seconds
        self.commits += r.commits
        self.transactions += r.transactions
        self.task_steps += r.task_steps
        self.prefix_cpu_seconds += r.prefix_cpu_seconds
        self.resumed += r.resumed
        self.by_scenario[r.scenario] = self.by_scenario.get(r.scenario, 0) + 1
        self._hash.update(f"{r.scenario}|{r.seed}|{r.plan.describe()}|{r.trace}\n".encode())
        for v in r.violations:
            self.invariant_failures[v.invariant] = self.invariant_failures.get(v.invariant, 0) + 1

    @property
    def trace(self) -> str:
        """The session's trace hash: every run's trace, in order (same arguments -> same hash)."""
        return self._hash.hexdigest()

    @property
    def runs_per_second(self) -> float:
        return self.runs / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def crash_points_per_second(self) -> float:
        return self.crash_points / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def figures(self) -> dict[str, object]:
        return {
            "runs": self.runs, "crash_points": self.crash_points, "checks": self.checks,
            "faults": sum(self.faults.values()), "simulated_hours": round(self.virtual_seconds / 3600, 3),
            "wall_seconds": round(self.wall_seconds, 2), "runs_per_s": round(self.runs_per_second, 1),
            "crash_points_per_s": round(self.crash_points_per_second, 1),
            "runs_per_cpu_s": round(self.runs / self.cpu_seconds, 1) if self.cpu_seconds else 0.0,
            "crash_points_per_cpu_s": round(self.crash_points / self.cpu_seconds, 1) if self.cpu_seconds else 0.0,
            "failures": len(self.failures),
            # deterministic cost per run (same arguments, same figures; CPU time on a shared machine is not)
            "kv_transactions_per_run": round(self.transactions / self.runs, 1) if self.runs else 0.0,
            "writes_applied_per_run": round(self.commits / self.runs, 1) if self.runs else 0.0,
            "task_steps_per_run": round(self.task_steps / self.runs, 1) if self.runs else 0.0,
            # the share of the CPU spent before each run's first crash (re-running the history up to
            # the crash point): the most any prefix sharing could save
            "prefix_cpu_share": round(self.prefix_cpu_seconds / self.cpu_seconds, 3) if self.cpu_seconds else 0.0,
            # crash runs that started at their crash point (the rest of the crash runs re-ran their
            # history: the two-process scenarios)
            "resumed_runs": self.resumed,
            "trace": self.trace,
        }


def plan_runs(names: list[str], seed: int, *, exhaustive_mode: bool, runs: int,
              plan: FaultPlan | None = None,
              poison: int | None = None) -> Iterator[Callable[[], RunResult] | tuple[str, Iterator[RunResult]]]:
    """Yield the session's work lazily (exhaustive iterators first, then random seeds; ``poison``:
    every random run with a sure poison run at that depth, FaultPlan.poison)."""
    scen = all_scenarios(targeted=True)
    if plan is not None:  # an exact replay
        for n in names:
            yield lambda n=n: run_once(scen[n], seed, plan)
        return
    if exhaustive_mode:
        for n in names:
            yield (n, exhaustive(scen[n], seed))
    for i in range(runs):
        s = seed + i
        n = names[i % len(names)]
        yield lambda n=n, s=s: run_once(scen[n], s, random_plan(s, poison))


def shrink(result: RunResult) -> RunResult | None:
    """A smaller schedule that still fails: the same seed with fewer fault kinds (random runs only)."""
    if not result.plan.buggify or result.plan.poison is not None:  # (a sure poison is kept as it is)
        return None
    factory = all_scenarios(targeted=True)[result.scenario]
    names = {v.invariant for v in result.violations}
    for plan in (FaultPlan(), FaultPlan(buggify=True, crash_rate=0.0)):
        r = run_once(factory, result.seed, plan)
        if names & {v.invariant for v in r.violations}:
            return r
    return None


def run_session(names: list[str], seed: int, *, exhaustive_mode: bool = False, runs: int = 0,
                time_budget: float | None = None, plan: FaultPlan | None = None,
                on_result: Callable[[RunResult], None] | None = None, max_failures: int = 5,
                quiet: bool = True, poison: int | None = None) -> Summary:
    """Run the work ``plan_runs`` describes within ``time_budget`` seconds; return the summary."""
    summary = Summary(seed=seed)
    t0 = time.perf_counter()
    c0 = time.process_time()
    previous = logging.root.manager.disable
    if quiet:
        logging.disable(logging.CRITICAL)  # the runtime logs every injected fault; the summary tells the story
    try:
        for work in plan_runs(names, seed, exhaustive_mode=exhaustive_mode, runs=runs, plan=plan, poison=poison):
            it: Iterator[RunResult] = work[1] if isinstance(work, tuple) else iter([work()])
            for r in it:
                summary.add(r)
                if not r.ok and len(summary.failures) < max_failures:
                    summary.failures.append(Failure(r, shrink(r)))
                if on_result is not None:
                    on_result(r)
                if time_budget is not None and time.perf_counter() - t0 > time_budget:
                    summary.budget_exhausted = True
                    break
            if summary.budget_exhausted:
                break
    finally:
        logging.disable(previous)
        summary.wall_seconds = time.perf_counter() - t0
        summary.cpu_seconds = time.process_time() - c0
    return summary
