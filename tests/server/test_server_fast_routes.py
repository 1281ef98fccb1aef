"""The raw ASGI front (server.app.FastRoutes) for submit and events: same behaviour as the Quart routes.

These two routes skip Quart for speed, so what Quart used to give them for free is checked here:
the hub subscription of a vanished SSE client is released, near-miss paths still get Quart's
routing errors, and query parameters keep their first value.
"""

from __future__ import annotations

import httpx
import trio

from server_helpers import SSEReader, serving, wait_settled

SSE = {"Accept": "text/event-stream"}


def subscribers(s, conv: str) -> int:
    """Subscribers of every live hub following ``conv`` (one owner here)."""
    return sum(len(h.subscribers) for key, h in list(s.api.hubs._hubs.items()) if key[1] == conv)


async def test_a_closed_sse_client_releases_its_hub_subscription():
    async with serving() as s:
        async with s.client() as c:
            first = (await c.post("/v1/conversations/c/messages", json={"message": "hi"})).json()
            await wait_settled(c, first["run_id"])
            for _ in range(3):
                async with c.stream("GET", "/v1/conversations/c/events", headers=SSE) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    assert r.headers["cache-control"] == "no-cache"
                    await SSEReader(r).next()  # the opening comment: subscribed
                    assert subscribers(s, "c") == 1
            # The client is gone: the disconnect watcher ends the stream, which unsubscribes.
            with trio.fail_after(10):
                while subscribers(s, "c"):
                    await trio.sleep(0.02)
            # And the same kept-alive client still works for ordinary requests.
            assert (await c.get("/v1/conversations/c/events")).status_code == 200


async def test_near_miss_paths_and_methods_get_quarts_json_errors():
    async with serving() as s:
        async with s.client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as c:
            for method, path in [("POST", "/v1/conversations/c/messages/"), ("GET", "/v1/conversations//events"),
                                 ("POST", "/v1/conversations/c/messages/x"), ("GET", "/v1/conversations/c")]:
                r = await c.request(method, path, content=b'{"message": "x"}',
                                    headers={"Content-Type": "application/json"})
                assert r.status_code in (404, 405), (method, path, r.status_code)
                assert r.json()["error"]["code"] in ("not_found", "method_not_allowed")
            r = await c.put("/v1/conversations/c/events", content=b"x" * 3000)
            assert r.status_code == 405 and "GET" in r.headers["allow"]
            # the fast routes on the same kept-alive connection afterwards
            r = await c.post("/v1/conversations/c/messages", json={"message": "x"}, headers={"Idempotency-Key": "k1"})
            assert r.status_code == 202 and r.headers["idempotency-key"] == "k1"
            assert r.headers["location"] == f"/v1/runs/{r.json()['run_id']}"
            assert r.headers["content-type"].startswith("application/json")


async def test_query_keeps_the_first_value_and_errors_are_json():
    async with serving() as s:
        async with s.client() as c:
            await c.post("/v1/conversations/c/messages", json={"message": "x"})
            r = await c.get("/v1/conversations/c/events?after=bogus&after=")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cursor"
            r = await c.get("/v1/conversations/c/events?limit=1&limit=bogus")
            assert r.status_code == 200 and len(r.json()["events"]) == 1
        async with s.client(token="wrong") as c:
            r = await c.get("/v1/conversations/c/events", headers=SSE)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert r.headers["content-type"].startswith("application/json")
