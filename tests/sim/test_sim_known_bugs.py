"""Bugs the simulator found in other packages, kept as regression tests once fixed.

(A bug still open is pinned here as ``xfail(strict=True)`` with its replay command, and its
(scenario, invariant) pair listed in ``KNOWN_BUGS`` of test_sim_ci.py.)
"""

from __future__ import annotations

from sim.session import all_scenarios, run_session


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


def test_tool_call_ids_stay_unique_across_compaction():
    """Found by ``surefoot sim --scenario mix --seed 121 --buggify`` (tool_call_ids_unique, promise 2):
    ScriptedModel derives call ids from the context length, so after a compaction a later call reused an
    earlier id (call_8_0 twice) and results could no longer be paired with calls; a provider that numbers
    calls per response would do the same. Fixed in the runner: ids already used in the transcript are
    renamed (deterministically, by transcript position) before the assistant message is persisted."""
    from sim import run_once
    from sim.scenarios import RuntimeScenario, Turn

    class CompactingToolTurns(RuntimeScenario):
        name = "compaction-tools"

        def make_turns(self):
            return [Turn("c1", "multi", f"s{i}", delay=i * 0.01) for i in range(3)]

        def agent_name(self, turn):
            return "sim-compact"  # threshold compaction between and within turns

    r = run_once(CompactingToolTurns, 1)
    assert "tool_call_ids_unique" not in {v.invariant for v in r.violations}, r.violations


def test_an_exhausted_run_whose_last_attempt_also_dies_leaves_no_dangling_call():
    """Found by ``surefoot sim --scenario exhaustion --seed 42 --buggify`` (transcript_tool_results,
    promises 2/3): when the claim that settles retry_exhausted (and finalises dangling tool calls) died
    too, the ledger's backstop settled the run and the last started call kept no result. Fixed by
    handing up to ``ledger.runs.FINALIZE_CLAIMS`` finalising claims to the loop before the backstop
    (0 failures in 300 exhaustion runs, seed 5). Schedule-dependent, so it searches 60 seeds."""
    from sim.session import run_session

    summary = run_session(["exhaustion"], 0, runs=60, max_failures=100)
    assert "transcript_tool_results" not in summary.invariant_failures, [f.command for f in summary.failures]


# Found by the session-12 soak; the probabilistic fix above narrowed this, it did not close it.
EXHAUSTED_FINALISERS_ALL_DIE_SEEDS = (20170, 77374, 92830, 101965)


def test_an_exhausted_run_whose_finalisers_all_die_after_their_claim_leaves_no_dangling_call():
    """Found by a 1,800 s soak, ``surefoot sim --scenario exhaustion --seed 20170 --buggify`` (and the
    other seeds here; transcript_tool_results, promise 3): each of the ``FINALIZE_CLAIMS`` (3) finalising
    claims committed and its process died before the tidy-up commit, so the ledger's backstop settled the
    run and the call that was out kept ``tool.started`` with no result. Fixed in session 13: the
    finaliser's tidy-up and settle commit inside the claiming transaction
    (``Runner.finish_exhausted_in_claim``), so a crash leaves either no claim or the finished run.

    The soak's seeds reproduce it only while the schedules are the soak's (any change to what a
    run reads moves them), so the same situation is also made on purpose, every seed: a sure
    poison at depth 0 (every claim of the taken-over run dies right after it commits, the
    finalisers' too) in ``exhaustion-alone`` (no later turn to finalise the call for it) — the
    run tests/sim/test_sim_bites.py shows catching the pre-session-13 finaliser in 40 of 40 seeds."""
    from sim.faults import FaultPlan
    from sim.harness import random_plan, run_once

    factory = all_scenarios()["exhaustion"]
    broken = [seed for seed in EXHAUSTED_FINALISERS_ALL_DIE_SEEDS
              if "transcript_tool_results" in {v.invariant for v in run_once(factory, seed, random_plan(seed)).violations}]
    assert not broken, broken
    alone = all_scenarios(targeted=True)["exhaustion-alone"]
    runs = [run_once(alone, seed, FaultPlan(poison=0)) for seed in range(1, 5)]
    assert all(r.ok and r.faults.get("crash.poison_run", 0) >= 3 for r in runs), \
        [(r.seed, [v.detail for v in r.violations], r.faults) for r in runs]
