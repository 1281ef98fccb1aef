"""Simulator throughput: full crash-restart-recover-check cycles per second (issue 5's benchmark).

Runs every scenario exhaustively (a crash before and after every write) plus random BUGGIFY seeds,
and prints one JSON line: runs/s and crash points/s by wall clock and per CPU-second (the machine
is shared, so the CPU figure is the comparable one), cycles (runs: boot, faults, crash, restart,
recovery to quiescence, every invariant checked) per CPU-second and per wall-second, and whether
the target of >= 100 cycles/s on one core (judged per CPU-second) was met.  Beside the rates, the
deterministic cost of a cycle (the same on every machine, for the same code and seed): kv
transactions, writes applied and trio task steps per cycle — on a shared machine the CPU figures
swing by +-15% between identical runs, these do not.  (Task steps are counted by the scheduler's
seeded PRNG, sim.world._SchedulerRandom: free.)  ``prefix_cpu_share`` (per mode) is the part of the
CPU spent before each run's first crash, and ``cycles_per_cpu_s_prefix_free`` the rate if the
exhaustive crash runs' prefixes cost nothing: the ceiling of any prefix-sharing scheme.  (Crash
runs that can be resumed from a snapshot, sim.resume, run no prefix — ``resumed_runs`` counts them
per mode; what is left is the two-process scenarios'.)

    python tests/bench/bench_sim.py [--random-runs N] [--seed S] [--exhaustive-scenario NAME ...]

``--exhaustive-scenario`` (repeatable) limits the exhaustive session to those scenarios: a small
fixed workload for deterministic instruction counts (docs/sim.md, session 13: approval,
two-runtimes, kv-cycle and mix exhaustively with ``--random-runs 21``, under
``PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=no``).  The figures of such a run are
not the benchmark's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sim.session import all_scenarios, run_session  # noqa: E402

TARGET_CYCLES_PER_S = 100


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--random-runs", type=int, default=100)
    ap.add_argument("--exhaustive-scenario", action="append", default=[],
                    help="run only these scenarios exhaustively (repeatable; default: all)")
    a = ap.parse_args()
    names = sorted(all_scenarios())
    unknown = set(a.exhaustive_scenario) - set(names)
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    ex = run_session(sorted(a.exhaustive_scenario) or names, a.seed, exhaustive_mode=True)
    rnd = run_session(names, a.seed, runs=a.random_runs)
    cycles = ex.runs + rnd.runs
    fig = {
        "bench": "sim",
        "scenarios": len(names),
        "exhaustive": {k: v for k, v in ex.figures().items() if k != "trace"},
        "random": {k: v for k, v in rnd.figures().items() if k != "trace"},
        "cycles": cycles,
        "cycles_per_cpu_s": round(cycles / (ex.cpu_seconds + rnd.cpu_seconds), 1),
        "cycles_per_wall_s": round(cycles / (ex.wall_seconds + rnd.wall_seconds), 1),
        # The rate if every exhaustive crash run started at its crash point for free (its prefix,
        # the history re-run up to write k, skipped): the ceiling of any prefix sharing (fork,
        # snapshots) - see docs/sim.md, "Throughput".
        "cycles_per_cpu_s_prefix_free": round(cycles / (ex.cpu_seconds + rnd.cpu_seconds - ex.prefix_cpu_seconds), 1),
        "kv_transactions_per_cycle": round((ex.transactions + rnd.transactions) / cycles, 1),
        "writes_applied_per_cycle": round((ex.commits + rnd.commits) / cycles, 1),
        "task_steps_per_cycle": round((ex.task_steps + rnd.task_steps) / cycles, 1),
        # the session trace hashes (every run's trace in order): a speed-up must leave them unchanged
        "trace_exhaustive": ex.trace, "trace_random": rnd.trace,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "target_cycles_per_s": TARGET_CYCLES_PER_S,
    }
    fig["ratio_to_target"] = round(fig["cycles_per_cpu_s"] / TARGET_CYCLES_PER_S, 3)
    # The target is per core: judged on CPU time (the machine is shared, wall time is noisy).
    fig["target_met"] = fig["cycles_per_cpu_s"] >= TARGET_CYCLES_PER_S
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
