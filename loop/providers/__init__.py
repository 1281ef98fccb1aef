"""Model providers behind one streaming protocol, and model spec strings.

Specs: ``echo`` (offline, the default), ``anthropic:MODEL`` (optionally
``@BASE_URL``), ``openai:MODEL`` or ``openai:MODEL@BASE_URL`` for any
OpenAI-compatible server (vLLM, llama.cpp, Ollama: ``openai:llama3.2@http://localhost:11434/v1``).

Provider options have no spec syntax (a spec names a model and where it is served, nothing
more): extended thinking, interleaved thinking, or OpenAI's ``max_completion_tokens`` are
asked for by passing a provider object (``AnthropicProvider(..., thinking_budget=N)``,
``OpenAIProvider(..., max_tokens_param="max_completion_tokens")``), or the same keywords to
:func:`make_provider`. ``surefoot run`` / ``surefoot serve`` take them as options beside
``--model`` (``--thinking``, ``--effort``, ``--max-tokens-param``...: ``loop.cli.add_model_options``),
which build the provider object through :func:`make_provider`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ModelSpecError
from .anthropic import AnthropicProvider
from .base import (
    DEFAULT_MAX_TOKENS,
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_TOOL_USE,
    Finish,
    Provider,
    ResponseBuilder,
    StreamEvent,
    RedactedThinking,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
    stream_model,
)
from .openai import OpenAIProvider
from .scripted import (
    BreakAfter,
    EchoModel,
    Fail,
    RedactedBlock,
    Reply,
    ScriptedModel,
    ThinkingBlock,
    broken,
    overflow,
    permanent,
    redacted_thinking,
    reply,
    thinking,
    tool_call,
    transient,
)

__all__ = [
    "Provider",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ThinkingSignature",
    "RedactedThinking",
    "ToolCallStart",
    "ToolCallDelta",
    "Finish",
    "Usage",
    "ToolSpec",
    "ResponseBuilder",
    "stream_model",
    "STOP_END",
    "STOP_TOOL_USE",
    "STOP_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "AnthropicProvider",
    "OpenAIProvider",
    "ScriptedModel",
    "EchoModel",
    "Reply",
    "Fail",
    "BreakAfter",
    "ThinkingBlock",
    "RedactedBlock",
    "reply",
    "tool_call",
    "thinking",
    "redacted_thinking",
    "transient",
    "overflow",
    "permanent",
    "broken",
    "ModelSpec",
    "parse_model_spec",
    "make_provider",
]


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "echo" | "anthropic" | "openai"
    model: str | None = None
    base_url: str | None = None

    def __str__(self) -> str:
        if self.kind == "echo":
            return "echo"
        s = f"{self.kind}:{self.model}"
        return f"{s}@{self.base_url}" if self.base_url else s


def parse_model_spec(spec: str) -> ModelSpec:
    """``echo`` | ``anthropic:MODEL[@BASE_URL]`` | ``openai:MODEL[@BASE_URL]``.

    The base URL is whatever follows the last ``@`` that starts an
    ``http://`` or ``https://`` URL, so model names with ``@`` or ``:`` (Ollama's
    ``llama3:8b``) survive.
    """
    s = spec.strip()
    if s == "echo":
        return ModelSpec("echo")
    kind, sep, rest = s.partition(":")
    if not sep or kind not in ("anthropic", "openai"):
        raise ModelSpecError(f"unknown model spec {spec!r}: use echo, anthropic:MODEL or openai:MODEL@BASE_URL")
    base_url = None
    for marker in ("@https://", "@http://"):
        at = rest.rfind(marker)
        if at != -1:
            rest, base_url = rest[:at], rest[at + 1 :]
            break
    if not rest:
        raise ModelSpecError(f"model spec {spec!r} names no model")
    return ModelSpec(kind, rest, base_url)


def make_provider(spec: str | ModelSpec | Provider, **kw: Any) -> Provider:
    """A provider from a spec string (providers pass through unchanged)."""
    if not isinstance(spec, (str, ModelSpec)):
        return spec
    ms = parse_model_spec(spec) if isinstance(spec, str) else spec
    if ms.kind == "echo":
        return EchoModel()
    assert ms.model is not None
    if ms.kind == "anthropic":
        return AnthropicProvider(ms.model, base_url=ms.base_url, **kw)
    return OpenAIProvider(ms.model, base_url=ms.base_url, **kw)
