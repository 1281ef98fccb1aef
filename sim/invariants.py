"""The named invariants, each tied to a promise of ../shared/DESIGN.md, checked after every run.

They read what survived through the public Runtime API (transcripts, runs,
the journal) on a fault-free handle, and compare it with what the world saw
from outside: acknowledgements the clients received, cancels they were told
were recorded, effects the tools had on the far end, events the journal
followers saw live.

=============================  =======  ===============================================
invariant                      promise  what must hold
=============================  =======  ===============================================
every_ack_settles              1, 4     every acknowledged submission's run settled
submission_idempotent          1        one id -> one run, however often it was retried
submission_conflict            1        same id + different request -> refused
no_phantom_runs                1        runs in a conversation == distinct submissions
attempts_bounded               4        attempt <= max; exhaustion settles retry_exhausted
transcript_tool_results        2, 3     exactly one result per tool call, after the call
tool_call_ids_unique           2        no two tool calls of a transcript share an id
no_duplicate_turn              2        a turn's user message appears once
tool_at_most_once              3        an effect whose call was recorded ran <= 1 time
tool_result_matches_effect     3        a successful result implies exactly one effect
no_stale_lease_writes          5        no event of an older attempt after a newer start
one_active_per_conversation    6        runs of a conversation never overlap
fifo_per_conversation          6        runs start in the order they were queued
cancel_is_durable              7        an acknowledged cancel ends the run cancelled
journal_ordered                9        positions strictly increasing, no duplicates
journal_replay_equals_live     9        what followers saw live == the replay
journal_matches_state          9        each run: one run.queued, one settle event = its state
usage_once_per_step            10       one usage record per (run, step), journaled as recorded
usage_total_is_sum             10       a run's totals (tokens, cost) == the sum of its steps' records
cost_matches_price             10       a step's cost_micros == its price applied to its tokens
usage_within_ceiling           10       a run's tokens and cost never pass its ceilings
thinking_in_place_once         2        an answer's reasoning parts where they streamed, once
thinking_journaled_in_place    9        streamed reasoning journaled as parts at its stream position
thinking_passed_back           2        the tool loop's reasoning sent back unmodified, in place
fork_is_prefix                 2        a fork holds exactly the parent's first N messages
kv_serializable                (kv)     the oracle replays the history (sim.oracle)
no_unexpected_exception        -        the runtime never died of its own accord
quiescence                     4        recovery settles everything in bounded time
=============================  =======  ===============================================
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import kv
from loop import Runtime
from loop import messages as M
from loop.pricing import FREE, cost_micros
from ledger.usage import decode_total
from sessions.codec import loads

if TYPE_CHECKING:
    from .harness import Checker
    from .scenarios import RuntimeScenario

__all__ = ["check_runtime", "INVARIANTS"]

INVARIANTS: dict[str, int | None] = {
    "every_ack_settles": 1, "submission_idempotent": 1, "submission_conflict": 1, "no_phantom_runs": 1,
    "attempts_bounded": 4, "transcript_tool_results": 2, "tool_call_ids_unique": 2, "no_duplicate_turn": 2, "tool_at_most_once": 3,
    "tool_result_matches_effect": 3, "no_stale_lease_writes": 5, "one_active_per_conversation": 6,
    "fifo_per_conversation": 6, "cancel_is_durable": 7, "journal_ordered": 9,
    "journal_replay_equals_live": 9, "journal_matches_state": 9, "usage_once_per_step": 10, "usage_total_is_sum": 10, "cost_matches_price": 10, "usage_within_ceiling": 10,
    "thinking_in_place_once": 2, "thinking_journaled_in_place": 9, "thinking_passed_back": 2, "fork_is_prefix": 2,
    "kv_serializable": None, "no_unexpected_exception": None, "quiescence": 4,
}

# The usage keys' (kind, name) tails unpacked so far (bounded: a soak meets few distinct ones).
_USAGE_KEY_TAILS: dict[bytes, tuple[Any, ...]] = {}
_USAGE_KEY_TAILS_MAX = 4096
_EFFECT_KEY = re.compile(r"ok \[([^\]]+)\]")
SETTLED_EVENTS = {"run.completed", "run.failed", "run.cancelled"}
_REASONING = ("thinking", "redacted_thinking")


async def check_runtime(sc: "RuntimeScenario", checker: "Checker") -> None:
    from .scenarios import SimClock

    world = sc.world
    expect = checker.expect
    # A Runtime that is only read through: no claim loops, journal trimmer or lease keeper to start
    # and stop (Runtime.open with workers=0 started and cancelled those on every check).
    rt = Runtime(checker.db, clock=SimClock(world))
    # ---- promise 1: submissions
    for sub, runs in sorted(sc.acks.items()):
        expect(len(runs) == 1, "submission_idempotent", 1, f"submission {sub} was acknowledged as runs {sorted(runs)}")
    for sub, n in sorted(sc.conflict_accepted.items()):
        expect(False, "submission_conflict", 1, f"submission {sub} with a different request was {n}")
    runs_by_conv: dict[str, list[Any]] = {}
    for conv in sc.conversations:
        runs_by_conv[conv] = await rt.runs(conv)
        subs = {t.submission_id for t in sc.turns if t.conversation == conv and t.submission_id in sc.acks}
        expect(len(runs_by_conv[conv]) == len(subs), "no_phantom_runs", 1,
               f"{conv}: {len(runs_by_conv[conv])} runs for {len(subs)} submissions")
    infos = {i.run_id: i for runs in runs_by_conv.values() for i in runs}
    events_of: dict[str, list[Any]] = {}  # conversation -> its whole journal (read once)

    async def journal_of(conv: str) -> list[Any]:
        if conv not in events_of:
            events_of[conv] = await _all_events(rt, conv)
        return events_of[conv]

    for sub, run_id in sorted(sc.run_of.items()):
        info = infos.get(run_id) or await rt.get_run(run_id)
        expect(info.status in ("completed", "failed", "cancelled"), "every_ack_settles", 1,
               f"run {run_id} of submission {sub} ended {info.status}")
        expect(info.attempt <= sc.max_attempts, "attempts_bounded", 4, f"run {run_id} reached attempt {info.attempt}")
        err = (info.outcome or {}).get("error") or {}
        if err.get("type") == "retry_exhausted":
            expect(info.status == "failed", "attempts_bounded", 4, f"run {run_id} exhausted but {info.status}")
        turn = next((t for t in sc.turns if t.submission_id == sub), None)
        if turn is not None and turn.expect_error and not world.plan.buggify:
            expect(info.status == "failed" and err.get("type") == turn.expect_error, "attempts_bounded", 4,
                   f"run {run_id} ended {info.status} ({err.get('type')}), want failed {turn.expect_error}")
        # ---- promise 7
        before = sc.cancel_acked.get(run_id)
        if before is not None and before not in ("completed", "failed", "cancelled"):
            expect(info.status == "cancelled", "cancel_is_durable", 7,
                   f"run {run_id} was {before} when its cancel was acknowledged, but ended {info.status}")

    # ---- promise 5: the settle write came from the run's latest lease (fencing token)
    # ---- promise 10: the ledger's usage records per (run, step) and its per-run totals
    ledger = getattr(rt.store, "ledger", None)
    read_run = getattr(ledger, "_run", None)  # private record: the token that settled vs the latest claim
    usage_of: dict[str, tuple[dict[str, dict[str, int]], dict[str, int]]] = {}  # run -> (steps, totals)
    if read_run is not None:
        run_ids = sorted(sc.run_of.values())
        keys = ledger.keys  # type: ignore[union-attr]

        async def read_all(tr: Any) -> list[Any]:  # read-only
            out = []
            for run_id in run_ids:
                # ("u", run, "s", step): a step's CBOR record; ("u", run, "t", field): an int64 total,
                # ("u", run, "t", 1): the packed totals of the usual fields (ledger.usage.decode_total)
                steps: dict[str, dict[str, int]] = {}
                totals: dict[str, int] = {}
                r = keys.base.range(("u", run_id))
                head = len(r.start) - 1  # (the packed ("u", run) prefix: range's start is it + \x00)
                for row in await tr.get_range(r.start, r.stop):
                    # the key's (kind, name) after the prefix: a few distinct ones, met again in
                    # every check, so each is unpacked once (unpacking whole keys here was half the
                    # tuple decoding of the checks: 4,605 of 9,019 in the bench's exhaustive session)
                    tail = row.key[head:]
                    kind_name = _USAGE_KEY_TAILS.get(tail)
                    if kind_name is None:
                        if len(_USAGE_KEY_TAILS) >= _USAGE_KEY_TAILS_MAX:
                            _USAGE_KEY_TAILS.clear()
                        kind_name = _USAGE_KEY_TAILS[tail] = kv.tuple.unpack(tail)
                    kind, name = kind_name
                    if kind == "s":
                        steps[name] = loads(row.value)
                    else:
                        # (an int64 key per field, or the packed record of several: ledger.usage)
                        for k, v in decode_total(name, row.value).items():
                            if v:
                                totals[k] = totals.get(k, 0) + v
                out.append((await read_run(tr, run_id), steps, totals))
            return out

        for run_id, (rec, steps, totals) in zip(run_ids, await checker.db.transact(read_all)):
            tok, claims = rec.get("settled_token"), rec.get("claims")
            if tok is not None and claims is not None:
                expect(tok == claims, "no_stale_lease_writes", 5,
                       f"run {run_id} was settled under lease token {tok} after claim {claims} took it over")
            usage_of[run_id] = (steps, totals)
            _check_usage(checker, sc, run_id, steps, totals)


    # ---- promise 3: effects counted outside the process
    for key, n in sorted(world.effects.items()):
        expect(n <= 1, "tool_at_most_once", 3, f"tool call {key} executed {n} times")

    transcripts: dict[str, list[dict[str, Any]]] = {}  # conversation -> its transcript (read once)
    for conv in sc.conversations:
        msgs = transcripts[conv] = await rt.transcript(conv)
        events = await journal_of(conv)
        _check_transcript(checker, conv, msgs, world.effects)
        _check_reasoning(checker, sc, conv, msgs, runs_by_conv.get(conv, []))
        if sc._reasoning_steps is not None:
            _check_reasoning_journal(checker, sc, conv, events)
        _check_journal(checker, conv, events, sc.followed.get(conv))
        _check_usage_journaled(checker, conv, events, usage_of, sc.journal_retention is not None)
        trimmed = sc.journal_retention is not None  # older events may be gone: check what is retained
        _check_runs_in_journal(checker, conv, events, trimmed)
        _check_journal_matches_state(checker, conv, events, runs_by_conv.get(conv, []), trimmed)

    for refusal in sc.thinking_refused:
        expect(False, "thinking_passed_back", 2, f"the model was sent reasoning modified, moved or dropped: {refusal}")

    # ---- fork
    for parent, fork, at in sc.forks:
        p = transcripts[parent] if parent in transcripts else await rt.transcript(parent)
        f = transcripts[fork] if fork in transcripts else await rt.transcript(fork)
        expect(_strip(f[:at]) == _strip(p[:at]), "fork_is_prefix", 2, f"fork {fork} does not start with {parent}[:{at}]")


async def _all_events(rt: Runtime, conv: str) -> list[Any]:
    out: list[Any] = []
    after = None
    while True:
        page = await rt.read_events(conv, after, limit=10_000)
        out.extend(page.events)
        if len(page.events) < 10_000:
            return out
        after = page.events[-1].cursor


def _check_usage(checker: "Checker", sc: "RuntimeScenario", run_id: str, steps: dict[str, dict[str, int]],
                 totals: dict[str, int]) -> None:
    """Promise 10 in the ledger: each step's cost is its price applied to its recorded tokens (the
    runtime's price, recomputed here), the run's totals are the sum of its step records (a figure
    counted twice, or a record lost, shows here), and the totals stay within the run's ceilings."""
    expect = checker.expect
    price = (sc.pricing or {}).get("scripted", FREE)  # (every sim agent's model is a ScriptedModel)
    summed: dict[str, int] = {}
    for step, rec in sorted(steps.items()):
        want = cost_micros(price, rec)
        expect(rec.get("cost_micros", 0) == want, "cost_matches_price", 10,
               f"run {run_id} step {step}: cost_micros {rec.get('cost_micros', 0)}, but its tokens "
               f"{ {k: v for k, v in rec.items() if k != 'cost_micros'} } cost {want}")
        for k, v in rec.items():
            summed[k] = summed.get(k, 0) + v
    for k in sorted(set(summed) | set(totals)):
        expect(totals.get(k, 0) == summed.get(k, 0), "usage_total_is_sum", 10,
               f"run {run_id}: total {k} is {totals.get(k, 0)}, its {len(steps)} step records sum to {summed.get(k, 0)}")
    turn = next((t for t in sc.turns if sc.run_of.get(t.submission_id) == run_id), None)
    for name, ceiling in sorted(((turn.limits or {}) if turn is not None else {}).items()):
        used = totals.get(name[4:], 0)
        expect(used <= ceiling, "usage_within_ceiling", 10, f"run {run_id} recorded {name[4:]} {used}, past its ceiling of {ceiling}")


