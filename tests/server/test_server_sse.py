"""SSE over real hypercorn: replay then live, Last-Event-ID resume, retention, stream tokens, heartbeats."""

from __future__ import annotations

import json

import httpx
import jwt
import pytest
import trio

from server.auth import STREAM_AUDIENCE

from server_helpers import FDB_CAPI, SSEReader, serving, ticking_agent, wait_settled

SSE = {"Accept": "text/event-stream"}


@pytest.fixture(params=["memory:", FDB_CAPI])
def url(request):
    """Each stream test on the memory engine and on the FoundationDB backend over the stand-in
    libfdb_c, where going live rests on the backend's watches and versionstamped keys."""
    return request.param


def settled(f: dict) -> bool:
    return f.get("event") in ("run.completed", "run.failed", "run.cancelled")


async def journal_ids(c: httpx.AsyncClient, conv: str) -> list[str]:
    ids, after = [], None
    while True:
        r = await c.get(f"/v1/conversations/{conv}/events", params={"after": after} if after else {})
        page = r.json()
        ids += [e["cursor"] for e in page["events"]]
        if not page["more"]:
            return ids
        after = page["next_cursor"]


async def test_replay_then_live_ids_are_positions(url):
    async with serving(url, agent=ticking_agent(4, 0.02)) as s:
        async with s.client() as c:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "go"})).json()
            await wait_settled(c, ack["run_id"])
            ack2 = (await c.post("/v1/conversations/c/messages", json={"message": "again"})).json()
            async with c.stream("GET", "/v1/conversations/c/events", headers=SSE) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                reader = SSEReader(r)
                frames = await reader.events_until(lambda f: settled(f) and ack2["run_id"] in f["data"])
            ids = [f["id"] for f in frames]
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
            assert ids == (await journal_ids(c, "c"))[: len(ids)]
            for f in frames:
                body = json.loads(f["data"])
                assert body["cursor"] == f["id"] and body["type"] == f["event"]


async def test_disconnect_and_resume_with_last_event_id_equals_live_follower(url):
    async with serving(url, agent=ticking_agent(10, 0.05)) as s:
        async with s.client() as c, s.client() as c2:
            # a live follower from before the run
            first = (await c.post("/v1/conversations/c/messages", json={"message": "warm"})).json()
            await wait_settled(c, first["run_id"])
            start = (await journal_ids(c, "c"))[-1]  # after the warm-up run's events
            live: list[dict] = []
            resumed: list[dict] = []
            ack_box = {}

            async def live_follower(task_status=trio.TASK_STATUS_IGNORED):
                async with c.stream("GET", f"/v1/conversations/c/events?after={start}", headers=SSE) as r:
                    reader = SSEReader(r)
                    task_status.started()
                    live.extend(await reader.events_until(
                        lambda f: settled(f) and f["data"].find(ack_box.get("run", "?")) >= 0, timeout=30))

            async with trio.open_nursery() as n:
                await n.start(live_follower)
                ack = (await c2.post("/v1/conversations/c/messages", json={"message": "go"})).json()
                ack_box["run"] = ack["run_id"]
                # follower 2: read a few events, drop the connection mid-turn, resume with Last-Event-ID
                async with c2.stream("GET", f"/v1/conversations/c/events?after={start}", headers=SSE) as r:
                    reader = SSEReader(r)
                    resumed.extend(await reader.events_until(lambda f: f.get("event") == "tool.completed"))
                info = (await c2.get(f"/v1/runs/{ack['run_id']}")).json()
                assert info["status"] not in ("completed",), "the drop must happen mid-turn"
                for _ in range(2):  # twice, to resume from a resume
                    async with c2.stream("GET", f"/v1/conversations/c/events?after={start}",
                                         headers={**SSE, "Last-Event-ID": resumed[-1]["id"]}) as r:
                        reader = SSEReader(r)
                        resumed.extend(await reader.events_until(lambda f: f.get("event") == "tool.completed"))
                async with c2.stream("GET", "/v1/conversations/c/events",
                                     headers={**SSE, "Last-Event-ID": resumed[-1]["id"]}) as r:
                    reader = SSEReader(r)
                    resumed.extend(await reader.events_until(
                        lambda f: settled(f) and ack["run_id"] in f["data"], timeout=30))
            live_ids = [f["id"] for f in live]
            resumed_ids = [f["id"] for f in resumed]
            assert resumed_ids == live_ids, "every event exactly once, in order, at the live positions"
            assert [f["data"] for f in resumed] == [f["data"] for f in live]
            j = await journal_ids(c, "c")
            assert live_ids == j[j.index(start) + 1: j.index(start) + 1 + len(live_ids)]


