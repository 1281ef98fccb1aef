"""Proof that it bites: break one promise in the real code on purpose, and the simulator names the
invariant and the seed (and the exact command) that reproduce it.

Each test patches the real package (never the simulator) and runs the same search CI runs: the
scenario's exhaustive crash points — or, where only some schedules reach the broken path, a
targeted scenario (sim.scenarios.TARGETED) or fault plan (a sure poison, FaultPlan.poison) that
reaches it on every schedule.

Sturdiness (session 17).  A search over a fixed window of seeds bites only while the window
holds a schedule that reaches the broken path, and any change to what a run reads or writes
moves every schedule; so each test's detection rate was measured (runs that catch the bug /
runs, at ef05576 with this session's sim) and each search is one that reaches the path by
construction (or, for a comparison, expects many detections):

* Exhaustive searches of one seed (most tests): the broken path is a write every history has
  (a crash point after it), or the fault-free run itself breaks the promise — caught at every
  seed of 1..20 (the searches' seeds moved by 0..19 as a stand-in for a schedule move), the same
  number of failing runs at each (but the stand-in's re-run, 4-8).  Not luck: kept as they were.
* The skipped lease check: caught in 11 of 20 seeds of the ``stale-worker`` search (the stale
  worker's write and its own lease keeper race once let go; 44% of fault-free runs at ef05576
  with the fence check, 17% without it). Now the targeted ``stale-write-first`` (the keeper
  held back): 200 of 200 runs.
* The exhausted run finalised apart from its claim: 7 of 1,000 ``exhaustion`` random runs
  (2 in the old window of 80; none in 80 with the lease-record change of docs/loop.md). Now
  ``exhaustion-alone`` under a sure poison at depth 0: 40 of 40 runs.
* The poison run's depth >= 1: a sure poison (``--poison 1``) gives 46 of 200 ``multi-tool``
  transcripts with three interrupted calls against 2 of 400 without the poison; was 9 vs 2 in
  400 runs each with BUGGIFY's chance of a poison.
"""

from __future__ import annotations

import pytest

import ledger.runs
import loop.runner
import sessions.journal
from sim.faults import FaultPlan
from sim.harness import run_once
from sim.kvworkloads import OutboxApp
from sim.session import Failure, Summary, all_scenarios, run_session

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


def _targeted(scenario: str, runs: int, plan: FaultPlan | None = None) -> Summary:
    """Seeds SEED .. SEED + runs - 1 of a targeted scenario (sim.scenarios.TARGETED), fault-free or
    under ``plan``, summed up as one search (each failure replayable by its command)."""
    summary = Summary(seed=SEED)
    factory = all_scenarios(targeted=True)[scenario]
    for seed in range(SEED, SEED + runs):
        r = run_once(factory, seed, plan)
        summary.add(r)
        if not r.ok:
            summary.failures.append(Failure(r))
    return summary


def _caught(summary, invariant: str) -> int:
    return sum(invariant in {v.invariant for v in f.result.violations} for f in summary.failures)


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


EXHAUSTED_ALONE_RUNS = 4  # (see the test's docstring)


def test_an_exhausted_run_finalised_apart_from_its_claim_is_caught(monkeypatch):
    """The exhausted run's finaliser writing in a commit of its own after its claim (as before
    session 13, when session 12's soak met it once in ~1,000 exhaustion runs): a poison run at
    depth 0 kills every finaliser right after its claim, and the ledger's backstop settles the run
    with the call that was out left without a result.

    Targeted: ``exhaustion-alone`` (no later turn whose claim finalises the call for it) under a
    sure poison at depth 0 catches it in every run (40 of 40, seeds 1-40; 200 of 200 seeds in
    windows of 4 moved 0..49: none missed). The search it replaces, 80 random ``exhaustion``
    runs, expected ~0.6 (7 of 1,000 at ef05576: the poison must strike at depth 0 and the
    second turn must not run after it; 2 in seeds 1-80, and none once the lease-record change
    of docs/loop.md moved the schedules)."""

    async def finalise_apart(store, tr, claim):  # the claim is made again without it: see Store.claim
        raise RuntimeError("planted: finalise in a commit of its own")

    plan = FaultPlan(poison=0)
    monkeypatch.setattr(loop.runner.Runner, "finish_exhausted_in_claim", staticmethod(finalise_apart))
    summary = _targeted("exhaustion-alone", EXHAUSTED_ALONE_RUNS, plan)
    _assert_bites(summary, "transcript_tool_results", "exhaustion-alone")
    assert _caught(summary, "transcript_tool_results") >= EXHAUSTED_ALONE_RUNS // 2, summary.invariant_failures
    assert summary.failures[0].command.endswith(" --poison 0")
    monkeypatch.undo()
    summary = _targeted("exhaustion-alone", EXHAUSTED_ALONE_RUNS, plan)
    # (unbroken, the first finalising claim settles the run as it commits: the poison then kills
    # its process, and the claims before it; 3-4 poison crashes a run)
    assert summary.ok and summary.faults.get("crash.poison_run", 0) >= 3 * EXHAUSTED_ALONE_RUNS, \
        (summary.invariant_failures, summary.faults)


