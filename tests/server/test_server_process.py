"""The server as a real process: SIGKILL mid-turn and restart; SIGTERM shuts down gracefully;
a second process on the same data directory is refused."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import httpx
import trio

from server_helpers import TOKEN, ServeProcess, SSEReader

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SSE = {"Accept": "text/event-stream"}
ENV = {**os.environ, "SUREFOOT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}


def start_child(tmp: Path, data: Path, effects: Path, tick: float = 0.15) -> ServeProcess:
    """serve_child.py (a tool-using agent whose effects are logged) on a port the kernel picks."""
    return ServeProcess([sys.executable, str(HERE / "serve_child.py"), str(data), "0", str(effects)], tmp=tmp,
                        env={**ENV, "SUREFOOT_TEST_TICK_SECONDS": str(tick)})


def start_cli(tmp: Path, data: Path, *extra: str) -> ServeProcess:
    """``python -m server.cli serve`` on a port the kernel picks."""
    return ServeProcess([sys.executable, "-m", "server.cli", "serve", "--data", str(data), "--port", "0", *extra],
                        tmp=tmp, env=ENV, cwd=ROOT)


def settled(f: dict) -> bool:
    return f.get("event") in ("run.completed", "run.failed", "run.cancelled")


async def test_sigkill_mid_turn_then_restart_settles_everything_once(tmp_path):
    data, effects = tmp_path / "data", tmp_path / "effects.txt"
    effects.touch()
    proc = start_child(tmp_path, data, effects)
    try:
        await proc.healthy()
        acks = []
        frames: list[dict] = []
        async with proc.client() as c:
            for i in range(6):
                r = await c.post(f"/v1/conversations/c{i % 2}/messages", json={"message": f"m{i}"},
                                 headers={"Idempotency-Key": f"kill-{i}"})
                assert r.status_code == 202, r.text
                acks.append(r.json())
            # follow c0 until a tool effect exists, then kill the server mid-turn
            try:
                async with c.stream("GET", "/v1/conversations/c0/events", headers=SSE) as r:
                    reader = SSEReader(r)
                    with trio.fail_after(20):
                        while True:
                            f = await reader.next()
                            if "id" in f:
                                frames.append(f)
                            if f.get("event") == "tool.started" and len(effects.read_text().split()) >= 3:
                                await trio.sleep(0.05)  # the effect is recorded; its result is not
                                proc.signal(signal.SIGKILL)
                                break
                    # read what was already sent, until the connection drops
                    with trio.move_on_after(5):
                        while True:
                            f = await reader.next()
                            if "id" in f:
                                frames.append(f)
            except (httpx.TransportError, StopAsyncIteration):
                pass
        proc.wait(10)
        proc.close()
        before_restart = effects.read_text().split()
        # restart on the same data directory (on another port: the follower resumes there)
        proc = start_child(tmp_path, data, effects)
        await proc.healthy()
        async with proc.client() as c:
            # the follower resumes from its last id, without gap, until every c0 run settled
            c0_runs = {a["run_id"] for a in acks if a["conversation_id"] == "c0"}
            seen_settled = {json.loads(f["data"])["data"]["run_id"] for f in frames if settled(f)}
            async with c.stream("GET", "/v1/conversations/c0/events",
                                headers={**SSE, "Last-Event-ID": frames[-1]["id"]}) as r:
                reader = SSEReader(r)
                with trio.fail_after(60):
                    while not c0_runs <= seen_settled:
                        f = await reader.next()
                        if "id" in f:
                            frames.append(f)
                            if settled(f):
                                seen_settled.add(json.loads(f["data"])["data"]["run_id"])
            # every acknowledged submission settled
            with trio.fail_after(60):
                for a in acks:
                    while True:
                        info = (await c.get(f"/v1/runs/{a['run_id']}")).json()
                        if info["status"] in ("completed", "failed", "cancelled"):
                            break
                        await trio.sleep(0.05)
                    assert info["status"] == "completed", info
            # the follower saw the journal exactly: same positions, no gap, no duplicate
            journal, after = [], None
            while True:
                page = (await c.get("/v1/conversations/c0/events", params={"after": after} if after else {})).json()
                journal += page["events"]
                if not page["more"]:
                    break
                after = page["next_cursor"]
            ids = [f["id"] for f in frames]
            assert ids == [e["cursor"] for e in journal][: len(ids)]
            # tools ran at most once per call, and the interrupted one got an `interrupted` result
            counts = Counter(effects.read_text().split())
            assert counts and max(counts.values()) == 1, counts
            assert len(before_restart) >= 3
            transcript = (await c.get("/v1/conversations/c0/messages")).json()["messages"]
            assert "interrupted" in json.dumps(transcript)
            # re-submitting an acknowledged key answers with its settled outcome, not a new run
            r = await c.post("/v1/conversations/c0/messages", json={"message": "m0"}, headers={"Idempotency-Key": "kill-0"})
            assert r.status_code == 200 and r.json()["run_id"] == acks[0]["run_id"]
    finally:
        proc.close()


async def test_sigterm_is_graceful_and_second_process_refused(tmp_path):
    data = tmp_path / "data"
    proc = start_cli(tmp_path, data, "--workers", "2")
    try:
        await proc.healthy()
        # a second server on the same directory is refused with a clear message
        second = start_cli(tmp_path, data)
        try:
            assert second.wait(30) == 1
            err = second.stderr()
            assert "surefoot serve: data directory" in err and "already open by pid" in err, err
            assert "Traceback" not in err
        finally:
            second.close()
        async with proc.client() as c:
            r = await c.post("/v1/conversations/c/messages", json={"message": "hello"})
            assert r.status_code == 202
            async with c.stream("GET", "/v1/conversations/c/events", headers=SSE) as r:
                reader = SSEReader(r)
                await reader.events_until(settled)
                proc.signal(signal.SIGTERM)
                closing = await reader.events_until(lambda f: f.get("event") == "stream.closing", timeout=10)
                assert closing[-1]["event"] == "stream.closing"
        assert proc.wait(15) == 0
        proc.close()
        # and it comes back with the data
        proc = start_cli(tmp_path, data)
        await proc.healthy()
        async with proc.client() as c:
            msgs = (await c.get("/v1/conversations/c/messages")).json()["messages"]
            assert "You said: hello" in json.dumps(msgs)
        proc.signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        proc.close()


async def test_sigterm_mid_turn_releases_leases_so_a_restart_resumes_at_once(tmp_path):
    data, effects = tmp_path / "data", tmp_path / "effects.txt"
    effects.touch()
    proc = start_child(tmp_path, data, effects, tick=3.0)  # a turn far longer than the shutdown
    try:
        await proc.healthy()
        async with proc.client() as c:
            ack = (await c.post("/v1/conversations/t/messages", json={"message": "go"})).json()
            with trio.fail_after(20):
                while not effects.read_text().split():
                    await trio.sleep(0.02)
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        proc.close()
        proc = start_child(tmp_path, data, effects, tick=0.05)
        await proc.healthy()
        async with proc.client() as c:
            # well inside the 10 s lease: the lease was released, not left to lapse
            with trio.fail_after(6):
                while True:
                    info = (await c.get(f"/v1/runs/{ack['run_id']}")).json()
                    if info["status"] == "completed":
                        break
                    await trio.sleep(0.05)
            events = (await c.get("/v1/conversations/t/events")).json()["events"]
            starts = [e for e in events if e["type"] == "run.started"]
            assert len(starts) >= 2, "the turn must have been cut by the shutdown and resumed"
        assert max(Counter(effects.read_text().split()).values()) == 1
    finally:
        proc.close()
