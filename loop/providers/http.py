"""What the HTTP providers share: one httpx client, a streamed POST, error classification.

No SDK, so no retry loop underneath ours (an SDK that retries a 529 three
times inside one "attempt" would hide failures from the journal and multiply
waits).  httpx's ``AsyncClient`` runs on trio through anyio.
"""

from __future__ import annotations

import logging
import os
from contextlib import aclosing
from typing import Any, AsyncIterator, Mapping

import httpx

from ..errors import PermanentProviderError, ProviderError, classify_exception, classify_http
from .sse import SSEEvent, aiter_sse

__all__ = ["HTTPProvider", "DEFAULT_TIMEOUT"]

log = logging.getLogger(__name__)

# Connect fast or fail over to our retry; a slow model may think for minutes
# between tokens, so reads get a long timeout.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=30.0)
# Error bodies read at most this much (they are small; a broken proxy's may not be).
MAX_ERROR_BODY = 64 * 1024

assert MAX_ERROR_BODY > 0


class HTTPProvider:
    """Base of the Anthropic and OpenAI-compatible providers."""

    kind = "http"
    api_key_env: str | None = None

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
        client: httpx.AsyncClient | None = None,
        extra_headers: Mapping[str, str] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not model:
            raise ValueError("model name is empty")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else (os.environ.get(self.api_key_env) if self.api_key_env else None)
        self.timeout = timeout
        self._client = client
        self._owns_client = client is None
        self.extra_headers = dict(extra_headers or {})
        self.max_tokens = max_tokens
        self.name = f"{self.kind}:{model}"

    def output_cap(self, max_tokens: int | None) -> int | None:
        """The most output a call sent with the per-call ``max_tokens`` may produce: that, else
        this provider's own ``max_tokens``, else None (nothing is sent, the server decides:
        unbounded as far as the loop can tell). Anthropic overrides it (it always sends one)."""
        return max_tokens or self.max_tokens or None

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    def _headers(self) -> dict[str, str]:
        raise NotImplementedError

    async def _post_sse(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[SSEEvent]:
        """POST ``body``; yield its SSE events; raise a classified error on a non-2xx."""
        url = self.base_url + path
        headers = {**self._headers(), **self.extra_headers, "accept": "text/event-stream"}
        client = self._get_client()
        try:
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code >= 400:
                    raw = b""
                    async for chunk in resp.aiter_bytes():
                        raw += chunk
                        if len(raw) >= MAX_ERROR_BODY:
                            break
                    err = classify_http(resp.status_code, raw, dict(resp.headers), provider=self.name)
                    log.info("%s: HTTP %s -> %s", self.name, resp.status_code, err.kind)
                    raise err
                if resp.status_code != 200:
                    raise PermanentProviderError(f"unexpected HTTP {resp.status_code}", status=resp.status_code, provider=self.name)
                async with aclosing(aiter_sse(resp.aiter_lines())) as events:
                    async for ev in events:
                        yield ev
        except ProviderError:
            raise
        except (httpx.HTTPError, OSError, ValueError) as e:
            raise classify_exception(e, provider=self.name) from e