def _interrupted_per_transcript(monkeypatch, scenario: str, runs: int,
                                poison: int | None = None) -> tuple[object, list[int]]:
    """A random search, counting the ``interrupted`` tool results of every transcript it checks."""
    import loop

    counts: list[int] = []
    read = loop.Runtime.transcript

    async def counting(self, conv, *args, **kwargs):
        msgs = await read(self, conv, *args, **kwargs)
        counts.append(sum(1 for m in msgs if m.get("role") == "tool"
                          for p in m.get("content") or () if p.get("reason") == "interrupted"))
        return msgs

    monkeypatch.setattr(loop.Runtime, "transcript", counting)
    return run_session([scenario], SEED, runs=runs, max_failures=50, poison=poison), counts


POISON_SEARCH_RUNS = 100  # (see the test's docstring)


def test_a_poison_run_past_its_claim_leaves_each_attempts_call_to_the_next(monkeypatch):
    """Depth >= 1 of the poison-run fault: every attempt dies right after its first step of
    progress (here: the assistant message that starts a tool call), so each next claim finds
    the call left dangling, reports it interrupted and goes on — transcripts with three
    interrupted calls of one run, which independent random crashes reach too but rarely; every
    invariant still holds.

    A sure poison at depth 1 (``--poison 1``: the first run taken over is poisoned, in every
    random run that takes one over): 46 transcripts of 200 ``multi-tool`` runs with three
    interrupted calls (23%; the rest had no takeover, or one late); without the poison 2 of 400
    (4 of 1,000 with the loop's reads of session 16). So 100 runs each expect ~23 against ~0.5.
    (Before: BUGGIFY's chance of a poison, POISON_DEPTHS patched to (1,), 400 runs each: 9
    against 2 at 5614f65, 12.5 s, a margin any schedule move could close.) Windows of 100 from
    seeds 1, 1001, ..., 4001: 13-25 poisoned, 0-1 unpoisoned."""
    import sim.faults

    summary, counts = _interrupted_per_transcript(monkeypatch, "multi-tool", POISON_SEARCH_RUNS, poison=1)
    assert summary.ok, summary.invariant_failures
    poisoned = sum(c >= 3 for c in counts)
    assert summary.faults.get("crash.poison_run", 0) >= 10 and poisoned >= 5, (summary.faults, sorted(counts))
    monkeypatch.setattr(sim.faults, "MAX_POISON_CRASHES", 0)
    summary, counts = _interrupted_per_transcript(monkeypatch, "multi-tool", POISON_SEARCH_RUNS)
    # (Independent random crashes reach three interrupted calls in one transcript too, rarely:
    # 1 run in 1,000 of this scenario at 40caa2a, 4 in 1,000 with the loop's reads of session 16;
    # which runs do moves with any change of what a run reads. So: less often than the poison.)
    assert summary.ok and sum(c >= 3 for c in counts) < poisoned, (poisoned, sorted(counts))


def test_a_skipped_submission_hash_check_is_caught(monkeypatch, break_submission_hash):
    _assert_bites(_search(monkeypatch, "duplicate"), "submission_conflict", "duplicate")


