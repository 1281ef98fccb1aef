"""``surefoot sim``: run the deterministic simulator from the command line.

    surefoot sim                                   # random runs over every scenario, fresh seed
    surefoot sim --exhaustive --seed 1             # crash before/after every write of every scenario
    surefoot sim --scenario cancel --seed 1 --crash-after 8     # replay one failing run exactly
    surefoot sim --runs 100000 --time-budget 3600  # a soak

Registered by ``server.cli`` through :func:`add_commands`.  Exit status 1
when any invariant failed; the failure report gives the seed, the (shrunk)
schedule and the exact command that reproduces it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .faults import POISON_DEPTHS, FaultPlan
from .harness import RunResult
from .session import Summary, all_scenarios, run_session

__all__ = ["add_commands", "cmd_sim", "print_summary"]

DEFAULT_RANDOM_RUNS = 200


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``surefoot sim`` to the ``surefoot`` command."""
    names = sorted(all_scenarios(targeted=True))
    p = subparsers.add_parser(
        "sim",
        help="run the deterministic simulator (crash at every write, check every promise)",
        description="Runs the real runtime against the memory engine with a virtual clock and a seeded "
                    "scheduler, injects crashes and faults, recovers, and checks the promises.",
    )
    p.add_argument("--seed", type=int, default=None, help="first seed (default: a fresh one, printed)")
    p.add_argument("--runs", type=int, default=None,
                   help=f"random runs (default {DEFAULT_RANDOM_RUNS}, or 0 with --exhaustive)")
    p.add_argument("--scenario", action="append", choices=names, metavar="NAME",
                   help=f"scenario(s) to run (repeatable; default all): {', '.join(names)}")
    p.add_argument("--exhaustive", action="store_true", help="crash before and after every write of each scenario")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting runs after this many seconds")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--crash-before", type=int, metavar="K", help="replay: crash before write K")
    g.add_argument("--crash-after", type=int, metavar="K", help="replay: crash after write K")
    g.add_argument("--buggify", action="store_true", help="replay: one random-mode run (BUGGIFY faults) of --seed")
    p.add_argument("--poison", type=int, default=None, choices=POISON_DEPTHS, metavar="DEPTH",
                   help="a sure poison run at this depth (sim.faults.POISON_DEPTHS): with --runs, in every random "
                        "run; with --buggify, in that replay; alone, replay the run whose only fault it is")
    p.add_argument("--show-trace", type=int, default=0, metavar="N",
                   help="for each failure, replay it and print the last N trace lines (commits, crashes, faults)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (CI logs)")
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=False)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    names = args.scenario or sorted(all_scenarios())
    plan: FaultPlan | None = None
    if args.crash_before is not None:
        plan = FaultPlan().with_crash(args.crash_before, "before")
    elif args.crash_after is not None:
        plan = FaultPlan().with_crash(args.crash_after, "after")
    elif args.buggify:
        from .harness import random_plan

        plan = random_plan(seed, args.poison)
    elif args.poison is not None and args.runs is None and not args.exhaustive:
        plan = FaultPlan(poison=args.poison)  # replay: the poison the only fault
    runs = args.runs if args.runs is not None else (0 if args.exhaustive or plan else DEFAULT_RANDOM_RUNS)
    if plan is not None and (args.scenario is None or len(args.scenario) != 1):
        console.print("[red]a replay (--crash-before/--crash-after/--buggify/--poison) needs exactly one --scenario[/]")
        return 2

    progress = Progress(TextColumn("[bold]sim[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
                        disable=args.no_progress or not console.is_terminal and not os.environ.get("FORCE_PROGRESS"))
    failures = 0
    with progress:
        total = runs + (len(names) if args.exhaustive else 0) + (len(names) if plan else 0)
        task = progress.add_task(f"seed {seed}", total=total, status="")

        def on_result(r: RunResult) -> None:
            nonlocal failures
            if args.exhaustive and r.plan.crash_at is None and not r.plan.buggify and plan is None:
                progress.update(task, total=(progress.tasks[0].total or 0) + 2 * r.writes)
            if not r.ok:
                failures += 1
            progress.update(task, advance=1, status=f"{r.scenario:>14}  failures {failures}")

        summary = run_session(names, seed, exhaustive_mode=args.exhaustive, runs=runs,
                              time_budget=args.time_budget, plan=plan, on_result=on_result, poison=args.poison)
    print_summary(summary, console)
    if args.show_trace:
        from .harness import run_once

        for f in summary.failures:
            r = f.shrunk or f.result
            world_trace: list[str] = []
            again = run_once(all_scenarios(targeted=True)[r.scenario], r.seed, r.plan, trace_keep=args.show_trace,
                             on_world=lambda w: world_trace.append(w))
            console.print(f"[bold]trace of {r.scenario} seed {r.seed} ({r.plan.describe()}), last lines:[/]")
            for line in world_trace[-1].trace.tail if world_trace else []:  # (a crash run resumed: its 2nd world)
                console.print("   " + line, highlight=False, markup=False)
            assert again.trace == r.trace, "replay diverged"
    return 0 if summary.ok else 1


def print_summary(summary: Summary, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"surefoot sim — seed {summary.seed}", show_header=True, header_style="bold")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("runs", f"{summary.runs:,}")
    t.add_row("crash points", f"{summary.crash_points:,}")
    for kind, n in sorted(summary.faults.items()):
        t.add_row(f"  faults: {kind}", f"{n:,}")
    t.add_row("invariant checks", f"{summary.checks:,}")
    t.add_row("commits", f"{summary.commits:,}")
    t.add_row("simulated hours", f"{summary.virtual_seconds / 3600:.2f}")
    t.add_row("wall seconds", f"{summary.wall_seconds:.1f}")
    t.add_row("runs/s", f"{summary.runs_per_second:.1f}")
    t.add_row("crash points/s", f"{summary.crash_points_per_second:.1f}")
    if summary.cpu_seconds:
        t.add_row("runs per CPU-second", f"{summary.runs / summary.cpu_seconds:.1f}")
    for name, n in sorted(summary.by_scenario.items()):
        t.add_row(f"  scenario: {name}", f"{n:,}")
    t.add_row("failed runs", f"{sum(1 for _ in summary.failures)}" + (" (first 5 kept)" if len(summary.failures) >= 5 else ""))
    if summary.budget_exhausted:
        t.add_row("stopped", "time budget spent")
    console.print(t)
    console.print(f"trace: {summary.trace}")
    for inv, n in sorted(summary.invariant_failures.items()):
        console.print(f"[red]invariant {inv} failed in {n} run(s)[/]")
    for f in summary.failures:
        r = f.result
        console.print(f"[red bold]FAILED[/] {r.scenario} seed {r.seed} ({r.plan.describe()}), trace {r.trace}")
        for v in r.violations[:6]:
            console.print(f"   {v}")
        if f.shrunk is not None:
            console.print(f"   shrunk to: {f.shrunk.plan.describe()} — still fails "
                          f"({', '.join(sorted({v.invariant for v in f.shrunk.violations}))})")
        console.print(f"   replay: [bold]{f.command}[/]")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `python -m sim.cli`
    parser = argparse.ArgumentParser(prog="surefoot")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sim", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
