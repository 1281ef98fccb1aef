"""Bugs the simulator found in other packages, kept as regression tests once fixed.

(A bug still open is pinned here as ``xfail(strict=True)`` with its replay command, and its
(scenario, invariant) pair listed in ``KNOWN_BUGS`` of test_sim_ci.py.)
"""

from __future__ import annotations

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


def test_an_exhausted_run_leaves_no_tool_call_without_a_result():
    """Found by ``surefoot sim --scenario exhaustion --seed 1 --crash-before 1`` (transcript_tool_results):
    a run settled retry_exhausted inside the ledger's claim kept the last attempt's tool_call without a
    result. Fixed in loop 29ca27d (the loop settles retry_exhausted itself and finalises the call)."""
    summary = run_session(["exhaustion"], 1, exhaustive_mode=True)
    assert summary.ok, [f.command for f in summary.failures]
