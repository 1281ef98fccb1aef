"""loop — the agent loop: agents, model providers, tools, retry, compaction, approvals, recovery.

Public face (phase 1; the durable Runtime lands on top of sessions/ and ledger/):

* :class:`Agent`, :func:`tool`, :class:`Tool`, :class:`Hooks`, :class:`ToolContext`
* providers: :func:`make_provider` / :func:`parse_model_spec` (``echo``,
  ``anthropic:MODEL``, ``openai:MODEL@BASE_URL``), :class:`ScriptedModel`,
  :class:`EchoModel`
* :class:`RetryPolicy` and the provider error classes of :mod:`loop.errors`
* :func:`call_model` — one model call with retries applied
"""

from .agents import Agent, Hooks, ModelCallInfo, Tool, ToolCallInfo, ToolContext, tool
from .calls import Clock, RetryNotice, call_model
from .errors import (
    ContextOverflowError,
    LoopError,
    ModelSpecError,
    PermanentProviderError,
    ProviderError,
    StreamBrokenError,
    ToolSchemaError,
    TransientProviderError,
)
from .providers import EchoModel, ScriptedModel, make_provider, parse_model_spec
from .retry import RetryPolicy

__all__ = [
    "Agent",
    "Tool",
    "tool",
    "Hooks",
    "ModelCallInfo",
    "ToolCallInfo",
    "ToolContext",
    "call_model",
    "Clock",
    "RetryNotice",
    "RetryPolicy",
    "make_provider",
    "parse_model_spec",
    "ScriptedModel",
    "EchoModel",
    "LoopError",
    "ProviderError",
    "TransientProviderError",
    "ContextOverflowError",
    "PermanentProviderError",
    "StreamBrokenError",
    "ToolSchemaError",
    "ModelSpecError",
]
