"""The journal's event names: fixed, stable, public (clients switch on them).

Nothing else in the code base spells an event name as a literal; import these.
"""

from __future__ import annotations

__all__ = [
    "RUN_QUEUED", "RUN_STARTED", "RUN_RETRY_PENDING", "RUN_COMPLETED", "RUN_FAILED", "RUN_CANCELLED",
    "MESSAGE_ADDED", "PART_ADDED", "PART_UPDATED", "TOOL_STARTED", "TOOL_COMPLETED",
    "USAGE_UPDATED", "CONTEXT_COMPACTED", "APPROVAL_REQUESTED", "APPROVAL_RESOLVED",
    "EVENT_TYPES", "RUN_SETTLED_EVENTS",
]

RUN_QUEUED = "run.queued"
RUN_STARTED = "run.started"
RUN_RETRY_PENDING = "run.retry-pending"
RUN_COMPLETED = "run.completed"
RUN_FAILED = "run.failed"
RUN_CANCELLED = "run.cancelled"
MESSAGE_ADDED = "message.added"
PART_ADDED = "part.added"
PART_UPDATED = "part.updated"
TOOL_STARTED = "tool.started"
TOOL_COMPLETED = "tool.completed"
USAGE_UPDATED = "usage.updated"
CONTEXT_COMPACTED = "context.compacted"
APPROVAL_REQUESTED = "approval.requested"
APPROVAL_RESOLVED = "approval.resolved"

EVENT_TYPES: frozenset[str] = frozenset({
    RUN_QUEUED, RUN_STARTED, RUN_RETRY_PENDING, RUN_COMPLETED, RUN_FAILED, RUN_CANCELLED,
    MESSAGE_ADDED, PART_ADDED, PART_UPDATED, TOOL_STARTED, TOOL_COMPLETED,
    USAGE_UPDATED, CONTEXT_COMPACTED, APPROVAL_REQUESTED, APPROVAL_RESOLVED,
})
assert len(EVENT_TYPES) == 15

#: The event that ends a run, per settled status.
RUN_SETTLED_EVENTS: dict[str, str] = {
    "completed": RUN_COMPLETED,
    "failed": RUN_FAILED,
    "cancelled": RUN_CANCELLED,
}
