"""The JSON API over real hypercorn on loopback, with httpx: auth, errors, idempotency, ownership, limits."""

from __future__ import annotations

import json
import time

import httpx
import jwt
import pytest
import trio

from server.auth import AuthConfig
from server.limits import MAX_REQUEST_BYTES

from server_helpers import FDB_CAPI, TOKEN, serving, wait_settled

JWT_KEY = "jwt-test-secret-with-enough-bytes-0123456789"
ISSUER = "https://issuer.example/realm"


def make_jwt(sub: str, *, iss: str = ISSUER, key: str = JWT_KEY, exp_in: float = 300, **extra) -> str:
    return jwt.encode({"sub": sub, "iss": iss, "exp": int(time.time() + exp_in), **extra}, key, algorithm="HS256")


# ---------------------------------------------------------------------------- auth


async def test_no_token_configured_is_503_everywhere_but_health():
    async with serving(auth=AuthConfig(mode="token", token=None)) as s:
        async with s.client(token="anything") as c:
            for method, path in [("GET", "/v1/conversations"), ("POST", "/v1/conversations/c/messages"),
                                 ("GET", "/v1/runs/r"), ("POST", "/v1/stream-tokens"),
                                 ("GET", "/v1/conversations/c/events")]:
                r = await c.request(method, path, json={"message": "x"} if method == "POST" else None)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == "auth_not_configured"
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/openapi.json")).status_code == 200


async def test_wrong_and_missing_token_401_right_token_ok():
    async with serving() as s:
        for token in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
            async with s.client(token=token) as c:
                r = await c.get("/v1/conversations")
                assert r.status_code == 401
                assert r.json() == {"error": {"code": "unauthorized", "message": "missing or invalid credentials"}}
                assert r.headers["www-authenticate"].startswith("Bearer")
        async with s.client(headers={"Authorization": f"Basic {TOKEN}"}, token=None) as c:
            assert (await c.get("/v1/conversations")).status_code == 401
        async with s.client() as c:
            r = await c.get("/v1/conversations")
            assert r.status_code == 200 and r.json() == {"conversations": []}


async def test_repeated_401_on_one_kept_alive_connection_with_bodies_under_cpu_load():
    """The hypercorn pitfall: an early 401 before the POST body is read can hang the next request."""
    stop = False

    def burn() -> None:
        while not stop:
            sum(range(10_000))

    async with serving() as s:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with s.client(token="wrong", limits=limits, timeout=10) as c:
            async with trio.open_nursery() as n:
                n.start_soon(trio.to_thread.run_sync, burn)
                try:
                    for i in range(40):
                        r = await c.post("/v1/conversations/c/messages", content=b"x" * (20_000 + i),
                                         headers={"Content-Type": "application/json"})
                        assert r.status_code == 401
                finally:
                    stop = True
        async with s.client(limits=limits) as c:
            r = await c.get("/v1/conversations")
            assert r.status_code == 200