def _check_usage_journaled(checker: "Checker", conv: str, events: list[Any],
                           usage_of: dict[str, tuple[dict[str, dict[str, int]], dict[str, int]]], trimmed: bool) -> None:
    """Each usage.updated event carries exactly the figures the ledger recorded for its (run, step),
    and (within retention) every recorded step was journaled."""
    seen: set[tuple[str, str]] = set()
    for e in events:
        if e.type != "usage.updated":
            continue
        d = e.data or {}
        run_id, step = d.get("run_id"), d.get("step")
        seen.add((run_id, step))
        if run_id in usage_of:
            rec = usage_of[run_id][0].get(step)
            checker.expect(rec == d.get("usage"), "usage_once_per_step", 10,
                           f"{conv}: usage.updated of {run_id} step {step} says {d.get('usage')}, the ledger {rec}")
    if trimmed:
        return
    runs = {(e.data or {}).get("run_id") for e in events if e.type == "run.queued"}
    for run_id in sorted(runs & set(usage_of)):
        for step in sorted(usage_of[run_id][0]):
            checker.expect((run_id, step) in seen, "usage_once_per_step", 10,
                           f"{conv}: usage of {run_id} step {step} was recorded but never journaled")


def _check_reasoning(checker: "Checker", sc: "RuntimeScenario", conv: str, msgs: list[dict[str, Any]],
                     runs: list[Any]) -> None:
    """``thinking_in_place_once`` (promise 2): reasoning (extended thinking, interleaved or not) in
    the transcript.  Every assistant message holds exactly the content its model call streamed, in
    stream order: each reasoning part (thinking text, signature, redacted data unmodified) at the
    position it streamed among the text and tool calls — first, or between them — none dropped,
    none repeated, none in an answer that streamed none.  Each reasoning step's answer is persisted
    at most once, and a completed run holds every one of its steps (a resumed run neither repeats
    nor drops one) — unless a compaction (a provider overflow in random mode) summarised the turn,
    after which the scripted model no longer sees the turn's text and answers the summary."""
    from .scenarios import part_shape

    expect = checker.expect
    steps = sc.reasoning_steps() if sc._reasoning_steps is not None else {}
    expected = {said: shape for said, (turn_text, shape) in steps.items()
                if any(t.text == turn_text and t.conversation == conv for t in sc.turns)}
    if not expected and not any(p.get("type") in _REASONING for m in msgs if m.get("role") == "assistant"
                                and isinstance(m.get("content"), list) for p in m["content"]):
        return  # (the common case: no reasoning anywhere)
    completed: list[str] = []
    status = {i.run_id: i.status for i in runs}
    for t in sc.turns:
        if t.conversation == conv and status.get(sc.run_of.get(t.submission_id, "")) == "completed":
            completed += [said for said, (turn_text, _) in steps.items() if turn_text == t.text]
    persisted: dict[str, int] = {}
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant" or not isinstance(m.get("content"), list):
            continue
        parts = m["content"]
        text = M.text_of(m)
        if text in expected:
            persisted[text] = persisted.get(text, 0) + 1
            got = [part_shape(p) for p in parts]
            expect(got == expected[text], "thinking_in_place_once", 2,
                   f"{conv}: message {i} ({text!r}) holds {_describe_parts(got)}, "
                   f"its model call streamed {_describe_parts(expected[text])}")
        else:
            reasoning = [p for p in parts if p.get("type") in _REASONING]
            expect(not reasoning, "thinking_in_place_once", 2,
                   f"{conv}: message {i} ({text!r}) carries reasoning {_describe_parts(reasoning)}, "
                   f"its model call streamed none")
    for text, n in sorted(persisted.items()):
        expect(n == 1, "thinking_in_place_once", 2, f"{conv}: the reasoning answer {text!r} was persisted {n} times")
    if any(m.get("role") == "compaction" for m in msgs):
        completed = []  # a summary replaced the turn's text: the script then answers from the summary
    for text in completed:
        expect(text in persisted, "thinking_in_place_once", 2,
               f"{conv}: a completed reasoning run lacks its answer {text!r} (and its reasoning)")


