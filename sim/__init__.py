"""sim — deterministic simulation: the real code on the memory engine, crashed at every write.

Public face:

* :class:`World` — one run's universe (seeded PRNG and scheduler, virtual
  clock, the memory engine as disk, supervised processes, external effects).
* :class:`FaultPlan`, :class:`Crash`, :class:`Buggify` — what goes wrong.
* :class:`Scenario`, :func:`run_once`, :func:`exhaustive`, :func:`random_runs`
  — running workloads; :data:`SCENARIOS` names the built-in ones.
* :func:`sim.cli.add_commands` — registers ``surefoot sim``.
"""

from .faults import Buggify, Crash, FaultPlan
from .harness import Checker, RunResult, Scenario, exhaustive, random_runs, replay_command, run_once
from .world import Process, ProcessDied, Violation, World

__all__ = [
    "World", "Process", "ProcessDied", "Violation", "FaultPlan", "Crash", "Buggify",
    "Scenario", "Checker", "RunResult", "run_once", "exhaustive", "random_runs", "replay_command",
]
