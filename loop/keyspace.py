"""The loop's own records: every key this package writes, in one place.

Transcripts and the journal belong to ``sessions``; runs, leases, usage and
steps to ``ledger``.  The loop keeps only what neither models: where a run's
turn stands, so a worker that re-claims it after a crash knows what to do
next without guessing from the transcript alone.

Keys are FoundationDB tuple-encoded under ``root["lp"]`` (``root`` is the
deployment's subspace, default ``(b"surefoot",)``):

Key (under root["lp"])   Value
-----------------------  ------------------------------------------------------------
("r", run_id)            CBOR loop state of a run (see :class:`LoopState`):
                         {"owner", "conversation", "agent", "user_seq",
                          "model_calls", "retries", "next_attempt_at", "compactions",
                          "calls": {call_id: {"state", "name", "reason"?, "allow"?}},
                          "ver", "tok"}  (the write guard, see LoopState)
                         "state" of a tool call: "started" (the tool may have run:
                         recovery finalises it as interrupted, never re-runs it),
                         "approval" (parked, waiting for a decision), "approved",
                         "denied", "done".
("p", run_id)            CBOR {"owner", "conversation", "call_ids"}: the run is parked
                         for approval (index for ``inspect`` and restarts)
("ci", owner, conv,      b"": tool call id ``call_id`` is used in the conversation's
 call_id)                transcript before its mark. Written by the compaction that moves
                         the mark past it (same transaction: blind sets, idempotent), so a
                         claim that reads only the window (loop.compaction, Windows) can
                         still keep call ids unique in the whole transcript with a point
                         read per new id — and only once the conversation has a mark.

Every write of ``("r", run)`` happens in a transaction that also checks the
run's lease (ledger fencing), except approval decisions, which are written
while the run is parked (no lease exists) and are guarded by re-reading the
state (a decision is only recorded for a call in state "approval").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kv
from sessions.codec import dumps, loads, pack_str

__all__ = ["LoopKeyspace", "LoopState", "CALL_STARTED", "CALL_APPROVAL", "CALL_APPROVED", "CALL_DENIED", "CALL_DONE"]

CALL_STARTED = "started"
CALL_APPROVAL = "approval"
CALL_APPROVED = "approved"
CALL_DENIED = "denied"
CALL_DONE = "done"

_R, _P, _CI = pack_str("r"), pack_str("p"), pack_str("ci")


class LoopKeyspace:
    __slots__ = ("root", "base", "_b")

    def __init__(self, root: "kv.Subspace | None" = None) -> None:
        self.root = root if root is not None else kv.Subspace((b"surefoot",))
        self.base = self.root["lp"]
        self._b = self.base.key()

    # A packed prefix + the packed run id (tuple encoding concatenates; several times cheaper
    # than Subspace.pack): every runner commit reads and writes the state key.
    def state(self, run_id: str) -> bytes:
        return self._b + _R + pack_str(run_id)

    def parked(self, run_id: str) -> bytes:
        return self._b + _P + pack_str(run_id)

    def call_id_used(self, owner: str, conv: str, call_id: str) -> bytes:
        return self._b + _CI + pack_str(owner) + pack_str(conv) + pack_str(call_id)

    def parked_range(self) -> tuple[bytes, bytes]:
        r = self.base.range(("p",))
        return r.start, r.stop


@dataclass
class LoopState:
    owner: str
    conversation: str
    agent: str
    user_seq: int = -1  # transcript position of this run's user message (-1: not appended yet)
    model_calls: int = 0
    retries: int = 0  # transient retries of the current model call
    next_attempt_at: float | None = None  # wall clock of the pending retry, if any
    compactions: int = 0  # compactions for the current model call (overflow)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Write guard: every write bumps ``ver`` and stores a token chosen before the
    # transaction's first attempt, so a retry after commit_unknown_result (1021)
    # recognises its own committed write instead of applying it twice.
    ver: int = 0
    tok: bytes | None = None

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "owner": self.owner,
                "conversation": self.conversation,
                "agent": self.agent,
                "user_seq": self.user_seq,
                "model_calls": self.model_calls,
                "retries": self.retries,
                "next_attempt_at": self.next_attempt_at,
                "compactions": self.compactions,
                "calls": self.calls,
                "ver": self.ver,
                "tok": self.tok,
            }
        )

    def copy(self) -> "LoopState":
        """An independent copy (the per-call records too: commits mutate a copy). The fields
        are copied as one dict update, not through the generated ``__init__`` (every commit
        of a run copies its state)."""
        new = object.__new__(LoopState)
        new.__dict__.update(self.__dict__)
        calls = self.calls
        new.calls = dict(zip(calls, map(dict, calls.values()))) if calls else {}
        return new

    @classmethod
    def from_bytes(cls, raw: bytes) -> "LoopState":
        d = loads(raw)
        return cls(
            owner=d["owner"],
            conversation=d["conversation"],
            agent=d.get("agent", ""),
            user_seq=d.get("user_seq", -1),
            model_calls=d.get("model_calls", 0),
            retries=d.get("retries", 0),
            next_attempt_at=d.get("next_attempt_at"),
            compactions=d.get("compactions", 0),
            calls=dict(d.get("calls") or {}),
            ver=d.get("ver", 0),
            tok=d.get("tok"),
        )
