"""Proof that it bites: break one promise in the real code on purpose, and the simulator names the
invariant and the seed (and the exact command) that reproduce it.

Each test patches the real package (never the simulator) and runs the same search CI runs: the
scenario's exhaustive crash points (plus, where a schedule matters, a few random seeds).
"""

from __future__ import annotations

import pytest

import ledger.runs
import loop.runner
import sessions.journal
from sim.kvworkloads import OutboxApp
from sim.session import run_session

SEED = 1


def _search(monkeypatch, scenario: str, *, runs: int = 0):
    summary = run_session([scenario], SEED, exhaustive_mode=True, runs=runs, max_failures=50)
    return summary


def _assert_bites(summary, invariant: str, scenario: str) -> None:
    assert not summary.ok, "the broken promise went unnoticed"
    hits = [f for f in summary.failures if invariant in {v.invariant for v in f.result.violations}]
    assert hits, f"expected {invariant}, got {summary.invariant_failures}"
    f = hits[0]
    assert f.result.scenario == scenario
    assert f.command.startswith(f"surefoot sim --scenario {scenario} --seed {f.result.seed}")


def _clean(scenario: str) -> None:
    """The same search without the patch finds nothing (so the failure above is the patch's)."""
    assert run_session([scenario], SEED, exhaustive_mode=True).ok


def test_recovery_that_reruns_a_dangling_tool_is_caught(monkeypatch):
    async def rerun_dangling(self):  # forget that a call was started, so the loop runs it again
        for cid, call in list(self.state.calls.items()):
            if call.get("state") == loop.runner.CALL_STARTED:
                self.state.calls.pop(cid)

    monkeypatch.setattr(loop.runner.Runner, "_recover", rerun_dangling)
    _assert_bites(_search(monkeypatch, "tool"), "tool_at_most_once", "tool")


def test_a_skipped_submission_hash_check_is_caught(monkeypatch, break_submission_hash):
    _assert_bites(_search(monkeypatch, "duplicate"), "submission_conflict", "duplicate")


def test_a_skipped_lease_check_is_caught(monkeypatch):
    async def no_check(self, tr, lease):
        return None

    monkeypatch.setattr(ledger.runs.Ledger, "check_lease", no_check)
    _assert_bites(_search(monkeypatch, "stale-worker"), "no_stale_lease_writes", "stale-worker")


def test_a_journal_event_outside_its_state_change_is_caught(monkeypatch):
    emit = sessions.journal.Journal.emit

    async def emit_apart(self, tr, owner, conversation, type, data=None, *a, **k):
        if type in ("run.completed", "run.failed", "run.cancelled"):  # its own transaction, committed first
            return await self.db.transact(lambda t2: emit(self, t2, owner, conversation, type, data, *a, **k))
        return await emit(self, tr, owner, conversation, type, data, *a, **k)

    monkeypatch.setattr(sessions.journal.Journal, "emit", emit_apart)
    _assert_bites(_search(monkeypatch, "plain"), "journal_matches_state", "plain")


@pytest.mark.parametrize("flag,invariant", [("recover_reruns", "tool_at_most_once"),
                                            ("skip_marker", "acknowledged_exactly_once")])
def test_the_stand_in_workload_bites_too(monkeypatch, flag, invariant):
    monkeypatch.setattr(OutboxApp, flag, True)
    _assert_bites(_search(monkeypatch, "kv-outbox"), invariant, "kv-outbox")


@pytest.mark.parametrize("scenario", ["tool", "duplicate", "stale-worker", "plain", "kv-outbox"])
def test_the_unpatched_searches_are_clean(scenario):
    _clean(scenario)


def test_a_follower_that_skips_an_event_is_caught(monkeypatch):
    follow = sessions.journal.Journal.follow

    async def lossy_follow(self, *a, **k):  # loses the third event it would yield (a gap)
        n = 0
        async for ev in follow(self, *a, **k):
            n += 1
            if n != 3:
                yield ev

    monkeypatch.setattr(sessions.journal.Journal, "follow", lossy_follow)
    _assert_bites(_search(monkeypatch, "tool"), "journal_replay_equals_live", "tool")


def test_the_retention_scenario_really_falls_behind():
    from sim import run_once
    from sim.scenarios import SCENARIOS

    box = {}

    def factory(world):
        box["s"] = SCENARIOS["retention"](world)
        return box["s"]

    r = run_once(factory, 1)
    assert r.ok and box["s"].behind.get("c1", 0) >= 1 and len(box["s"].followed["c1"]) > 6
