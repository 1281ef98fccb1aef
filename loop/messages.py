"""The loop's message shapes: plain dicts, because transcripts store them as CBOR.

Every message the loop persists is a ``dict`` with a ``role`` and a list of
``content`` parts; providers translate these to and from their wire formats
(:mod:`loop.providers.anthropic`, :mod:`loop.providers.openai`).  Keeping them
plain (no classes) means a transcript written by one version of the code is
read by the next without pickling concerns, and the server can hand them to
a browser as JSON unchanged.

Roles and parts::

    {"role": "user", "content": [{"type": "text", "text": "..."}]}
    {"role": "assistant", "content": [
        {"type": "text", "text": "..."},
        {"type": "tool_call", "id": "call_1", "name": "lookup", "arguments": {...}}],
     "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5}}
    {"role": "tool", "content": [
        {"type": "tool_result", "call_id": "call_1", "name": "lookup",
         "content": "...", "is_error": false, "reason": None}]}
    {"role": "compaction", "summary": "...", "replaces": N}   # not sent as-is; see context()
    {"role": "error", "error": {"type": "permanent", "message": "..."}}  # never sent to a model

``reason`` on a tool result says why an error result exists without the tool
having produced it: ``interrupted`` (crash recovery), ``denied`` (approval),
``cancelled``, ``invalid_arguments``, ``unknown_tool``.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

__all__ = [
    "Message",
    "user",
    "assistant",
    "tool_result",
    "tool_results",
    "text_of",
    "tool_calls_of",
    "result_text",
    "MODEL_ROLES",
]

Message = dict[str, Any]

# Roles a provider sends to a model; others (compaction, error) are the loop's own records.
MODEL_ROLES = frozenset({"user", "assistant", "tool"})


def user(text: str) -> Message:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def assistant(text: str = "", tool_calls: Iterable[Mapping[str, Any]] = (), **extra: Any) -> Message:
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for tc in tool_calls:
        content.append({"type": "tool_call", "id": tc["id"], "name": tc["name"], "arguments": dict(tc.get("arguments") or {})})
    return {"role": "assistant", "content": content, **extra}


def result_text(value: Any) -> str:
    """A tool's return value as the text a model reads (JSON unless already a string)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default, separators=(",", ":"))
    except (TypeError, ValueError):
        return repr(value)


def _json_default(o: Any) -> Any:
    import dataclasses
    import enum

    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(type(o).__name__)


def tool_result(
    call_id: str, name: str, content: Any, *, is_error: bool = False, reason: str | None = None
) -> dict[str, Any]:
    part: dict[str, Any] = {
        "type": "tool_result",
        "call_id": call_id,
        "name": name,
        "content": result_text(content),
        "is_error": bool(is_error),
    }
    if reason is not None:
        part["reason"] = reason
    return part


def tool_results(parts: Iterable[dict[str, Any]]) -> Message:
    return {"role": "tool", "content": list(parts)}


def text_of(message: Mapping[str, Any]) -> str:
    """All text parts of a message, concatenated."""
    return "".join(p.get("text", "") for p in message.get("content") or () if p.get("type") == "text")


def tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [p for p in message.get("content") or () if p.get("type") == "tool_call"]
