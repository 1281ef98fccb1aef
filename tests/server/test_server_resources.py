"""Projects, per-owner agent overrides and attachments over HTTP, with two users."""

from __future__ import annotations

import base64
import json

from server.auth import AuthConfig
from server.limits import MAX_ATTACHMENT_BYTES, MAX_REQUEST_BYTES

from server_helpers import serving, wait_settled
from test_server_api import ISSUER, JWT_KEY, make_jwt

JWT = AuthConfig(mode="jwt", jwt_key=JWT_KEY, jwt_issuer=ISSUER)


async def test_projects_and_overrides_are_per_owner():
    async with serving(auth=JWT) as s:
        async with s.client(token=make_jwt("alice")) as a, s.client(token=make_jwt("bob")) as b:
            r = await a.post("/v1/projects", json={"name": "Alpha", "project_id": "p1"})
            assert r.status_code == 201 and r.json()["project_id"] == "p1" and r.json()["agents"] == {}
            r = await a.put("/v1/projects/p1/agents/default", json={"instructions": "Be terse."})
            assert r.status_code == 200 and r.json()["agents"] == {"default": {"instructions": "Be terse."}}
            ack = (await a.post("/v1/conversations/c1/messages", json={"message": "hi", "project_id": "p1"})).json()
            run = await wait_settled(a, ack["run_id"])
            assert run["status"] == "completed" and run["agent"].startswith("default~")  # a derived agent
            assert (await a.get("/v1/projects/p1/conversations")).json() == {"conversations": ["c1"]}
            # without the project: the shared agent, untouched
            ack2 = (await a.post("/v1/conversations/c2/messages", json={"message": "hi"})).json()
            assert (await wait_settled(a, ack2["run_id"]))["agent"] == "default"
            # bob: alice's project is the same 404 as a missing one, on every route
            for method, path, body in [("GET", "/v1/projects/{}", None), ("DELETE", "/v1/projects/{}", None),
                                       ("GET", "/v1/projects/{}/conversations", None),
                                       ("PUT", "/v1/projects/{}/agents/default", {"instructions": "x"}),
                                       ("DELETE", "/v1/projects/{}/agents/default", None)]:
                foreign = await b.request(method, path.format("p1"), json=body)
                missing = await b.request(method, path.format("nope"), json=body)
                assert foreign.status_code == missing.status_code == 404
                assert foreign.content == missing.content
            r1 = await b.post("/v1/conversations/c1/messages", json={"message": "x", "project_id": "p1"})
            r2 = await b.post("/v1/conversations/c1/messages", json={"message": "x", "project_id": "nope"})
            assert r1.status_code == r2.status_code == 404 and r1.content == r2.content
            assert (await b.get("/v1/projects")).json() == {"projects": []}
            assert [p["project_id"] for p in (await a.get("/v1/projects")).json()["projects"]] == ["p1"]
            # remove the override, delete the project
            r = await a.delete("/v1/projects/p1/agents/default")
            assert r.status_code == 200 and r.json()["agents"] == {}
            assert (await a.delete("/v1/projects/p1")).status_code == 204
            assert (await a.get("/v1/projects/p1")).status_code == 404


async def test_attachments_round_trip_limits_and_ownership():
    async with serving(auth=JWT) as s:
        async with s.client(token=make_jwt("alice")) as a, s.client(token=make_jwt("bob")) as b:
            data = bytes(range(256)) * 300  # 76,800 bytes: two chunks
            r = await a.post("/v1/attachments", json={"data": base64.b64encode(data).decode(),
                                                      "media_type": "application/octet-stream",
                                                      "filename": "blob.bin"})
            assert r.status_code == 201, r.text
            info = r.json()
            assert info["state"] == "ready" and info["size"] == len(data)
            aid = info["attachment_id"]
            assert (await a.get(f"/v1/attachments/{aid}")).json() == info
            r = await a.get(f"/v1/attachments/{aid}/content")
            assert r.status_code == 200 and r.content == data
            assert r.headers["content-type"] == "application/octet-stream"
            # bob: the same 404 as missing, on every route
            for method, path in [("GET", "/v1/attachments/{}"), ("GET", "/v1/attachments/{}/content"),
                                 ("DELETE", "/v1/attachments/{}")]:
                foreign = await b.request(method, path.format(aid))
                missing = await b.request(method, path.format("0" * 32))
                assert foreign.status_code == missing.status_code == 404 and foreign.content == missing.content
            # the decoded cap, at the edge: the largest that fits one request, and one byte over the cap
            def body(n: int) -> bytes:
                return b'{"data":"' + base64.b64encode(b"z" * n) + b'","media_type":"a/b"}'

            framing = len(body(0))
            fit = (MAX_REQUEST_BYTES - framing) // 4 * 3
            assert fit < MAX_ATTACHMENT_BYTES  # base64 of exactly 192 KiB is exactly 256 KiB: the request cap binds
            assert len(body(fit)) <= MAX_REQUEST_BYTES < len(body(fit + 3))
            h = {"Content-Type": "application/json"}
            r = await a.post("/v1/attachments", content=body(fit), headers=h)
            assert r.status_code == 201 and r.json()["size"] == fit
            r = await a.post("/v1/attachments", content=body(fit + 3), headers=h)
            assert r.status_code == 413 and r.json()["error"]["limit"] == "request"
            assert r.json()["error"]["over_by_bytes"] == len(body(fit + 3)) - MAX_REQUEST_BYTES
            # the decoded cap is checked on its own too (base64 without padding slack can't exceed it here,
            # so prove the message: over by N bytes, via a direct call of the transport-free API)
            from server.api import ApiRequest, ROUTES_BY_NAME
            big = base64.b64encode(b"q" * (MAX_ATTACHMENT_BYTES + 5)).decode()
            resp = await s.api.handle(ROUTES_BY_NAME["create_attachment"], ApiRequest(
                "POST", {}, {}, {"authorization": f"Bearer {make_jwt('alice')}", "content-type": "application/json"},
                json.dumps({"data": big, "media_type": "a/b"}).encode()))
            err = json.loads(resp.body_bytes())["error"]
            assert resp.status == 413 and err["limit"] == "attachment" and err["over_by_bytes"] == 5
            assert "by 5 bytes" in err["message"]
            # invalid base64 -> 422; same id with other content -> 409
            r = await a.post("/v1/attachments", json={"data": "!!!not base64", "media_type": "a/b"})
            assert r.status_code == 422
            r1 = await a.post("/v1/attachments", json={"data": "aGVsbG8=", "media_type": "text/plain", "attachment_id": "x1"})
            r2 = await a.post("/v1/attachments", json={"data": "aGVsbG8=", "media_type": "text/plain", "attachment_id": "x1"})
            r3 = await a.post("/v1/attachments", json={"data": "d29ybGQ=", "media_type": "text/plain", "attachment_id": "x1"})
            assert r1.status_code == r2.status_code == 201 and r3.status_code == 409
            # delete
            assert (await a.delete(f"/v1/attachments/{aid}")).status_code == 204
            assert (await a.get(f"/v1/attachments/{aid}")).status_code == 404