async def test_jwt_principal_from_verified_token_only():
    cfg = AuthConfig(mode="jwt", jwt_key=JWT_KEY, jwt_issuer=ISSUER)
    async with serving(auth=cfg) as s:
        bad = [
            make_jwt("alice", key="another-key-with-enough-bytes-0123456789"),
            make_jwt("alice", iss="https://other.example"),
            make_jwt("alice", exp_in=-120),
            jwt.encode({"sub": "alice", "iss": ISSUER}, JWT_KEY, algorithm="HS256"),  # no exp
            "not.a.jwt",
        ]
        for tok in bad:
            async with s.client(token=tok) as c:
                assert (await c.get("/v1/conversations")).status_code == 401, tok
        async with s.client(token=make_jwt("alice")) as c:
            r = await c.post("/v1/conversations/c1/messages", json={"message": "hi"})
            assert r.status_code == 202
            # a user_id / owner in the body is data, never identity: it is refused as an unknown field
            r = await c.post("/v1/conversations/c1/messages", json={"message": "hi", "user_id": "bob"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        async with s.client(token=make_jwt("bob")) as c:
            assert (await c.get("/v1/conversations")).json() == {"conversations": []}


async def test_jwt_not_configured_is_503():
    async with serving(auth=AuthConfig(mode="jwt", jwt_key=None, jwt_issuer=ISSUER)) as s:
        async with s.client(token=make_jwt("alice")) as c:
            assert (await c.get("/v1/conversations")).status_code == 503


# ---------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("url", ["memory:", FDB_CAPI])
async def test_two_users_never_see_each_other(url):
    cfg = AuthConfig(mode="jwt", jwt_key=JWT_KEY, jwt_issuer=ISSUER)
    async with serving(url, auth=cfg) as s:
        async with s.client(token=make_jwt("alice")) as a, s.client(token=make_jwt("bob")) as b:
            r = await a.post("/v1/conversations/secret/messages", json={"message": "alice's"})
            assert r.status_code == 202
            ack = r.json()
            await wait_settled(a, ack["run_id"])

            def same_404(foreign: httpx.Response, missing: httpx.Response) -> None:
                assert foreign.status_code == missing.status_code == 404
                assert foreign.content == missing.content
                assert foreign.headers["content-type"] == missing.headers["content-type"]

            pairs = [
                ("GET", "/v1/conversations/secret/messages", "/v1/conversations/nothing/messages", None),
                ("GET", "/v1/conversations/secret/events", "/v1/conversations/nothing/events", None),
                ("GET", f"/v1/conversations/secret/events?after={ack['cursor']}",
                 f"/v1/conversations/nothing/events?after={ack['cursor']}", None),
                ("GET", "/v1/conversations/secret/runs", "/v1/conversations/nothing/runs", None),
                ("POST", "/v1/conversations/secret/fork", "/v1/conversations/nothing/fork", {"at": 1}),
                ("GET", f"/v1/runs/{ack['run_id']}", "/v1/runs/0123456789abcdef0123456789abcdef", None),
                ("POST", f"/v1/runs/{ack['run_id']}/cancel", "/v1/runs/0123456789abcdef0123456789abcdef/cancel", None),
                ("POST", f"/v1/runs/{ack['run_id']}/approvals/c1",
                 "/v1/runs/0123456789abcdef0123456789abcdef/approvals/c1", {"allow": True}),
            ]
            for method, foreign, missing, body in pairs:
                same_404(await b.request(method, foreign, json=body), await b.request(method, missing, json=body))
            # SSE with bob's credentials on alice's conversation: the same 404
            h = {"Accept": "text/event-stream"}
            same_404(await b.get("/v1/conversations/secret/events", headers=h),
                     await b.get("/v1/conversations/nothing/events", headers=h))
            assert (await b.get("/v1/conversations")).json() == {"conversations": []}
            # bob's own "secret" is a different conversation
            assert (await b.post("/v1/conversations/secret/messages", json={"message": "bob's"})).status_code == 202
            msgs = (await a.get("/v1/conversations/secret/messages")).json()["messages"]
            assert all("bob's" not in json.dumps(m) for m in msgs)
            # tags are escaped, never confused: subject "x/y" from issuer I is not subject "y" of issuer "I/x"
            async with s.client(token=make_jwt("x/y")) as xy:
                assert (await xy.get("/v1/conversations")).json() == {"conversations": []}


# ---------------------------------------------------------------------------- idempotency


@pytest.mark.parametrize("url", ["memory:", FDB_CAPI])
async def test_idempotency_same_key_same_run_different_body_409(url):
    async with serving(url) as s:
        async with s.client() as c:
            h = {"Idempotency-Key": "sub-1"}
            r1 = await c.post("/v1/conversations/c/messages", json={"message": "one"}, headers=h)
            assert r1.status_code == 202 and r1.headers["idempotency-key"] == "sub-1"
            r2 = await c.post("/v1/conversations/c/messages", json={"message": "one"}, headers=h)
            assert r2.status_code in (200, 202) and r2.json()["run_id"] == r1.json()["run_id"]
            r3 = await c.post("/v1/conversations/c/messages", json={"message": "two"}, headers=h)
            assert r3.status_code == 409 and r3.json()["error"]["code"] == "idempotency_conflict"
            r4 = await c.post("/v1/conversations/other/messages", json={"message": "one"}, headers=h)
            assert r4.status_code == 409
            await wait_settled(c, r1.json()["run_id"])
            r5 = await c.post("/v1/conversations/c/messages", json={"message": "one"}, headers=h)
            assert r5.status_code == 200
            assert r5.json()["outcome"]["status"] == "completed" and r5.json()["run_id"] == r1.json()["run_id"]
            # no key: one is generated and returned
            r6 = await c.post("/v1/conversations/c/messages", json={"message": "three"})
            assert r6.status_code == 202 and r6.headers["idempotency-key"] == r6.json()["submission_id"]
            runs = (await c.get("/v1/conversations/c/runs")).json()["runs"]
            assert len(runs) == 2


@pytest.mark.parametrize("backend", ["lmdb", FDB_CAPI])
async def test_fifty_concurrent_identical_submissions_make_one_run(tmp_path, backend):
    async with serving(f"lmdb:{tmp_path / 'data'}" if backend == "lmdb" else backend) as s:
        async with s.client(limits=httpx.Limits(max_connections=50)) as c:
            results = []

            async def one() -> None:
                r = await c.post("/v1/conversations/c/messages", json={"message": "same"},
                                 headers={"Idempotency-Key": "fifty"})
                results.append(r)

            async with trio.open_nursery() as n:
                for _ in range(50):
                    n.start_soon(one)
            assert all(r.status_code in (200, 202) for r in results), [r.text for r in results]
            assert len({r.json()["run_id"] for r in results}) == 1
            assert sum(not r.json()["duplicate"] for r in results) == 1
            runs = (await c.get("/v1/conversations/c/runs")).json()["runs"]
            assert len(runs) == 1


# ---------------------------------------------------------------------------- errors and limits


async def test_errors_are_stable_json():
    async with serving() as s:
        async with s.client() as c:
            r = await c.post("/v1/conversations/c/messages", content=b"{not json", headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await c.post("/v1/conversations/c/messages", content=b'{"message":"x"}', headers={"Content-Type": "text/plain"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
            r = await c.post("/v1/conversations/c/messages", json={"nope": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
            r = await c.post("/v1/conversations/c/messages", json={"message": 5})
            assert r.status_code == 400
            r = await c.post("/v1/conversations/c/messages", json=["message"])
            assert r.status_code == 400
            r = await c.post("/v1/conversations/c/messages", json={"message": "x"}, headers={"Idempotency-Key": "has space"})
            assert r.status_code == 400
            r = await c.get("/v1/conversations/c/events?after=zzz")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cursor"
            r = await c.get("/v1/conversations/c/messages?limit=0")
            assert r.status_code == 400
            r = await c.get("/v1/nothing-here")
            assert r.status_code == 404 and r.json() == {"error": {"code": "not_found", "message": "not found"}}
            r = await c.delete("/v1/conversations")
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
            r = await c.post("/v1/runs/nope/approvals/x", json={"allow": "yes"})
            assert r.status_code == 400
            r = await c.post("/v1/conversations/c/messages", json={"message": "x"})
            await wait_settled(c, r.json()["run_id"])
            r = await c.post("/v1/conversations/c/fork", json={"at": 99})
            assert r.status_code == 422 and r.json()["error"]["code"] == "unprocessable"
            for resp in [r]:
                assert "Traceback" not in resp.text


async def test_request_cap_edges():
    async with serving() as s:
        async with s.client() as c:
            # Exactly at the cap the body is read and parsed (here refused for its unknown field, 400, not 413).
            prefix, suffix = b'{"message":"x","pad":"', b'"}'
            exact = prefix + b"a" * (MAX_REQUEST_BYTES - len(prefix) - len(suffix)) + suffix
            assert len(exact) == MAX_REQUEST_BYTES
            r = await c.post("/v1/conversations/c/messages", content=exact, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"] == "unknown field(s): pad", r.text
            over = prefix + b"a" * (MAX_REQUEST_BYTES - len(prefix) - len(suffix) + 10) + suffix
            r = await c.post("/v1/conversations/c/messages", content=over, headers={"Content-Type": "application/json"})
            assert r.status_code == 413
            err = r.json()["error"]
            assert err["code"] == "payload_too_large" and err["limit"] == "request" and err["over_by_bytes"] == 10
            assert "by 10 bytes" in err["message"] and str(MAX_REQUEST_BYTES) in err["message"]

            async def chunked():
                for _ in range(10):
                    yield b"x" * 30_000

            r = await c.post("/v1/conversations/c/messages", content=chunked(), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["limit"] == "request"
        # over the cap without credentials: still 401, not 413
        async with s.client(token=None) as c:
            r = await c.post("/v1/conversations/c/messages", content=over, headers={"Content-Type": "application/json"})
            assert r.status_code == 401


async def test_health_ready_openapi():
    async with serving() as s:
        async with s.client(token=None) as c:
            assert (await c.get("/healthz")).json() == {"status": "ok"}
            assert (await c.get("/readyz")).json() == {"status": "ready"}
            doc = (await c.get("/openapi.json")).json()
            assert doc["openapi"].startswith("3.1")
            assert "/v1/conversations/{conversation_id}/messages" in doc["paths"]
            assert set(doc["paths"]["/v1/conversations/{conversation_id}/messages"]) == {"get", "post"}
        s.shutdown.set()


async def test_routing_errors_drain_the_body_on_a_kept_alive_connection():
    async with serving() as s:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with s.client(limits=limits, timeout=5) as c:
            for i in range(20):
                r = await c.put("/v1/conversations/c/fork", content=b'{"at": 0}' + b" " * (5000 + i),
                                headers={"Content-Type": "application/json"})
                assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
                r = await c.post("/v1/no/such/route", content=b"x" * 7000)
                assert r.status_code == 404
            assert (await c.get("/v1/conversations")).status_code == 200


async def test_message_forms_and_message_cap():
    from server.limits import MAX_MESSAGE_BYTES

    async with serving() as s:
        async with s.client() as c:
            r = await c.post("/v1/conversations/c/messages", json={
                "message": {"role": "user", "content": [{"type": "text", "text": "as an object"}]}})
            assert r.status_code == 202
            info = await wait_settled(c, r.json()["run_id"])
            assert info["status"] == "completed" and "as an object" in info["outcome"]["text"]
            for bad in [{"role": "assistant", "content": [{"type": "text", "text": "x"}]},
                        {"role": "user", "content": []}, {"role": "user", "content": [{"type": "image"}]},
                        {"role": "user", "content": "x"}, {"anything": 1}]:
                r = await c.post("/v1/conversations/c/messages", json={"message": bad})
                assert r.status_code == 400, bad
            r = await c.post("/v1/conversations/c/messages", json={"message": "é" * (MAX_MESSAGE_BYTES // 2)})
            assert r.status_code == 202  # exactly at the cap (2 bytes a character)
            r = await c.post("/v1/conversations/c/messages", json={"message": "x" * (MAX_MESSAGE_BYTES + 7)})
            err = r.json()["error"]
            assert r.status_code == 413 and err["limit"] == "message" and err["over_by_bytes"] == 7
            r = await c.post("/v1/conversations/c/messages", content=b'{"message": "\\udb70"}',
                             headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------------------- usage ceilings


async def test_usage_ceilings_on_a_submission():
    """``limits`` on a submission reach the run: a ceiling the first model call would pass fails the run
    ``usage_limit`` before the call; malformed ceilings are 400 naming them, with nothing stored; a cost
    ceiling on a model the server has no price for is 422, nothing stored."""
    from loop import Agent

    async with serving() as s:
        async with s.client() as c:
            r = await c.post("/v1/conversations/c/messages", json={"message": "hello", "limits": {"max_total_tokens": 1}})
            assert r.status_code == 202, r.text
            run = await wait_settled(c, r.json()["run_id"])
            assert run["status"] == "failed" and run["outcome"]["error"]["type"] == "usage_limit", run
            r = await c.post("/v1/conversations/c/messages",
                             json={"message": "hello", "limits": {"max_total_tokens": 100_000.0, "max_cost_micros": 10}})
            assert r.status_code == 202  # the offline model is free: a cost ceiling holds (and 100000.0 is an integer)
            assert (await wait_settled(c, r.json()["run_id"]))["status"] == "completed"
            for bad, words in [({"max_total_tokens": "9"}, "non-negative int"), ({"tokens": 9}, "bad usage limit name"),
                               ([1], "mapping"), ({"max_total_tokens": -3}, "non-negative int")]:
                r = await c.post("/v1/conversations/fresh/messages", json={"message": "x", "limits": bad})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
                assert words in r.json()["error"]["message"]
            assert "fresh" not in (await c.get("/v1/conversations")).json()["conversations"]
    unpriced = Agent("paid", "", "openai:some-model@http://127.0.0.1:9/v1")  # never called: refused first
    async with serving(agent=unpriced) as s:
        async with s.client() as c:
            r = await c.post("/v1/conversations/p/messages", json={"message": "x", "limits": {"max_cost_micros": 5}})
            assert r.status_code == 422 and r.json()["error"]["code"] == "missing_price", r.text
            assert "some-model" in r.json()["error"]["message"] and "price" in r.json()["error"]["message"]
            assert "p" not in (await c.get("/v1/conversations")).json()["conversations"]
