"""Transport-free pieces: auth, SSE framing, the route table vs the app vs the OpenAPI document."""

from __future__ import annotations

import json
import time

import jwt
import pytest

from server.api import ROUTES, ID_PATTERN
from server.app import create_app, quart_path
from server.auth import STREAM_TOKEN_SECONDS, AuthConfig, Authenticator, Principal, _escape, auth_from_env
from server.errors import CODES, ApiError, from_exception
from server.openapi import build_openapi
from server.sse import encode_comment, encode_event, encode_named
from sessions.errors import NotFound
from sessions.journal import Event


def test_token_mode_fails_closed():
    a = Authenticator(AuthConfig(mode="token", token=None))
    with pytest.raises(ApiError) as e:
        a.authenticate("Bearer anything")
    assert e.value.status == 503 and e.value.code == "auth_not_configured"
    a = Authenticator(AuthConfig(mode="token", token="s3cret"))
    for header in (None, "", "Bearer", "Bearer ", "bearer wrong", "Basic s3cret", "Bearer s3cret2", "s3cret"):
        with pytest.raises(ApiError) as e:
            a.authenticate(header)
        assert e.value.status == 401
    assert a.authenticate("Bearer s3cret").owner == "local/default"
    assert a.authenticate("bearer   s3cret  ").via == "token"


def test_env_config():
    cfg = auth_from_env("jwt", {"SUREFOOT_JWT_KEY": "k", "SUREFOOT_JWT_ISSUER": "i", "SUREFOOT_JWT_ALGORITHMS": "HS256, HS384"})
    assert cfg.jwt_algorithms == ("HS256", "HS384") and cfg.token is None
    assert not Authenticator(auth_from_env("jwt", {"SUREFOOT_JWT_KEY": "k"})).configured()
    with pytest.raises(ValueError):
        AuthConfig(mode="open")


def test_owner_tags_escape_injectively():
    assert _escape("a/b") == "a%2Fb" and _escape("a%2Fb") == "a%252Fb"
    key = "k" * 40
    a = Authenticator(AuthConfig(mode="jwt", jwt_key=key, jwt_issuer="https://iss/x"))
    tok = jwt.encode({"sub": "u/1", "iss": "https://iss/x", "exp": int(time.time()) + 60}, key, algorithm="HS256")
    assert a.authenticate(f"Bearer {tok}").owner == "https:%2F%2Fiss%2Fx/u%2F1"


def test_stream_tokens_bound_expiring_and_not_bearers():
    now = [1_700_000_000.0]
    a = Authenticator(AuthConfig(mode="token", token="s3cret"), clock=lambda: now[0])
    p = Principal("local/default", "token")
    tok, exp = a.issue_stream_token(p, "c1")
    assert exp == int(now[0]) + STREAM_TOKEN_SECONDS  # the authenticator's clock, not the wall clock
    assert a.verify_stream_token(tok, "c1").owner == "local/default"
    with pytest.raises(ApiError):
        a.verify_stream_token(tok, "c2")
    with pytest.raises(ApiError):
        a.authenticate(f"Bearer {tok}")
    now[0] += STREAM_TOKEN_SECONDS + 1
    with pytest.raises(ApiError):
        a.verify_stream_token(tok, "c1")
    # the same token is worthless to a server with another token (key derived from it)
    now[0] -= STREAM_TOKEN_SECONDS
    other = Authenticator(AuthConfig(mode="token", token="other"), clock=lambda: now[0])
    with pytest.raises(ApiError):
        other.verify_stream_token(tok, "c1")


def test_sse_frames():
    ev = Event("00" * 12, "part.added", {"text": "a\nb"}, 1.5)
    frame = encode_event(ev).decode()
    assert frame.startswith(f"id: {'00' * 12}\nevent: part.added\ndata: ") and frame.endswith("\n\n")
    assert frame.count("\n") == 4  # the data's newline is escaped by JSON: one data line
    assert json.loads(frame.split("data: ", 1)[1]) == {"cursor": "00" * 12, "type": "part.added",
                                                       "data": {"text": "a\nb"}, "ts": 1.5}
    assert "id:" not in encode_named("cursor.behind", {"first_retained": "x"}).decode()
    assert encode_comment("heartbeat") == b": heartbeat\n\n"


def test_error_mapping_is_stable():
    err = from_exception(NotFound("conversation 'secret-name' not found"))
    assert err is not None and err.status == 404 and err.message == "not found"  # never echoes the id
    assert from_exception(RuntimeError("boom")) is None
    assert set(CODES.values()) <= {400, 401, 404, 405, 406, 409, 413, 415, 422, 500, 503}


def test_routes_app_and_openapi_agree():
    doc = build_openapi()
    assert doc["openapi"] == "3.1.0"
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == {(r.method, r.path) for r in ROUTES}

    class Dummy:  # the app factory needs only an object with the handlers' names
        pass

    app = create_app(Dummy())  # type: ignore[arg-type]
    registered = {(m, rule.rule) for rule in app.url_map.iter_rules() for m in rule.methods
                  if m not in ("HEAD", "OPTIONS") and rule.endpoint != "static"}
    assert registered == {(r.method, quart_path(r.path)) for r in ROUTES}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for p in op.get("parameters", []):
                if p["in"] == "path":
                    assert p["schema"]["pattern"] == ID_PATTERN
            assert all(int(code) for code in op["responses"])