def _check_reasoning_journal(checker: "Checker", sc: "RuntimeScenario", conv: str, events: list[Any]) -> None:
    """``thinking_journaled_in_place`` (promise 9, for reasoning): a model call's stream is journaled
    as parts numbered in stream order, so a client following the journal sees the reasoning where
    it streamed — before, between or after the text and tool calls.  For each (run, model call),
    ``part.added`` numbers run 0, 1, 2... (a call streamed again after a crash starts again at 0);
    every streamed sequence holding reasoning is a prefix of one of the turn's reasoning steps,
    part by part: the same kind at the same number (a redacted block too, as a bare part), each
    thinking part's text a prefix of the block's (the whole block once a later part streamed), a
    text part likewise, a tool call by name.  (Not checked when retention trims the journal.)"""
    if sc.journal_retention is not None:
        return
    steps = sc.reasoning_steps() if sc._reasoning_steps is not None else {}
    shapes = [shape for said, (turn_text, shape) in steps.items()
              if any(t.text == turn_text and t.conversation == conv for t in sc.turns)]
    expect = checker.expect
    segments: dict[tuple[Any, Any], list[list[dict[str, Any]]]] = {}
    for e in events:
        if e.type not in ("part.added", "part.updated"):
            continue
        d = e.data or {}
        segs = segments.setdefault((d.get("run_id"), d.get("call")), [])
        part = d.get("part")
        if e.type == "part.added":
            if part == 0 and (not segs or segs[-1]):
                segs.append([])  # a call's stream, or the same call streamed again after a crash
            if not segs or part != len(segs[-1]):
                expect(False, "thinking_journaled_in_place", 9,
                       f"{conv}: part.added {part} of {d.get('run_id')} call {d.get('call')} after "
                       f"{len(segs[-1]) if segs else 0} parts (numbers must follow the stream)")
                segs.append([])  # (resynchronise: one report per break)
                continue
            segs[-1].append({"kind": d.get("kind"), "thinking": d.get("thinking", ""), "text": d.get("text", ""),
                             "name": d.get("name")})
        elif segs and isinstance(part, int) and 0 <= part < len(segs[-1]):
            q = segs[-1][part]
            q["thinking"] += d.get("thinking", "")
            q["text"] += d.get("text", "")
    for (run_id, call), segs in sorted(segments.items(), key=str):
        for seg in segs:
            if not any(q["kind"] in _REASONING for q in seg):
                continue
            ok = any(_journal_prefix(seg, shape) for shape in shapes)
            expect(ok, "thinking_journaled_in_place", 9,
                   f"{conv}: {run_id} call {call} journaled parts {[q['kind'] for q in seg]}, not as any "
                   f"reasoning step of the conversation streamed them ({[[p['type'] for p in sh] for sh in shapes]})")


