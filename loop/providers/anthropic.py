"""Anthropic Messages API, streaming (``POST /v1/messages`` with ``stream: true``).

Wire format (https://docs.anthropic.com/en/api/messages-streaming): named SSE
events ``message_start`` (usage.input_tokens), ``content_block_start``
(``text`` or ``tool_use`` with id and name), ``content_block_delta``
(``text_delta`` / ``input_json_delta``), ``content_block_stop``,
``message_delta`` (stop_reason, cumulative usage.output_tokens),
``message_stop``, ``ping`` and ``error`` (e.g. ``overloaded_error`` mid-stream).

Extended thinking (https://docs.anthropic.com/en/docs/build-with-claude/extended-thinking,
"Streaming thinking" and "Preserving thinking blocks"): ``thinking_budget=N`` sends
``"thinking": {"type": "enabled", "budget_tokens": N}`` (N >= 1024 and below
``max_tokens``, as the API requires).  The stream then opens ``thinking`` blocks
(``content_block_start`` with ``{"type": "thinking", "thinking": ""}``) filled by
``thinking_delta`` (``delta.thinking``) and closed by one ``signature_delta``
(``delta.signature``) just before ``content_block_stop``; a block the safety systems
encrypted arrives whole as ``{"type": "redacted_thinking", "data": ...}`` in its
``content_block_start``.  They come before the text and tool_use blocks (unless
interleaved, below).  With tools, the next request must carry that assistant turn's
``thinking`` blocks (``thinking`` and ``signature`` unmodified) and ``redacted_thinking``
blocks (``data``) where they were in its content (first, without interleaving), or the
API answers 400; :func:`to_anthropic_messages` does so from the
``thinking`` / ``redacted_thinking`` parts the loop persisted (loop.providers.base).
Earlier turns' thinking is sent too. What the API does with it depends on the model
(https://platform.claude.com/docs/en/build-with-claude/extended-thinking): models that keep
all prior turns (Opus 4.5+, Sonnet 4.6+) keep it in context and bill it as input; older
ones strip it. The usage-ceiling estimate counts it (loop.compaction.estimate_context_tokens).
A call the loop clamps under a usage ceiling to a ``max_tokens`` at or below the budget
is sent with the budget lowered to ``max_tokens - 1`` for that call
(:meth:`AnthropicProvider.capped_call_options`): thinking stays on, as a tool-use turn
requires, and the request stays valid.

Interleaved thinking (Claude 4 models; same page, "Interleaved thinking"; beta header
``anthropic-beta: interleaved-thinking-2025-05-14``, several betas comma-separated in one
header per https://docs.anthropic.com/en/api/beta-headers): ``interleaved_thinking=True``
sends the header, and the model may then think between tool calls, so ``thinking`` /
``redacted_thinking`` blocks can follow ``tool_use`` (and text) blocks in one response and
one assistant turn.  They are kept and passed back in stream order, exactly where they
were.  The docs relax one rule for it: "when using interleaved thinking with tools" the
budget may exceed ``max_tokens`` (it becomes the budget of the whole assistant turn, bounded
by the context window).  Only that is relaxed, and only where the docs say: a request with
tools is sent with the budget as configured whatever its ``max_tokens``; a request without
tools (the compaction summariser's) keeps the ordinary rule, its budget lowered to
``max_tokens - 1`` for that call (refused when that is below the minimum); a call clamped by
a usage ceiling is sent with ``budget < max_tokens`` as without the beta (valid either way,
and the call's whole output, reasoning included, stays under the clamp).

Adaptive thinking (Claude 4.6 models and later; documented by Anthropic as replacing
budgeted thinking, whose ``{"type": "enabled", "budget_tokens": N}`` is deprecated on
Opus/Sonnet 4.6 and answered 400 on Opus 4.7+): ``thinking="adaptive"`` sends
``"thinking": {"type": "adaptive"}`` (plus ``"display": "summarized" | "omitted"`` when
``thinking_display`` is set; Opus 4.7+ defaults to ``omitted``: ``thinking`` blocks stream
with no ``thinking_delta`` at all, only a ``signature_delta``, and are passed back exactly
like any other, empty text and signature unmodified).  The model decides how much to think;
there is no budget, so a ceiling's clamp only lowers ``max_tokens`` (which still caps the
whole response, reasoning included).  It interleaves reasoning between tool calls by
itself, without the beta header, so ``interleaved_thinking`` is refused with it.
``effort`` ("low" ... "max") sends the top-level ``"output_config": {"effort": ...}``, with
or without thinking (it governs all of a response's token spend); which levels a model
takes varies and the API is left to refuse one it does not (400, permanent).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Mapping, Sequence

from ..errors import PermanentProviderError, classify_http
from ..messages import Message
from .base import (
    DEFAULT_MAX_TOKENS,
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_TOOL_USE,
    Finish,
    RedactedThinking,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from .http import HTTPProvider

__all__ = [
    "AnthropicProvider",
    "to_anthropic_messages",
    "ANTHROPIC_VERSION",
    "DEFAULT_ANTHROPIC_BASE_URL",
    "MIN_THINKING_BUDGET",
    "INTERLEAVED_THINKING_BETA",
    "THINKING_MODES",
    "EFFORT_LEVELS",
    "THINKING_DISPLAYS",
]

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
# The smallest ``budget_tokens`` the API accepts for extended thinking.
MIN_THINKING_BUDGET = 1024

# The beta that lets Claude 4 models think between tool calls (exact value as documented).
INTERLEAVED_THINKING_BETA = "interleaved-thinking-2025-05-14"

# ``thinking=`` values: the modes without a budget (budgeted thinking is ``thinking_budget=N``).
THINKING_MODES = ("adaptive",)
# ``output_config.effort`` levels as documented (a model may accept only some: the API says which).
EFFORT_LEVELS = ("low", "medium", "high", "xhigh", "max")
# ``thinking.display`` values for adaptive thinking: readable summaries, or signature-only blocks.
THINKING_DISPLAYS = ("summarized", "omitted")

assert 0 < MIN_THINKING_BUDGET
assert THINKING_MODES and EFFORT_LEVELS and THINKING_DISPLAYS
# Reasoning parts, passed back verbatim, where they streamed (first in their turn unless interleaved).
_THINKING_TYPES = ("thinking", "redacted_thinking")

_STOP = {"end_turn": STOP_END, "stop_sequence": STOP_END, "tool_use": STOP_TOOL_USE, "max_tokens": STOP_MAX_TOKENS}


def to_anthropic_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The loop's messages as Anthropic ``messages`` (tool results ride in user turns).

    Consecutive messages of one role are merged, and tool results are put
    first in their user turn, as the API requires them to follow the
    assistant turn that asked for them.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        blocks: list[dict[str, Any]] = []
        if role == "user":
            for p in m.get("content") or ():
                if p.get("type") == "text" and p.get("text"):
                    blocks.append({"type": "text", "text": p["text"]})
            wire_role = "user"
        elif role == "assistant":
            for p in m.get("content") or ():
                ptype = p.get("type")
                if ptype == "text":
                    if p.get("text"):
                        blocks.append({"type": "text", "text": p["text"]})
                elif ptype == "tool_call":
                    blocks.append({"type": "tool_use", "id": p["id"], "name": p["name"], "input": p.get("arguments") or {}})
                elif ptype == "thinking":
                    # Unmodified: the signature covers the text; in stream order (first, unless interleaved).
                    blocks.append({"type": "thinking", "thinking": p.get("thinking", ""), "signature": p.get("signature", "")})
                elif ptype == "redacted_thinking":
                    blocks.append({"type": "redacted_thinking", "data": p.get("data", "")})
            wire_role = "assistant"
        elif role == "tool":
            for p in m.get("content") or ():
                if p.get("type") == "tool_result":
                    b: dict[str, Any] = {"type": "tool_result", "tool_use_id": p["call_id"], "content": p.get("content", "")}
                    if p.get("is_error"):
                        b["is_error"] = True
                    blocks.append(b)
            wire_role = "user"
        else:
            continue  # the loop's own records (errors, compaction markers) are not model input
        if not blocks:
            continue
        if out and out[-1]["role"] == wire_role:
            prev = out[-1]["content"]
            merged = prev + blocks
            if wire_role == "user":
                # tool_result blocks first within a user turn
                merged.sort(key=lambda b: 0 if b["type"] == "tool_result" else 1)
            else:
                # Two assistant messages in a row (rare): the reasoning that opens each one
                # must still lead the turn; reasoning a message streamed later (interleaved,
                # after a tool_use or text block) stays exactly where it was.
                lp, ln = _leading_reasoning(prev), _leading_reasoning(blocks)
                merged = prev[:lp] + blocks[:ln] + prev[lp:] + blocks[ln:]
            out[-1]["content"] = merged
        else:
            out.append({"role": wire_role, "content": blocks})
    return out


def _leading_reasoning(blocks: Sequence[Mapping[str, Any]]) -> int:
    """How many of ``blocks`` are reasoning before the first non-reasoning block."""
    n = 0
    while n < len(blocks) and blocks[n]["type"] in _THINKING_TYPES:
        n += 1
    return n


def merge_beta(existing: str | None, beta: str) -> str:
    """``beta`` added to an ``anthropic-beta`` header value (comma-separated, as the API takes
    several betas in one header), once: values already there are kept, in their order."""
    names = [v.strip() for v in (existing or "").split(",") if v.strip()]
    if beta not in names:
        names.append(beta)
    return ",".join(names)


class AnthropicProvider(HTTPProvider):
    kind = "anthropic"
    api_key_env = "ANTHROPIC_API_KEY"

    def __init__(
        self, model: str, *, base_url: str | None = None, thinking_budget: int | None = None,
        interleaved_thinking: bool = False, thinking: str | None = None, effort: str | None = None,
        thinking_display: str | None = None, strips_prior_thinking: bool = False, **kw: Any,
    ) -> None:
        """``thinking_budget``: enable extended thinking with this many ``budget_tokens``
        (an int >= :data:`MIN_THINKING_BUDGET`, below ``max_tokens`` unless interleaved;
        None: off) — the older models' mode (up to the 4.5 family; deprecated on 4.6,
        refused by Opus 4.7+). ``interleaved_thinking``: send the
        ``interleaved-thinking-2025-05-14`` beta (Claude 4 models think between tool calls);
        needs ``thinking_budget``, and lets the budget reach or pass ``max_tokens`` (the docs
        allow it with tools: it is then the budget of the whole assistant turn).

        ``thinking="adaptive"``: adaptive thinking (4.6 models and later), the model choosing
        how much to think; exclusive with ``thinking_budget``; interleaves by itself, so
        ``interleaved_thinking=True`` is refused with it. ``thinking_display``: "summarized" or
        "omitted" (adaptive only; None sends no ``display``: the model's default, "omitted" on
        Opus 4.7+). ``effort``: one of :data:`EFFORT_LEVELS`, sent as ``output_config.effort``,
        with any thinking mode or none.

        ``strips_prior_thinking``: this model keeps only the last turn's reasoning in context
        (the extended-thinking page's "last turn only" models: Opus and Sonnet before 4.5 / 4.6,
        Haiku through 4.5), so usage ceilings do not reserve input for earlier turns' reasoning.
        False (the default) reserves it, as the "keep all prior turns" models bill it: an
        over-estimate on an older model, never an under-estimate on a newer one."""
        import os

        base = base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_ANTHROPIC_BASE_URL
        super().__init__(model, base_url=base, **kw)
        if not isinstance(strips_prior_thinking, bool):
            raise ValueError(f"strips_prior_thinking must be a bool, not {type(strips_prior_thinking).__name__}")
        self.strips_prior_thinking = strips_prior_thinking  # (read by the runner's usage reserve)
        if not isinstance(interleaved_thinking, bool):
            raise ValueError(f"interleaved_thinking must be a bool, not {type(interleaved_thinking).__name__}")
        if thinking is not None and thinking not in THINKING_MODES:
            raise ValueError(f"thinking must be one of {', '.join(map(repr, THINKING_MODES))} or None, not {thinking!r} "
                             f"(budgeted thinking is thinking_budget=N)")
        if thinking is not None and thinking_budget is not None:
            raise ValueError(f"thinking={thinking!r} and thinking_budget= are exclusive: adaptive thinking has no "
                             f"budget (use effort= to steer it), budgeted thinking is for models without adaptive")
        if thinking is not None and interleaved_thinking:
            raise ValueError("adaptive thinking interleaves reasoning between tool calls by itself (no beta header): "
                             "drop interleaved_thinking=True")
        if thinking_display is not None:
            if thinking != "adaptive":
                raise ValueError("thinking_display needs thinking='adaptive'")
            if thinking_display not in THINKING_DISPLAYS:
                raise ValueError(f"thinking_display must be one of {', '.join(map(repr, THINKING_DISPLAYS))}, "
                                 f"not {thinking_display!r}")
        if effort is not None and effort not in EFFORT_LEVELS:
            raise ValueError(f"effort must be one of {', '.join(map(repr, EFFORT_LEVELS))} or None, not {effort!r}")
        self.thinking = thinking
        self.thinking_display = thinking_display
        self.effort = effort
        if interleaved_thinking and thinking_budget is None:
            raise ValueError("interleaved_thinking=True needs extended thinking on: pass thinking_budget= too "
                             f"(an int >= {MIN_THINKING_BUDGET})")
        if thinking_budget is not None:
            if isinstance(thinking_budget, bool) or not isinstance(thinking_budget, int):
                raise ValueError(f"thinking_budget must be an int, not {type(thinking_budget).__name__}")
            if thinking_budget < MIN_THINKING_BUDGET:
                raise ValueError(f"thinking_budget {thinking_budget} is below the API's minimum of {MIN_THINKING_BUDGET} tokens")
            mt = self.max_tokens or DEFAULT_MAX_TOKENS
            if thinking_budget >= mt and not interleaved_thinking:
                raise ValueError(
                    f"thinking_budget {thinking_budget} must be less than max_tokens {mt} "
                    f"(the budget is part of max_tokens; pass a larger max_tokens=, or "
                    f"interleaved_thinking=True on a Claude 4 model with tools)"
                )
        self.thinking_budget = thinking_budget
        self.interleaved_thinking = interleaved_thinking
        # The anthropic-beta header value this provider sends (None: none of its own). The
        # caller's betas (extra_headers, name matched case-blind as HTTP header names are)
        # are merged into it and taken out of extra_headers, so one comma-separated header is
        # sent, not two, and not the caller's alone (extra_headers are applied last).
        self._beta: str | None = None
        if interleaved_thinking:
            existing: str | None = None
            for k in [k for k in self.extra_headers if k.lower() == "anthropic-beta"]:
                existing = ",".join(v for v in (existing, self.extra_headers.pop(k)) if v)
            self._beta = merge_beta(existing, INTERLEAVED_THINKING_BETA)

    def output_cap(self, max_tokens: int | None) -> int | None:
        """Always bounded: the request always carries ``max_tokens`` (the API requires it),
        the per-call one, else this provider's, else :data:`DEFAULT_MAX_TOKENS`."""
        return max_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def capped_call_options(self, max_tokens: int) -> dict[str, Any] | None:
        """A call clamped to ``max_tokens`` by a usage ceiling. Without thinking any value
        >= 1 is valid. With thinking the budget must stay below ``max_tokens`` and at least
        :data:`MIN_THINKING_BUDGET`: a clamp at or below the budget lowers it for this call to
        ``max_tokens - 1`` (thinking cannot be switched off instead: mid tool-use turn the API
        refuses a request that toggles it); a clamp that leaves no room for the minimum budget
        is None (no valid request fits: the loop refuses the call as over the ceiling).
        With ``interleaved_thinking`` the same: the docs let the budget pass ``max_tokens``
        only in requests with tools (this is not told whether the call has any), and a
        budget below the clamp keeps the call's whole output, reasoning included, under it.
        Adaptive thinking has no budget: any clamp >= 1 is valid as it is ({}), the smaller
        ``max_tokens`` capping the response, reasoning included."""
        if max_tokens < 1:
            return None
        if self.thinking_budget is None or self.thinking_budget < max_tokens:
            return {}
        lowered = max_tokens - 1
        if lowered < MIN_THINKING_BUDGET:
            return None
        return {"thinking_budget": lowered}

    def _headers(self) -> dict[str, str]:
        h = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
        if self.api_key:
            h["x-api-key"] = self.api_key
        if self._beta is not None:
            h["anthropic-beta"] = self._beta
        return h

    def request_body(
        self, *, system: str, messages: Sequence[Message], tools: Sequence[ToolSpec], max_tokens: int | None,
        thinking_budget: int | None = None,
    ) -> dict[str, Any]:
        """``thinking_budget``: this call's budget in place of the provider's (only as
        :meth:`capped_call_options` gives it, for a call clamped under a usage ceiling)."""
        budget = self.thinking_budget
        if thinking_budget is not None:
            if budget is None or not MIN_THINKING_BUDGET <= thinking_budget <= budget:
                raise PermanentProviderError(
                    f"a per-call thinking_budget {thinking_budget} must be within [{MIN_THINKING_BUDGET}, "
                    f"the provider's {budget}]", provider=self.name)
            budget = thinking_budget
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.output_cap(max_tokens),
            "messages": to_anthropic_messages(messages),
            "stream": True,
        }
        if system:
            body["system"] = system
        if budget is not None:
            if budget >= body["max_tokens"]:
                if self.interleaved_thinking and tools:
                    pass  # documented: with interleaved thinking and tools the budget may pass max_tokens
                elif self.interleaved_thinking and body["max_tokens"] - 1 >= MIN_THINKING_BUDGET:
                    # No tools (the compaction summariser's call): the ordinary rule, as the docs
                    # relax it only with tools; the budget is lowered for this call instead.
                    budget = body["max_tokens"] - 1
                else:
                    # a per-call max_tokens (the agent's) below the budget: the API would answer 400
                    raise PermanentProviderError(
                        f"thinking_budget {budget} must be less than max_tokens {body['max_tokens']}"
                        + (" (a request without tools: interleaved thinking does not relax this)"
                           if self.interleaved_thinking else ""),
                        provider=self.name,
                    )
            body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        elif self.thinking is not None:
            body["thinking"] = {"type": self.thinking}
            if self.thinking_display is not None:
                body["thinking"]["display"] = self.thinking_display
        if self.effort is not None:
            body["output_config"] = {"effort": self.effort}
        if tools:
            body["tools"] = [{"name": t.name, "description": t.description, "input_schema": dict(t.parameters)} for t in tools]
        return body

    async def _post_messages(self, body: Mapping[str, Any]) -> AsyncIterator[Any]:
        """``_post_sse`` to the Messages API; a 400 refusing budgeted thinking (Opus 4.7+ answers
        ``thinking.type.enabled is not supported for this model``) says which option to use
        instead. Still permanent, status and type kept: only the message gains the hint."""
        try:
            async with aclosing(self._post_sse("/v1/messages", body)) as events:
                async for sse in events:
                    yield sse
        except PermanentProviderError as e:
            if e.status == 400 and self.thinking_budget is not None and "thinking.type.enabled" in e.message:
                raise PermanentProviderError(
                    f"{e.message} (this model takes adaptive thinking: AnthropicProvider(thinking='adaptive', "
                    f"effort=...) in place of thinking_budget=)",
                    status=e.status, provider=e.provider, error_type=e.error_type, retry_after=e.retry_after,
                ) from e
            raise

    async def stream(
        self,
        *,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        max_tokens: int | None = None,
        thinking_budget: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        body = self.request_body(system=system, messages=messages, tools=tools, max_tokens=max_tokens,
                                 thinking_budget=thinking_budget)
        usage: dict[str, int] = {}
        stop_reason: str | None = None
        kinds: dict[int, str] = {}  # content block index -> "text" | "tool_use" | "thinking" | other
        async with aclosing(self._post_messages(body)) as events:
            async for sse in events:
                if not sse.data:
                    continue
                try:
                    data: Mapping[str, Any] = json.loads(sse.data)
                except ValueError as e:
                    raise PermanentProviderError(f"bad JSON in {sse.event} event: {e}", provider=self.name) from e
                etype = data.get("type") or sse.event
                if etype == "message_start":
                    _merge_usage(usage, (data.get("message") or {}).get("usage"))
                elif etype == "content_block_start":
                    idx = int(data.get("index", 0))
                    block = data.get("content_block") or {}
                    kinds[idx] = block.get("type", "")
                    if kinds[idx] == "text":
                        if block.get("text"):
                            yield TextDelta(block["text"], idx)
                    elif kinds[idx] == "tool_use":
                        yield ToolCallStart(idx, str(block.get("id", f"toolu_{idx}")), str(block.get("name", "")))
                        initial = block.get("input")
                        if initial:  # normally {} with the arguments following as deltas
                            yield ToolCallDelta(idx, json.dumps(initial))
                    elif kinds[idx] == "thinking":
                        if block.get("thinking"):  # normally "" with the text following as deltas
                            yield ThinkingDelta(str(block["thinking"]), idx)
                        if block.get("signature"):
                            yield ThinkingSignature(idx, str(block["signature"]))
                    elif kinds[idx] == "redacted_thinking":
                        yield RedactedThinking(idx, str(block.get("data", "")))
                elif etype == "content_block_delta":
                    idx = int(data.get("index", 0))
                    delta = data.get("delta") or {}
                    dtype = delta.get("type")
                    if dtype == "text_delta":
                        if delta.get("text"):
                            yield TextDelta(delta["text"], idx)
                    elif dtype == "input_json_delta":
                        if kinds.get(idx) != "tool_use":
                            raise PermanentProviderError(f"input_json_delta for non-tool block {idx}", provider=self.name)
                        if delta.get("partial_json"):
                            yield ToolCallDelta(idx, delta["partial_json"])
                    elif dtype == "thinking_delta" or dtype == "signature_delta":
                        if kinds.get(idx) != "thinking":
                            raise PermanentProviderError(f"{dtype} for non-thinking block {idx}", provider=self.name)
                        if dtype == "thinking_delta":
                            if delta.get("thinking"):
                                yield ThinkingDelta(delta["thinking"], idx)
                        elif delta.get("signature"):
                            yield ThinkingSignature(idx, delta["signature"])
                elif etype == "message_delta":
                    stop_reason = (data.get("delta") or {}).get("stop_reason") or stop_reason
                    _merge_usage(usage, data.get("usage"))
                elif etype == "message_stop":
                    raw = stop_reason or "end_turn"
                    yield Finish(_STOP.get(raw, raw), _usage(usage), raw)
                    return
                elif etype == "error":
                    raise classify_http(None, data, provider=self.name)
                # ping, content_block_stop and future event types: nothing to do


def _merge_usage(acc: dict[str, int], u: Mapping[str, Any] | None) -> None:
    """Anthropic's usage numbers are cumulative: the latest value wins."""
    for k, v in (u or {}).items():
        if isinstance(v, int):
            acc[k] = v


def _usage(u: Mapping[str, int]) -> Usage:
    return Usage(
        input_tokens=u.get("input_tokens", 0),
        output_tokens=u.get("output_tokens", 0),
        cache_read_tokens=u.get("cache_read_input_tokens", 0),
        cache_write_tokens=u.get("cache_creation_input_tokens", 0),
    )
