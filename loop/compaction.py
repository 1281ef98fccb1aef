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
from .providers.scripted import estimate_tokens

__all__ = [
    "COMPACTION_SYSTEM",
    "SUMMARY_PREFIX",
    "model_context",
    "last_compaction",
    "estimate_context_tokens",
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


def estimate_context_tokens(system: str, context: Sequence[Message], tools_schema_chars: int = 0) -> int:
    """The context's input tokens, roughly (4 characters a token; see ``estimate_tokens``).

    Reasoning is counted where a provider bills it as input: the assistant turns after the
    last user message, i.e. the tool-use loop under way, whose thinking blocks are passed
    back to the model (Anthropic drops earlier turns' reasoning from the context and does
    not bill it). Its text and a redacted block's data count; the signature does not.
    """
    n = estimate_tokens(system) + tools_schema_chars // 4
    last_user = max((i for i, m in enumerate(context) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(context):
        n += 4 + estimate_tokens(text_of(m))
        for p in m.get("content") or ():
            kind = p.get("type")
            if kind == "tool_call":
                n += estimate_tokens(json.dumps(p.get("arguments") or {}))
            elif kind == "tool_result":
                n += estimate_tokens(str(p.get("content") or ""))
            elif i > last_user and kind == "thinking":
                n += estimate_tokens(p.get("thinking") or "")
            elif i > last_user and kind == "redacted_thinking":
                n += estimate_tokens(p.get("data") or "")
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