def _journal_prefix(seg: list[dict[str, Any]], shape: list[dict[str, Any]]) -> bool:
    """Whether the journaled parts ``seg`` are a prefix of the stream of ``shape``."""
    if len(seg) > len(shape):
        return False
    for j, (q, p) in enumerate(zip(seg, shape)):
        complete = j + 1 < len(seg)  # a later part streamed: this one was streamed whole
        if q["kind"] != p["type"]:
            return False
        if p["type"] in ("thinking", "text"):
            got, want = q[p["type"]], p[p["type"]]
            if not (got == want if complete else want.startswith(got)):
                return False
        elif p["type"] == "tool_call" and q["name"] != p["name"]:
            return False
    return True


def _describe_parts(parts: list[dict[str, Any]]) -> str:
    return "[" + ", ".join(f"{p.get('type')}({str(p.get('signature') or p.get('data') or p.get('name') or '')[-8:]})"
                           for p in parts) + "]"


def _strip(msgs: list[dict[str, Any]]) -> list[Any]:
    return [(m.get("role"), M.text_of(m) if m.get("role") in ("user", "assistant") else None) for m in msgs]


def _check_transcript(checker: "Checker", conv: str, msgs: list[dict[str, Any]], effects: dict[str, int]) -> None:
    expect = checker.expect
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    users: dict[str, int] = {}
    dup: set[str] = set()
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role == "user":
            t = M.text_of(m)
            users[t] = users.get(t, 0) + 1
        for p in m.get("content", ()) if isinstance(m.get("content"), list) else ():
            if p.get("type") == "tool_call":
                if p["id"] in calls:
                    dup.add(p["id"])
                calls[p["id"]] = i
            elif p.get("type") == "tool_result":
                cid = p.get("call_id")
                results[cid] = results.get(cid, 0) + 1
                expect(cid in calls and calls[cid] < i, "transcript_tool_results", 2,
                       f"{conv}: result for {cid} at message {i} without an earlier call")
                if not p.get("is_error") and not p.get("reason"):
                    mk = _EFFECT_KEY.search(str(p.get("content", "")))
                    if mk:
                        n = effects.get(mk.group(1), 0)
                        expect(n == 1, "tool_result_matches_effect", 3,
                               f"{conv}: call {cid} reported success but its effect ran {n} times")
    for cid in sorted(dup):  # results can no longer be matched to calls by id
        expect(False, "tool_call_ids_unique", 2, f"{conv}: tool call id {cid} used by more than one call")
    for cid in calls:
        if cid in dup:
            continue
        n = results.get(cid, 0)
        expect(n == 1, "transcript_tool_results", 3, f"{conv}: tool call {cid} has {n} results")
    for t, n in users.items():
        expect(n == 1, "no_duplicate_turn", 2, f"{conv}: user message {t!r} appears {n} times")


