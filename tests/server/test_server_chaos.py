"""The chaos soak (chaos.py) on a small budget: the real `surefoot serve` process SIGKILLed mid-work
and restarted, twice per seed, for two seeds; then the checker shown to bite on corrupted records.

A long soak is `python tests/server/chaos.py --seconds 900 --seed N` (README, testing).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from chaos import VIOLATIONS, ChaosConfig, check, command, soak_many, summary

SEEDS = (11, 12)
KILLS = 2  # per seed: the first two kill modes are always mid_tool and after_submit (chaos.kill_modes)


@pytest.fixture(scope="module")
def soaks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, Any]]:
    # Sync on purpose: the soaks are one trio.run of their own, both seeds at once (the test
    # bodies only read the records).
    cfgs = [config(seed) for seed in SEEDS]
    results = soak_many(cfgs, [tmp_path_factory.mktemp(f"chaos{seed}") for seed in SEEDS])
    for _, rep in results:
        print(summary(rep))
    return dict(zip(SEEDS, results))


def config(seed: int) -> ChaosConfig:
    return ChaosConfig(seed=seed, seconds=7.0, kills=KILLS)


@pytest.mark.parametrize("seed", SEEDS)
def test_repeated_sigkill_keeps_every_promise(soaks, seed):
    rec, rep = soaks[seed]
    assert not rep.violations, f"{summary(rep)}\nreproduce: {command(config(seed))}"
    assert rep.stats["kills"] == KILLS and rec["starts"] == KILLS + 1
    # the soak did real work and checked it: runs settled, effects and followed events exist
    assert rep.stats["acks"] >= 5 and rep.stats["runs"] == rep.stats["acks"]
    assert rep.stats["effects"] > 0 and rep.stats["events_followed"] > 0


def test_the_kills_landed_mid_work(soaks):
    """Zero violations means something only if the kills hit work in flight."""
    stats = [rep.stats for _, rep in soaks.values()]
    # a tool's effect recorded and its result lost: recovered as `interrupted`, not re-run
    assert sum(s["interrupted_with_effect"] for s in stats) >= 1, stats
    # an acknowledgement lost to a kill, and the submission retried (same key and body) to an ack
    assert sum(s["lost_acks_retried"] for s in stats) >= 1, stats
    # followers were cut by the kills and resumed from their Last-Event-ID (checked gapless above)
    assert all(s["follower_resumes"] >= 1 for s in stats), stats
    # the clients re-sent acknowledged keys, reused keys with other bodies, cancelled runs
    assert sum(s["resends"] + s["conflicts"] + s["cancels"] for s in stats) > 0, stats
    # and some followers started mid-journal, from an acknowledgement's cursor
    assert any(f["after"] for rec, _ in soaks.values() for f in rec["followers"])


# ----------------------------------------------------------------------------- the checker bites


def _interrupted(rec: dict) -> tuple[str, int, int]:
    """An `interrupted` result of a call whose effect is recorded (a kill can also land between a
    call being marked started and its tool's first line: interrupted, with no effect)."""
    ran = {(e[3], e[1]) for e in rec["effects"]}
    for conv, msgs in rec["transcripts"].items():
        for i, m in enumerate(msgs):
            for j, p in enumerate(m.get("content") or []):
                if p.get("type") == "tool_result" and p.get("reason") == "interrupted" and (conv, p["call_id"]) in ran:
                    return conv, i, j
    raise AssertionError("no interrupted result with a recorded effect in the record")


def dup_effect(rec: dict) -> None:
    rec["effects"].append(list(rec["effects"][len(rec["effects"]) // 2]))


def gap_in_follower(rec: dict) -> None:
    f = max(rec["followers"], key=lambda f: len(f["ids"]))
    del f["ids"][len(f["ids"]) // 2]


def dup_in_follower(rec: dict) -> None:
    f = max(rec["followers"], key=lambda f: len(f["ids"]))
    k = len(f["ids"]) // 2
    f["ids"].insert(k, f["ids"][k - 1])


def follower_swapped(rec: dict) -> None:
    f = max(rec["followers"], key=lambda f: len(f["ids"]))
    f["ids"][3], f["ids"][4] = f["ids"][4], f["ids"][3]


def interrupted_result_lost(rec: dict) -> None:
    conv, i, j = _interrupted(rec)
    del rec["transcripts"][conv][i]["content"][j]


def interrupted_result_rerun(rec: dict) -> None:
    # the recovered call was run again instead: its effect twice and a real result
    conv, i, j = _interrupted(rec)
    part = rec["transcripts"][conv][i]["content"][j]
    effect = next(e for e in rec["effects"] if e[1] == part["call_id"] and e[3] == conv)
    rec["effects"].append(list(effect))
    rec["transcripts"][conv][i]["content"][j] = {**part, "reason": None, "is_error": False, "content": "ok 0"}


def effect_with_wrong_result(rec: dict) -> None:
    conv, i, j = _interrupted(rec)
    part = rec["transcripts"][conv][i]["content"][j]
    rec["transcripts"][conv][i]["content"][j] = {**part, "reason": "cancelled"}


def effect_missing(rec: dict) -> None:
    # a call answered with the tool's own result, though the tool never ran (no effect)
    ok = {(conv, p["call_id"]) for conv, msgs in rec["transcripts"].items() for m in msgs
          for p in m.get("content") or [] if p.get("type") == "tool_result" and not p.get("is_error")}
    rec["effects"].remove(next(e for e in rec["effects"] if (e[3], e[1]) in ok))


def two_runs_for_a_key(rec: dict) -> None:
    s = next(s for s in rec["submissions"] if s["acks"])
    s["acks"].append({**s["acks"][0], "run_id": "f" * 32})


def settled_resend_new_run(rec: dict) -> None:
    s = next(s for s in rec["submissions"] if s["resend"])
    s["resend"] = {"status": 202, "run_id": "e" * 32}


def conflict_accepted(rec: dict) -> None:
    rec["conflicts"].append({"key": rec["submissions"][0]["key"], "conv": "conv0", "status": 202, "body": "{}"})


def ack_lost(rec: dict) -> None:
    s = next(s for s in rec["submissions"] if s["acks"] and not s["cancel"])
    rec["runs"][s["acks"][0]["run_id"]]["status"] = "queued"


def uncancelled_run_cancelled(rec: dict) -> None:
    s = next(s for s in rec["submissions"] if s["acks"] and not s["cancel"])
    rec["runs"][s["acks"][0]["run_id"]]["status"] = "cancelled"


def user_message_dropped(rec: dict) -> None:
    s = next(s for s in rec["submissions"] if s["acks"] and rec["runs"][s["acks"][0]["run_id"]]["status"] == "completed")
    msgs = rec["transcripts"][s["conv"]]
    msgs[:] = [m for m in msgs if not (m.get("role") == "user" and s["body"]["message"] in str(m))]


def journal_reordered(rec: dict) -> None:
    j = max(rec["journals"].values(), key=len)
    j[5], j[6] = j[6], j[5]


def position_reused(rec: dict) -> None:
    # a versionstamp reused after a restart, in another conversation
    a, b = sorted(rec["journals"].values(), key=len)[-2:]
    a.append({**a[-1], "cursor": b[-1]["cursor"]})
    a.sort(key=lambda e: e["cursor"])


def terminal_twice(rec: dict) -> None:
    j = max(rec["journals"].values(), key=len)
    j.append(dict(next(e for e in j if e["type"] == "run.completed")))


def call_answered_twice(rec: dict) -> None:
    conv, i, j = _interrupted(rec)
    rec["transcripts"][conv][i]["content"].append(dict(rec["transcripts"][conv][i]["content"][j]))


def server_error(rec: dict) -> None:
    rec["errors"].append({"what": "submit", "status": 500, "body": "Traceback"})


def restart_failed(rec: dict) -> None:
    rec["start_failures"].append("ServerFailed: exited 1 at start 2: Traceback ...")


def phantom_run(rec: dict) -> None:
    rec["conv_runs"]["conv0"].append({"run_id": "d" * 32, "submission_id": "nobody-sent-this"})


def never_acknowledged(rec: dict) -> None:
    rec["submissions"].append({**copy.deepcopy(rec["submissions"][0]), "key": "never", "acks": [], "refusals": []})


def follower_stalled(rec: dict) -> None:
    rec["followers_caught_up"] = False
    max(rec["followers"], key=lambda f: len(f["ids"]))["ids"].pop()


BITES: list[tuple[Callable[[dict], None], str]] = [
    (dup_effect, "tool_at_most_once"),
    (gap_in_follower, "stream_exact"),
    (dup_in_follower, "stream_exact"),
    (follower_swapped, "stream_exact"),
    (interrupted_result_lost, "interrupted_result"),
    (interrupted_result_lost, "transcript_well_formed"),
    (interrupted_result_rerun, "tool_at_most_once"),
    (effect_with_wrong_result, "interrupted_result"),
    (effect_missing, "interrupted_result"),
    (two_runs_for_a_key, "one_run_per_key"),
    (settled_resend_new_run, "one_run_per_key"),
    (phantom_run, "one_run_per_key"),
    (conflict_accepted, "key_conflict_409"),
    (ack_lost, "ack_settled"),
    (uncancelled_run_cancelled, "ack_settled"),
    (user_message_dropped, "ack_in_transcript"),
    (journal_reordered, "journal_order"),
    (position_reused, "journal_order"),
    (terminal_twice, "settled_once"),
    (call_answered_twice, "transcript_well_formed"),
    (server_error, "server_error"),
    (follower_stalled, "stream_caught_up"),
    (restart_failed, "server_start"),
    (never_acknowledged, "submit_unacknowledged"),
]


@pytest.mark.parametrize("corrupt,expected", BITES, ids=[f"{f.__name__}-{v}" for f, v in BITES])
def test_the_checker_bites(soaks, corrupt, expected):
    # the record richest in recovered calls (each seed's mid_tool kill almost always leaves some)
    rec, _ = max(soaks.values(), key=lambda r: r[1].stats["interrupted_with_effect"])
    assert not check(rec).violations  # the pristine record passes (re-checked: check() is pure)
    bad = copy.deepcopy(rec)
    corrupt(bad)
    names = check(bad).names()
    assert expected in names, (expected, names)
    assert names <= set(VIOLATIONS)


def test_every_violation_name_has_a_bite():
    assert {v for _, v in BITES} == set(VIOLATIONS)
