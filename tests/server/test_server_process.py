"""The server as a real process: SIGKILL mid-turn and restart; SIGTERM shuts down gracefully;
a second process on the same data directory is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import trio

from server_helpers import TOKEN, SSEReader, free_port

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SSE = {"Accept": "text/event-stream"}
ENV = {**os.environ, "SUREFOOT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}


def start_child(data: Path, port: int, effects: Path, tick: float = 0.15) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "serve_child.py"), str(data), str(port), str(effects)],
                            env={**ENV, "SUREFOOT_TEST_TICK_SECONDS": str(tick)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_cli(data: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--data", str(data), "--port", str(port),
                             *extra], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        async with httpx.AsyncClient(base_url=url, timeout=2) as c:
            while True:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
                try:
                    if (await c.get("/readyz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.05)


def settled(f: dict) -> bool:
    return f.get("event") in ("run.completed", "run.failed", "run.cancelled")


async def test_sigkill_mid_turn_then_restart_settles_everything_once(tmp_path):
    data, effects = tmp_path / "data", tmp_path / "effects.txt"
    effects.touch()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_child(data, port, effects)
    try:
        await wait_healthy(url, proc)
        acks = []
        frames: list[dict] = []
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
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
                                proc.send_signal(signal.SIGKILL)
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
        before_restart = effects.read_text().split()
        # restart on the same data directory
        proc = start_child(data, port, effects)
        await wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
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
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_sigterm_is_graceful_and_second_process_refused(tmp_path):
    data = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_cli(data, port, "--workers", "2")
    try:
        await wait_healthy(url, proc)
        # a second server on the same directory is refused with a clear message
        second = start_cli(data, free_port())
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1
        assert b"surefoot serve:" in err and b"Traceback" not in err
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            r = await c.post("/v1/conversations/c/messages", json={"message": "hello"})
            assert r.status_code == 202
            async with c.stream("GET", "/v1/conversations/c/events", headers=SSE) as r:
                reader = SSEReader(r)
                await reader.events_until(settled)
                proc.send_signal(signal.SIGTERM)
                closing = await reader.events_until(lambda f: f.get("event") == "stream.closing", timeout=10)
                assert closing[-1]["event"] == "stream.closing"
        assert proc.wait(15) == 0
        # and it comes back with the data
        proc = start_cli(data, port)
        await wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            msgs = (await c.get("/v1/conversations/c/messages")).json()["messages"]
            assert "You said: hello" in json.dumps(msgs)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_sigterm_mid_turn_releases_leases_so_a_restart_resumes_at_once(tmp_path):
    data, effects = tmp_path / "data", tmp_path / "effects.txt"
    effects.touch()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_child(data, port, effects, tick=3.0)  # a turn far longer than the shutdown
    try:
        await wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            ack = (await c.post("/v1/conversations/t/messages", json={"message": "go"})).json()
            with trio.fail_after(20):
                while not effects.read_text().split():
                    await trio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        proc = start_child(data, port, effects, tick=0.05)
        await wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
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
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