def _check_journal(checker: "Checker", conv: str, events: list[Any], live: list[tuple[str, str]] | None) -> None:
    expect = checker.expect
    cursors = [e.cursor for e in events]
    expect(all(a < b for a, b in zip(cursors, cursors[1:])), "journal_ordered", 9,
           f"{conv}: journal positions are not strictly increasing")
    if live is not None:
        replay = [(e.cursor, e.type) for e in events]
        expect(all(a[0] < b[0] for a, b in zip(live, live[1:])), "journal_replay_equals_live", 9,
               f"{conv}: a follower saw positions out of order or twice")
        # Within retention (from the oldest retained event on) what was seen live is the replay, no gap.
        tail = [x for x in live if replay and x[0] >= replay[0][0]]
        expect(tail == replay[: len(tail)], "journal_replay_equals_live", 9,
               f"{conv}: a follower saw {len(tail)} retained events live that differ from the replay "
               f"(first difference at {_first_diff(tail, replay)})")
    steps: dict[tuple[str, str], int] = {}
    for e in events:
        if e.type == "usage.updated":
            d = e.data or {}
            k = (d.get("run_id"), d.get("step"))
            steps[k] = steps.get(k, 0) + 1
    for (run_id, step), n in sorted(steps.items(), key=str):
        expect(n == 1, "usage_once_per_step", 10, f"{conv}: usage of {run_id} step {step} recorded {n} times")