STALE_WRITE_RUNS = 4  # (see the test's docstring)


def test_a_skipped_lease_check_is_caught(monkeypatch):
    """A worker that no longer checks its lease writes after its run was taken over.

    Targeted: in ``stale-worker`` the stale worker's pending write and its own lease keeper race
    once both are let go at the takeover, and when the keeper learns first the runner stops
    before its write is handed over: 11 of 20 seeds' exhaustive searches caught it (seed 1's
    did, then not once the lease-record change moved the schedules). ``stale-write-first`` holds
    the keeper back, so the stale write is tried in every run: caught in 200 of 200 fault-free
    runs (4 of 4 in every window of 4 seeds moved 0..49; also in the shared tree with others'
    changes, and with the lease-record change emulated), both by the fence check at the commit
    (SimHooks.fence) and by the run settled under the old token."""

    async def no_check(self, tr, lease):
        return None

    monkeypatch.setattr(ledger.runs.Ledger, "check_lease", no_check)
    summary = _targeted("stale-write-first", STALE_WRITE_RUNS)
    # (the hold finds the keeper by its task's name: a rename in loop must be followed there)
    assert summary.faults.get("clog.held", 0) >= STALE_WRITE_RUNS, \
        f"the lease keeper was not held: is sim.scenarios.KEEPER_TASK still its task's name? {summary.faults}"
    _assert_bites(summary, "no_stale_lease_writes", "stale-write-first")
    assert _caught(summary, "no_stale_lease_writes") >= STALE_WRITE_RUNS // 2, summary.invariant_failures


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


@pytest.mark.parametrize("scenario", ["tool", "duplicate", "stale-worker", "stale-write-first", "plain", "kv-outbox"])
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


# ---- promise 10 with a price: the cost ceiling (scenario cost-ceiling, a priced scripted model)


def test_a_cost_counted_twice_is_caught(monkeypatch):
    """A step's cost added to the run's total twice (the step's record itself written once)."""
    import ledger.usage
    from sessions.codec import pack_i64

    record_tr = ledger.usage.UsageBook.record_tr

    async def record_cost_twice(self, tr, run_id, step_id, usage, **kw):
        fresh = await record_tr(self, tr, run_id, step_id, usage, **kw)
        if fresh and usage.get("cost_micros"):
            tr.add(self.keys.usage_total(run_id, "cost_micros"), pack_i64(usage["cost_micros"]))
        return fresh

    monkeypatch.setattr(ledger.usage.UsageBook, "record_tr", record_cost_twice)
    summary = _search(monkeypatch, "cost-ceiling")
    _assert_bites(summary, "usage_total_is_sum", "cost-ceiling")
    # (and the doubled total is what the reserve reads: the run stops early, not late)


def test_a_skipped_reserve_is_caught(monkeypatch):
    """The pre-flight reserve skipped: nothing stops the spending run before the call that passes
    its cost ceiling."""
    import ledger.usage

    async def no_reserve(self, tr, run_id, estimate):
        return {}

    monkeypatch.setattr(ledger.usage.UsageBook, "reserve_tr", no_reserve)
    _assert_bites(_search(monkeypatch, "cost-ceiling"), "usage_within_ceiling", "cost-ceiling")


def test_a_step_billed_at_the_wrong_price_is_caught(monkeypatch):
    """A step's cost computed without its output tokens (the recorded figure no longer follows
    from the price and the recorded tokens)."""
    real = loop.runner.cost_micros
    monkeypatch.setattr(loop.runner, "cost_micros", lambda price, usage: real(price, {**usage, "output_tokens": 0}))
    _assert_bites(_search(monkeypatch, "cost-ceiling"), "cost_matches_price", "cost-ceiling")


# ---- extended thinking (scenario thinking)


def test_reasoning_persisted_after_the_answer_is_caught(monkeypatch):
    """The response builder puts reasoning parts last (the API would refuse the next request)."""
    import loop.providers.base as base

    message = base.ResponseBuilder.message

    def reasoning_last(self):
        msg = message(self)
        parts = msg["content"]
        msg["content"] = [p for p in parts if p["type"] not in ("thinking", "redacted_thinking")] + \
                         [p for p in parts if p["type"] in ("thinking", "redacted_thinking")]
        return msg

    monkeypatch.setattr(base.ResponseBuilder, "message", reasoning_last)
    _assert_bites(_search(monkeypatch, "thinking"), "thinking_in_place_once", "thinking")


