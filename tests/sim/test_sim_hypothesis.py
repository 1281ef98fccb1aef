"""Hypothesis drives the random mode: it picks a scenario, a seed and maybe an exact crash point,
and on a failure shrinks towards the smallest seed / earliest crash that still breaks a promise."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import FaultPlan, run_once
from sim.harness import random_plan
from sim.session import all_scenarios

SCENARIOS = all_scenarios()
KNOWN = {"tool_call_ids_unique"}  # an open bug pinned in test_sim_known_bugs.py
KNOWN_IN = {("exhaustion", "transcript_tool_results")}  # likewise


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SCENARIOS)), seed=st.integers(0, 2**31),
       crash=st.one_of(st.none(), st.tuples(st.integers(1, 40), st.sampled_from(["before", "after"]))),
       buggify=st.booleans())
def test_generated_schedules_keep_every_promise(name, seed, crash, buggify):
    plan = random_plan(seed) if buggify else FaultPlan()
    if crash is not None:
        plan = plan.with_crash(*crash)
    r = run_once(SCENARIOS[name], seed, plan)
    bad = [v for v in r.violations if v.invariant not in KNOWN and (name, v.invariant) not in KNOWN_IN]
    assert not bad, f"surefoot sim --scenario {name} --seed {seed} ({plan.describe()}): {bad[:3]}"
