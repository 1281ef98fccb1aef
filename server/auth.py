"""Identity, failing closed.

Modes (``surefoot serve --auth``):

* ``token`` — one client token from ``SUREFOOT_TOKEN``, sent as ``Authorization:
  Bearer TOKEN``. No token configured -> every API route answers 503
  ``auth_not_configured`` (never "open because unset"); wrong or missing -> 401.
  Compared in constant time. The principal is the single local owner, the same
  one ``surefoot run`` writes as, so the CLI and the server share conversations.
* ``jwt`` — a verified bearer JWT (PyJWT): key from ``SUREFOOT_JWT_KEY`` (an HMAC
  secret, or a PEM public key), issuer from ``SUREFOOT_JWT_ISSUER``, optional
  audience ``SUREFOOT_JWT_AUDIENCE``, algorithms ``SUREFOOT_JWT_ALGORITHMS``.
  ``exp``, ``iss`` and ``sub`` are required. The principal is (realm from the
  issuer, subject from ``sub``); both are escaped so that ``/`` (which owner tags
  refuse, and which every URL issuer contains) maps injectively into a tag.
  Missing key or issuer -> 503.
There is deliberately no "no auth" mode.

Stream tokens: EventSource cannot send headers, so ``POST /v1/stream-tokens``
issues a short-lived token (10 minutes) signed with the server's stream key,
bound to the caller's owner tag (and optionally one conversation). It is
accepted as ``?token=`` on the SSE route only; anywhere else a query token is
ignored, so it can never stand in for the real credential.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jwt

from sessions.owners import LOCAL_OWNER, Owner
from sessions.errors import InvalidOwner

from .errors import ApiError

__all__ = [
    "Principal", "Authenticator", "AuthConfig", "STREAM_TOKEN_SECONDS", "auth_from_env",
]

#: Lifetime of a stream token (the design card's 10 minutes).
STREAM_TOKEN_SECONDS = 600
#: Audience claim that marks a stream token; a bearer JWT never carries it.
STREAM_AUDIENCE = "surefoot:stream"
#: Longest Authorization header or query token we look at (anything longer is wrong).
MAX_CREDENTIAL_LENGTH = 8_192
#: Clock skew tolerated on JWT exp/nbf/iat.
JWT_LEEWAY_SECONDS = 30
assert STREAM_TOKEN_SECONDS == 600 and MAX_CREDENTIAL_LENGTH > 0

MODES = ("token", "jwt")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: the owner tag every resource is stored and checked under."""

    owner: str  # "realm/subject"
    via: str    # "token" | "jwt" | "stream-token"
    conversation: str | None = None  # a stream token bound to one conversation


def _escape(part: str) -> str:
    """Injective escape of '/' (and '%') so any issuer/subject string can be an owner-tag part."""
    return part.replace("%", "%25").replace("/", "%2F")


@dataclass(frozen=True)
class AuthConfig:
    mode: str = "token"
    token: str | None = None
    jwt_key: str | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    jwt_algorithms: tuple[str, ...] = ()
    stream_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"auth mode must be one of {MODES}")


def auth_from_env(mode: str, env: Mapping[str, str] | None = None) -> AuthConfig:
    env = os.environ if env is None else env
    algs = tuple(a.strip() for a in env.get("SUREFOOT_JWT_ALGORITHMS", "").split(",") if a.strip())
    sk = env.get("SUREFOOT_STREAM_KEY")
    return AuthConfig(
        mode=mode,
        token=env.get("SUREFOOT_TOKEN") or None,
        jwt_key=env.get("SUREFOOT_JWT_KEY") or None,
        jwt_issuer=env.get("SUREFOOT_JWT_ISSUER") or None,
        jwt_audience=env.get("SUREFOOT_JWT_AUDIENCE") or None,
        jwt_algorithms=algs,
        stream_key=sk.encode() if sk else None,
    )


