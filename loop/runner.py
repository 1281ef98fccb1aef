"""The durable loop: one claimed run, driven from wherever storage says it stands.

A worker that claims a run builds a :class:`Runner`, which reads the run's
loop state (:mod:`loop.keyspace`) and the conversation's transcript, and
then repeats, until the run settles or parks:

* a tool call without a result -> run it (or finalise it as ``interrupted``
  when an earlier attempt started it, or park for approval);
* an assistant message without tool calls -> the final answer: validate,
  settle ``completed``;
* otherwise -> a model call, streamed into the journal, retried on
  transient errors (each retry a ``run.retry-pending`` event persisted
  *before* the wait), compacted once on overflow.

Every write is one transaction that checks the run's lease (ledger fencing:
a worker whose lease was taken over fails its next write and stops), learns
from that same lease record whether a cancel was requested (the ledger
carries the request in the lease: a cancel is seen at every boundary), and
is guarded by the loop state's version + token (a retry after
``commit_unknown_result`` recognises its own commit).  Messages are appended to the transcript as they
end, each in the transaction that journals it.  A storage failure aborts the
turn (the lease lapses; the run is re-claimed and resumes from storage).

A tool's effect and its result cannot commit atomically, so the runner
records ``started`` for a call (with ``tool.started``) *before* running it;
an attempt that finds ``started`` without a result finalises the call as
``interrupted`` and lets the model decide — it never runs the tool again
(promise 3).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

import trio

import kv
import ledger as L
from sessions import events as E
from sessions.codec import Encoded, cbor_uint, dumps
from sessions.transcript import MAX_READ_PAGE

from . import messages as M
from .agents import Agent, Hooks, ModelCallInfo, ToolCallInfo, ToolContext
from .calls import RetryNotice, call_model, trio_now
from .compaction import (
    COMPACTION_SYSTEM,
    choose_cut,
    compaction_entry,
    estimate_context_tokens,
    model_context,
    summary_request,
)
from .errors import (
    ContextOverflowError,
    ProviderError,
    ResultSchemaError,
)
from .keyspace import CALL_APPROVAL, CALL_APPROVED, CALL_DENIED, CALL_DONE, CALL_STARTED, LoopState
from .pricing import FREE, TOKENS_PER_PRICE_UNIT, cost_micros, estimate_cost_micros, model_label
from .providers.base import STOP_MAX_TOKENS, ToolSpec, capped_call_options, output_cap
from .schema import validate
from .store import MAX_CALL_ID_BATCH
from .stream import FLUSH_INTERVAL, MAX_PENDING_CHARS, PartCoalescer

if TYPE_CHECKING:
    from .runtime import Runtime
    from .store import Claim

log = logging.getLogger(__name__)

__all__ = ["Runner", "RunStopped", "parse_result", "MAX_EVENT_TEXT"]

# A cancel made by another process reaches a run busy in a long tool or wait within this.
CANCEL_POLL_SECONDS = 1.0
# Text carried inside a journal event (tool results, messages); the full value
# is in the transcript, the event says where (``seq``).
MAX_EVENT_TEXT = 8_000
# The fewest output tokens a model call is made with under a ceiling that bounds its output
# (max_output_tokens, max_total_tokens, max_cost_micros with an output price): with less room
# the call is refused before it is made (``usage_limit``). One, not more: the runtime cannot
# know how long the answer will be (a final "Done." is a couple of tokens), and the call's
# input is inside the ceiling by construction, so a larger threshold would only end runs the
# user's ceiling still allows. A provider may need more (Anthropic with thinking: see
# ``capped_call_options``).
MIN_CALL_OUTPUT_TOKENS = 1

assert MAX_EVENT_TEXT < 80_000
assert MIN_CALL_OUTPUT_TOKENS >= 1



class _CallPlan:
    """How one model call is sent, as the pre-flight reserve decided: ``max_tokens`` (None:
    the provider's own default), the provider's extra ``stream`` keywords for a clamped call,
    and ``clamped_by`` — the usage field whose ceiling lowered ``max_tokens`` below the call's
    own cap (None: not lowered), so an answer cut at that length is known to be the ceiling's."""

    __slots__ = ("max_tokens", "options", "clamped_by")

    def __init__(self, max_tokens: int | None, options: Mapping[str, Any] | None = None,
                 clamped_by: str | None = None) -> None:
        self.max_tokens, self.options, self.clamped_by = max_tokens, options, clamped_by


class RunStopped(Exception):
    """Internal: this worker stops driving the run (parked, settled elsewhere, state moved)."""


class _CancelSeen(Exception):
    """Internal: the cancel record was seen inside a transaction that must not proceed."""


class _StateMoved(Exception):
    """The loop state changed under us although our lease check passed (should not happen)."""


def _clip(text: str, limit: int = MAX_EVENT_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def parse_result(text: str, schema: Any) -> Any:
    """The final answer as a value of ``schema``: JSON (optionally in a ``` fence), validated.

    A schema of type string accepts the raw text as is.
    """
    if isinstance(schema, dict) and schema.get("type") == "string":
        errors = validate(text, schema)
        if errors:
            raise ResultSchemaError("; ".join(errors))
        return text
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        value = json.loads(body)
    except ValueError as e:
        raise ResultSchemaError(f"final answer is not JSON: {e}") from None
    errors = validate(value, schema)
    if errors:
        raise ResultSchemaError("; ".join(errors))
    return value


class LeaseKeeper:
    """The runtime's one service task that keeps the runs it drives leased.

    Every ``poll`` seconds (the lease's third, at most CANCEL_POLL_SECONDS) it
    reads the cancel records of all of them in one read-only transaction (a
    cancel made by another process reaches a run busy in a long tool or wait;
    one made here notifies the runner directly), and renews the leases due —
    a third of the lease after the last renewal — in one transaction
    (``Ledger.renew_many``, guarded by each lease's token).  A runner whose
    lease was taken over is stopped (its next write would fail ``LeaseLost``
    anyway).  Idle while the runtime drives nothing.

    One task for all runs instead of a task per run: a run of a few
    milliseconds no longer pays for starting, scheduling and cancelling its own
    sleeping keeper (about a tenth of a short turn's CPU), and N runs cost one
    poll transaction per interval, not N.
    """

    def __init__(self, rt: "Runtime") -> None:
        self.rt = rt
        self.renew_every = max(0.05, rt.store.lease_seconds / 3)
        self.poll = min(self.renew_every, CANCEL_POLL_SECONDS)
        self._wake = trio.Event()

    def added(self) -> None:
        """A runner registered in ``rt._active``: wake the keeper if it idles."""
        self._wake.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self.rt._active:
                self._wake = trio.Event()
                await self._wake.wait()
            await trio.sleep(self.poll)
            await self.tick()

    async def tick(self) -> None:
        store = self.rt.store
        runners = list(self.rt._active.values())
        try:
            polled = [r.run_id for r in runners if not r._cancel_noted]
            for i in range(0, len(polled), L.MAX_RENEW_BATCH):
                cancelled = await store.cancels_requested_now(polled[i:i + L.MAX_RENEW_BATCH])
                for r in runners:
                    if r.run_id in cancelled:
                        r._note_cancel()
        except kv.KVError as e:  # the next poll tries again; the runner's commits read it anyway
            log.warning("cancel poll failed: %s", e)
        now = trio_now()
        due = [r for r in runners if now - r.last_renew >= self.renew_every - self.poll / 2]
        for i in range(0, len(due), L.MAX_RENEW_BATCH):
            batch = due[i:i + L.MAX_RENEW_BATCH]
            try:
                lost = await store.renew_many([r.claim for r in batch])
            except kv.KVError as e:  # try again; if it keeps failing the next write fails LeaseLost
                log.warning("lease renewal of %d runs failed: %s", len(batch), e)
                continue
            for r in batch:
                if r.run_id not in lost:
                    r.last_renew = now
                elif self.rt._active.get(r.run_id) is r:  # (one that ended meanwhile released it)
                    r._lost_lease()


class Runner:
    """Drives one claimed run until it settles, parks, or this worker loses it."""

    def __init__(self, rt: "Runtime", claim: "Claim", agent: Agent) -> None:
        self.rt = rt
        self.store = rt.store
        self.claim = claim
        self.agent = agent
        self.run_id = claim.run_id
        self.owner = claim.owner
        self.conv = claim.conversation
        self.provider = rt.provider_for(agent)
        # The model's price (loop.pricing; None: unpriced, so a cost ceiling fails the run
        # ``missing_price``), and the one costs are computed with: None for a free model, so
        # a turn without a price pays nothing for pricing.
        self.price = rt.price_for(agent)
        # (``is not``: the offline models' price is FREE itself; a price equal to it that is
        # another object only costs a computed 0, which _priced drops, not a dataclass __eq__ a run)
        self._bill = self.price if self.price is not None and self.price is not FREE else None
        self.state: LoopState | None = None
        # The transcript from ``base`` on (its mark: the context of the latest compaction,
        # which is all the loop needs; see loop.compaction, Windows): ``messages[i]`` is
        # message ``base + i``, and ``head`` (the next sequence number) is absolute.
        self.messages: list[dict[str, Any]] = []
        self.base = 0
        self.head = 0
        self.cancel_event = trio.Event()
        # Whether ``cancel_event`` is set (see _note_cancel), read where the loop checks it at
        # every boundary: an attribute, not an ``is_set()`` call, several a turn.
        self._cancel_noted = False
        # One commit at a time: made when a slow call's flusher starts (the only other task
        # that commits for this runner); until then this task's commits cannot overlap.
        self._lock: trio.Lock | None = None
        self._started_here: set[str] = set()  # calls this attempt marked started (not interrupted)
        # The tool-call ids of ``messages`` (see _call_ids_in_memory): of the list object
        # ``_ids_of``, its first ``_ids_upto`` messages.
        self._ids: set[str] = set()
        self._ids_of: list[dict[str, Any]] | None = None
        self._ids_upto = 0
        # While a model call runs (``_in_call``: its commits, a flush or a retry notice, are
        # shielded), the cancel scope of the part of it that may wait, if any (see
        # loop.calls.call_model's ``cancel_scope``; ``_new_call_scope``), and whether a failed
        # flush stopped the call (every scope made for it after that starts cancelled).
        self._in_call = False
        self._call_scope: trio.CancelScope | None = None
        self._call_stopped = False
        self._lease_lost = False
        self._scope: trio.CancelScope | None = None  # while executing: the drive's (see _lost_lease)
        self._host: trio.Nursery | None = None  # while executing: hosts a slow call's flusher
        self.last_renew = trio_now()  # the lease was written (claimed) just now: see LeaseKeeper
        self._txn_cancel = False  # the cancel record as read by the current commit attempt
        self._new_token = rt.store.new_token
        self._state_key = rt.store.loop_keys.state(self.run_id)  # read and written by every commit
        self._txn_settled: dict[str, Any] | None = None  # the outcome the current commit attempt settles
        self._txn_lease: Any = None  # the lease record the current commit attempt's check read
        # The events of the current commit attempt a settle in it is to journal (``settles``)
        self._txn_events: Sequence[tuple[str, Any]] | None = None
        # The CBOR of the messages the current commit attempt appends (by id: see
        # _message_events), as the transcript encoded them; None outside such an attempt.
        self._txn_encoded: dict[int, bytes] | None = None
        self._added_prefix = _added_prefix(self.run_id)
        # The session head record as this runner's last committed append wrote it (None: not
        # known; the next append reads it). A commit's first attempt appends from it instead
        # of reading the head (see _commit); ``_txn_head`` is what the current attempt writes.
        self._head_rec: dict[str, Any] | None = None
        self._txn_head: dict[str, Any] | None = None
        # The outcome this runner settled the run with, once committed (``Runtime.run`` answers
        # from it instead of reading and watching the outcome); None: not settled by this runner.
        self.settled: dict[str, Any] | None = None
        # A run exists only once its submission committed, and that journaled run.queued to its
        # conversation: the conversation's journal record exists, emits needn't look for it.
        rt.store.journal.note_committed(self.owner, self.conv)

    # ------------------------------------------------------------------ entry

    async def execute(self) -> None:
        """Drive the run; returns when it settled, parked, or was lost (all logged).

        Nothing escapes but bugs and a shutdown's cancellation: the drive's
        expected endings are handled here.  The lease is renewed, and the
        cancel record polled, by the runtime's :class:`LeaseKeeper` (one task
        for all the runs a process drives, not a task per run).  A slow model
        call's part flusher (see :meth:`_model_step`) runs in the runtime's
        nursery and is joined by the step that started it, so a run needs only
        a cancel scope of its own (for :meth:`_lost_lease`), not a nursery: a
        nursery's open and close cost about four cancel scopes, per run.  A
        runtime constructed without :meth:`Runtime.open` has no nursery: the
        run then opens one to host it.
        """
        host = self.rt._nursery
        if host is None:
            async with trio.open_nursery() as nursery:
                await self._execute(nursery)
        else:
            await self._execute(host)

    async def _execute(self, host: trio.Nursery) -> None:
        with trio.CancelScope() as scope:
            self._scope, self._host = scope, host
            self.rt._active[self.run_id] = self
            self.rt._keeper.added()
            try:
                await self._drive()
            except trio.Cancelled:
                # The runtime is shutting down (Ctrl-C, close): give the run back so the
                # next process resumes it at once instead of waiting for the lease to lapse.
                # (Cancelled because the keeper found the lease lost: nothing to give back.)
                if self.rt.release_on_shutdown and not self._lease_lost:
                    await self._abort()
                raise
            except RunStopped as e:
                log.debug("run %s: stopped driving (%s)", self.run_id, e)
            except self.store.LeaseLost as e:
                log.warning("run %s: lease lost (%s); another worker owns it now", self.run_id, e)
            except kv.KVError as e:
                # A storage failure aborts the turn. The lease is left to lapse (not
                # released): the takeover counts as an attempt, so a failure that
                # repeats ends in retry_exhausted instead of looping forever.
                log.error("run %s: storage failure %s; turn aborted", self.run_id, e)
            except Exception:  # noqa: BLE001 — a bug (ours, a hook's) must not take the runtime down
                log.exception("run %s: unexpected failure; turn aborted (the next attempt resumes it)", self.run_id)
            finally:
                if self.rt._active.get(self.run_id) is self:
                    del self.rt._active[self.run_id]
                self._scope = self._host = None
        if self._lease_lost:
            log.warning("run %s: lease lost during renewal; stopped", self.run_id)

    async def _abort(self) -> None:
        """Give the run back at shutdown (a clean release is not an attempt)."""
        with trio.CancelScope(shield=True):
            try:
                await self.store.release(self.claim)
            except Exception:  # noqa: BLE001 — best effort, the lease expires anyway
                pass

    def _lost_lease(self) -> None:
        """The keeper found the lease taken over: stop driving (the next write would fail anyway)."""
        self._lease_lost = True
        if self._scope is not None:
            self._scope.cancel()

    def _note_cancel(self) -> None:
        if not self._cancel_noted:
            self._cancel_noted = True
            self.cancel_event.set()
            if self._call_scope is not None:
                self._call_scope.cancel()

    def _new_call_scope(self) -> trio.CancelScope:
        """A cancel scope for a part of the model call that may wait (``call_model``'s
        ``cancel_scope``): cancelled already when a cancel was noted or a flush failed
        since the call began, as one scope around the whole call would be by then."""
        scope = self._call_scope = trio.CancelScope()
        if self._call_stopped or self._cancel_noted:
            scope.cancel()
        return scope

    def _stop_call(self) -> None:
        """A failed flush stops the model call (the step then raises its error)."""
        self._call_stopped = True
        if self._call_scope is not None:
            self._call_scope.cancel()

    # ------------------------------------------------------------------ commits

    async def _commit(
        self,
        mutate: Callable[[LoopState], None] | None = None,
        *,
        append: Sequence[dict[str, Any]] = (),
        events: Callable[[int], Sequence[tuple[str, Any]]] | Sequence[tuple[str, Any]] = (),
        extra: Callable[[Any, LoopState], Awaitable[None]] | None = None,
        abort_on_cancel: bool = False,
        mark: int | None = None,
        settles: bool = False,
    ) -> bool:
        """One guarded, lease-checked transaction: append, update the loop state, journal.

        The run's cancel request is read in every attempt, from the lease record
        the lease check reads (``"cancel"``: a cancel of a running run rewrites
        its lease, so one committed meanwhile makes the attempt conflict and
        retry, as reading the cancel record did); while ``mutate``,
        ``events`` and ``extra`` run, ``self._txn_cancel`` says whether it is
        set, so a commit that would settle settles cancelled instead, and one
        that would start a tool doesn't.  With ``abort_on_cancel`` the commit is
        abandoned instead (returns False; the loop then finalises as cancelled).

        ``events`` may be a function of the first appended message's sequence
        number; ``mark`` moves the transcript's mark with the append (a
        compaction).  ``settles``: ``extra`` settles the run (:meth:`_settle_tr`) and
        emits no other event, so ``events`` are journaled by the settle, ahead of its
        run.completed / failed / cancelled, in one emit (the same keys, values and order).
        Guard: the state's ``ver`` must be what this runner last
        wrote; a matching ``tok`` at ``ver + 1`` means an earlier attempt of
        this very transaction committed (1021), and nothing is applied twice.

        The first attempt takes the state from memory instead of reading it:
        while this runner holds the lease nobody else writes it (a takeover
        rewrites the lease, which the lease check reads, so it conflicts;
        approvals are written only while the run is parked, leaseless), and
        every commit of this runner that may have landed either updated
        ``self.state`` or ended the runner.  A retry (a conflict, or a 1021
        whose commit may have landed) reads it to apply the guard.  The session
        head is taken from memory the same way (``_head_rec``, the head this
        runner's last append committed; the lease is its guard too: see the
        append below), and so is the run record a settle rewrites
        (``Ledger.settle_tr`` given this attempt's lease record), and a model
        step's usage is recorded without reading its marker
        (``UsageBook.record_tr``'s ``new``: the step is named by the state this
        commit moves past it).  The lease check itself (which carries the cancel
        request) is always read.
        """
        assert self.state is not None
        # One commit at a time (a slow call's flusher vs. this task; see __init__). Uncontended,
        # the lock is taken without acquire()'s two schedule points: the commit itself is a
        # checkpoint.
        lock = self._lock
        if lock is not None:
            try:
                lock.acquire_nowait()
            except trio.WouldBlock:
                await lock.acquire()
        try:
            token = self._new_token()
            expected_ver = self.state.ver
            first_seq = self.head
            store = self.store
            attempts = 0

            async def fn(tr: Any) -> LoopState:
                nonlocal attempts
                attempts += 1
                self._txn_settled = None
                self._txn_events = None
                self._txn_encoded = None
                self._txn_lease = await store.check_lease(tr, self.claim)
                if attempts == 1:
                    assert self.state is not None
                    st = self.state.copy()
                else:
                    raw = await tr.get(self._state_key)
                    st = LoopState.from_bytes(raw) if raw is not None else None  # type: ignore[assignment]
                    if st is None or st.ver != expected_ver:
                        if st is not None and st.ver == expected_ver + 1 and st.tok == token:
                            return st  # our own commit, seen again after commit_unknown_result
                        raise _StateMoved(f"loop state of {self.run_id} moved")
                # The cancel request as the lease carries it (ledger.runs: a cancel of a running
                # run rewrites its lease, a claim sets it from the cancel record): the lease check
                # above is its read. (A check that returns no record, as the simulator's bite of a
                # skipped lease check does, leaves the cancel record to read.)
                rec = self._txn_lease
                self._txn_cancel = (rec.get("cancel", False) if rec is not None
                                    else await store.cancel_requested(tr, self.run_id))
                if self._txn_cancel:
                    self._note_cancel()
                    if abort_on_cancel:
                        raise _CancelSeen()
                if append:
                    encoded: list[bytes] = []
                    written: list[dict[str, Any]] = []
                    # The first attempt appends from the head this runner last committed,
                    # without reading it: the lease check above (a real read, with its
                    # conflict) is the guard. Only the conversation's active run appends to
                    # its transcript, and only while holding its lease; a takeover rewrites
                    # the lease, so a worker whose lease was taken over fails that check
                    # (promises 2, 5). A retry reads it (as it reads the state).
                    known = self._head_rec if attempts == 1 else None
                    if known is not None and known["n"] != first_seq:
                        known = None
                    await store.transcripts.append_tr(tr, self.owner, self.conv, list(append), expected_head=first_seq,
                                                      mark=mark, encoded_out=encoded, known_head=known,
                                                      head_out=written)
                    self._txn_head = written[0]
                    # (while ``append`` holds the messages their ids are theirs)
                    self._txn_encoded = dict(zip(map(id, append), encoded))
                if mutate is not None:
                    mutate(st)
                st.ver += 1
                st.tok = token
                tr.set(self._state_key, st.to_bytes())
                evs = events(first_seq) if callable(events) else events
                self._txn_encoded = None
                if settles:
                    self._txn_events = evs  # journaled by the settle in ``extra`` (_settle_tr)
                elif evs:
                    await store.journal.emit_many_tr(tr, self.owner, self.conv, evs, refs=False)
                if extra is not None:
                    await extra(tr, st)
                assert self._txn_events is None, "a commit that settles must settle (its events unjournaled)"
                return st

            try:
                if not self._in_call and lock is None:
                    # ``db.transact(fn)`` (the kv API's manual retry loop, as both backends
                    # write it) with only the retry step shielded, instead of a shielded cancel
                    # scope around every commit. A commit cancelled half-way would leave us
                    # unsure whether it landed. It cannot be: a kv commit, once called, is never
                    # cancelled (the embedded engine parks its waiters uninterruptibly and
                    # shields the batch it writes; the FoundationDB backend shields its commit
                    # future), and ``fn`` only reads before it, so a cancel delivered in ``fn``
                    # leaves nothing committed. The one other await that may follow a commit
                    # that landed is ``on_error``'s backoff after ``commit_unknown_result``
                    # (1021): that is shielded, so the guarded retry always runs and
                    # ``self.state`` matches storage. (A shielded scope costs a cancel-status
                    # rebuild on entry and exit: ~3% of a turn's CPU when every commit had
                    # one.) A cancel arriving meanwhile is delivered at the runner's next
                    # checkpoint, as before. Written out here, not in a method of its own: one
                    # coroutine frame less to make, and to pass through on every resumption of
                    # the commit's wait.
                    tr = store.db.create_transaction()
                    while True:
                        try:
                            st = await fn(tr)
                            await tr.commit()
                            break
                        except kv.KVError as e:
                            with trio.CancelScope(shield=True):
                                await tr.on_error(e)
                    self.state = st
                else:
                    # Inside the model call's scope (a flush, a retry notice) or with a
                    # flusher about: a cancel of that scope, or of the flusher, must not
                    # abandon a commit whose items the step then considers journaled.
                    with trio.CancelScope(shield=True):
                        self.state = await self.store.db.transact(fn)
            except _StateMoved as e:
                raise RunStopped(str(e)) from None
            except _CancelSeen:
                return False
            if self._txn_settled is not None:  # the attempt that committed settled the run
                self.settled = self._txn_settled
            if append:
                # (after a retry, which attempt's head committed is not tracked: the next reads it)
                self._head_rec = self._txn_head if attempts == 1 else None
                self._txn_head = None
            self.messages.extend(map(dict, append))
            self.head += len(append)
            return True
        finally:
            if lock is not None:
                lock.release()

    async def _settle_tr(self, tr: Any, outcome: Mapping[str, Any]) -> None:
        """Settle in the commit's transaction, noting the outcome as stored (see ``settled``);
        the commit's events, when it ``settles`` (see :meth:`_commit`), journaled with it."""
        evs, self._txn_events = self._txn_events, None
        self._txn_settled = await self.store.settle(tr, self.claim, outcome, lease_rec=self._txn_lease,
                                                    state=self.state, events_before=evs or ())

    def _message_events(self, first_seq: int, msgs: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
        return _message_events(self.run_id, first_seq, msgs, self._txn_encoded, self._added_prefix)

    # ------------------------------------------------------------------ begin / recovery

    @staticmethod
    async def prepare_in_claim(store: Any, tr: Any, claim: "Claim", agent_name: str) -> "_Prepared | None":
        """The first claim's writes, made inside the claiming transaction (``Store.claim(prepare=...)``).

        What :meth:`_begin_fresh` does in a transaction of its own — repair what
        earlier runs left dangling, append the user message, create the loop
        state, journal ``message.added`` — committed together with the lease and
        ``run.started`` instead: one commit per run less, and the state and
        transcript are read here rather than in a separate read-only transaction
        (the cancel request too: the claim read it into the lease it wrote).
        Lease-checked by construction (the lease is written in this very
        transaction); guarded by the claim's nonce (a
        retry that finds its committed claim skips this hook, and the runner
        then finds the loop state and recovers) and by the loop state's absence.
        None (nothing written) when the run already has a loop state (a
        takeover, a resumed park) or its transcript is longer than one page:
        the runner's ordinary path handles those.
        """
        run_id, owner, conv = claim.run_id, claim.owner, claim.conversation
        new_run = claim.lease.new_run  # created by this very transaction: no state, no cancel yet
        if not new_run and await tr.get(store.loop_keys.state(run_id)) is not None:
            return None
        base = 0
        # From the mark: the latest compaction's context (dangling calls can only be there:
        # a compaction runs only when every earlier call has its result). The head read here
        # is the append's below (not read twice).
        page, head = await store.transcripts.read_tail_for_append_tr(tr, owner, conv, MAX_READ_PAGE)
        if page is None:  # a new conversation
            messages: list[dict[str, Any]] = []
        else:
            if page.next_seq is not None:
                return None
            messages = [m.data for m in page.messages]
            base = page.start
        # (the claim read the cancel record into the lease it wrote in this transaction)
        cancel = False if new_run else await _claimed_cancel(store, tr, claim)
        first_seq = base + len(messages)
        appended = [_user_message(claim.delivery)]
        if messages:  # (a new conversation has nothing dangling)
            appended[:0] = _dangling_results(messages, 0, reason="interrupted")
        state = LoopState(owner, conv, agent_name, user_seq=first_seq + len(appended) - 1)
        state.ver, state.tok = 1, store.new_token()
        # (a new session is created by the append, its head written once)
        encoded: list[bytes] = []
        written: list[dict[str, Any]] = []
        await store.transcripts.append_tr(tr, owner, conv, appended, expected_head=first_seq, create=page is None,
                                          head=head, encoded_out=encoded, head_out=written)
        tr.set(store.loop_keys.state(run_id), state.to_bytes())
        evs = _message_events(run_id, first_seq, appended, dict(zip(map(id, appended), encoded)))
        after_start = claim.lease.journal_after_start
        if after_start is not None:  # submitted in this transaction: journaled with run.started
            after_start.extend(evs)
        else:
            await store.journal.emit_many_tr(tr, owner, conv, evs, refs=False)
        messages.extend(appended)
        return _Prepared(state, messages, cancel, base, written[0])

    async def _begin(self) -> None:
        store = self.store
        prepared = self.claim.prepared
        if prepared is not None:  # the claim's transaction already began the run
            self.state, self.messages, self.base = prepared.state, prepared.messages, prepared.base
            self._head_rec = prepared.head
            self.head = self.base + len(self.messages)
            if prepared.cancel:
                self._note_cancel()
            return
        raw, self.messages, cancel, self.base = await store.read_state_and_transcript(self.run_id, self.owner, self.conv)
        self.head = self.base + len(self.messages)
        if cancel:
            self._note_cancel()
        if raw is None:
            await self._begin_fresh()
        else:
            self.state = LoopState.from_bytes(raw)
            await self._recover()

    async def _begin_fresh(self) -> None:
        """First claim: repair what earlier runs left dangling, append the user message, start."""
        store = self.store
        repairs = _dangling_results(self.messages, 0, reason="interrupted")
        user_msg = _user_message(self.claim.delivery)
        appended = repairs + [user_msg]
        first_seq = self.head
        state = LoopState(self.owner, self.conv, self.agent.name, user_seq=first_seq + len(repairs))
        token = self._new_token()
        state.ver, state.tok = 1, token

        async def fn(tr: Any) -> LoopState:
            await store.check_lease(tr, self.claim)
            raw = await tr.get(self._state_key)
            if raw is not None:
                st = LoopState.from_bytes(raw)
                if st.tok == token:
                    return st  # committed before a 1021
                raise RunStopped("loop state appeared concurrently")
            await store.ensure_session(tr, self.owner, self.conv)
            await store.transcripts.append_tr(tr, self.owner, self.conv, appended, expected_head=first_seq)
            tr.set(self._state_key, state.to_bytes())
            for typ, data in self._message_events(first_seq, appended):
                await store.journal.emit(tr, self.owner, self.conv, typ, data)
            return state

        self.state = await store.db.transact(fn)
        self.messages.extend(appended)
        self.head += len(appended)

    async def _recover(self) -> None:
        """A later claim: finalise calls an earlier attempt started, then continue."""
        assert self.state is not None
        st = self.state
        a = _last_assistant(self.messages, st.user_seq - self.base)
        interrupted: list[dict[str, Any]] = []
        if a is not None:
            answered = _answered(self.messages, a)
            for call in M.tool_calls_of(self.messages[a]):
                cid = call["id"]
                if cid in answered:
                    continue
                if (st.calls.get(cid) or {}).get("state") == CALL_STARTED:
                    interrupted.append(
                        M.tool_results([M.tool_result(
                            cid, call["name"],
                            "The tool call was interrupted (the process running it stopped before it returned). "
                            "It may or may not have taken effect; it was not run again.",
                            is_error=True, reason="interrupted",
                        )])
                    )
        ids = [m["content"][0]["call_id"] for m in interrupted]

        def mutate(s: LoopState) -> None:
            for cid in ids:
                s.calls[cid] = {**(s.calls.get(cid) or {}), "state": CALL_DONE, "reason": "interrupted"}

        def events(first_seq: int) -> list[tuple[str, Any]]:
            # run.started itself was journaled by the ledger's claim (attempt, takeover)
            out: list[tuple[str, Any]] = []
            for m in interrupted:
                p = m["content"][0]
                out.append((E.TOOL_COMPLETED, {"run_id": self.run_id, "call_id": p["call_id"], "name": p["name"],
                                               "is_error": True, "reason": "interrupted", "content": p["content"],
                                               "attempt": self.claim.attempt}))
            out.extend(self._message_events(first_seq, interrupted))
            return out

        if interrupted:
            await self._commit(mutate, append=interrupted, events=events)

    # ------------------------------------------------------------------ the loop

    async def _drive(self) -> None:
        if self.claim.lease.exhausted:  # the claim after the last attempt: see Store.submit
            finished = self.claim.prepared
            if isinstance(finished, _Finished):  # settled in the claim itself (finish_exhausted_in_claim)
                self.settled = finished.outcome
                return
            await self._finish_exhausted()
            return
        await self._begin()
        if self.price is None and self.claim.limits and self.claim.limits.get("max_cost_micros") is not None:
            # Submitted elsewhere (Runtime.submit refuses this up front): this worker's pricing
            # enforces the ceiling, and it has no price for the model. Fail, never run unenforced.
            label = model_label(self.agent.model)
            await self._fail({"type": "missing_price", "model": label,
                              "message": f"the run has a cost ceiling (max_cost_micros="
                                         f"{self.claim.limits['max_cost_micros']}) but model {label!r} has no "
                                         f"price in this runtime's pricing; nothing was sent to the model"})
            return
        while True:
            if self._cancel_noted:
                await self._finish_cancelled()
                return
            assert self.state is not None
            a = _last_assistant(self.messages, self.state.user_seq - self.base)
            if a is not None:
                calls = M.tool_calls_of(self.messages[a])
                answered = _answered(self.messages, a)
                pending = [c for c in calls if c["id"] not in answered]
                if pending:
                    await self._run_tool(a, pending[0], pending[1:])
                    continue
                if not calls:
                    await self._finish_completed(self.messages[a], a)
                    return
            await self._model_step()

    # ------------------------------------------------------------------ model calls

    async def _model_step(self) -> None:
        st = self.state
        assert st is not None
        agent = self.agent
        if st.model_calls >= agent.max_model_calls:
            await self._fail({"type": "max_model_calls", "message": f"the run made {st.model_calls} model calls, the limit"})
            return
        context = model_context(self.messages, self.base)
        specs = agent.tool_specs()
        if agent.compact_at_tokens is not None:
            # (the agent's own tool definitions: a hook's changes are not known yet)
            est = estimate_context_tokens(agent.instructions, context, agent.tool_schema_chars(),
                                          prior_reasoning=self._prior_reasoning())
            if est > agent.compact_at_tokens and choose_cut(self.messages, agent.keep_recent, self.base) is not None:
                await self._compact("threshold")
                context = model_context(self.messages, self.base)
        system, tools = agent.instructions, specs
        if agent.hooks is not None and agent.hooks.before_model_call is not None:
            info = ModelCallInfo(agent, self.run_id, self.conv, st.model_calls + 1, system, context, specs)
            await Hooks.call(agent.hooks.before_model_call, info)
            system, context, tools = info.system, info.messages, info.tools
        plan = await self._reserve(system, context, tools=tools)
        coalescer = PartCoalescer(self.run_id, st.model_calls + 1)
        msg: dict[str, Any] | None = None
        error: ProviderError | None = None
        flush_error: list[BaseException] = []
        started_at = trio_now()
        # A slow answer's periodic flusher, started in the runtime's nursery on its first flush
        # and joined below before this step goes on (a fast answer starts none, and the call
        # needs no nursery of its own): (its cancel scope, set when it has finished).
        flusher: tuple[trio.CancelScope, trio.Event] | None = None
        # No cancel scope of the step's own around the call: call_model enters one (made by
        # _new_call_scope) around each part of it that may wait, and a call whose stream cannot
        # wait has none (a scope entered and left is ~48k instructions; two model calls a turn).
        self._in_call, self._call_stopped, self._call_scope = True, False, None
        try:

            async def first_flush() -> None:
                nonlocal flusher
                await self._flush(coalescer)
                if flusher is None:
                    flusher = (trio.CancelScope(), trio.Event())
                    assert self._host is not None
                    if self._lock is None:  # (not inside a commit here: made before it can matter)
                        self._lock = trio.Lock()
                    self._host.start_soon(self._flusher, coalescer, flush_error, *flusher)

            def on_event(ev: Any) -> Awaitable[None] | None:
                # A fast answer is journaled whole by message.added, with no part
                # events and no extra commit; a slow one starts the periodic flusher.
                # Until a flush may be due its events are only held (PartCoalescer.hold:
                # a fast answer's parts are never made), and a plain function, not a
                # coroutine, answers the events that need no commit (call_model awaits
                # only what is returned).
                if coalescer.flushes == 0 and not coalescer.pending:  # (nothing made into items yet)
                    if coalescer.hold(ev) < MAX_PENDING_CHARS and trio_now() - started_at < FLUSH_INTERVAL:
                        return None
                    coalescer.release()
                else:
                    coalescer.add(ev)
                if coalescer.flushes == 0:
                    if coalescer.pending and (coalescer.urgent or trio_now() - started_at >= FLUSH_INTERVAL):
                        return first_flush()
                elif coalescer.urgent:
                    return self._flush(coalescer)
                return None

            try:
                msg = await call_model(
                    self.provider,
                    system=system,
                    messages=context,
                    tools=tools,
                    max_tokens=plan.max_tokens,
                    stream_options=plan.options,
                    policy=agent.retry,
                    on_event=on_event,
                    on_retry=self._on_retry,
                    clock=self.rt.clock,
                    retries_done=st.retries,
                    resume_at=st.next_attempt_at,
                    cancel_scope=self._new_call_scope,
                )
            except ProviderError as e:
                error = e
            except (RunStopped, kv.KVError, self.store.LeaseLost) as e:
                flush_error.append(e)
            finally:
                if flusher is not None:  # stop it and wait until it has (as a nursery exit would)
                    flusher[0].cancel()
                    with trio.CancelScope(shield=True):
                        await flusher[1].wait()
        finally:
            self._in_call, self._call_scope = False, None
        if flush_error:
            raise flush_error[0]
        if msg is None and error is None:
            return  # cancelled mid-call: the loop's next boundary finalises
        if error is not None:
            if isinstance(error, ContextOverflowError) and agent.retry.should_compact(error, st.compactions):
                if choose_cut(self.messages, agent.keep_recent, self.base) is not None:
                    await self._flush(coalescer)
                    await self._compact("overflow")
                    return
            await self._flush(coalescer)
            await self._fail(error.to_dict(), error_message=True)
            return
        assert msg is not None
        await self._model_done(msg, coalescer, plan)

    async def _flusher(self, coalescer: PartCoalescer, errors: list[BaseException],
                       own_scope: trio.CancelScope, done: trio.Event) -> None:
        """Flush streamed parts every FLUSH_INTERVAL until ``own_scope`` is cancelled; a failed
        flush stops the call (:meth:`_stop_call`) and is re-raised by the model step. Runs in the
        nursery hosting the run (the runtime's; see :meth:`execute`) and is joined by the step:
        anything it raises goes to ``errors``, never into that nursery."""
        try:
            with own_scope:
                while True:
                    await trio.sleep(FLUSH_INTERVAL)
                    if coalescer.pending:
                        await self._flush(coalescer)
        except Exception as e:  # noqa: BLE001 — storage/lease failures and bugs alike: the step re-raises it
            errors.append(e)
            self._stop_call()
        finally:
            done.set()

    async def _flush(self, coalescer: PartCoalescer) -> None:
        items = coalescer.take()
        if items:
            coalescer.flushes += 1
            await self._commit(events=items)

    async def _on_retry(self, n: RetryNotice) -> None:
        attempt_next = n.attempt + 1

        def mutate(s: LoopState) -> None:
            s.retries = n.attempt
            s.next_attempt_at = n.next_attempt_at

        await self._commit(
            mutate,
            events=[(E.RUN_RETRY_PENDING, {
                "run_id": self.run_id,
                "attempt": attempt_next,
                "maxAttempts": n.max_attempts,
                "nextAttemptAt": n.next_attempt_at,
                "delay": n.delay,
                "error": n.error.to_dict(),
            })],
        )

    async def _unique_call_ids(self, calls: list[dict[str, Any]]) -> None:
        """Rename tool-call ids already used in this transcript, before the message is persisted.

        Per-call state (started/done, approvals, idempotency keys) and the
        pairing of results with calls are keyed by the call id, so an id must
        be unique within a transcript. Providers don't all promise that (local
        OpenAI-compatible servers may number calls per response; a scripted
        model derives ids from the context, which a compaction shortens). The
        new id is a function of the transcript position, so a model call
        replayed after a crash gets the same one.

        The ids before ``self.base`` (the transcript's mark when this run read it) are
        not in memory: the compactions that moved the mark recorded them
        (``Store.note_call_ids``), and a new id is looked up there — one read, and only
        in a conversation that has a mark.
        """
        used = self._call_ids_in_memory()  # (read only: the ids of this message are in ``taken``)
        if self.base:
            fresh = [c["id"] for c in calls if c["id"] not in used]
            if fresh:
                used = used | await self.store.call_ids_used(self.owner, self.conv, fresh)
        taken: set[str] = set()
        for i, c in enumerate(calls):
            if c["id"] in used or c["id"] in taken:
                n = 0
                new = f"{c['id']}~{self.head}_{i}"
                while new in used or new in taken:
                    n += 1
                    new = f"{c['id']}~{self.head}_{i}_{n}"
                c["id"] = new
            taken.add(c["id"])

    def _call_ids_in_memory(self) -> set[str]:
        """Every tool-call id in ``self.messages``, kept incrementally: only the messages
        appended since the last call are looked at (every model step that calls tools used to
        walk the whole window for them, O(window) a step and O(window²) a run). Messages are
        only appended to that list, and a stored message's call ids never change; a new list
        (a re-read transcript) starts the index again."""
        msgs = self.messages
        if self._ids_of is not msgs:
            self._ids, self._ids_of, self._ids_upto = set(), msgs, 0
        ids = self._ids
        for i in range(self._ids_upto, len(msgs)):
            for c in M.tool_calls_of(msgs[i]):
                ids.add(c["id"])
        self._ids_upto = len(msgs)
        return ids

    async def _model_done(self, msg: dict[str, Any], coalescer: PartCoalescer, plan: _CallPlan) -> None:
        """Persist the assistant message (and its usage) as it ends; settle if it is final.

        An answer the run's ceiling cut off (sent with a ``max_tokens`` the ceiling lowered,
        ended by it) is kept, with its usage, but it is neither a final answer nor a tool
        call to run (its text or arguments are truncated): the run fails ``usage_limit``."""
        st = self.state
        assert st is not None
        call_no = st.model_calls + 1
        usage = self._priced(msg.get("usage") or {})
        calls = M.tool_calls_of(msg)
        if calls:
            await self._unique_call_ids(calls)
        cut = plan.clamped_by is not None and msg.get("stop_reason") == STOP_MAX_TOKENS
        start_first = self._startable(calls[0]) if calls and not cut else None
        final_outcome: dict[str, Any] | None = None
        appended = [msg]
        if cut:
            err = {"type": "usage_limit",
                   "message": f"run {self.run_id!r}: the model's answer was cut off at {plan.max_tokens} output "
                              f"tokens: more would take {plan.clamped_by} past its ceiling of "
                              f"{self.claim.limits.get('max_' + plan.clamped_by)}"}
            final_outcome = {"status": "failed", "result": None, "error": err}
            # Its tool calls (arguments possibly cut) are answered as not run, so the
            # transcript stays a valid context for the conversation's next run.
            unrun = _dangling_results([msg], 0, reason="usage_limit",
                                      text="The answer was cut off at the run's usage ceiling; this call was not run.")
            appended = [msg, *unrun, {"role": "error", "error": err}]
        elif not calls:
            final_outcome, error_msg = self._final_outcome(msg)
            if error_msg is not None:
                appended = [msg, error_msg]

        def mutate(s: LoopState) -> None:
            s.model_calls = call_no
            s.retries, s.next_attempt_at, s.compactions = 0, None, 0
            if start_first is not None and not self._txn_cancel:
                s.calls[start_first["id"]] = {"state": CALL_STARTED, "name": start_first["name"]}

        def events(first_seq: int) -> list[tuple[str, Any]]:
            # Parts already journaled are completed by the pending rest; if none were,
            # message.added alone tells the whole answer.
            out = list(coalescer.pending) if coalescer.flushes else []
            out.extend(_message_events(self.run_id, first_seq, appended, self._txn_encoded, self._added_prefix))
            if usage:
                out.append((E.USAGE_UPDATED, {"run_id": self.run_id, "step": f"model-{call_no}", "usage": usage}))
            if start_first is not None and not self._txn_cancel:
                out.append(self._tool_started_event(start_first))
            return out

        async def extra(tr: Any, s: LoopState) -> None:
            if usage:
                await self.store.record_usage(tr, self.claim, f"model-{call_no}", usage)
            if final_outcome is not None:
                # A cancel seen here wins over the answer (which stays in the transcript).
                await self._settle_tr(tr, L.cancelled("cancel requested") if self._txn_cancel else final_outcome)

        await self._commit(mutate, append=appended, events=events, extra=extra, settles=final_outcome is not None)
        if start_first is not None and (self.state.calls.get(start_first["id"]) or {}).get("state") == CALL_STARTED:  # type: ignore[union-attr]
            self._started_here.add(start_first["id"])
        if final_outcome is not None:
            raise RunStopped("settled")

    def _final_outcome(self, msg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        text = M.text_of(msg)
        schema = self.claim.result_schema
        if schema:
            try:
                value = parse_result(text, schema)
            except ResultSchemaError as e:
                err = {"type": "result_schema", "message": f"final answer does not match the result schema: {e}"}
                return {**L.failed("result_schema", err["message"]), "text": text}, {"role": "error", "error": err}
            return {**L.completed(value), "text": text}, None
        return {**L.completed(text), "text": text}, None

    def _priced(self, usage: Mapping[str, Any]) -> Mapping[str, Any]:
        """A step's usage with its ``cost_micros`` beside the tokens (recorded with them, in the
        same idempotent (run, step) record, so counted once like them). Deterministic: a
        retried record carries identical figures. A free or unpriced model adds nothing."""
        if self._bill is None or not usage:
            return usage
        cost = cost_micros(self._bill, usage)
        return {**usage, "cost_micros": cost} if cost else usage

    def _prior_reasoning(self) -> bool:
        """Whether earlier turns' reasoning is billed as input (``estimate_context_tokens``'s
        ``prior_reasoning``): yes, unless the provider says its model strips it
        (``strips_prior_thinking``, an optional attribute). Anthropic's models differ ("keep
        all prior turns": Opus 4.5+, Sonnet 4.6+; "keep the last turn only": older ones and
        Haiku through 4.5) and the runtime keeps no model table, so a provider that does not
        say is taken to keep them all: the over-estimate, never the under-estimate."""
        return not getattr(self.provider, "strips_prior_thinking", False)

    async def _reserve(self, system: str, messages: list[dict[str, Any]], *, tools: Sequence[ToolSpec] = (),
                       during: str | None = None) -> _CallPlan:
        """The pre-flight reserve of a model call against the run's usage ceilings, and how
        the call is sent; a refusal fails the run (``_fail`` raises RunStopped). Only a run
        with ceilings needs the estimate and the read.

        The estimate: the context's tokens as input and, as output, the call's *effective*
        cap — the provider's answer to ``output_cap(Agent.max_tokens)`` (Anthropic always
        sends one, its default included; an OpenAI-compatible server none unless set) — and
        with a cost ceiling their cost at the model's input and output prices. When a ceiling
        bounds output (max_output_tokens, max_total_tokens, max_cost_micros at a non-zero
        output price) and the cap is unknown or larger than the room that ceiling leaves
        after the input, the call is sent with ``max_tokens`` lowered to that room (so the
        provider itself stops at the ceiling); with less room than a call needs
        (MIN_CALL_OUTPUT_TOKENS, or the provider's own minimum) it is refused. Without such a
        ceiling the call is sent exactly as configured.

        Read-only, like the ledger's reserve (one run makes one model call at a time, so
        nothing is held): the figures are a function of the recorded totals and the context
        only, so a step retried (after a transient error, or by the next claim after a
        crash, its usage unrecorded) reserves, and is sent with, the same figures."""
        agent_mt = self.agent.max_tokens
        limits = self.claim.limits
        if not limits:
            return _CallPlan(agent_mt)
        price = self.price
        # The tool definitions the call sends are input too: the agent's own measured once
        # (Agent.tool_schema_chars), a hook's replacement measured for this call.
        schema_chars = self.agent.tool_schema_chars(tools) if tools else 0
        input_est = estimate_context_tokens(system, messages, schema_chars, prior_reasoning=self._prior_reasoning())
        estimate = {"input_tokens": input_est, "output_tokens": 0}
        if limits.get("max_cost_micros") is not None and price is not None:
            estimate["cost_micros"] = estimate_cost_micros(price, input_est, 0)
        extra = {"during": during} if during is not None else {}
        try:
            # The input alone first; the output's room is what each ceiling has left after it.
            headroom = await self.store.reserve(self.claim, estimate)  # read-only
        except L.UsageLimitExceeded as e:
            await self._fail({"type": "usage_limit", "message": str(e), **extra})
            raise AssertionError("unreachable: _fail raises")  # pragma: no cover
        cap = output_cap(self.provider, agent_mt)
        room, field = _output_room(headroom, input_est, price)
        if field is None or (cap is not None and cap <= room):
            return _CallPlan(agent_mt)  # no ceiling bounds this call's output, or its own cap fits
        options = capped_call_options(self.provider, room) if room >= MIN_CALL_OUTPUT_TOKENS else None
        if options is None:
            need = max(MIN_CALL_OUTPUT_TOKENS, room + 1)
            ceiling = int(limits[f"max_{field}"])
            would = ceiling - headroom[field] + {
                "output_tokens": need,
                "total_tokens": input_est + need,
                "cost_micros": estimate_cost_micros(price, input_est, need) if price is not None else 0,
            }[field]
            await self._fail({"type": "usage_limit", **extra, "message":
                              f"run {self.run_id!r}: {field} would reach {would}, past its ceiling of {ceiling} "
                              f"(room for {max(room, 0)} output tokens, fewer than a call to "
                              f"{model_label(self.agent.model)} can be made with)"})
        assert price is None or "cost_micros" not in headroom or \
            estimate_cost_micros(price, input_est, room) <= headroom["cost_micros"]
        return _CallPlan(room, options, field)

    async def _compact(self, reason: str) -> None:
        cut = choose_cut(self.messages, self.agent.keep_recent, self.base)
        assert cut is not None
        request = summary_request(self.messages, cut, self.base)
        # The summariser is a model call like any other (unreserved, its usage could carry
        # the run past a ceiling), clamped like any other; a summary cut at the ceiling's room
        # is kept as it is (shorter, still a summary; the next call then finds no room).
        plan = await self._reserve(COMPACTION_SYSTEM, request, during="compaction")
        try:
            summary_msg = await call_model(
                self.provider, system=COMPACTION_SYSTEM, messages=request, tools=[],
                max_tokens=plan.max_tokens, stream_options=plan.options, policy=self.agent.retry,
                clock=self.rt.clock,
            )
        except ProviderError as e:  # the summariser failed too: the run fails with its error
            await self._fail({**e.to_dict(), "during": "compaction"})
            return
        assert summary_msg is not None  # (no cancel_scope given: call_model returns a message)
        entry = compaction_entry(M.text_of(summary_msg), cut, reason=reason, usage=summary_msg.get("usage") or {})
        usage = self._priced(summary_msg.get("usage") or {})
        st = self.state
        assert st is not None
        # The usage step is named by where the entry lands: unique per compaction of the run (a
        # threshold compaction and an overflow one in the same model step had one name, and the
        # second's usage was refused as a conflicting record: lost, and the turn aborted).
        step = f"compact@{self.head}"

        def mutate(s: LoopState) -> None:
            if reason == "overflow":
                s.compactions += 1
            s.retries, s.next_attempt_at = 0, None

        def events(first_seq: int) -> list[tuple[str, Any]]:
            out = [(E.CONTEXT_COMPACTED, {"run_id": self.run_id, "seq": first_seq, "upto": cut, "reason": reason})]
            out.extend(self._message_events(first_seq, [entry]))
            if usage:
                out.append((E.USAGE_UPDATED, {"run_id": self.run_id, "step": step, "usage": usage}))
            return out

        # The call ids leaving the window (before the new cut) are recorded with the mark's move,
        # so later claims, which read from the mark on, still see them (_unique_call_ids).
        leaving = {c["id"] for m in self.messages[:cut - self.base] for c in M.tool_calls_of(m)}
        if len(leaving) > MAX_CALL_ID_BATCH:  # a long unmarked history: too many for one commit
            await self.store.note_call_ids_now(self.owner, self.conv, leaving)
            leaving = set()

        async def extra(tr: Any, s: LoopState) -> None:
            if usage:
                await self.store.record_usage(tr, self.claim, step, usage)
            self.store.note_call_ids(tr, self.owner, self.conv, leaving)

        # The mark moves to the new cut with the entry (one transaction): the next claim reads
        # the transcript from there, the entry and the context it keeps (loop.compaction).
        await self._commit(mutate, append=[entry], events=events, extra=extra, mark=cut)

    # ------------------------------------------------------------------ tools

    def _startable(self, call: dict[str, Any]) -> dict[str, Any] | None:
        """``call`` if it can be marked started right away (known, valid, no approval, not cancelled)."""
        t = self.agent.get_tool(call["name"])
        if t is None or t.requires_approval or self._cancel_noted:
            return None
        if t.check_arguments(call.get("arguments")):
            return None
        return call

    def _tool_started_event(self, call: dict[str, Any]) -> tuple[str, Any]:
        return (E.TOOL_STARTED, {"run_id": self.run_id, "call_id": call["id"], "name": call["name"],
                                 "arguments": call.get("arguments") or {}})

    async def _run_tool(self, a: int, call: dict[str, Any], rest: list[dict[str, Any]]) -> None:
        st = self.state
        assert st is not None
        cid, name = call["id"], call["name"]
        args = call.get("arguments") or {}
        cstate = (st.calls.get(cid) or {}).get("state")
        t = self.agent.get_tool(name)
        if cstate == CALL_STARTED and cid not in self._started_here:
            # Started by an attempt that died: _recover normally handled it; be safe.
            await self._tool_result(call, "The tool call was interrupted; it was not run again.", True, "interrupted", rest)
            return
        if t is None:
            await self._tool_result(call, f"Unknown tool {name!r}.", True, "unknown_tool", rest)
            return
        # (a call this attempt started was validated before it was marked started: _startable)
        errors = t.check_arguments(args) if cid not in self._started_here else None
        if errors:
            await self._tool_result(call, "Invalid arguments: " + "; ".join(errors), True, "invalid_arguments", rest)
            return
        if self._cancel_noted:
            return  # the loop finalises as cancelled
        if t.requires_approval and cstate not in (CALL_APPROVED, CALL_DENIED, CALL_STARTED):
            await self._park(call)
            return
        if cstate == CALL_DENIED:
            reason = (st.calls.get(cid) or {}).get("reason") or "denied"
            await self._tool_result(call, f"The call was not approved: {reason}", True, "denied", rest)
            return
        if cid not in self._started_here:
            def mutate(s: LoopState) -> None:
                s.calls[cid] = {**(s.calls.get(cid) or {}), "state": CALL_STARTED, "name": name}

            if not await self._commit(mutate, events=[self._tool_started_event(call)], abort_on_cancel=True):
                return  # cancelled: the loop finalises without running the tool
            self._started_here.add(cid)
        ctx = ToolContext(
            run_id=self.run_id, conversation=self.conv, call_id=cid, tool_name=name,
            attempt=self.claim.attempt, step_impl=self._step_impl, cancel_event=self.cancel_event,
            idempotency_key=lambda: self.store.idempotency_key(self.run_id, f"tool/{cid}"),
        )
        try:
            value = await t.invoke(args, ctx)
            content, is_error = M.result_text(value), False
        except Exception as e:  # noqa: BLE001 — a tool's failure is a result the model sees
            log.info("run %s: tool %s raised %r", self.run_id, name, e)
            content, is_error = f"{type(e).__name__}: {e}", True
        after_tool = self.agent.hooks.after_tool if self.agent.hooks else None
        if after_tool is None:
            await self._tool_result(call, content, is_error, None, rest)
            return
        hook_info = ToolCallInfo(self.agent, self.run_id, self.conv, cid, name, dict(args), content, is_error)
        await Hooks.call(after_tool, hook_info)
        await self._tool_result(call, hook_info.content, hook_info.is_error, hook_info.reason, rest)

    async def _step_impl(self, name: str, fn: Callable[[], Any]) -> Any:
        return await self.store.step(self.claim, name, fn)

    async def _tool_result(
        self, call: dict[str, Any], content: str, is_error: bool, reason: str | None, rest: list[dict[str, Any]]
    ) -> None:
        """Persist one tool result; in the same transaction start the next call when possible."""
        cid, name = call["id"], call["name"]
        msg = M.tool_results([M.tool_result(cid, name, content, is_error=is_error, reason=reason)])
        nxt = self._startable(rest[0]) if rest else None
        if nxt is not None and (self.state.calls.get(nxt["id"]) or {}).get("state") is not None:  # type: ignore[union-attr]
            nxt = None

        def mutate(s: LoopState) -> None:
            s.calls[cid] = {**(s.calls.get(cid) or {}), "state": CALL_DONE, "name": name}
            if reason:
                s.calls[cid]["reason"] = reason
            if nxt is not None and not self._txn_cancel:
                s.calls[nxt["id"]] = {"state": CALL_STARTED, "name": nxt["name"]}

        def events(first_seq: int) -> list[tuple[str, Any]]:
            done: dict[str, Any] = {"run_id": self.run_id, "call_id": cid, "name": name, "is_error": is_error,
                                    "content": _clip(content), "seq": first_seq}
            if reason:
                done["reason"] = reason
            out = [(E.TOOL_COMPLETED, done)]
            out.extend(_message_events(self.run_id, first_seq, [msg], self._txn_encoded, self._added_prefix))
            if nxt is not None and not self._txn_cancel:
                out.append(self._tool_started_event(nxt))
            return out

        await self._commit(mutate, append=[msg], events=events)
        if nxt is not None and (self.state.calls.get(nxt["id"]) or {}).get("state") == CALL_STARTED:  # type: ignore[union-attr]
            self._started_here.add(nxt["id"])

    async def _park(self, call: dict[str, Any]) -> None:
        cid, name = call["id"], call["name"]

        def mutate(s: LoopState) -> None:
            s.calls[cid] = {"state": CALL_APPROVAL, "name": name}

        async def extra(tr: Any, s: LoopState) -> None:
            await self.store.park(tr, self.claim, [cid])

        if await self._commit(
            mutate,
            events=[(E.APPROVAL_REQUESTED, {"run_id": self.run_id, "call_id": cid, "name": name,
                                            "arguments": call.get("arguments") or {}})],
            extra=extra,
            abort_on_cancel=True,
        ):
            raise RunStopped("parked for approval")

    # ------------------------------------------------------------------ endings

    async def _fail(self, error: dict[str, Any], *, error_message: bool = True) -> None:
        outcome = {"status": "failed", "result": None, "error": error}
        appended = [{"role": "error", "error": error}] if error_message else []

        async def extra(tr: Any, s: LoopState) -> None:
            await self._settle_tr(tr, L.cancelled("cancel requested") if self._txn_cancel else outcome)

        await self._commit(append=appended, events=lambda seq: self._message_events(seq, appended), extra=extra)
        raise RunStopped("settled")

    async def _finish_completed(self, msg: dict[str, Any], a: int) -> None:
        """Recovery path: the final answer was persisted but the run not settled."""
        outcome, error_msg = self._final_outcome(msg)
        appended = [error_msg] if error_msg is not None else []

        async def extra(tr: Any, s: LoopState) -> None:
            await self._settle_tr(tr, L.cancelled("cancel requested") if self._txn_cancel else outcome)

        await self._commit(append=appended, events=lambda seq: self._message_events(seq, appended), extra=extra)
        raise RunStopped("settled")

    @staticmethod
    async def finish_exhausted_in_claim(store: Any, tr: Any, claim: Claim) -> _Finished:
        """The exhausted run's finaliser, inside the claiming transaction (``Store.claim(prepare=...)``).

        After ``max_attempts`` the next claim is handed to a worker (``lease.exhausted``)
        to finalise the run: an ``interrupted`` result (and ``tool.completed``) for every
        call that was out, then settle ``retry_exhausted``. Made here, all of it commits
        with the claim: a crash leaves either the claim undone or the run finished. (As a
        second transaction, a finaliser that died after its claim commit
        ``ledger.runs.FINALIZE_CLAIMS`` times in a row left the ledger's backstop to
        settle the run without the results: a call with ``tool.started`` and no result,
        found by the sim's soak.) Lease-checked by construction (the lease is written in
        this very transaction) and guarded by the claim's nonce: a retry that finds its
        committed claim skips this hook and the runner's :meth:`_finish_exhausted` then
        finds the run settled. The whole context is read here, page by page beyond the
        first (a context longer than a page is rare; the claim stays one transaction).
        """
        run_id, owner, conv = claim.run_id, claim.owner, claim.conversation
        cancel = await _claimed_cancel(store, tr, claim)
        raw = await tr.get(store.loop_keys.state(run_id))
        if raw is None:  # it never got as far as its first write
            return _Finished(await store.settle(tr, claim, _exhausted_outcome(claim, cancel)))
        state = LoopState.from_bytes(raw)
        page, head = await store.transcripts.read_tail_for_append_tr(tr, owner, conv, MAX_READ_PAGE)
        messages: list[dict[str, Any]] = []
        base = 0
        if page is not None:
            messages = [m.data for m in page.messages]
            base = page.start
            while page.next_seq is not None:
                page = await store.transcripts.read_tr(tr, owner, conv, page.next_seq, MAX_READ_PAGE)
                messages.extend(m.data for m in page.messages)
        results, events = _exhausted_tidy(run_id, messages, state, base, cancel)
        first_seq = base + len(messages)
        if results:
            await store.transcripts.append_tr(tr, owner, conv, results, expected_head=first_seq, head=head)
        return _Finished(await store.settle(tr, claim, _exhausted_outcome(claim, cancel), state=state,
                                            events_before=events(first_seq)))

    async def _finish_exhausted(self) -> None:
        """The exhausted run's finaliser when :meth:`finish_exhausted_in_claim` did not run
        (it failed, and the claim was made again without it; or a retried claim found its
        own commit): the same tidy-up and settle, in a transaction of their own."""
        raw, self.messages, cancel, self.base = await self.store.read_state_and_transcript(
            self.run_id, self.owner, self.conv)
        outcome = _exhausted_outcome(self.claim, cancel)
        self.head = self.base + len(self.messages)
        if raw is None:  # it never got as far as its first write
            self.settled = await self.store.settle_now(self.claim, outcome)
            raise RunStopped("settled retry_exhausted")
        self.state = LoopState.from_bytes(raw)
        results, events = _exhausted_tidy(self.run_id, self.messages, self.state, self.base, cancel)

        async def extra(tr: Any, s: LoopState) -> None:
            # (a cancel committed since the read above: the results say interrupted, the run cancelled)
            await self._settle_tr(tr, _exhausted_outcome(self.claim, cancel or self._txn_cancel))

        try:
            await self._commit(append=results, events=events, extra=extra)
        except self.store.LeaseLost:
            # A retried claim (1021) whose first attempt committed, finaliser and all: the
            # settle clears the lease. Settling again with it answers the stored outcome if
            # this lease settled the run, and raises LeaseLost again if someone else did.
            self.settled = await self.store.settle_now(self.claim, outcome)
        raise RunStopped("settled retry_exhausted")

    async def _finish_cancelled(self) -> None:
        st = self.state
        assert st is not None
        a = _last_assistant(self.messages, st.user_seq - self.base)
        results = _cancelled_results(self.messages, a if a is not None else len(self.messages), st)
        outcome = L.cancelled("cancel requested")

        async def extra(tr: Any, s: LoopState) -> None:
            await self._settle_tr(tr, outcome)

        await self._commit(append=results, events=lambda seq: _cancelled_events(self.run_id, seq, results, st),
                           extra=extra)
        raise RunStopped("settled cancelled")


async def _claimed_cancel(store: Any, tr: Any, claim: "Claim") -> bool:
    """Inside the claiming transaction: whether a cancel of the run is requested, as the
    lease the claim wrote in it says (``Ledger.claim`` set its ``"cancel"`` from the cancel
    record, read in this transaction); the cancel record itself when that lease is not at
    hand (no claim of ours leaves it so)."""
    seen = claim.lease.seen
    if seen is not None and seen[1].get("token") == claim.lease.token:
        return bool(seen[1].get("cancel", False))
    return await store.cancel_requested(tr, claim.run_id)


# ---------------------------------------------------------------------- transcript helpers


class _Finished:
    """What :meth:`Runner.finish_exhausted_in_claim` did inside the claim: the run is settled
    (``outcome``, as stored); the runner has nothing left to do."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: dict[str, Any]) -> None:
        self.outcome = outcome


def _exhausted_outcome(claim: Claim, cancel: bool) -> dict[str, Any]:
    """An exhausted run's outcome: ``retry_exhausted``, or ``cancelled`` when a cancel was
    requested (an acknowledged cancel ends the run cancelled, DESIGN promise 7, even when every
    attempt to finalise it died)."""
    if cancel:
        return L.cancelled("cancel requested")
    n = claim.lease.max_attempts
    return L.failed("retry_exhausted", f"run gave up after {n} attempts", attempts=n)


def _exhausted_tidy(
    run_id: str, messages: Sequence[dict[str, Any]], state: LoopState, base: int, cancel: bool
) -> tuple[list[dict[str, Any]], Callable[[int], list[tuple[str, Any]]]]:
    """An exhausted run's finalising writes: an error result for every call of its last
    answer that has none, and their events as a function of the first result's sequence
    number (``messages`` start at ``base``). ``interrupted`` results with ``tool.completed``;
    with a cancel requested, the results :meth:`Runner._finish_cancelled` would write."""
    a = _last_assistant(messages, state.user_seq - base)
    if cancel:
        results = [] if a is None else _cancelled_results(messages, a, state)
        return results, lambda first_seq: _cancelled_events(run_id, first_seq, results, state)
    results = [] if a is None else _dangling_results(messages, a, reason="interrupted")

    def events(first_seq: int) -> list[tuple[str, Any]]:
        return _completed_events(run_id, results) + _message_events(run_id, first_seq, results)

    return results, events


def _completed_events(run_id: str, results: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    """``tool.completed`` for synthetic error results (one result part per message)."""
    out: list[tuple[str, Any]] = []
    for m in results:
        p = m["content"][0]
        out.append((E.TOOL_COMPLETED, {"run_id": run_id, "call_id": p["call_id"], "name": p["name"],
                                       "is_error": True, "reason": p.get("reason"), "content": p["content"]}))
    return out


def _cancelled_events(run_id: str, first_seq: int, results: Sequence[dict[str, Any]],
                      state: LoopState) -> list[tuple[str, Any]]:
    """A cancelled run's results' events: ``tool.completed`` for the calls whose
    ``tool.started`` was journaled (a follower then sees every started call end), and
    ``message.added`` for all of them."""
    started = [m for m in results
               if (state.calls.get(m["content"][0]["call_id"]) or {}).get("state") == CALL_STARTED]
    return _completed_events(run_id, started) + _message_events(run_id, first_seq, results)


class _Prepared:
    """What :meth:`Runner.prepare_in_claim` began inside the claim: the loop state as
    committed, the transcript (from ``base``, its mark) after the appended messages, the
    cancel record as read, the session head record as the append wrote it (None: unknown)."""

    __slots__ = ("state", "messages", "cancel", "base", "head")

    def __init__(self, state: LoopState, messages: list[dict[str, Any]], cancel: bool, base: int = 0,
                 head: dict[str, Any] | None = None) -> None:
        self.state, self.messages, self.cancel, self.base, self.head = state, messages, cancel, base, head


#: Parts of a ``message.added`` event's data encoded by hand (see _message_events): a 4-entry
#: map's head with the "run_id" key, and the keys after it.
_ADDED_HEAD = b"\xa4" + dumps("run_id")
_K_SEQ, _K_ROLE, _K_MESSAGE = dumps("seq"), dumps("role"), dumps("message")
_ROLE_CBOR = {r: dumps(r) for r in ("user", "assistant", "tool", "error", "compaction")}


#: A message of ``k`` content parts whose CBOR is ``n`` bytes has ``_approx_size`` at most
#: 97 + 48 k + _JSON_PER_CBOR_BYTE n, so ``_message_events`` needs no estimate of it when that is
#: within MAX_EVENT_TEXT. The estimate is 64, plus 48 a content part, plus the lengths of its
#: strings (characters: at most their UTF-8 bytes, each inside the CBOR), plus the JSON (with
#: ``default=str``) of its tool-call arguments and of its error/summary (with 33 characters of
#: the dict around those). JSON takes at most ~13 characters per CBOR byte of the same value:
#: ``cbor2.undefined`` (1 byte, ``"undefined", ``), then ``false, `` (1 byte, 7), an escaped
#: control character (6 for 1), a dict entry ``"false": false, `` (16 for 2).
_JSON_PER_CBOR_BYTE = 16
_ESTIMATE_FIXED, _ESTIMATE_PER_PART = 97, 48


def _added_prefix(run_id: str) -> bytes:
    """The CBOR of a run's ``message.added`` data up to its ``seq`` value."""
    return _ADDED_HEAD + _cbor_text(run_id) + _K_SEQ


def _cbor_text(s: str) -> bytes:
    """``dumps(s)`` for a str, without cbor2's per-call setup (~2,500 instructions; two a
    turn): its UTF-8 under a text-string head (major type 3: an unsigned int's head | 0x60)."""
    b = s.encode()
    head = cbor_uint(len(b))
    return bytes((head[0] | 0x60,)) + head[1:] + b


def _message_events(run_id: str, first_seq: int, msgs: Sequence[dict[str, Any]],
                    encoded: Mapping[int, bytes] | None = None, prefix: bytes | None = None) -> list[tuple[str, Any]]:
    """``message.added`` for each of ``msgs`` (message ``first_seq`` on). ``encoded``: the
    CBOR of messages the transcript just encoded to append them, by ``id`` of the message:
    the data of such a message's event is then built from those bytes, as
    :class:`sessions.codec.Encoded` (the same bytes as encoding the dict below: the same
    entries in the same order), instead of cbor2 encoding the message a second time."""
    out: list[tuple[str, Any]] = []
    seq = first_seq
    for m in msgs:
        role = m.get("role")
        enc = encoded.get(id(m)) if encoded is not None and type(m) is dict else None
        # A message whose CBOR is short enough is under the limit whatever _approx_size would
        # find (see _JSON_PER_CBOR_BYTE): the estimate is skipped (a turn's every message).
        if ((enc is not None and _ESTIMATE_FIXED + _ESTIMATE_PER_PART * len(m.get("content") or ())
             + _JSON_PER_CBOR_BYTE * len(enc) <= MAX_EVENT_TEXT) or _approx_size(m) <= MAX_EVENT_TEXT):
            if enc is not None:
                if prefix is None:
                    prefix = _added_prefix(run_id)
                rc = _ROLE_CBOR.get(role) if type(role) is str else None
                out.append((E.MESSAGE_ADDED, Encoded(prefix + cbor_uint(seq) + _K_ROLE
                                                     + (rc if rc is not None else dumps(role)) + _K_MESSAGE + enc)))
                seq += 1
                continue
            data: dict[str, Any] = {"run_id": run_id, "seq": seq, "role": role, "message": m}
        else:
            data = {"run_id": run_id, "seq": seq, "role": role}
            data["truncated"] = True
            data["text"] = _clip(M.text_of(m))
        out.append((E.MESSAGE_ADDED, data))
        seq += 1
    return out


def _approx_size(m: dict[str, Any]) -> int:
    """A cheap upper-ish estimate of a message's encoded size (texts, arguments, results)."""
    n = 64
    for p in m.get("content") or ():
        # (reasoning parts too: thinking text, its signature, a redacted block's data)
        n += (48 + len(p.get("text") or "") + len(p.get("content") or "") + len(p.get("thinking") or "")
              + len(p.get("signature") or "") + len(p.get("data") or ""))
        if p.get("arguments"):
            n += len(json.dumps(p["arguments"], default=str))
    if "error" in m or "summary" in m:
        n += len(json.dumps({k: m.get(k) for k in ("error", "summary")}, default=str))
    return n


def _user_message(delivery: Any) -> dict[str, Any]:
    msg = delivery.get("message") if isinstance(delivery, dict) else delivery
    if isinstance(msg, str):
        return M.user(msg)
    if isinstance(msg, dict) and msg.get("role") == "user":
        return dict(msg)
    raise ValueError(f"a delivery's message is a string or a user message, got {type(msg).__name__}")


def _output_room(headroom: Mapping[str, int], input_est: int, price: Any) -> tuple[int, str | None]:
    """The output tokens a call may produce under the run's ceilings (``headroom``: the
    ledger's ceiling minus totals, per limited field) after its estimated input, and the field
    whose ceiling leaves the least; (0, None) when no ceiling bounds output. A cost ceiling
    bounds output only at a non-zero output price, and exactly as the reserve prices it: the
    call's estimate, ceil((in × in_price + out × out_price) / 10⁶), fits the headroom H iff
    in × in_price + out × out_price <= H × 10⁶ (integers; rounded down, never in the
    caller's favour)."""
    rooms: list[tuple[int, str]] = []
    if "output_tokens" in headroom:
        rooms.append((headroom["output_tokens"], "output_tokens"))
    if "total_tokens" in headroom:
        rooms.append((headroom["total_tokens"] - input_est, "total_tokens"))
    if "cost_micros" in headroom and price is not None and price.output_tokens > 0:
        spare = headroom["cost_micros"] * TOKENS_PER_PRICE_UNIT - input_est * price.input_tokens
        rooms.append((spare // price.output_tokens, "cost_micros"))
    if not rooms:
        return 0, None
    return min(rooms)


def _last_assistant(messages: Sequence[dict[str, Any]], start: int) -> int | None:
    for i in range(len(messages) - 1, max(start, 0) - 1, -1):
        role = messages[i].get("role")
        if role == "assistant":
            return i
        if role == "user":
            return None  # a user message after the last answer: the model speaks next
    return None


def _answered(messages: Sequence[dict[str, Any]], a: int) -> set[str]:
    out = set()
    for m in messages[a + 1 :]:
        if m.get("role") == "tool":
            for p in m.get("content") or ():
                if p.get("type") == "tool_result":
                    out.add(p["call_id"])
    return out


def _cancelled_results(messages: Sequence[dict[str, Any]], start: int, state: LoopState) -> list[dict[str, Any]]:
    """A cancelled run's results for its calls from ``start`` on that have none: ``cancelled``,
    saying whether the call had started (it may have taken effect) or never ran."""
    return _dangling_results(messages, start, reason="cancelled", text="The run was cancelled before this call ran.",
                             started=state.calls,
                             started_text="The run was cancelled while this call ran; it may have taken effect.")


def _dangling_results(
    messages: Sequence[dict[str, Any]],
    start: int,
    *,
    reason: str,
    text: str = "The tool call was interrupted; it was not run again.",
    started: dict[str, Any] | None = None,
    started_text: str | None = None,
) -> list[dict[str, Any]]:
    """Synthetic error results for every tool call from ``start`` on that has none.

    A result answers the latest earlier call with its id that has none, so an id reused
    after its call was answered leaves neither call looking answered wrongly (the runner
    keeps new ids unique, see _unique_call_ids, but a history may hold repeats it did not
    write: local servers number calls per response)."""
    calls: list[dict[str, Any] | None] = []
    open_: dict[str, list[int]] = {}  # call id -> indices in ``calls`` still without a result
    for m in messages[start:]:
        if m.get("role") == "assistant":
            for c in M.tool_calls_of(m):
                open_.setdefault(c["id"], []).append(len(calls))
                calls.append(c)
        elif m.get("role") == "tool":
            for p in m.get("content") or ():
                if p.get("type") == "tool_result":
                    waiting = open_.get(p["call_id"])
                    if waiting:
                        calls[waiting.pop()] = None
    out = []
    for c in calls:
        if c is None:
            continue
        was_started = started is not None and (started.get(c["id"]) or {}).get("state") == CALL_STARTED
        body = started_text if (was_started and started_text) else text
        out.append(M.tool_results([M.tool_result(c["id"], c["name"], body, is_error=True, reason=reason)]))
    return out