def _check_journal_matches_state(checker: "Checker", conv: str, events: list[Any], runs: list[Any],
                                 trimmed: bool = False) -> None:
    """Every state change is journaled in its own transaction: exactly once, never without the change."""
    queued: dict[str, int] = {}
    settles: dict[str, list[str]] = {}
    for e in events:
        rid = (e.data or {}).get("run_id")
        if e.type == "run.queued":
            queued[rid] = queued.get(rid, 0) + 1
        elif e.type in SETTLED_EVENTS:
            settles.setdefault(rid, []).append(e.type.split(".", 1)[1])
    for info in runs:
        rid = info.run_id
        if trimmed and queued.get(rid, 0) == 0:
            continue  # its events were trimmed by retention
        checker.expect(queued.get(rid, 0) == 1, "journal_matches_state", 9,
                       f"{conv}: run {rid} has {queued.get(rid, 0)} run.queued events")
        want = [info.status] if info.status in ("completed", "failed", "cancelled") else []
        checker.expect(settles.get(rid, []) == want, "journal_matches_state", 9,
                       f"{conv}: run {rid} is {info.status} but the journal settles it {settles.get(rid, [])}")


def _first_diff(a: list[Any], b: list[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _check_runs_in_journal(checker: "Checker", conv: str, events: list[Any], trimmed: bool = False) -> None:
    """Promises 5 and 6 as the journal shows them: attempts, overlap, FIFO."""
    expect = checker.expect
    queued: list[str] = []
    first_start: list[str] = []
    attempt: dict[str, int] = {}
    active: str | None = None
    settled: set[str] = set()
    for e in events:
        d = e.data or {}
        rid = d.get("run_id")
        if e.type == "run.queued":
            queued.append(rid)
        elif e.type == "run.started":
            a = d.get("attempt", 0)
            # (a run resumed after parking for approval starts again in the same attempt)
            expect(a >= attempt.get(rid, 0), "no_stale_lease_writes", 5,
                   f"{conv}: run {rid} started attempt {a} after attempt {attempt.get(rid, 0)}")
            attempt[rid] = max(a, attempt.get(rid, 0))
            if rid not in first_start:
                first_start.append(rid)
            expect(active in (None, rid), "one_active_per_conversation", 6,
                   f"{conv}: run {rid} started while {active} was active")
            active = rid
        elif e.type in SETTLED_EVENTS:
            settled.add(rid)
            if active == rid:
                active = None
        elif rid is not None and "attempt" in d and e.type != "run.retry-pending":
            expect(d["attempt"] >= attempt.get(rid, 0), "no_stale_lease_writes", 5,
                   f"{conv}: {e.type} of run {rid} from attempt {d['attempt']} after attempt {attempt.get(rid)} started")
        if rid is not None and rid in settled and e.type not in SETTLED_EVENTS:
            expect(False, "journal_matches_state", 9, f"{conv}: {e.type} of run {rid} journaled after it settled")
    if trimmed:  # runs queued before the retained window cannot be ordered
        first_start = [r for r in first_start if r in queued]
    order = [r for r in queued if r in first_start]
    expect(order == first_start, "fifo_per_conversation", 6, f"{conv}: runs started in order {first_start}, queued {queued}")
