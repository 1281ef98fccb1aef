"""Bugs the simulator found in other packages, kept as regression tests once fixed.

(A bug still open is pinned here as ``xfail(strict=True)`` with its replay command, and its
(scenario, invariant) pair listed in ``KNOWN_BUGS`` of test_sim_ci.py.)
"""

from __future__ import annotations

import pytest

from sim.session import run_session


def test_an_acknowledged_cancel_survives_a_crash():
    """Found by ``surefoot sim --scenario cancel --seed 1 --crash-after 8`` (cancel_is_durable, promise 7):
    a run whose cancel was acknowledged settled *completed* when the process crashed after the tool's
    result and the next attempt drove on. Fixed in loop 5a46a81 (a cancel seen inside a commit wins;
    the begin read reads the cancel record)."""
    for seed in (1, 2):
        summary = run_session(["cancel"], seed, exhaustive_mode=True)
        assert summary.ok, [f.command for f in summary.failures]
        assert summary.crash_points >= 10


@pytest.mark.xfail(strict=True, reason=(
    "ledger/runs.py claim + loop recovery (promises 2/3): when a claim finds a run past max_attempts it "
    "settles it failed retry_exhausted inside the claim transaction, so no Runner ever finalises the tool "
    "call the last attempt started — the transcript keeps an assistant tool_call with no tool_result "
    "(a real provider then refuses the conversation's next turn). "
    "Replay: surefoot sim --scenario exhaustion --seed 1 --crash-before 1"))
def test_an_exhausted_run_leaves_no_tool_call_without_a_result():
    from sim import FaultPlan, run_once
    from sim.scenarios import SCENARIOS

    r = run_once(SCENARIOS["exhaustion"], 1, FaultPlan().with_crash(1, "before"))
    assert "transcript_tool_results" not in {v.invariant for v in r.violations}, r.violations