def _unauthorized(message: str = "missing or invalid credentials") -> ApiError:
    return ApiError("unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="surefoot"'})


class Authenticator:
    """Turns request credentials into a :class:`Principal`, or raises 401/503 :class:`ApiError`."""

    def __init__(self, config: AuthConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self._token = config.token.encode() if config.token else None
        key = config.stream_key
        if key is None:
            if self._token is not None:
                # Stable across restarts and shared by every process with the same token.
                key = hmac.new(self._token, b"surefoot stream-token key v1", hashlib.sha256).digest()
            elif config.mode == "jwt" and config.jwt_key:
                key = hmac.new(config.jwt_key.encode(), b"surefoot stream-token key v1", hashlib.sha256).digest()
            else:
                key = secrets.token_bytes(32)
        self._stream_key = key
        self._algorithms = list(config.jwt_algorithms) or (
            ["RS256", "ES256", "EdDSA", "PS256"] if (config.jwt_key or "").lstrip().startswith("-----BEGIN")
            else ["HS256"]
        )

    # -- configuration state ---------------------------------------------------

    def configured(self) -> bool:
        c = self.config
        if c.mode == "token":
            return self._token is not None
        if c.mode == "jwt":
            return bool(c.jwt_key and c.jwt_issuer)
        return False

    def _require_configured(self) -> None:
        if not self.configured():
            what = "SUREFOOT_TOKEN" if self.config.mode == "token" else "SUREFOOT_JWT_KEY and SUREFOOT_JWT_ISSUER"
            raise ApiError("auth_not_configured", f"authentication is not configured on this server (set {what})")

    # -- bearer credentials ----------------------------------------------------

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``Authorization`` header value; fails closed."""
        self._require_configured()
        mode = self.config.mode
        bearer = _bearer(authorization)
        if bearer is None:
            raise _unauthorized()
        if mode == "token":
            assert self._token is not None
            if not hmac.compare_digest(bearer.encode(), self._token):
                raise _unauthorized()
            return Principal(LOCAL_OWNER.tag, "token")
        return self._verify_jwt(bearer)

    def _verify_jwt(self, token: str) -> Principal:
        c = self.config
        try:
            claims = jwt.decode(
                token,
                c.jwt_key,
                algorithms=self._algorithms,
                issuer=c.jwt_issuer,
                audience=c.jwt_audience,
                leeway=JWT_LEEWAY_SECONDS,
                options={"require": ["exp", "iss", "sub"], "verify_aud": c.jwt_audience is not None},
            )
        except jwt.PyJWTError:
            raise _unauthorized() from None
        aud = claims.get("aud")
        if aud == STREAM_AUDIENCE or (isinstance(aud, list) and STREAM_AUDIENCE in aud):
            raise _unauthorized()  # a stream token is never a bearer credential
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise _unauthorized()
        try:
            owner = Owner(_escape(str(claims["iss"])), _escape(sub))
        except InvalidOwner:
            raise _unauthorized("credential subject or issuer is not acceptable") from None
        return Principal(owner.tag, "jwt")

    # -- stream tokens ---------------------------------------------------------

    def issue_stream_token(self, principal: Principal, conversation: str | None = None) -> tuple[str, float]:
        """A signed token for ``principal`` valid :data:`STREAM_TOKEN_SECONDS`; returns (token, expires_at)."""
        now = self.clock()
        exp = int(now) + STREAM_TOKEN_SECONDS
        claims: dict[str, Any] = {"sub": principal.owner, "aud": STREAM_AUDIENCE, "iat": int(now), "exp": exp,
                                  "jti": secrets.token_hex(8)}
        if conversation is not None:
            claims["conv"] = conversation
        return jwt.encode(claims, self._stream_key, algorithm="HS256"), float(exp)

    def verify_stream_token(self, token: str, conversation: str) -> Principal:
        """The principal of a valid stream token for ``conversation``; 401 otherwise (expired, forged, other conversation)."""
        self._require_configured()
        if not token or len(token) > MAX_CREDENTIAL_LENGTH:
            raise _unauthorized()
        try:
            # Expiry is checked below against this authenticator's clock (the one that issued it),
            # not PyJWT's wall clock, so tests and simulations can move time.
            claims = jwt.decode(token, self._stream_key, algorithms=["HS256"], audience=STREAM_AUDIENCE,
                                options={"require": ["exp", "sub", "aud"], "verify_exp": False,
                                         "verify_iat": False})
        except jwt.PyJWTError:
            raise _unauthorized("invalid or expired stream token") from None
        if not isinstance(claims["exp"], (int, float)) or claims["exp"] <= self.clock():
            raise _unauthorized("invalid or expired stream token")
        bound = claims.get("conv")
        if bound is not None and bound != conversation:
            raise _unauthorized("stream token is for another conversation")
        return Principal(str(claims["sub"]), "stream-token", bound)


def _bearer(authorization: str | None) -> str | None:
    if not authorization or len(authorization) > MAX_CREDENTIAL_LENGTH:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
