"""OpenAI-compatible Chat Completions, streaming (``POST {base}/chat/completions``).

Speaks the dialect vLLM, llama.cpp's server and Ollama also serve: ``data:``
chunks whose ``choices[0].delta`` carries ``content`` and ``tool_calls``
(``index``, then ``id`` and ``function.name`` once, ``function.arguments`` in
fragments), a ``finish_reason``, a final usage chunk (``stream_options:
{include_usage: true}``, empty ``choices``) and ``data: [DONE]``.

The output cap is sent as ``max_tokens`` by default, the name those local servers know.
OpenAI's own Chat Completions reference marks ``max_tokens`` deprecated in favour of
``max_completion_tokens`` ("an upper bound for the number of tokens that can be generated
for a completion, including visible output tokens and reasoning tokens") and its reasoning
models (o-series, gpt-5) refuse ``max_tokens``: ``max_tokens_param="max_completion_tokens"``
sends the cap under that name instead (the clamp a usage ceiling puts on a call too).
"""

from __future__ import annotations

import json
import os
from contextlib import aclosing
from typing import Any, AsyncIterator, Mapping, Sequence

from ..errors import PermanentProviderError, classify_http
from ..messages import Message
from .base import (
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_TOOL_USE,
    Finish,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from .http import HTTPProvider

__all__ = ["OpenAIProvider", "to_openai_messages", "DEFAULT_OPENAI_BASE_URL", "MAX_TOKENS_PARAMS"]

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"
# The request keys an output cap may be sent under: the classic one (vLLM, llama.cpp,
# Ollama, older OpenAI models) first, the default; OpenAI's current one second.
MAX_TOKENS_PARAMS = ("max_tokens", "max_completion_tokens")

assert MAX_TOKENS_PARAMS[0] == "max_tokens"

_STOP = {"stop": STOP_END, "tool_calls": STOP_TOOL_USE, "function_call": STOP_TOOL_USE, "length": STOP_MAX_TOKENS}


def to_openai_messages(system: str, messages: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for m in messages:
        role = m.get("role")
        parts = m.get("content") or ()
        if role == "user":
            text = "".join(p.get("text", "") for p in parts if p.get("type") == "text")
            out.append({"role": "user", "content": text})
        elif role == "assistant":
            text = "".join(p.get("text", "") for p in parts if p.get("type") == "text")
            calls = [
                {
                    "id": p["id"],
                    "type": "function",
                    "function": {"name": p["name"], "arguments": json.dumps(p.get("arguments") or {})},
                }
                for p in parts
                if p.get("type") == "tool_call"
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif role == "tool":
            for p in parts:
                if p.get("type") == "tool_result":
                    content = p.get("content", "")
                    if p.get("is_error"):
                        content = f"Error: {content}"  # Chat Completions has no is_error flag
                    out.append({"role": "tool", "tool_call_id": p["call_id"], "content": content})
        # other roles are the loop's own records
    return out


class OpenAIProvider(HTTPProvider):
    kind = "openai"
    api_key_env = "OPENAI_API_KEY"

    def __init__(self, model: str, *, base_url: str | None = None, max_tokens_param: str = "max_tokens", **kw: Any) -> None:
        """``max_tokens_param``: the request key the output cap goes under (when one is sent
        at all): ``"max_tokens"`` (the default, what OpenAI-compatible local servers know) or
        ``"max_completion_tokens"`` (OpenAI's current name; its reasoning models, o-series
        and gpt-5, refuse ``max_tokens``)."""
        if max_tokens_param not in MAX_TOKENS_PARAMS:
            raise ValueError(f"max_tokens_param must be one of {', '.join(map(repr, MAX_TOKENS_PARAMS))}, "
                             f"not {max_tokens_param!r}")
        base = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_OPENAI_BASE_URL
        super().__init__(model, base_url=base, **kw)
        self.max_tokens_param = max_tokens_param

    def _headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.api_key:  # local servers usually need none
            h["authorization"] = f"Bearer {self.api_key}"
        return h

    def request_body(
        self, *, system: str, messages: Sequence[Message], tools: Sequence[ToolSpec], max_tokens: int | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": to_openai_messages(system, messages),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        mt = self.output_cap(max_tokens)  # None: no cap key at all (local servers' own default)
        if mt:
            body[self.max_tokens_param] = mt  # the one configured name, never both
        if tools:
            body["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}}
                for t in tools
            ]
        return body

    async def stream(
        self,
        *,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        body = self.request_body(system=system, messages=messages, tools=tools, max_tokens=max_tokens)
        finish_reason: str | None = None
        usage = Usage()
        # tool call index -> {"id", "name", "started", "pending": [argument fragments before the name]}
        calls: dict[int, dict[str, Any]] = {}
        done = False
        async with aclosing(self._post_sse("/chat/completions", body)) as events:
            async for sse in events:
                data_text = sse.data.strip()
                if not data_text:
                    continue
                if data_text == "[DONE]":
                    done = True
                    break
                try:
                    data: Mapping[str, Any] = json.loads(data_text)
                except ValueError as e:
                    raise PermanentProviderError(f"bad JSON chunk: {e}", provider=self.name) from e
                if "error" in data and data["error"]:
                    err = data["error"]
                    code = err.get("code") if isinstance(err, Mapping) else None
                    status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else None
                    raise classify_http(status, data, provider=self.name)
                if data.get("usage"):
                    usage = _usage(data["usage"])
                for choice in data.get("choices") or ():
                    if choice.get("index", 0) != 0:
                        continue  # n > 1 is not used by the loop
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        yield TextDelta(delta["content"], 0)
                    for tc in delta.get("tool_calls") or ():
                        i = int(tc.get("index", 0))
                        st = calls.setdefault(i, {"id": None, "name": None, "started": False, "pending": []})
                        fn = tc.get("function") or {}
                        if tc.get("id"):
                            st["id"] = tc["id"]
                        if fn.get("name"):
                            st["name"] = (st["name"] or "") + fn["name"] if not st["started"] else st["name"]
                        args = fn.get("arguments")
                        if not st["started"] and st["name"]:
                            st["started"] = True
                            yield ToolCallStart(i, st["id"] or f"call_{i}", st["name"])
                            for frag in st["pending"]:
                                yield ToolCallDelta(i, frag)
                            st["pending"].clear()
                        if args:
                            if st["started"]:
                                yield ToolCallDelta(i, args)
                            else:
                                st["pending"].append(args)
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
        if not done and finish_reason is None:
            return  # no finish: stream_model reports a broken stream
        for i, st in calls.items():
            if not st["started"]:
                raise PermanentProviderError(f"tool call {i} never named its function", provider=self.name)
        raw = finish_reason or "stop"
        if calls and raw == "stop":
            raw = "tool_calls"  # some local servers say "stop" after tool calls
        yield Finish(_STOP.get(raw, raw), usage, raw)


def _usage(u: Mapping[str, Any]) -> Usage:
    """OpenAI's ``prompt_tokens`` *include* the ``cached_tokens`` read from its prompt cache;
    the loop's :class:`Usage` counts them apart (Anthropic's convention: ``input_tokens`` are
    the uncached ones), so one price formula fits both (loop.pricing) and a cached token is
    never billed twice."""
    details = u.get("prompt_tokens_details") or {}
    prompt = int(u.get("prompt_tokens") or 0)
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0
    cached = min(max(cached, 0), prompt)
    return Usage(
        input_tokens=prompt - cached,
        output_tokens=int(u.get("completion_tokens") or 0),
        cache_read_tokens=cached,
    )