def test_reasoning_not_passed_back_is_caught(monkeypatch):
    """The loop leaves reasoning out of the context it sends the model (so the request after a
    reasoning turn lacks it: Anthropic's API answers 400)."""
    import loop.compaction

    context = loop.compaction.model_context

    def without_reasoning(*a, **k):
        return [{**m, "content": [p for p in m["content"] if p.get("type") not in ("thinking", "redacted_thinking")]}
                if m.get("role") == "assistant" and isinstance(m.get("content"), list) else m
                for m in context(*a, **k)]

    monkeypatch.setattr(loop.runner, "model_context", without_reasoning)
    _assert_bites(_search(monkeypatch, "thinking"), "thinking_passed_back", "thinking")


def test_a_resumed_run_that_persists_reasoning_twice_is_caught(monkeypatch):
    """Recovery that does not see what the earlier attempt persisted after the user message: the
    resumed run calls the model for the reasoning step again and persists its answer a second
    time. Only a crash after that write and before the run settles shows it."""
    recover = loop.runner.Runner._recover

    async def recover_blind(self):
        keep = self.state.user_seq - self.base + 1  # up to and including the turn's user message
        del self.messages[keep:]
        await recover(self)

    monkeypatch.setattr(loop.runner.Runner, "_recover", recover_blind)
    summary = _search(monkeypatch, "thinking")
    _assert_bites(summary, "thinking_in_place_once", "thinking")
    hits = [f for f in summary.failures if "thinking_in_place_once" in {v.invariant for v in f.result.violations}]
    assert all(f.result.plan.crash_at is not None for f in hits)  # the fault-free run was clean
    assert any("persisted 2 times" in v.detail for f in hits for v in f.result.violations)


def test_the_cost_ceiling_scenario_really_cuts_an_answer():
    """The spending run of ``cost-ceiling`` reaches the call the loop clamps to the room its cost
    ceiling leaves: the scripted model stops there (stop_reason max_tokens, inside a tool call), the
    run fails usage_limit, and the cost recorded stays within the ceiling (the checks pass)."""
    from loop import Runtime
    from sim import run_once
    from sim.scenarios import SCENARIOS

    seen = {}

    class Probe(SCENARIOS["cost-ceiling"]):
        async def check(self, checker):
            await super().check(checker)
            rt = Runtime(checker.db)
            run_id = self.run_of["s1"]
            seen["info"], seen["usage"] = await rt.get_run(run_id), await rt.usage(run_id)
            seen["msgs"] = await rt.transcript("c1")

    r = run_once(Probe, 1)
    assert r.ok, r.violations
    last = [m for m in seen["msgs"] if m["role"] == "assistant"][-1]
    assert last["stop_reason"] == "max_tokens" and any(p["type"] == "tool_call" for p in last["content"])
    assert seen["info"].status == "failed" and seen["info"].outcome["error"]["type"] == "usage_limit"
    assert 0 < seen["usage"]["cost_micros"] <= 2_480


# ---- interleaved thinking (scenario thinking-interleaved): reasoning between text and tool calls


def _reasoning_first(parts: list) -> list:
    reasoning = [p for p in parts if p.get("type") in ("thinking", "redacted_thinking")]
    return reasoning + [p for p in parts if p.get("type") not in ("thinking", "redacted_thinking")]


def test_reasoning_sorted_to_the_front_when_passed_back_is_caught(monkeypatch):
    """The loop sends each assistant message of the context with its reasoning sorted to the front
    (what the Anthropic merge did to interleaved reasoning before 1731a0f): persisted in place, but
    passed back moved. The reasoning-first ``thinking`` scenario cannot see it (its reasoning is
    first already); the interleaved one names the invariant."""
    import loop.compaction

    context = loop.compaction.model_context

    def sorted_reasoning(*a, **k):
        return [{**m, "content": _reasoning_first(m["content"])}
                if m.get("role") == "assistant" and isinstance(m.get("content"), list) else m
                for m in context(*a, **k)]

    monkeypatch.setattr(loop.runner, "model_context", sorted_reasoning)
    summary = _search(monkeypatch, "thinking-interleaved")
    _assert_bites(summary, "thinking_passed_back", "thinking-interleaved")
    assert any("tool-use loop under way" in v.detail for f in summary.failures for v in f.result.violations)
    assert run_session(["thinking"], SEED, exhaustive_mode=True).ok  # invisible without interleaving


