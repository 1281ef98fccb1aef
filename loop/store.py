"""The loop's view of storage: sessions (transcripts, journal) and the ledger, behind one object.

The runner and the Runtime call only this module, so the exact shapes of
the ``sessions`` and ``ledger`` APIs are adapted in one place.  Every
``*_tr``-style method here takes the caller's transaction and does its
work inside it (the caller commits); the others run their own transactions
and say whether they are idempotent or guarded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import trio

import kv
from sessions import events as E
from sessions.errors import NotFound as SessionNotFound
from sessions.journal import Journal
from sessions.owners import LOCAL_OWNER, as_tag
from sessions.transcript import Transcripts

from . import _interim_ledger as L
from .keyspace import CALL_APPROVAL, CALL_APPROVED, CALL_DENIED, LoopKeyspace, LoopState

if TYPE_CHECKING:
    from .calls import Clock
    from .runtime import Acknowledgement, RunInfo

log = logging.getLogger(__name__)

__all__ = ["Store", "Claim", "DEFAULT_LEASE_SECONDS", "ApprovalError"]

DEFAULT_LEASE_SECONDS = 30.0


class ApprovalError(Exception):
    """No approval is pending for that call (already resolved, or never requested)."""


@dataclass
class Claim:
    """A run this worker holds a lease on."""

    run_id: str
    owner: str
    conversation: str
    attempt: int
    delivery: Any
    result_schema: Any
    lease: Any  # the ledger's lease (fencing token)


class Store:
    LeaseLost: type[Exception] = L.LeaseLost

    def __init__(
        self,
        db: Any,
        *,
        root: kv.Subspace | None = None,
        clock: "Clock",
        lease_seconds: float | None = None,
        max_attempts: int | None = None,
        journal_retention: int | None = None,
    ) -> None:
        self.db = db
        self.root = root if root is not None else kv.Subspace((b"surefoot",))
        self.clock = clock
        self.lease_seconds = lease_seconds or DEFAULT_LEASE_SECONDS
        jkw = {} if journal_retention is None else {"retention": journal_retention}
        self.journal = Journal(db, self.root, clock=clock.now, **jkw)
        self.transcripts = Transcripts(db, self.root, clock=clock.now)
        self.loop_keys = LoopKeyspace(self.root)
        self.ledger = L.InterimLedger(
            db, self.root, journal=self.journal, clock=clock.now, lease_seconds=self.lease_seconds,
            max_attempts=max_attempts or L.DEFAULT_MAX_ATTEMPTS,
        )
        self.default_owner = as_tag(LOCAL_OWNER)

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.journal.run_trimmer)

    # ------------------------------------------------------------------ transcripts

    async def ensure_session(self, tr: Any, owner: str, conv: str) -> None:
        """Create the conversation's session if missing (idempotent)."""
        await self.transcripts.create_tr(tr, owner, conv)

    async def read_transcript(self, owner: str, conv: str, start: int = 0) -> list[dict[str, Any]]:
        try:
            return [m.data for m in await self.transcripts.read_all(owner, conv, start)]
        except SessionNotFound:
            return []

    # ------------------------------------------------------------------ runs

    async def submit(self, owner: str, conv: str, submission_id: str, delivery: Any, schema: Any, *,
                     policy: str = "queue") -> "Acknowledgement":
        from .runtime import Acknowledgement

        res = await self.ledger.submit(owner, conv, submission_id, delivery, schema)
        run = res["run"]
        return Acknowledgement(submission_id, run["id"], res.get("cursor"), run["status"], conv,
                               duplicate=res["duplicate"], outcome=run.get("outcome"))

    async def claim(self, worker: str) -> Claim | None:
        got = await self.ledger.claim(worker)
        if got is None:
            return None
        run, lease = got
        return Claim(run["id"], run["owner"], run["conversation"], lease.attempt, run["delivery"],
                     run.get("result_schema"), lease)

    async def check_lease(self, tr: Any, claim: Claim) -> None:
        await self.ledger.check_lease(tr, claim.lease)

    async def renew(self, claim: Claim) -> None:
        await self.ledger.renew(claim.lease)

    async def release(self, claim: Claim) -> None:
        await self.ledger.release(claim.lease)

    async def settle(self, tr: Any, claim: Claim, outcome: Mapping[str, Any]) -> None:
        """Settle in the caller's transaction; journals run.completed / run.failed / run.cancelled."""
        await self.ledger.settle(tr, claim.lease, dict(outcome))
        tr.clear(self.loop_keys.parked(claim.run_id))

    async def recover_after_restart(self) -> int:
        return await self.ledger.void_all_leases()

    async def wait_for_work(self) -> None:
        await self.ledger.wait_ready()

    # ------------------------------------------------------------------ cancel

    async def cancel(self, run_id: str, owner: str) -> "RunInfo":
        try:
            await self.ledger.cancel(owner, run_id)
        except L.RunNotFound:
            from .runtime import NotFound
            raise NotFound(f"run {run_id!r} not found") from None
        return await self.get_run(run_id, owner)

    async def cancel_requested(self, tr: Any, run_id: str) -> bool:
        return await self.ledger.cancel_requested(tr, run_id)

    async def wait_cancel_requested(self, run_id: str) -> None:
        await self.ledger.wait_cancel(run_id)

    # ------------------------------------------------------------------ usage / steps

    async def record_usage(self, tr: Any, claim: Claim, step_id: str, usage: Mapping[str, Any]) -> None:
        await self.ledger.record_usage(tr, claim.run_id, step_id, dict(usage))

    async def reserve(self, claim: Claim, estimate: int) -> str | None:
        """None when the call may proceed, else why not (the run's ceiling would be passed)."""
        limits = (claim.delivery or {}).get("limits") if isinstance(claim.delivery, Mapping) else None
        if not limits:
            return None
        ceiling = limits.get("max_tokens")
        if ceiling is None:
            return None
        totals = await self.db.transact(lambda tr: self.ledger.usage_totals(tr, claim.run_id))
        used = totals["input_tokens"] + totals["output_tokens"]
        if used + estimate > ceiling:
            return f"usage ceiling: {used} tokens used + ~{estimate} estimated > {ceiling}"
        return None

    async def step(self, claim: Claim, name: str, fn: Callable[[], Any]) -> Any:
        return await self.ledger.step(claim.lease, name, fn)

    # ------------------------------------------------------------------ approvals

    async def park(self, tr: Any, claim: Claim, call_ids: list[str]) -> None:
        await self.ledger.park(tr, claim.lease)
        tr.set(self.loop_keys.parked(claim.run_id), kv_dumps({"owner": claim.owner, "conversation": claim.conversation,
                                                              "call_ids": call_ids}))

    async def resolve_approval(self, run_id: str, owner: str, call_id: str, allow: bool, reason: str | None) -> None:
        """Guarded by the loop state: only a call in state ``approval`` takes a decision."""
        from .runtime import NotFound

        async def fn(tr: Any) -> None:
            raw = await tr.get(self.loop_keys.state(run_id))
            if raw is None:
                raise NotFound(f"run {run_id!r} not found")
            st = LoopState.from_bytes(raw)
            if st.owner != owner:
                raise NotFound(f"run {run_id!r} not found")
            c = st.calls.get(call_id)
            if c is None or c.get("state") != CALL_APPROVAL:
                if c is not None and "allow" in c and bool(c["allow"]) == bool(allow):
                    return  # the same decision again (a retried request): nothing to do
                raise ApprovalError(f"no approval pending for call {call_id!r} of run {run_id!r}")
            c.update({"state": CALL_APPROVED if allow else CALL_DENIED, "allow": bool(allow)})
            if reason:
                c["reason"] = reason
            st.ver += 1
            st.tok = None
            tr.set(self.loop_keys.state(run_id), st.to_bytes())
            tr.clear(self.loop_keys.parked(run_id))
            await self.journal.emit(tr, owner, st.conversation, E.APPROVAL_RESOLVED,
                                    {"run_id": run_id, "call_id": call_id, "allow": bool(allow), "reason": reason})
            await self.ledger.unpark(tr, run_id)

        await self.db.transact(fn)

    async def pending_approvals(self, run_id: str) -> list[str]:
        raw = await self.db.transact(lambda tr: tr.get(self.loop_keys.state(run_id)))
        if raw is None:
            return []
        return [cid for cid, c in LoopState.from_bytes(raw).calls.items() if c.get("state") == CALL_APPROVAL]

    # ------------------------------------------------------------------ reading runs

    def _info(self, run: Mapping[str, Any], approvals: list[str]) -> "RunInfo":
        from .runtime import RunInfo

        d = run.get("delivery") or {}
        return RunInfo(run["id"], run["conversation"], run["status"], run["attempt"],
                       d.get("agent") if isinstance(d, Mapping) else None, run.get("submission_id"),
                       run.get("created"), run.get("outcome"), tuple(approvals))

    async def get_run(self, run_id: str, owner: str) -> "RunInfo":
        from .runtime import NotFound

        try:
            run = await self.ledger.get(owner, run_id)
        except L.RunNotFound:
            raise NotFound(f"run {run_id!r} not found") from None
        approvals = await self.pending_approvals(run_id) if run["status"] == "parked" else []
        return self._info(run, approvals)

    async def list_runs(self, owner: str, conv: str | None) -> list["RunInfo"]:
        runs = await self.ledger.list_runs(owner, conv)
        return [self._info(r, []) for r in sorted(runs, key=lambda r: r.get("created") or 0)]


def kv_dumps(v: Any) -> bytes:
    from sessions.codec import dumps

    return dumps(v)
