"""Compaction: what the model sees once a conversation outgrows its context.

The transcript always keeps the full history.  A compaction *appends* an
entry ``{"role": "compaction", "summary": ..., "upto": cut}`` saying
"messages [0, cut) are summarised by this text"; :func:`model_context` then
builds the next call's input as the summary (a user turn) followed by the
messages from ``cut`` on, skipping the loop's own records.  Nothing is
rewritten, so a crash mid-compaction leaves either no entry or the whole
entry, and forks at any position see a consistent history.

The cut is chosen so the model never sees a tool result without the call
that asked for it: it falls on a user or assistant message, never on a tool
result, and keeps at least ``keep_recent`` messages verbatim.

Windows: the loop need not hold the whole history. The transaction that
appends a compaction entry marks the transcript at the entry's cut (the
session head's ``mark``), and a claim reads from that mark on: the messages
every function here needs (the newest entry and what follows its cut).
Every function takes ``base``, the sequence number of ``messages[0]``;
positions in entries (``upto``) and the cut returned are absolute.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .messages import MODEL_ROLES, Message, text_of, user
from .providers.base import ToolSpec
from .providers.scripted import CHARS_PER_TOKEN, estimate_tokens

__all__ = [
    "COMPACTION_SYSTEM",
    "SUMMARY_PREFIX",
    "model_context",
    "last_compaction",
    "estimate_context_tokens",
    "tools_schema_chars",
    "choose_cut",
    "summary_request",
    "compaction_entry",
    "MAX_RENDERED_CHARS",
]

COMPACTION_SYSTEM = (
    "You are compacting a conversation so it can continue in a smaller context. "
    "Write a faithful, dense summary of the conversation below: the user's goals, "
    "decisions made, facts learned (including tool results that still matter), and "
    "open questions. Do not add anything that is not in the conversation."
)
SUMMARY_PREFIX = "[Summary of the earlier conversation]\n"
# The rendered history handed to the summariser is cut to this many characters
# (its tail is what matters most; a summary of a summary keeps the head).
MAX_RENDERED_CHARS = 400_000

assert MAX_RENDERED_CHARS > 0


def last_compaction(messages: Sequence[Message]) -> tuple[int, Message] | None:
    """(index, entry) of the newest compaction entry, if any."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "compaction":
            return i, messages[i]
    return None


def model_context(messages: Sequence[Message], base: int = 0) -> list[Message]:
    """The messages a model call sends: summary + history after the cut, model roles only.
    (``messages`` start at sequence number ``base``: see Windows above.)"""
    lc = last_compaction(messages)
    if lc is None:
        assert base == 0, "a window starts at a compaction's cut and holds that compaction"
        return [m for m in messages if m.get("role") in MODEL_ROLES]
    _, entry = lc
    cut = max(0, int(entry.get("upto", 0)) - base)
    out: list[Message] = [user(SUMMARY_PREFIX + str(entry.get("summary", "")))]
    out.extend(m for m in messages[cut:] if m.get("role") in MODEL_ROLES)
    return out


def tools_schema_chars(tools: Sequence[ToolSpec]) -> int:
    """Characters of the tool definitions a model call sends: each spec's JSON as the
    Anthropic provider puts it in the body (``{"name", "description", "input_schema"}``; the
    OpenAI-compatible one wraps the same three fields in ``{"type": "function", "function":
    {...}}``, some 30 characters more a tool). Every call sends them and the provider bills
    them as input ("Everything in the request counts toward the context window: the system
    prompt, every message in ``messages`` (including tool results, images, and documents), and
    your tool definitions", https://platform.claude.com/docs/en/build-with-claude/context-windows;
    the tool-use system prompt the API adds besides is not counted). An agent measures
    its own once (``Agent.tool_schema_chars``): this walks every schema."""
    return sum(
        len(json.dumps({"name": t.name, "description": t.description, "input_schema": t.parameters},
                       ensure_ascii=False, separators=(",", ":"), default=str))
        for t in tools
    )


def _recorded_output_tokens(m: Message) -> int:
    """The output tokens recorded with an assistant message (its step's usage), 0 if none."""
    u = m.get("usage")
    if not isinstance(u, dict):
        return 0
    try:
        return max(0, int(u.get("output_tokens") or 0))
    except (TypeError, ValueError):
        return 0


