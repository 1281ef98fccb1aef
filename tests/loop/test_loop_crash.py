"""Crash tests: a child process running the embedded runtime is SIGKILLed at four points.

(a) after the tool call is persisted and the tool's external effect happened,
    before its result; (b) while the model streams; (c) during a backoff wait;
(d) while parked for approval.  After a restart on the same data directory the
run completes, the effect counter shows one execution per call id, the
transcript holds an ``interrupted`` result exactly where expected (and nowhere
else), and the journal shows what happened.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_crash_child.py")
MARKER_TIMEOUT = 30.0
RESUME_TIMEOUT = 60.0


def spawn(scenario: str, phase: str, data, effects) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, scenario, phase, str(data), str(effects)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_marker(proc: subprocess.Popen, marker: str) -> dict:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + MARKER_TIMEOUT
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        msg = json.loads(line)
        if msg.get("marker") == marker:
            return msg
    proc.kill()
    raise AssertionError(f"no {marker!r} marker; stderr:\n{proc.stderr.read()[-4000:]}")


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def resume(scenario: str, data, effects) -> dict:
    proc = spawn(scenario, "resume", data, effects)
    try:
        out, err = proc.communicate(timeout=RESUME_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"resume timed out; stderr:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def effects_of(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tool_results(transcript: list[dict]) -> list[dict]:
    return [p for m in transcript if m["role"] == "tool" for p in m["content"]]


def journal_types(res: dict) -> list[str]:
    return [e["type"] for e in res["journal"]]


@pytest.fixture
def paths(tmp_path):
    return tmp_path / "data", tmp_path / "effects.jsonl"


def test_kill_after_tool_effect_before_result(paths):
    data, effects = paths
    child = spawn("tool", "first", data, effects)
    wait_marker(child, "effect-done")
    kill(child)
    assert len(effects_of(effects)) == 1
    res = resume("tool", data, effects)
    assert res["outcome"]["status"] == "completed" and res["outcome"]["result"] == "final answer"
    # one execution per call id: the tool was never run again
    runs = effects_of(effects)
    assert len(runs) == 1
    call_id = runs[0]["call_id"]
    # the transcript: user, assistant(tool call), interrupted result, final answer
    t = res["transcript"]
    assert [m["role"] for m in t] == ["user", "assistant", "tool", "assistant"]
    (result,) = tool_results(t)
    assert result["call_id"] == call_id and result["is_error"] and result["reason"] == "interrupted"
    assert t[1]["content"][-1]["id"] == call_id
    # the journal: started once, taken over on attempt 2, finalised as interrupted, completed
    types = journal_types(res)
    assert types.count("tool.started") == 1
    starts = [e["data"] for e in res["journal"] if e["type"] == "run.started"]
    assert [(s["attempt"], s["takeover"]) for s in starts] == [(1, False), (2, True)]
    done = [e["data"] for e in res["journal"] if e["type"] == "tool.completed"]
    assert [(d["call_id"], d.get("reason")) for d in done] == [(call_id, "interrupted")]
    assert types[-1] == "run.completed"
    assert res["run"] == 2


def test_kill_while_the_model_streams(paths):
    data, effects = paths
    child = spawn("stream", "first", data, effects)
    wait_marker(child, "streaming")
    kill(child)
    assert effects_of(effects) == []  # the tool call had not even finished streaming
    res = resume("stream", data, effects)
    assert res["outcome"]["status"] == "completed"
    assert len(effects_of(effects)) == 1
    t = res["transcript"]
    # no half-streamed assistant message was persisted; nothing is interrupted
    assert [m["role"] for m in t] == ["user", "assistant", "tool", "assistant"]
    assert all(not r.get("reason") for r in tool_results(t))
    types = journal_types(res)
    # the partial stream of attempt 1 is in the journal, then attempt 2 streams again
    first_start, second_start = [i for i, ty in enumerate(types) if ty == "run.started"]
    assert "part.updated" in types[first_start:second_start]
    assert "message.added" in types[second_start:]
    assert types.count("tool.started") == 1 and types[-1] == "run.completed"


def test_kill_during_a_backoff_wait(paths):
    data, effects = paths
    child = spawn("backoff", "first", data, effects)
    m = wait_marker(child, "backoff")
    kill(child)
    next_attempt_at = m["next"]
    res = resume("backoff", data, effects)
    assert res["outcome"]["status"] == "completed"
    assert len(effects_of(effects)) == 1
    with open(str(effects) + ".model-calls") as f:
        calls = [json.loads(line) for line in f]
    first_calls = [c for c in calls if c["phase"] == "first"]
    resumed = [c for c in calls if c["phase"] == "resume"]
    assert len(first_calls) == 1  # killed during the first backoff wait
    # the resumed process honoured the persisted nextAttemptAt before calling again
    assert resumed[0]["t"] >= next_attempt_at
    pending = [e["data"] for e in res["journal"] if e["type"] == "run.retry-pending"]
    assert len(pending) == 1 and pending[0]["attempt"] == 2 and pending[0]["nextAttemptAt"] == next_attempt_at
    # the transient error never reached the transcript
    assert [m["role"] for m in res["transcript"]] == ["user", "assistant", "tool", "assistant"]


def test_kill_while_parked_for_approval(paths):
    data, effects = paths
    child = spawn("approval", "first", data, effects)
    m = wait_marker(child, "parked")
    kill(child)
    assert effects_of(effects) == []
    res = resume("approval", data, effects)
    assert res["outcome"]["status"] == "completed"
    runs = effects_of(effects)
    assert len(runs) == 1 and runs[0]["call_id"] == m["call_id"]
    types = journal_types(res)
    assert types.index("approval.requested") < types.index("approval.resolved") < types.index("tool.started")
    assert all(not r.get("reason") for r in tool_results(res["transcript"]))  # parked, not interrupted
    resolved = next(e["data"] for e in res["journal"] if e["type"] == "approval.resolved")
    assert resolved["allow"] is True and resolved["reason"] == "ok after restart"