def test_the_wire_sort_of_the_old_anthropic_merge_is_caught(monkeypatch):
    """The provider's wire conversion sorts every assistant turn's reasoning to the front (the old
    merge's sort, applied to each turn): the request the "API" reads moves the interleaved blocks."""
    import loop.providers.anthropic as anthropic

    wire = anthropic.to_anthropic_messages

    def sorted_wire(messages):
        return [{**t, "content": _reasoning_first(t["content"])} if t["role"] == "assistant" else t
                for t in wire(messages)]

    monkeypatch.setattr(anthropic, "to_anthropic_messages", sorted_wire)
    _assert_bites(_search(monkeypatch, "thinking-interleaved"), "thinking_passed_back", "thinking-interleaved")


@pytest.mark.parametrize("how", ["drop", "duplicate"])
def test_an_interleaved_reasoning_part_dropped_or_duplicated_on_persist_is_caught(monkeypatch, how):
    """The response builder loses (or repeats) a reasoning part that streamed after a tool call,
    when it builds the message the loop persists; leading reasoning is untouched."""
    import loop.providers.base as base

    message = base.ResponseBuilder.message

    def broken(self):
        msg = message(self)
        parts, out, seen_call = msg["content"], [], False
        for p in parts:
            interleaved = seen_call and p["type"] in ("thinking", "redacted_thinking")
            seen_call = seen_call or p["type"] == "tool_call"
            if interleaved and how == "drop":
                continue
            out.append(p)
            if interleaved and how == "duplicate":
                out.append(dict(p))
        msg["content"] = out
        return msg

    monkeypatch.setattr(base.ResponseBuilder, "message", broken)
    summary = _search(monkeypatch, "thinking-interleaved")
    _assert_bites(summary, "thinking_in_place_once", "thinking-interleaved")
    assert run_session(["thinking"], SEED, exhaustive_mode=True).ok  # (no reasoning after a call there)


def test_journaled_parts_out_of_step_with_the_stream_are_caught(monkeypatch):
    """The journal's part numbers skip redacted blocks (not journaled as parts at all), so every
    part streamed after one is journaled one place early: a client rebuilds the answer with its
    reasoning moved."""
    import loop.stream

    add = loop.stream.PartCoalescer.add

    def no_redacted(self, ev):
        if isinstance(ev, loop.stream.RedactedThinking):
            return
        add(self, ev)

    monkeypatch.setattr(loop.stream.PartCoalescer, "add", no_redacted)
    _assert_bites(_search(monkeypatch, "thinking-interleaved"), "thinking_journaled_in_place", "thinking-interleaved")


def test_an_earlier_turns_reasoning_moved_when_sent_is_caught(monkeypatch):
    """An earlier turn's reasoning may be left out of a request (the API strips it) but, when sent,
    it goes unmodified where it streamed: a loop that sorts only earlier turns' reasoning to the
    front is caught by the call of the turn after it (``plain`` after ``ithink``)."""
    import loop.compaction

    context = loop.compaction.model_context

    def sorted_earlier(*a, **k):
        msgs = context(*a, **k)
        last_user = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
        return [{**m, "content": _reasoning_first(m["content"])}
                if i < last_user and m.get("role") == "assistant" and isinstance(m.get("content"), list) else m
                for i, m in enumerate(msgs)]

    monkeypatch.setattr(loop.runner, "model_context", sorted_earlier)
    summary = _search(monkeypatch, "thinking-interleaved")
    _assert_bites(summary, "thinking_passed_back", "thinking-interleaved")
    assert all("an earlier turn" in v.detail for f in summary.failures for v in f.result.violations
               if v.invariant == "thinking_passed_back")
