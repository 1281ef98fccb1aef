"""The embedded Runtime: the loop's public face over storage.

    async with Runtime.open("./data") as rt:            # any kv url; memory: for tests
        outcome = await rt.run(agent, "conv-1", "hello")  # submit + wait for the settled outcome
        ack = await rt.submit(agent, "conv-1", "more")    # durable acknowledgement, no waiting
        async for ev in rt.events("conv-1", after=ack.cursor): ...
        await rt.cancel(ack.run_id)
        await rt.approve(run_id, call_id, allow=True, reason="ok")

Opening a runtime starts ``workers`` claim loops in its nursery (default 1),
which also recover what a crash left: a run whose lease lapsed (its process
was killed) is taken over by the next claim, and its next attempt finalises
the tool calls that were started but never returned as ``interrupted``.  A
clean shutdown (Ctrl-C, leaving the ``async with``) releases the leases of
runs in flight, so the next process resumes them at once; after a SIGKILL
the takeover waits for the lease to lapse (``lease_seconds``, default 10).
``await rt.serve(workers=N)`` runs more claim loops until cancelled.

Agents are configuration, not data: a run records its agent's *name* (and
its model spec and instructions when the model is a spec string), and a
worker runs it with the agent registered under that name (``agents=[...]``
at open, or any agent passed to ``run``/``submit``).  A run whose agent is
unknown to this process runs with an agent rebuilt from that record, with
no tools (its tool calls get ``unknown_tool`` results).

Prices are configuration of the runtime, not of an agent: ``pricing={model:
Price(...)}`` (see :mod:`loop.pricing`) prices every agent's model by its
spec or name, the agents rebuilt from a run's record included, so a cost
ceiling (``limits={"max_cost_micros": n}``) is enforced wherever the run is
driven.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

import trio

import kv
from sessions import events as E
from ledger.usage import check_limits
from sessions.errors import NotFound as SessionNotFound

from .agents import Agent
from .calls import SYSTEM_CLOCK, Clock
from .errors import LoopError, MissingPrice
from .pricing import Price, check_pricing, model_label, price_for
from .providers import Provider, make_provider
from .runner import LeaseKeeper, Runner
from .store import Claim, Store, check_lease_seconds

log = logging.getLogger(__name__)

__all__ = ["Runtime", "Acknowledgement", "Outcome", "RunInfo", "DEFAULT_URL", "DEFAULT_WORKERS", "NotFound"]

DEFAULT_URL = "./surefoot-data"
DEFAULT_WORKERS = 1
# Idle claim loops sleep on the ledger's ready signal (a watch: any process's
# submission wakes them) and until the earliest lease expiry; this bounds the
# sleep anyway, as a safety net against a missed wake-up.
IDLE_POLL_SECONDS = 2.0
MAX_WORKERS = 1_024
# Idle claim loops of one runtime that look for work at the same time.  The
# others queue (FIFO) behind them in memory: without this bound every
# submission woke *every* idle worker (32 in the benchmark), each running a
# claim and a wait transaction for the one run — a thundering herd that cost
# far more than the turn itself.  A worker that gets a run leaves the queue at
# once, so the next one starts looking immediately (a burst is claimed by a
# relay of workers, CLAIMERS at a time).  Two, so a claim in flight (its
# commit) does not leave the queue unwatched.
CLAIMERS = 2
# ...but a relay of two serialises claims behind their commits when work piles
# up, so a claim that saw more claimable runs (``lease.backlog``) opens one more
# seat, up to this many extra; a seat holder that then finds nothing closes one.
MAX_EXTRA_CLAIMERS = 14

assert IDLE_POLL_SECONDS > 0 and MAX_WORKERS > 0 and CLAIMERS >= 1 and MAX_EXTRA_CLAIMERS >= 0

# The cyclic collector's thresholds while a runtime is open (``surefoot serve`` sets the same,
# server.serve imports these). A turn's objects die by reference count (bench_turns at 32
# conversations: the young and middle collections freed nothing, the full ones 154 objects in
# 3,200 turns), yet with CPython's
# defaults the young generation was collected every ~10 turns, each collection walking the
# thousands of objects the turns in flight hold (~2 ms each on the reference VM), the middle
# generation every ~100 turns and the whole heap every ~1,000 (50-150 ms): 12-16% of the CPU of
# a turn at 32 concurrent conversations. At these thresholds the young generation is collected
# ~30 times less often; cyclic garbage still is, within ~20,000 allocations.
GC_THRESHOLDS = (20_000, 20, 20)
# CPython's own defaults: only a process still at them is tuned (an application that chose its
# thresholds, the simulator's runs, a server that tuned them first, keep theirs).
PYTHON_GC_THRESHOLDS = (700, 10, 10)
assert all(t > 0 for t in GC_THRESHOLDS)


class _GcTuning:
    """GC_THRESHOLDS while at least one runtime that asked for them is open (they are the
    process's, so counted across runtimes); the previous thresholds come back when the last
    one closes, unless someone changed them meanwhile."""

    holders = 0
    saved: tuple[int, ...] | None = None  # the thresholds before, when this changed them

    @classmethod
    def acquire(cls) -> None:
        if cls.holders == 0:
            now = gc.get_threshold()
            cls.saved = None
            if now == PYTHON_GC_THRESHOLDS:
                gc.set_threshold(*GC_THRESHOLDS)
                cls.saved = now
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders -= 1
        assert cls.holders >= 0
        if cls.holders == 0 and cls.saved is not None:
            if gc.get_threshold() == GC_THRESHOLDS:
                gc.set_threshold(*cls.saved)
            cls.saved = None

SETTLED = {E.RUN_COMPLETED: "completed", E.RUN_FAILED: "failed", E.RUN_CANCELLED: "cancelled"}


class _IdleWorker:
    """A claim loop waiting for work, offered to this runtime's submits (``Runtime._idle``).

    A submit takes the oldest one (``reserved``), wakes it (``scope``), and claims the
    run for it inside the submitting transaction (``Ledger.submit_and_claim``); the
    worker waits for ``done`` and drives ``claim`` (None: the run queued behind
    another, or the id was already used, and the worker looks for work as usual).
    The worker count still bounds the runs this process drives: a submit hands a run
    only to a worker that was idle, and submits with no idle worker go through the
    ready index as before."""

    __slots__ = ("worker", "scope", "done", "reserved", "claim")

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.reserved = False
        self.claim: Claim | None = None


class NotFound(LoopError):
    """No such run / conversation for this owner (a foreign one looks the same)."""


@dataclass(frozen=True)
class Acknowledgement:
    """What ``submit`` returns once the submission is durable."""

    submission_id: str
    run_id: str
    cursor: str | None  # journal position of the run's run.queued event (resume events after it)
    status: str  # "queued" | "running" | "parked" | a settled status for a duplicate submission
    conversation: str
    duplicate: bool = False
    outcome: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Outcome:
    """A settled run: ``status`` completed | failed | cancelled."""

    run_id: str
    status: str
    result: Any = None
    text: str | None = None
    error: Mapping[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    @classmethod
    def from_record(cls, run_id: str, outcome: Mapping[str, Any]) -> "Outcome":
        return cls(run_id, outcome.get("status", "unknown"), outcome.get("result"), outcome.get("text"), outcome.get("error"))


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    conversation: str
    status: str  # queued | running | parked | completed | failed | cancelled
    attempt: int
    agent: str | None
    submission_id: str | None
    created: float | None
    outcome: Mapping[str, Any] | None = None
    pending_approvals: Sequence[str] = field(default_factory=tuple)
    cancel_requested: bool = False


class Runtime:
    """The embedded profile.  Construct with :meth:`open`."""

    def __init__(
        self,
        db: Any,
        *,
        owner: str | None = None,
        clock: Clock | None = None,
        root: kv.Subspace | None = None,
        lease_seconds: float | None = None,
        agents: Sequence[Agent] = (),
        max_attempts: int | None = None,
        journal_retention: int | None = None,
        release_on_shutdown: bool = True,
        pricing: Mapping[str, Price] | None = None,
    ) -> None:
        self.db = db
        # model spec / name -> Price (loop.pricing); ValueError for a bad table, at construction.
        self.pricing = check_pricing(pricing)
        self.clock = clock or SYSTEM_CLOCK
        self.store = Store(
            db,
            root=root,
            clock=self.clock,
            lease_seconds=lease_seconds,
            max_attempts=max_attempts,
            journal_retention=journal_retention,
        )
        self.owner = owner or self.store.default_owner
        # Give in-flight runs back on a clean shutdown (False: behave like a crash,
        # leaving the lease to lapse — tests of takeover use it).
        self.release_on_shutdown = release_on_shutdown
        self._active: dict[str, Any] = {}  # run id -> its Runner, while this process drives it
        self._keeper = LeaseKeeper(self)  # renews their leases, polls their cancel records
        self._agents: dict[str, Agent] = {}
        self._providers: dict[str, Provider] = {}
        self._prices: dict[str, Price | None] = {}  # agent name -> its model's price (cached like providers)
        self._nursery: trio.Nursery | None = None
        self.worker_prefix = f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._worker_seq = 0
        self._claimers = trio.Semaphore(CLAIMERS)  # seats of idle workers looking for work: see CLAIMERS
        self._extra_seats = 0  # seats opened beyond CLAIMERS because of a backlog
        self._idle: collections.deque[_IdleWorker] = collections.deque()  # seated workers waiting for work
        for a in agents:
            self.register(a)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str = DEFAULT_URL,
        *,
        workers: int = DEFAULT_WORKERS,
        db: Any = None,
        tune_gc: bool = True,
        **kw: Any,
    ) -> AsyncIterator["Runtime"]:
        """``async with Runtime.open(url) as rt``: open storage, recover, start ``workers`` claim loops.

        ``db`` passes an already-open kv database instead of a url (not closed on exit).
        ``tune_gc``: while it is open, a process still at CPython's default collector
        thresholds gets :data:`GC_THRESHOLDS` (see there; the old ones come back at exit);
        False leaves the collector alone.
        """
        assert 0 <= workers <= MAX_WORKERS
        # Bad arguments are refused before storage is opened (which would create a data directory).
        check_lease_seconds(kw.get("lease_seconds"))
        check_pricing(kw.get("pricing"))
        own_db = db is None
        if db is None:
            db = await kv.open(url)
        if tune_gc:
            _GcTuning.acquire()
        try:
            rt = cls(db, **kw)
            async with trio.open_nursery() as nursery:
                rt._nursery = nursery
                await rt.store.start(nursery)
                await nursery.start(rt._keeper.run)
                for _ in range(workers):
                    nursery.start_soon(rt._claim_loop)
                try:
                    yield rt
                finally:
                    nursery.cancel_scope.cancel()
                    for p in list(rt._providers.values()):
                        with trio.CancelScope(shield=True):
                            try:
                                await p.aclose()
                            except Exception:  # noqa: BLE001
                                pass
        finally:
            if tune_gc:
                _GcTuning.release()
            if own_db:
                await db.close()

    async def serve(self, workers: int = 4) -> None:
        """Run ``workers`` more claim loops until cancelled (the server profile)."""
        assert 0 < workers <= MAX_WORKERS
        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(self._claim_loop)

    # ------------------------------------------------------------------ agents

    def register(self, agent: Agent) -> Agent:
        """Make ``agent`` the one runs naming it execute with (replacing an earlier one)."""
        old = self._agents.get(agent.name)
        if old is not None and old is not agent:
            self._providers.pop(agent.name, None)
            self._prices.pop(agent.name, None)
        self._agents[agent.name] = agent
        return agent

    def provider_for(self, agent: Agent) -> Provider:
        p = self._providers.get(agent.name)
        if p is None:
            p = make_provider(agent.model)
            self._providers[agent.name] = p
        return p

    def price_for(self, agent: Agent) -> Price | None:
        """The price of ``agent``'s model in this runtime's ``pricing`` (``FREE`` for the
        offline models); None when it has none (a cost ceiling then cannot be enforced)."""
        name = agent.name
        if name in self._prices and self._agents.get(name) is agent:
            return self._prices[name]
        p = price_for(self.pricing, agent.model)
        if self._agents.get(name) is agent:
            self._prices[name] = p
        return p

    def _check_limits(self, agent: Agent, limits: Mapping[str, int] | None) -> None:
        """Refuse, before anything is written, a cost ceiling this runtime cannot enforce.

        This is the earliest point where the run's model is known (the agent is in hand);
        a worker that claims a run submitted elsewhere checks again (``Runner``: the run
        then fails ``missing_price``), since its own pricing is what enforces it.  Malformed
        ceilings are a ``ValueError`` naming them (the ledger's ``check_limits``)."""
        limits = check_limits(limits)
        if limits and limits.get("max_cost_micros") is not None and self.price_for(agent) is None:
            raise MissingPrice(
                f"run refused: it has a cost ceiling (max_cost_micros={limits['max_cost_micros']}) but model "
                f"{model_label(agent.model)!r} of agent {agent.name!r} has no price; pass "
                f"Runtime(pricing={{{model_label(agent.model)!r}: Price(...)}})")

    def _agent_for(self, claim: Claim) -> Agent:
        d = claim.delivery
        if type(d) is not dict and not isinstance(d, Mapping):  # (a dict first: see Store._claim_of)
            d = {}
        name = d.get("agent") or "default"
        a = self._agents.get(name)
        if a is not None:
            return a
        log.warning("run %s: agent %r is not registered here; running it without tools", claim.run_id, name)
        a = Agent(name, d.get("instructions") or "", d.get("model") or "echo")
        self._agents[name] = a
        return a

    # ------------------------------------------------------------------ submitting

    async def submit(
        self,
        agent: Agent,
        conversation: str,
        message: str | Mapping[str, Any],
        *,
        submission_id: str | None = None,
        result_schema: Mapping[str, Any] | None = None,
        owner: str | None = None,
        policy: str = "queue",
        limits: Mapping[str, int] | None = None,
    ) -> Acknowledgement:
        """Durably accept a run; returns once the acknowledgement is committed.

        The same ``submission_id`` with the same request returns the same run
        (or its settled outcome); with a different request it is a conflict
        (the ledger's ``SubmissionConflict``).  ``limits`` are the run's usage
        ceilings (``{"max_total_tokens": N}``, ``{"max_input_tokens": N}``...):
        a model call that would pass one is refused before it is made and the
        run fails with ``usage_limit``.  ``{"max_cost_micros": N}`` is a cost
        ceiling in micro-units of currency, priced by this runtime's ``pricing``
        (:mod:`loop.pricing`); for a model without a price it is refused here,
        with :class:`~loop.errors.MissingPrice` (a ``ValueError``), before anything
        is written.
        """
        self._check_limits(agent, limits)
        self.register(agent)
        tag = owner or self.owner
        sid = submission_id or self.store.new_id()
        delivery = self._delivery(agent, message, limits)
        schema = dict(result_schema) if result_schema else None
        if self._idle:
            # A claim loop of this runtime is idle: claim the run for it in the submitting
            # transaction and hand it over (one commit less, no ready entry, no worker woken
            # to look for it); see _IdleWorker.
            idle = self._idle.popleft()
            idle.reserved = True
            idle.scope.cancel()
            try:
                # Shielded: a submitter cancelled after the commit would otherwise leave a
                # run leased to a worker that never hears of it (until the lease lapses).
                with trio.CancelScope(shield=True):
                    ack, claim = await self.store.submit_and_claim(
                        tag, conversation, sid, delivery, schema, worker=idle.worker, prepare=self._prepare,
                        policy=policy, limits=limits)
                idle.claim = claim
            finally:
                idle.done.set()
            return ack
        return await self.store.submit(tag, conversation, sid, delivery, schema, policy=policy, limits=limits)

    @staticmethod
    def _delivery(agent: Agent, message: str | Mapping[str, Any], limits: Mapping[str, int] | None) -> dict[str, Any]:
        delivery: dict[str, Any] = {"agent": agent.name, "message": message if isinstance(message, str) else dict(message)}
        if isinstance(agent.model, str):
            delivery["model"] = agent.model
            delivery["instructions"] = agent.instructions
        if limits:
            delivery["limits"] = dict(limits)
        return delivery

    async def run(
        self,
        agent: Agent,
        conversation: str,
        message: str | Mapping[str, Any],
        *,
        submission_id: str | None = None,
        result_schema: Mapping[str, Any] | None = None,
        owner: str | None = None,
        limits: Mapping[str, int] | None = None,
    ) -> Outcome:
        """Submit and wait until the run settles; returns its :class:`Outcome` (never raises for a failed run).

        The caller is about to wait anyway, so this process drives the run itself: the
        submission, the claim and the run's first writes are one commit (the ledger's
        ``submit_and_claim``), the run executes in a task of the runtime (not the caller's:
        cancelling the wait neither stops nor interrupts it), and the outcome comes from
        that runner, with no transaction to read or watch it.  A run that must queue
        behind another of its conversation, or a submission id already used, is left to
        the claim loops and waited for as :meth:`wait` does; so is a run its runner
        stopped driving without settling (parked for approval, lease lost, a storage
        failure: it is re-claimed from storage).  A cost ceiling on an unpriced model
        raises :class:`~loop.errors.MissingPrice` as in :meth:`submit`.
        """
        self._check_limits(agent, limits)
        self.register(agent)
        tag = owner or self.owner
        nursery = self._nursery
        if nursery is None:  # not opened through Runtime.open: no task to drive it in
            ack = await self.submit(agent, conversation, message, submission_id=submission_id,
                                    result_schema=result_schema, owner=owner, limits=limits)
            return await self.wait(ack, owner=owner)
        ack, claim = await self.store.submit_and_claim(
            tag, conversation, submission_id or self.store.new_id(), self._delivery(agent, message, limits),
            dict(result_schema) if result_schema else None, worker=f"{self.worker_prefix}-run",
            prepare=self._prepare, limits=limits,
        )
        if claim is None:
            return await self.wait(ack, owner=owner)
        runner = Runner(self, claim, self._agent_for(claim))
        done = trio.Event()

        async def drive() -> None:
            try:
                await runner._execute(nursery)  # (Runner.execute with the runtime's nursery: a frame less)
            finally:
                done.set()

        nursery.start_soon(drive)
        await done.wait()
        if runner.settled is not None:
            return Outcome.from_record(ack.run_id, runner.settled)
        return await self.wait(ack, owner=owner)

    async def wait(self, ack: Acknowledgement | str, *, owner: str | None = None) -> Outcome:
        """Wait for an acknowledged run (or a run id) to settle; its :class:`Outcome`."""
        if isinstance(ack, Acknowledgement):
            if ack.outcome is not None:
                return Outcome.from_record(ack.run_id, ack.outcome)
            run_id = ack.run_id
        else:
            run_id = ack
        outcome = await self.store.wait_settled(run_id, owner or self.owner)
        return Outcome.from_record(run_id, outcome or {})

    # ------------------------------------------------------------------ reading

    async def events(
        self, conversation: str, after: str | None = None, *, owner: str | None = None
    ) -> AsyncIterator[Any]:
        """The conversation's journal: replay after ``after``, then live, forever (cancel to stop).

        Each event has ``cursor``, ``type``, ``data``, ``ts``.  Raises the
        journal's ``CursorBehind`` (with ``first_retained``) when the cursor
        fell behind retention.
        """
        try:
            async for ev in self.store.journal.follow(owner or self.owner, conversation, after):
                yield ev
        except SessionNotFound:
            raise NotFound(f"conversation {conversation!r} not found") from None

    async def read_events(self, conversation: str, after: str | None = None, *, limit: int = 256, owner: str | None = None) -> Any:
        """One page of the journal (no waiting): the journal's ``JournalPage``."""
        try:
            return await self.store.journal.read(owner or self.owner, conversation, after, limit)
        except SessionNotFound:
            raise NotFound(f"conversation {conversation!r} not found") from None

    async def get_run(self, run_id: str, *, owner: str | None = None) -> RunInfo:
        return await self.store.get_run(run_id, owner or self.owner)

    async def usage(self, run_id: str, *, owner: str | None = None) -> dict[str, int]:
        """The run's recorded usage totals: ``input_tokens``, ``output_tokens``, ``total_tokens``,
        cache fields, and ``cost_micros`` when its model is priced (each step counted once)."""
        return await self.store.usage_totals(run_id, owner or self.owner)

    async def transcript(self, conversation: str, *, start: int = 0, owner: str | None = None) -> list[dict[str, Any]]:
        """The conversation's messages from ``start`` (the full history, compaction entries included).

        Empty for a conversation whose first run has not started yet; NotFound for
        one this owner never had (a foreign one included).
        """
        tag = owner or self.owner
        try:
            return [m.data for m in await self.store.transcripts.read_all(tag, conversation, start)]
        except SessionNotFound:
            pass
        try:
            await self.store.journal.tail_cursor(tag, conversation)
        except SessionNotFound:
            raise NotFound(f"conversation {conversation!r} not found") from None
        return []

    async def fork(self, conversation: str, at: int, *, new_conversation: str | None = None, owner: str | None = None) -> str:
        """A new conversation holding messages [0, at) of ``conversation``; returns its id."""
        try:
            info = await self.store.transcripts.fork(owner or self.owner, conversation, at, new_session_id=new_conversation)
        except SessionNotFound:
            raise NotFound(f"conversation {conversation!r} not found") from None
        return info.id

    async def conversations(self, *, owner: str | None = None) -> list[str]:
        return await self.store.transcripts.list(owner or self.owner)

    async def runs(self, conversation: str | None = None, *, owner: str | None = None) -> list[RunInfo]:
        return await self.store.list_runs(owner or self.owner, conversation)

    # ------------------------------------------------------------------ control

    async def cancel(self, run_id: str, *, owner: str | None = None) -> RunInfo:
        """Durably request cancellation; a queued or parked run settles cancelled promptly."""
        info = await self.store.cancel(run_id, owner or self.owner)
        runner = self._active.get(run_id)
        if runner is not None:  # driven here: tell it now (other processes poll)
            runner._note_cancel()
        return info

    async def approve(
        self, run_id: str, call_id: str, allow: bool = True, reason: str | None = None, *, owner: str | None = None
    ) -> None:
        """Resolve a parked approval (works after a restart: nothing is held in memory)."""
        await self.store.resolve_approval(run_id, owner or self.owner, call_id, allow, reason)

    # ------------------------------------------------------------------ workers

    async def _prepare(self, tr: Any, claim: Claim) -> Any:
        """The claim hook (``Store.claim(prepare=...)``): a run's first writes, or, for the
        claim past its last attempt, its whole finalisation, commit with the claim."""
        if claim.lease.exhausted:
            return await Runner.finish_exhausted_in_claim(self.store, tr, claim)
        return await Runner.prepare_in_claim(self.store, tr, claim, self._agent_for(claim).name)

    async def _claim_loop(self) -> None:
        self._worker_seq += 1
        worker = f"{self.worker_prefix}-{self._worker_seq}"
        while True:
            claim = await self._next_claim(worker)
            agent = self._agent_for(claim)
            await Runner(self, claim, agent).execute()

    async def _next_claim(self, worker: str) -> Claim:
        """Take a seat (see CLAIMERS), claim a run, give the seat back."""
        await self._claimers.acquire()
        held = True
        try:
            while True:
                try:
                    # The run's first writes commit with the claim itself (Runner.prepare_in_claim).
                    claim = await self.store.claim(worker, self._prepare)
                except kv.KVError as e:
                    log.warning("%s: claim failed: %s", worker, e)
                    claim = None
                    await trio.sleep(IDLE_POLL_SECONDS)
                if claim is not None:
                    if claim.lease.backlog > 0 and self._extra_seats < MAX_EXTRA_CLAIMERS:
                        self._extra_seats += 1  # more is waiting: one more idle worker may look
                        self._claimers.release()
                    return claim
                if self._extra_seats > 0:
                    # Nothing found: close an extra seat (this one) and queue for a seat again.
                    self._extra_seats -= 1
                    held = False
                    await self._claimers.acquire()
                    held = True
                    continue
                idle = _IdleWorker(worker)
                self._idle.append(idle)
                try:
                    with idle.scope:
                        await self._wait_for_work(worker)
                except BaseException:  # cancelled (the runtime or serve() stopping): never offered again
                    if not idle.reserved:
                        self._idle.remove(idle)
                    else:
                        await self._hand_back(idle)
                    raise
                if not idle.reserved:
                    self._idle.remove(idle)
                    continue
                # A submit of this runtime took us while we waited: its transaction claims the
                # run for us (or finds it must queue: then we look for work as usual). Shielded
                # (one commit): a run claimed for us is then ours to drive, or to give back at
                # once if the runtime is shutting down (Runner.execute releases it).
                with trio.CancelScope(shield=True):
                    await idle.done.wait()
                if idle.claim is not None:
                    return idle.claim
        finally:
            if held:
                self._claimers.release()

    async def _hand_back(self, idle: _IdleWorker) -> None:
        """A worker stopping after a submit took it: give back a run claimed for it, so the
        next claim resumes it at once (as a runner stopping at shutdown does)."""
        with trio.CancelScope(shield=True):
            await idle.done.wait()
            if idle.claim is not None and self.release_on_shutdown:
                try:
                    await self.store.release(idle.claim)
                except Exception:  # noqa: BLE001 — best effort: the lease lapses anyway
                    log.debug("run %s: release after a stopped handover failed", idle.claim.run_id)

    async def _wait_for_work(self, worker: str) -> None:
        # Woken by the ledger's ready signal (any process), the earliest lease
        # expiry, or the poll interval.
        try:
            await self.store.wait_for_work(IDLE_POLL_SECONDS)
        except kv.KVError as e:
            log.warning("%s: waiting for work failed: %s", worker, e)
            await trio.sleep(IDLE_POLL_SECONDS)