def estimate_context_tokens(system: str, context: Sequence[Message], tools_schema_chars: int = 0, *,
                            prior_reasoning: bool = False) -> int:
    """The context's input tokens, roughly (4 characters a token; see ``estimate_tokens``),
    tool definitions included (``tools_schema_chars``: :func:`tools_schema_chars`).

    Reasoning (``thinking`` / ``redacted_thinking`` parts) is counted where it is billed as
    input. What Anthropic bills (https://platform.claude.com/docs/en/build-with-claude/extended-thinking,
    "Controlling thinking display", "Thinking block preservation by model", "Thinking and the
    context window"):

    * the reasoning passed back is the model's *whole* reasoning, whatever the response showed:
      with ``display: "omitted"`` "You're still charged for the full thinking tokens" and
      "The server decrypts the ``signature`` to reconstruct the original thinking for prompt
      construction"; a summary is shorter than what it summarises ("You're charged for the full
      thinking tokens generated by the original request, not the summary tokens"; "The thinking
      model does not see the summarized output"). The text at hand (empty when omitted, a
      summary, a redacted block's opaque data) is then no measure of it; the step's recorded
      output tokens are an upper bound (reasoning is output, billed once as such: "Current-turn
      thinking always counts toward ``max_tokens``, is billed as output tokens"). So an
      assistant message carrying reasoning counts ``max(its reasoning text's estimate, its
      recorded output_tokens)`` for its reasoning: an over-estimate by at most its visible text
      and tool calls (counted as well), which the ceilings prefer to an under-estimate (that
      would let a run pass its ceiling). Without a recorded usage, the text's estimate only.
    * which turns' reasoning is in the context depends on the model: "Prior-turn thinking ...
      On models that keep all prior turns [Claude Opus 4.5 and later Opus models, Claude
      Sonnet 4.6 and later Sonnet models, ...], previous thinking blocks remain in context,
      count toward the window, and are billed as input tokens like the rest of the conversation
      history. On models that keep only the last turn [earlier Opus and Sonnet models, all
      Haiku models through Claude Haiku 4.5], the API strips older thinking blocks
      automatically", while the tool-use loop under way keeps its own ("thinking stays in
      context alongside its tool result for the duration of the assistant turn, then drops out
      on the next user turn"). ``prior_reasoning=False`` is the last-turn-only rule: only the
      assistant messages after the last user message count (tool results are ``tool``
      messages here, so that is the tool-use loop under way); ``True`` counts every turn's.
      The signature itself counts for nothing (it is how the reasoning travels, not more of it).
    """
    n = estimate_tokens(system) + (max(0, tools_schema_chars) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN
    last_user = -1 if prior_reasoning else \
        max((i for i, m in enumerate(context) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(context):
        n += 4 + estimate_tokens(text_of(m))
        reasoning, has_reasoning = 0, False
        for p in m.get("content") or ():
            kind = p.get("type")
            if kind == "tool_call":
                n += estimate_tokens(json.dumps(p.get("arguments") or {}))
            elif kind == "tool_result":
                n += estimate_tokens(str(p.get("content") or ""))
            elif kind == "thinking":
                has_reasoning = True
                reasoning += estimate_tokens(p.get("thinking") or "")
            elif kind == "redacted_thinking":
                has_reasoning = True
                reasoning += estimate_tokens(p.get("data") or "")
        if has_reasoning and i > last_user:
            n += max(reasoning, _recorded_output_tokens(m))
    return n


def choose_cut(messages: Sequence[Message], keep_recent: int, base: int = 0) -> int | None:
    """Where the next compaction should cut (a sequence number), or None when nothing can be
    compacted.

    The cut is past the previous compaction's cut, leaves ``keep_recent``
    model messages after it, and lands on a user or assistant message (never
    between a tool call and its result).
    """
    lc = last_compaction(messages)
    prev = max(0, int(lc[1].get("upto", 0)) - base) if lc else 0  # (as an index into messages)
    model_idx = [i for i, m in enumerate(messages) if m.get("role") in MODEL_ROLES and i >= prev]
    if len(model_idx) <= keep_recent:
        # Not enough to keep a tail: compact all but the newest user turn onward.
        keep_recent = 1
    candidates = model_idx[: max(0, len(model_idx) - keep_recent) + 1]
    for i in reversed(candidates):
        if i > prev and messages[i].get("role") in ("user", "assistant"):
            return base + i
    return None


def _render(m: Message) -> str:
    role = m.get("role")
    lines = []
    t = text_of(m)
    if t:
        lines.append(f"{role}: {t}")
    for p in m.get("content") or ():
        if p.get("type") == "tool_call":
            lines.append(f"{role} called {p.get('name')}({json.dumps(p.get('arguments') or {}, ensure_ascii=False)})")
        elif p.get("type") == "tool_result":
            status = "error" if p.get("is_error") else "result"
            lines.append(f"tool {p.get('name')} {status}: {p.get('content')}")
    return "\n".join(lines)


def summary_request(messages: Sequence[Message], cut: int, base: int = 0) -> list[Message]:
    """The summariser's input: the previous summary (if any) and messages up to ``cut``, as text.

    The previous summary is the newest compaction's: it covers everything before its own
    cut, which every new cut passes (:func:`choose_cut`), and it is the one a window holds.
    (An older entry before ``cut`` would summarise less and re-render more.)"""
    lc = last_compaction(messages)
    prev_cut = base
    parts: list[str] = []
    if lc is not None and base <= int(lc[1].get("upto", 0)) <= cut:
        prev_cut = int(lc[1].get("upto", 0))
        parts.append(SUMMARY_PREFIX + str(lc[1].get("summary", "")))
    for m in messages[prev_cut - base:cut - base]:
        if m.get("role") in MODEL_ROLES:
            r = _render(m)
            if r:
                parts.append(r)
    text = "\n\n".join(parts)
    if len(text) > MAX_RENDERED_CHARS:
        head = MAX_RENDERED_CHARS // 4
        text = text[:head] + "\n[...]\n" + text[-(MAX_RENDERED_CHARS - head) :]
    return [user("Summarise this conversation:\n\n" + text)]


def compaction_entry(summary: str, cut: int, *, reason: str, usage: dict[str, Any] | None = None) -> Message:
    e: Message = {"role": "compaction", "summary": summary, "upto": cut, "reason": reason}
    if usage:
        e["usage"] = usage
    return e
