"""PartCoalescer.hold / release: a call's events kept raw until a flush may be due make the
same journal items, in the same order, as adding each as it came (loop.stream)."""

from __future__ import annotations

from loop.providers.base import (
    Finish,
    RedactedThinking,
    TextDelta,
    ThinkingDelta,
    ThinkingSignature,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from loop.stream import MAX_PENDING_CHARS, PartCoalescer

EVENTS = [
    ThinkingDelta("let me ", 0), ThinkingDelta("think", 0), ThinkingSignature(0, "sig"),
    RedactedThinking(1, "opaque"),
    TextDelta("Hello ", 2), TextDelta("there", 2),
    ToolCallStart(3, "call_1", "lookup"), ToolCallDelta(3, '{"city": '), ToolCallDelta(3, '"Oslo"}'),
    TextDelta("after", 4),
    Finish("tool_use", Usage(10, 5)),
]


def items_added_one_by_one() -> list:
    c = PartCoalescer("run", 1)
    for ev in EVENTS:
        c.add(ev)
    return c.take()


def test_held_events_make_the_same_items_as_added_ones():
    expected = items_added_one_by_one()
    assert [t for t, _ in expected][:2] == ["part.added", "part.added"] and len(expected) >= 5
    for cut in range(len(EVENTS) + 1):  # held up to ``cut``, then released, the rest added
        c = PartCoalescer("run", 1)
        for ev in EVENTS[:cut]:
            c.hold(ev)
        assert c.pending == [] and (cut == 0 or c.held is not None)
        c.release()
        for ev in EVENTS[cut:]:
            c.add(ev)
        assert c.held is None and c.take() == expected


def test_take_releases_what_is_held():
    c = PartCoalescer("run", 1)
    for ev in EVENTS:
        c.hold(ev)
    assert c.take() == items_added_one_by_one() and c.held is None and c.pending == []


def test_held_chars_never_undercount_the_pending_chars():
    """A caller releases once held_chars reaches MAX_PENDING_CHARS; it must not be later than
    the pending items would have become urgent."""
    c, ref = PartCoalescer("run", 1), PartCoalescer("run", 1)
    for ev in EVENTS:
        c.hold(ev)
        ref.add(ev)
        assert c.held_chars >= ref.pending_chars
    big = TextDelta("x" * MAX_PENDING_CHARS, 5)
    c.hold(big)
    ref.add(big)
    assert ref.urgent and c.held_chars >= MAX_PENDING_CHARS