async def test_fell_behind_retention_is_told_where_to_restart(url):
    async with serving(url, journal_retention=10) as s:
        async with s.client() as c:
            first = (await c.post("/v1/conversations/c/messages", json={"message": "m0"})).json()
            await wait_settled(c, first["run_id"])
            for i in range(1, 6):
                ack = (await c.post("/v1/conversations/c/messages", json={"message": f"m{i}"})).json()
                await wait_settled(c, ack["run_id"])
            with trio.fail_after(10):
                while True:
                    page = (await c.get(f"/v1/conversations/c/events?after={first['cursor']}")).json()
                    if page["behind"]:
                        break
                    await trio.sleep(0.05)
            assert page["first_retained"] and page["first_retained"] > first["cursor"]
            async with c.stream("GET", f"/v1/conversations/c/events?after={first['cursor']}", headers=SSE) as r:
                reader = SSEReader(r)
                f = await reader.next()
                while "event" not in f:
                    f = await reader.next()
                assert f["event"] == "cursor.behind" and "id" not in f
                info = json.loads(f["data"])
                assert info["first_retained"] == page["first_retained"]
                nxt = await reader.next()
                assert nxt["id"] == page["first_retained"]


async def test_stream_tokens(url):
    now = [1_000_000.0]
    import time as _time
    now[0] = _time.time()
    async with serving(url, clock=lambda: now[0]) as s:
        async with s.client() as c:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "x"})).json()
            await wait_settled(c, ack["run_id"])
            await c.post("/v1/conversations/other/messages", json={"message": "y"})
            tok = (await c.post("/v1/stream-tokens", json={"conversation_id": "c"})).json()
            assert tok["expires_in"] == 600
            any_tok = (await c.post("/v1/stream-tokens")).json()["token"]
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as anon:
            async with anon.stream("GET", f"/v1/conversations/c/events?token={tok['token']}", headers=SSE) as r:
                assert r.status_code == 200
                f = await SSEReader(r).events_until(lambda f: True)
                assert f[0]["event"] == "run.queued"
            async with anon.stream("GET", f"/v1/conversations/other/events?token={any_tok}", headers=SSE) as r:
                assert r.status_code == 200
            # bound to conversation c: not valid for another
            r = await anon.get(f"/v1/conversations/other/events?token={tok['token']}", headers=SSE)
            assert r.status_code == 401
            # only on the SSE route: not for the JSON page, not elsewhere, not as a bearer
            assert (await anon.get(f"/v1/conversations/c/events?token={tok['token']}")).status_code == 401
            assert (await anon.get(f"/v1/conversations?token={tok['token']}")).status_code == 401
            assert (await anon.get("/v1/conversations",
                                   headers={"Authorization": f"Bearer {tok['token']}"})).status_code == 401
            # forged: same claims, another key
            forged = jwt.encode({"sub": "local/default", "aud": STREAM_AUDIENCE, "exp": int(now[0]) + 60},
                                "not-the-key-0123456789abcdef0123456789", algorithm="HS256")
            assert (await anon.get(f"/v1/conversations/c/events?token={forged}", headers=SSE)).status_code == 401
            # expired: ten minutes later
            now[0] += 601
            r = await anon.get(f"/v1/conversations/c/events?token={tok['token']}", headers=SSE)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


async def test_heartbeats_on_an_idle_stream(url):
    async with serving(url, heartbeat=0.1) as s:
        async with s.client() as c:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "x"})).json()
            await wait_settled(c, ack["run_id"])
            async with c.stream("GET", "/v1/conversations/c/events", headers=SSE) as r:
                reader = SSEReader(r)
                await reader.events_until(settled)
                with trio.fail_after(5):
                    beats = 0
                    while beats < 2:
                        f = await reader.next()
                        beats += f.get("comment") == "heartbeat"


async def test_many_followers_share_one_hub_and_all_get_everything(url):
    async with serving(url, agent=ticking_agent(3, 0.02)) as s:
        async with s.client(limits=httpx.Limits(max_connections=60)) as c:
            first = (await c.post("/v1/conversations/c/messages", json={"message": "warm"})).json()
            await wait_settled(c, first["run_id"])
            got: list[list[str]] = []

            async def follower(task_status=trio.TASK_STATUS_IGNORED):
                async with c.stream("GET", f"/v1/conversations/c/events?after={first['cursor']}", headers=SSE) as r:
                    reader = SSEReader(r)
                    await reader.next()  # the opening comment
                    task_status.started()
                    frames = await reader.events_until(lambda f: settled(f) and first["run_id"] not in f["data"])
                    got.append([f["id"] for f in frames])

            async with trio.open_nursery() as n:
                for _ in range(40):
                    await n.start(follower)
                hubs = s.rt  # noqa: F841
                await c.post("/v1/conversations/c/messages", json={"message": "go"})
            assert len(got) == 40 and all(g == got[0] for g in got)
