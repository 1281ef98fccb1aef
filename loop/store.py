"""The loop's view of storage: sessions (transcripts, journal) and the ledger, behind one object.

The runner and the Runtime call only this module, so the exact shapes of
the ``sessions`` and ``ledger`` APIs are adapted in one place.  Methods that
take ``tr`` work inside the caller's transaction (the caller commits); the
others run their own transactions and say whether they are idempotent or
guarded.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

import trio

import kv
import ledger as L
from sessions import events as E
from sessions.codec import dumps, id_source, loads
from sessions.errors import NotFound as SessionNotFound
from sessions.journal import Journal
from sessions.owners import LOCAL_OWNER, as_tag
from sessions.transcript import Transcripts

from .keyspace import CALL_APPROVAL, LoopKeyspace, LoopState

if TYPE_CHECKING:
    from .calls import Clock
    from .runtime import Acknowledgement, RunInfo

log = logging.getLogger(__name__)

__all__ = ["Store", "Claim", "DEFAULT_LEASE_SECONDS", "ApprovalError"]

# Embedded default: short enough that a run left by a killed process is taken
# over quickly, long enough that renewals (every third of it) are cheap.
DEFAULT_LEASE_SECONDS = 10.0

# Call ids recorded per transaction (loop keyspace "ci"; ~100 bytes each): a compaction
# records up to this many in its own transaction, more in batches before it.
MAX_CALL_ID_BATCH = 5_000

assert DEFAULT_LEASE_SECONDS > 0 and 0 < MAX_CALL_ID_BATCH * 200 < kv.limits.TRANSACTION_SIZE_LIMIT // 2


def token_source() -> Callable[[], bytes]:
    """Write-guard tokens (LoopState.tok) need only be unique per run's writer: a random
    prefix drawn once per runtime plus a counter is as good as fresh random bytes per
    commit and cheaper (os.urandom is a syscall; the simulator patches it per run, so
    drawing the prefix from it keeps its runs byte-identical)."""
    prefix, seq = os.urandom(8), itertools.count()
    return lambda: prefix + next(seq).to_bytes(8, "big")


def may_be_parked(state: LoopState) -> bool:
    """Whether the run's parked record (``LoopKeyspace.parked``) may exist: :meth:`Store.park`
    writes it in the transaction that puts a call in state ``approval``, and it is cleared by
    the one that takes the decision (or settles), so without a call that ever awaited approval
    (state ``approval``, or a decision's ``allow``) there is none."""
    return any(c.get("state") == CALL_APPROVAL or "allow" in c for c in state.calls.values())


def _runtime() -> Any:
    """``loop.runtime`` (which imports this module, so it is resolved on first use, once:
    an import statement in a hot method costs the import machinery every call)."""
    global _RUNTIME_MODULE
    if _RUNTIME_MODULE is None:
        from . import runtime

        _RUNTIME_MODULE = runtime
    return _RUNTIME_MODULE


_RUNTIME_MODULE: Any = None


class ApprovalError(Exception):
    """No approval is pending for that call (already resolved differently, or never requested)."""


@dataclass
class Claim:
    """A run this worker holds a lease on."""

    run_id: str
    owner: str
    conversation: str
    attempt: int
    delivery: Any
    result_schema: Any
    lease: L.Lease
    limits: Mapping[str, Any]
    # What the worker's ``prepare`` wrote/read inside the claiming transaction
    # (see :meth:`Store.claim`); None: the runner reads the run's state itself.
    prepared: Any = None


def _take_claim(lease: L.Lease) -> Claim | None:
    """The Claim the claiming transaction's hook left in ``lease.prepared`` (None if none),
    taken out of it: the claim holds the lease, so leaving it there made every run's claim,
    lease and prepared state (its transcript included) a reference cycle, garbage only the
    cyclic collector frees (and, with runs in flight, promotes first)."""
    claim = lease.prepared
    if not isinstance(claim, Claim):
        return None
    lease.prepared = None
    return claim


class _PrepareFailed(Exception):
    """Internal: a claim's ``prepare`` hook failed; the claim is made again without it."""


def on_claimed_plain(store: "Store") -> Callable[[Any, L.Lease], Awaitable[Claim]]:
    """The claim hook without ``prepare``: only the request is read in the claiming transaction."""

    async def on_claimed(tr: Any, lease: L.Lease) -> Claim:
        delivery, schema = await store.ledger.request_tr(tr, lease)
        return store._claim_of(lease, delivery, schema)

    return on_claimed


def check_lease_seconds(lease_seconds: float | None) -> None:
    """ValueError unless ``lease_seconds`` is None (the default) or a finite number above 0: a
    lease of 0 or less (or NaN) would let every claim loop take every live run over at once."""
    if lease_seconds is not None and not (isinstance(lease_seconds, (int, float))
                                          and 0 < lease_seconds < float("inf")):
        raise ValueError(f"lease_seconds must be a positive number of seconds, not {lease_seconds!r}")


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
        check_lease_seconds(lease_seconds)
        self.lease_seconds = lease_seconds or DEFAULT_LEASE_SECONDS
        self.max_attempts = max_attempts or L.DEFAULT_MAX_ATTEMPTS
        jkw = {} if journal_retention is None else {"retention": journal_retention}
        self.journal = Journal(db, self.root, clock=clock.now, **jkw)
        self.transcripts = Transcripts(db, self.root, clock=clock.now)
        self.loop_keys = LoopKeyspace(self.root)
        self.ledger = L.Ledger(db, self.root, journal=self.journal, clock=clock.now)
        self.default_owner = as_tag(LOCAL_OWNER)
        # Write-guard tokens of every runner of this runtime (unique per process: see token_source).
        self.new_token: Callable[[], bytes] = token_source()
        # Ids this runtime makes up (submission ids of callers that give none).
        self.new_id: Callable[[], str] = id_source()

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.journal.run_trimmer)

    # ------------------------------------------------------------------ transcripts

    async def ensure_session(self, tr: Any, owner: str, conv: str) -> None:
        """Create the conversation's session if missing (idempotent)."""
        await self.transcripts.create_tr(tr, owner, conv)

    async def read_state_and_transcript(
        self, run_id: str, owner: str, conv: str
    ) -> tuple[bytes | None, list[dict[str, Any]], bool, int]:
        """The run's loop state, the conversation's transcript *from its mark* (the context of
        its latest compaction: see loop.compaction, Windows), whether a cancel is requested,
        and the sequence number the messages start at — in one read-only transaction when
        that fits a page. O(context), not O(history)."""
        from sessions.transcript import MAX_READ_PAGE

        async def fn(tr: Any) -> tuple[bytes | None, list[dict[str, Any]] | None, bool, int]:
            raw = await tr.get(self.loop_keys.state(run_id))
            cancel = await self.ledger.is_cancel_requested(tr, run_id)
            try:
                page = await self.transcripts.read_tail_tr(tr, owner, conv, MAX_READ_PAGE)
            except SessionNotFound:
                return raw, [], cancel, 0
            return raw, ([m.data for m in page.messages] if page.next_seq is None else None), cancel, page.start

        raw, msgs, cancel, base = await self.db.transact(fn)
        if msgs is None:  # longer than a page: read it page by page (nobody else appends: we hold the lease)
            msgs = await self.read_transcript(owner, conv, base)
        return raw, msgs, cancel, base

    async def call_ids_used(self, owner: str, conv: str, call_ids: list[str]) -> set[str]:
        """Which of ``call_ids`` the conversation used before its mark (``LoopKeyspace.call_id_used``).
        Read-only; outside the writer's commit, which is safe: only the run holding the
        conversation's active lease appends to it or moves its mark."""
        keys = self.loop_keys

        async def fn(tr: Any) -> set[str]:  # read-only
            found = await tr.get_multi([keys.call_id_used(owner, conv, c) for c in call_ids])
            return {c for c, v in zip(call_ids, found) if v is not None}

        return await self.db.transact(fn)

    def note_call_ids(self, tr: Any, owner: str, conv: str, call_ids: set[str]) -> None:
        """In the caller's (the compaction's) transaction: these ids now lie before the mark.
        Blind sets of empty values: idempotent. (Sorted: a set of strings iterates in an order
        that depends on PYTHONHASHSEED, and the simulator's trace hashes a commit's writes in
        order, so the same seed must write them in the same order.)"""
        for c in sorted(call_ids):
            tr.set(self.loop_keys.call_id_used(owner, conv, c), b"")

    async def note_call_ids_now(self, owner: str, conv: str, call_ids: set[str]) -> None:
        """The same in transactions of their own, MAX_CALL_ID_BATCH ids each: for a first
        compaction of a long unmarked history, whose ids would not fit the compaction's own
        transaction. Idempotent blind sets of a true fact (each id *is* in the transcript),
        so writing them before the mark moves, or from a worker that lost its lease, is
        harmless: an indexed id is only ever a reason to rename a new one."""
        ids = sorted(call_ids)
        for i in range(0, len(ids), MAX_CALL_ID_BATCH):
            batch = set(ids[i:i + MAX_CALL_ID_BATCH])

            async def fn(tr: Any, batch: set[str] = batch) -> None:  # idempotent: blind sets
                self.note_call_ids(tr, owner, conv, batch)

            await self.db.transact(fn)

    async def read_transcript(self, owner: str, conv: str, start: int = 0) -> list[dict[str, Any]]:
        try:
            return [m.data for m in await self.transcripts.read_all(owner, conv, start)]
        except SessionNotFound:
            return []

    # ------------------------------------------------------------------ runs

    async def submit(self, owner: str, conv: str, submission_id: str, delivery: Any, schema: Any, *,
                     policy: str = "queue", limits: Mapping[str, int] | None = None) -> "Acknowledgement":
        """Guarded by the ledger's submission record (a retry returns the same run)."""
        Acknowledgement = _runtime().Acknowledgement
        # max_attempts is the bound on attempts at the work. The claim after the last one is
        # handed to a worker as ``lease.exhausted`` (Store.claim passes finalize_exhausted):
        # the loop settles retry_exhausted itself, finalising dangling tool calls first, in
        # the claiming transaction (Runner.finish_exhausted_in_claim). The ledger's own
        # exhaustion, which cannot touch the transcript, stays as a backstop for a finaliser
        # that fails every time.
        ack = await self.ledger.submit(submission_id, delivery, schema, owner=owner, conversation=conv,
                                       policy=policy, limits=limits, max_attempts=self.max_attempts)  # type: ignore[arg-type]
        return Acknowledgement(ack.submission_id, ack.run_id, ack.cursor, ack.status, conv,
                               duplicate=not ack.created, outcome=ack.outcome)

    async def submit_and_claim(
        self, owner: str, conv: str, submission_id: str, delivery: Any, schema: Any, *, worker: str,
        prepare: Callable[[Any, Claim], Awaitable[Any]] | None = None, policy: str = "queue",
        limits: Mapping[str, int] | None = None,
    ) -> tuple["Acknowledgement", Claim | None]:
        """Submit, and claim the run for ``worker`` in the same transaction when it can start
        at once (the ledger's ``submit_and_claim``; guarded by the submission record and the
        lease's nonce), with ``prepare(tr, claim)`` making the run's first writes there too:
        one commit for what ``submit`` + ``claim`` do in two.  The claim is None when the run
        queued behind another or the submission id was already used (workers run it).
        A ``prepare`` that raises anything but a storage error aborts the transaction and the
        whole submission is made again without it (as in :meth:`claim`)."""
        Acknowledgement = _runtime().Acknowledgement
        # The request as the ledger stores it (what a claim elsewhere would read back), so a
        # run begun here sees exactly what a worker's claim would have; encoded once, for the
        # ledger too.
        encoded = L.encode_request(delivery, schema)
        request = loads(encoded[0])
        delivery_s, schema_s = request["delivery"], request["result_schema"]

        def on_claimed_with(with_prepare: bool) -> Callable[[Any, L.Lease], Awaitable[Claim]]:
            async def on_claimed(tr: Any, lease: L.Lease) -> Claim:
                claim = self._claim_of(lease, delivery_s, schema_s)
                if with_prepare and prepare is not None:
                    try:
                        claim.prepared = await prepare(tr, claim)
                    except (kv.KVError, L.LeaseLost):
                        raise
                    except Exception as e:  # noqa: BLE001 — see the docstring: made again without it
                        raise _PrepareFailed() from e
                return claim

            return on_claimed

        async def go(with_prepare: bool) -> tuple[L.Acknowledgement, L.Lease | None]:
            return await self.ledger.submit_and_claim(
                submission_id, delivery, schema, owner=owner, conversation=conv, worker_id=worker,
                lease_seconds=self.lease_seconds, policy=policy, limits=limits,  # type: ignore[arg-type]
                max_attempts=self.max_attempts,  # see submit
                on_claimed=on_claimed_with(with_prepare), encoded=encoded)

        try:
            ack, lease = await go(True)
        except _PrepareFailed as e:
            log.debug("submit_and_claim: prepare failed (%r); submitting without it", e.__cause__)
            ack, lease = await go(False)
        out = Acknowledgement(ack.submission_id, ack.run_id, ack.cursor, ack.status, conv,
                              duplicate=not ack.created, outcome=ack.outcome)
        if lease is None:
            return out, None
        claim = _take_claim(lease)
        if claim is not None:
            return out, claim
        # A retry that found its own committed claim: the hook's result is not at hand.
        return out, self._claim_of(lease, delivery_s, schema_s)

    async def claim(
        self, worker: str, prepare: Callable[[Any, Claim], Awaitable[Any]] | None = None
    ) -> Claim | None:
        """Claim the next runnable run (the ledger's claim: guarded by its nonce).

        The submission's request is read inside the claiming transaction (no
        second read-only transaction), and ``prepare(tr, claim)``, when given,
        runs there too, so the run's first writes (user message, loop state)
        commit with the claim itself; for the exhausted-run finaliser
        (``claim.lease.exhausted``) it makes the finalising writes and the
        settle there instead (see ``Runner.finish_exhausted_in_claim``).  Its
        result becomes ``claim.prepared``.  A ``prepare``
        that raises anything but a storage error aborts that whole transaction
        (nothing of it commits) and the claim is made again without it: the
        runner's ordinary path then meets (and reports) the same problem.
        """

        async def on_claimed(tr: Any, lease: L.Lease) -> Claim:
            delivery, schema = await self.ledger.request_tr(tr, lease)
            claim = self._claim_of(lease, delivery, schema)
            if prepare is not None:
                try:
                    claim.prepared = await prepare(tr, claim)
                except (kv.KVError, L.LeaseLost):
                    raise
                except Exception as e:  # noqa: BLE001 — see the docstring: retried without prepare
                    raise _PrepareFailed() from e
            return claim

        try:
            lease = await self.ledger.claim(worker, self.lease_seconds, finalize_exhausted=True, on_claimed=on_claimed)
        except _PrepareFailed as e:
            log.debug("claim: prepare failed (%r); claiming without it", e.__cause__)
            lease = await self.ledger.claim(worker, self.lease_seconds, finalize_exhausted=True, on_claimed=on_claimed_plain(self))
        if lease is None:
            return None
        claim = _take_claim(lease)
        if claim is not None:
            return claim
        # A retry that found its own committed claim: the hook's result is not at hand.
        delivery, schema = await self.ledger.get_request(lease.run_id)
        return self._claim_of(lease, delivery, schema)

    @staticmethod
    def _claim_of(lease: L.Lease, delivery: Any, schema: Any) -> Claim:
        # (a dict first: what every delivery is; isinstance against typing's Mapping alias walks the ABC machinery)
        limits = delivery.get("limits") if type(delivery) is dict or isinstance(delivery, Mapping) else None
        return Claim(lease.run_id, lease.owner, lease.conversation, lease.attempt, delivery, schema, lease,
                     dict(limits or {}))

    async def settle_now(self, claim: Claim, outcome: Mapping[str, Any]) -> dict[str, Any]:
        """Settle in a transaction of its own (idempotent with the same lease: settling again
        answers the outcome as stored). Returns the outcome as stored."""
        return await self.ledger.settle(claim.lease, outcome)

    # The adapters a runner's every commit awaits return the ledger's coroutine itself rather
    # than wrapping it in one of their own (``await store.check_lease(...)`` alike; one
    # coroutine and frame less per call, several per turn).

    def check_lease(self, tr: Any, claim: Claim) -> Awaitable[Any]:
        """Raises LeaseLost; returns the lease record read (pass it to :meth:`settle`)."""
        return self.ledger.check_lease(tr, claim.lease)

    async def renew(self, claim: Claim) -> None:
        await self.ledger.renew(claim.lease, self.lease_seconds)

    async def renew_many(self, claims: list[Claim]) -> set[str]:
        """Renew every claim's lease in one transaction (guarded by each lease's token);
        the run ids whose lease was lost."""
        return await self.ledger.renew_many([c.lease for c in claims], self.lease_seconds)

    async def release(self, claim: Claim) -> None:
        """Give the run back (not an attempt): the next claim resumes it at once."""
        await self.ledger.release(claim.lease)

    async def settle(self, tr: Any, claim: Claim, outcome: Mapping[str, Any], *,
                     lease_rec: Any = None, state: LoopState | None = None,
                     events_before: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
        """Settle in the caller's transaction; the ledger journals run.completed / failed / cancelled
        (after ``events_before``, in the same emit: see ``Ledger.settle_tr``).
        Returns the outcome as stored. ``lease_rec``: :meth:`check_lease`'s result in this
        transaction, if it was called (the lease is then not read again). ``state``: the run's
        loop state, if known: the parked record is cleared only if it may exist (see
        :func:`may_be_parked`), not blindly in every settle."""
        out = await self.ledger.settle_tr(tr, claim.lease, outcome, lease_rec=lease_rec, events_before=events_before)
        if state is None or may_be_parked(state):
            tr.clear(self.loop_keys.parked(claim.run_id))
        return out

    async def wait_for_work(self, max_wait: float) -> None:
        await self.ledger.wait_for_work(max_wait)

    # ------------------------------------------------------------------ cancel

    async def cancel(self, run_id: str, owner: str) -> "RunInfo":
        try:
            await self.ledger.cancel(run_id, owner=owner)
        except L.NotFound:
            from .runtime import NotFound
            raise NotFound(f"run {run_id!r} not found") from None
        return await self.get_run(run_id, owner)

    def cancel_requested(self, tr: Any, run_id: str) -> Awaitable[bool]:
        return self.ledger.is_cancel_requested(tr, run_id)  # (not wrapped: see check_lease)

    async def cancel_requested_now(self, run_id: str) -> bool:
        return await self.ledger.cancel_requested(run_id)  # read-only

    async def cancels_requested_now(self, run_ids: list[str]) -> set[str]:
        return await self.ledger.cancels_requested(run_ids)  # read-only

    async def wait_cancel_requested(self, run_id: str) -> None:
        await self.ledger.wait_cancel_requested(run_id)

    # ------------------------------------------------------------------ usage / steps

    def record_usage(self, tr: Any, claim: Claim, step_id: str, usage: Mapping[str, Any]) -> Awaitable[bool]:
        """In a runner's commit: count a new step's usage. Every caller is a runner commit
        that ran check_lease in this transaction (the lease exists only with its run, so the
        run record is not read) and names a step its loop-state-guarded commit has not
        recorded yet, so the step's marker is not read either (``UsageBook.record_tr``'s
        ``new``: see there why it cannot exist). (Not wrapped: see check_lease.)"""
        figures: dict[str, int] = {}
        for k, v in usage.items():  # (a loop, not a comprehension's frame: two commits a turn)
            if type(v) is int:
                if v >= 0:
                    figures[k] = v
            elif isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                figures[k] = int(v)
        return self.ledger.usage.record_tr(tr, claim.run_id, step_id, figures, run_exists=True, new=True)

    async def reserve(self, claim: Claim, estimate: dict[str, int]) -> dict[str, int]:
        """The run's room per limited usage field once ``estimate`` (a model call's
        input, output and cost estimates) is spent; raises ``ledger.UsageLimitExceeded``
        when a ceiling would be passed. Read-only (one run makes one call at a time)."""
        return await self.ledger.usage.reserve(claim.run_id, estimate)

    async def step(self, claim: Claim, name: str, fn: Callable[[], Any]) -> Any:
        return await self.ledger.steps.step(claim.lease, name, fn)

    def idempotency_key(self, run_id: str, name: str) -> str:
        return self.ledger.idempotency_key(run_id, name)

    # ------------------------------------------------------------------ approvals

    async def park(self, tr: Any, claim: Claim, call_ids: list[str]) -> None:
        """In the caller's transaction: release the lease, parked (not an attempt)."""
        await self.ledger.release_tr(tr, claim.lease, park=True)
        tr.set(self.loop_keys.parked(claim.run_id),
               dumps({"owner": claim.owner, "conversation": claim.conversation, "call_ids": call_ids}))

    async def resolve_approval(self, run_id: str, owner: str, call_id: str, allow: bool, reason: str | None) -> None:
        """Guarded by the loop state: only a call in state ``approval`` takes a decision;
        the same decision again is a no-op (a retried request), a different one an error."""
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
                    return
                raise ApprovalError(f"no approval pending for call {call_id!r} of run {run_id!r}")
            from .keyspace import CALL_APPROVED, CALL_DENIED

            c.update({"state": CALL_APPROVED if allow else CALL_DENIED, "allow": bool(allow)})
            if reason:
                c["reason"] = reason
            st.ver += 1
            st.tok = None
            tr.set(self.loop_keys.state(run_id), st.to_bytes())
            tr.clear(self.loop_keys.parked(run_id))
            await self.journal.emit(tr, owner, st.conversation, E.APPROVAL_RESOLVED,
                                    {"run_id": run_id, "call_id": call_id, "allow": bool(allow), "reason": reason})
            await self.ledger.resume_tr(tr, run_id)

        await self.db.transact(fn)

    async def loop_state(self, run_id: str) -> LoopState | None:
        raw = await self.db.transact(lambda tr: tr.get(self.loop_keys.state(run_id)))  # read-only
        return LoopState.from_bytes(raw) if raw is not None else None

    # ------------------------------------------------------------------ reading runs

    @staticmethod
    def _info(r: L.RunInfo, raw_state: bytes | None) -> "RunInfo":
        """A run as the loop reports it: the ledger's record and the run's loop state (as read
        in the same transaction: the agent, and the calls awaiting approval when parked)."""
        RunInfo = _runtime().RunInfo
        st = LoopState.from_bytes(raw_state) if raw_state is not None else None
        approvals = ([cid for cid, c in st.calls.items() if c.get("state") == CALL_APPROVAL]
                     if st is not None and r.state == L.PARKED else [])
        return RunInfo(r.id, r.conversation, r.state, r.attempt, st.agent if st else None, r.submission_id,
                       r.created, r.outcome, tuple(approvals), r.cancel_requested)

    async def get_run(self, run_id: str, owner: str) -> "RunInfo":
        """Read-only: the ledger's record and the loop state in one transaction."""
        from .runtime import NotFound

        async def fn(tr: Any) -> tuple[L.RunInfo, bytes | None]:  # read-only
            r = await self.ledger.get_run_tr(tr, run_id, owner=owner)
            return r, await tr.get(self.loop_keys.state(run_id))

        try:
            r, raw = await self.db.transact(fn)
        except L.NotFound:
            raise NotFound(f"run {run_id!r} not found") from None
        return self._info(r, raw)

    async def usage_totals(self, run_id: str, owner: str) -> dict[str, int]:
        """Read-only: the run's usage totals per field (tokens, ``total_tokens``, and
        ``cost_micros`` when the model was priced), owner-checked in the same transaction."""
        from .runtime import NotFound

        async def fn(tr: Any) -> dict[str, int]:  # read-only
            await self.ledger.get_run_tr(tr, run_id, owner=owner)
            return await self.ledger.usage.totals_tr(tr, run_id)

        try:
            return await self.db.transact(fn)
        except L.NotFound:
            raise NotFound(f"run {run_id!r} not found") from None

    async def wait_settled(self, run_id: str, owner: str) -> dict[str, Any]:
        from .runtime import NotFound

        try:
            return await self.ledger.wait_settled(run_id, owner=owner)
        except L.NotFound:
            raise NotFound(f"run {run_id!r} not found") from None

    async def list_runs(self, owner: str, conv: str | None) -> list["RunInfo"]:
        """Read-only: one transaction per conversation, its runs and their loop states together
        (was one for the runs plus one or two per run)."""
        convs = [conv] if conv is not None else await self.transcripts.list(owner)
        out = []
        for c in convs:
            async def fn(tr: Any, c: str = c) -> list[tuple[L.RunInfo, bytes | None]]:  # read-only
                runs = await self.ledger.list_runs_tr(tr, owner, c)
                return [(r, await tr.get(self.loop_keys.state(r.id))) for r in runs]

            out.extend(self._info(r, raw) for r, raw in await self.db.transact(fn))
        return out
