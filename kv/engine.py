"""The embedded engine's commit pipeline, shared by the memory and LMDB stores.

One :class:`Engine` plays FoundationDB's sequencer, resolver and commit
proxy for one process:

* **Versions.** Commit versions advance with the engine's clock at about
  1e6 per second (as FoundationDB's do), are strictly increasing, and are
  persisted with every batch, so a reopened store never reuses one.
* **Group commit.** A committing transaction joins the pending queue. If no
  batch is being written, it becomes the leader: it takes everything pending,
  resolves it in arrival order (each transaction checked against the ones
  accepted before it, which is the serialization order and the versionstamp's
  batch suffix), writes the accepted mutations as *one* store write (one
  LMDB transaction, one fsync), and wakes every waiter. Commits that arrive
  meanwhile form the next batch. There is no background task: the pipeline
  lives inside the awaiting commits, so nothing outlives the callers.
* **Watches** are checked after each applied batch.
* **Fault hooks** let the simulator crash the "process" before a batch is
  applied, after it is applied but before anyone hears, or turn a commit that
  did apply into ``commit_unknown_result``.
"""

from __future__ import annotations

import logging
import random
import time
import types
from operator import attrgetter
from typing import Any, Callable, Iterator, Protocol

import trio
from trio._core import _run as _trio_run  # the run state: see _deliver (trio is pinned in pyproject.toml)
from trio.lowlevel import reschedule, wait_task_rescheduled
from outcome import Value

from .errors import KVError
from .limits import MAX_BATCH_BYTES, MAX_BATCH_TRANSACTIONS, MAX_WATCHES, MVCC_WINDOW_VERSIONS, VERSIONS_PER_SECOND
from .resolver import Resolver

log = logging.getLogger(__name__)

__all__ = ["Engine", "Store", "Snapshot", "CommitRequest", "FaultHooks", "Watch", "Mutation"]

# A mutation, in transaction order: ("set", k, v) | ("clear", begin, end) | ("atomic", op, k, param)
Mutation = tuple


class Snapshot(Protocol):
    """A consistent view of the store at ``version`` (an MVCC read version)."""

    version: int

    def get(self, key: bytes) -> bytes | None: ...

    def range(self, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (0 = all) pairs in [begin, end), ascending or descending."""
        ...

    def close(self) -> None: ...


class Store(Protocol):
    """Durable (or not) storage under the engine: snapshots and atomic batches."""

    def committed_version(self) -> int: ...

    def snapshot(self) -> Snapshot: ...

    async def apply(self, version: int, mutations: list[Mutation]) -> None:
        """Apply one batch all-or-nothing and make it durable before returning."""
        ...

    def apply_sync(self, version: int, mutations: list[Mutation]) -> int | None:
        """``apply`` on the calling thread. A store may also offer
        ``can_apply_inline(mutations: int) -> bool``: whether the engine may call this on
        the event loop right now (see ``LmdbStore.can_apply_inline``), and
        ``checkpoint_after_inline: bool`` (default True): whether the commit
        then yields to the scheduler, and ``written_since(key, version) -> bool``:
        whether it wrote ``key`` at ``version`` or later (or may have: see
        ``Engine._check_watches``)."""
        ...

    def close(self) -> None: ...

    stats: dict[str, int]


class FaultHooks:
    """Injection points for the simulator. The defaults do nothing.

    A hook raises to inject: a ``KVError`` becomes that error for the caller;
    any other exception (e.g. the simulator's ``Crash``) is delivered to every
    waiter of the batch, modelling a process that died at that point.
    """

    def on_read(self, tr: Any) -> None:
        """Before a read is served (inject 1007 / 1009 like client BUGGIFY)."""

    def before_commit(self, tr: Any) -> None:
        """Before a transaction enters the pipeline (inject 1020 / 1007, or crash)."""

    def before_apply(self, version: int, batch: list["CommitRequest"]) -> None:
        """Resolved, not yet applied: raising here means the batch never happened."""

    def after_apply(self, version: int, batch: list["CommitRequest"]) -> dict["CommitRequest", BaseException] | None:
        """Applied and durable, nobody told yet: return errors to deliver instead of success."""
        return None


# What the pipeline carries: the committing kv Transaction itself (``Engine.commit(tr)``), not
# a request object built per commit and given the transaction's lists: that was a call, an
# allocation and sixteen slot stores a commit (instr.sh w64 46.65k -> 43.64k a commit, -6.5%,
# when dropped). The engine reads the attempt's own attributes, kept by the transaction as it
# goes (``_read_version``, ``_read_ranges``, ``_read_points``, ``_write_ranges``,
# ``_write_points``, ``_mutations``, ``_stamped``, ``_size``: see Transaction._clear_state),
# and owns six slots of it for the commit's course (``Engine.commit`` sets the last four on entry):
#   _batch_version    the version of the batch that accepted it: its commit version (set at resolve)
#   _batch_order      its position in that batch, the versionstamp's last two bytes (set at resolve)
#   _commit_error     the commit's failure (a BaseException), or None
#   _commit_answered  True once the pipeline is done with it (committed or failed)
#   _parked_task      the committer's trio task while it is parked, else None
#   _lead_batch       a submitted batch this waiter must see through (Engine._finish_submitted)
# Reading the transaction in place is exact: a committing transaction is frozen (every use is
# 2017 until reset/on_error, which start the next attempt with fresh lists), and
# ``Engine.commit`` does not return before the pipeline is done with it.
#
# The fault hooks (the simulator's, tests') see each accepted transaction as a CommitRequest
# (below), made for each hook call and only when hooks are installed.


Committing = Any  # a kv Transaction handed to Engine.commit (see above)


def _stamp(version: int, order: int) -> bytes:
    """The 10-byte versionstamp of the request at ``order`` in the batch at ``version``."""
    return version.to_bytes(8, "big") + order.to_bytes(2, "big")


class CommitRequest:
    """An accepted transaction as the fault hooks see it (``before_apply`` / ``after_apply``):
    what it sent to the pipeline (its lists, not copies; ``write_points`` without a stamped
    key's final key) and where it landed (``batch_version``, ``order``, ``stamp``); ``tag`` is
    the transaction. Made by :func:`_hook_requests` for each hook call (the two hooks of a
    batch get different objects), only when hooks are installed: the pipeline itself carries
    the transactions (see above). ``after_apply`` returns failures keyed by these requests."""

    __slots__ = ("read_version", "read_ranges", "write_ranges", "mutations", "read_points",
                 "write_points", "stamped", "size", "tag", "batch_version", "order")

    @property
    def stamp(self) -> bytes | None:
        """The 10-byte versionstamp (commit version + batch order), once accepted."""
        if self.order < 0:
            return None
        return _stamp(self.batch_version, self.order)

    def __repr__(self) -> str:
        return f"<CommitRequest rv={self.read_version} version={self.batch_version} order={self.order}>"


def _hook_requests(batch: list[Any]) -> list[CommitRequest]:
    """The hooks' view of ``batch`` (committing transactions, resolved): a CommitRequest each."""
    out = []
    for tr in batch:
        req = object.__new__(CommitRequest)
        req.read_version = tr._read_version
        req.read_ranges = tr._read_ranges
        req.write_ranges = tr._write_ranges
        req.mutations = tr._mutations
        req.read_points = tr._read_points
        req.write_points = tr._write_points
        req.stamped = tr._stamped
        req.size = tr._size
        req.tag = tr
        req.batch_version = tr._batch_version
        req.order = tr._batch_order
        out.append(req)
    return out


class Watch:
    """A one-shot notification that a key's value changed after a commit.

    ``await watch`` (or ``await watch.wait()``) returns once the value
    differs from what the creating transaction saw; it is only armed when
    that transaction commits. A commit error is copied to the watch.
    """

    def __init__(self, engine: "Engine | None", key: bytes) -> None:
        self._engine = engine
        self.key = key
        self.seen: bytes | None = None
        self._event = trio.Event()
        self._error: BaseException | None = None
        self.armed = False

    def _fire(self, error: BaseException | None = None) -> None:
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        if self._engine is not None:
            self._engine._unregister_watch(self)

    @property
    def ready(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()
        if self._error is not None:
            raise self._error

    def __await__(self):
        return self.wait().__await__()

    def cancel(self) -> None:
        self._fire(KVError(1101, "watch cancelled"))


_request_size = attrgetter("_size")  # a committing transaction's size (Engine._take_batch)


def _refuse_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


# A committer parks once per commit (``Engine.commit``), woken by its batch's
# ``_deliver``. trio's own pair (``wait_task_rescheduled`` / ``reschedule``) builds
# a trap message, a coroutine and a ``Value(None)`` per park and unwraps the value:
# ~4 calls a commit that say nothing here, since the park refuses cancellation
# (``_refuse_abort``), so the only thing it is ever sent is "woken". So the
# engine yields one shared trap message itself (trio reads only its
# ``abort_func``) and wakes with one shared value (``_WOKEN``); a Value is not
# unwrapped (it holds no error), anything else sent in (nothing in this module
# sends anything else) is, so an error is raised as trio's call would. trio is pinned (pyproject.toml);
# on a trio without the private trap class the engine parks through the public call.
try:
    from trio._core._traps import CancelShieldedCheckpoint as _CancelShieldedCheckpoint
    from trio._core._traps import WaitTaskRescheduled as _WaitTaskRescheduled
except ImportError:  # pragma: no cover (another trio)
    _CancelShieldedCheckpoint = _WaitTaskRescheduled = None

_WOKEN = Value(None)  # never unwrapped (_park), so it can wake any number of parks

if _WaitTaskRescheduled is not None:
    _PARK_MESSAGE = _WaitTaskRescheduled(_refuse_abort)

    @types.coroutine
    def _park():
        """``await trio.lowlevel.wait_task_rescheduled(_refuse_abort)``, one generator deep."""
        sent = yield _PARK_MESSAGE
        if type(sent) is not Value:  # (_WOKEN, or trio's Value(None): nothing to unwrap)
            sent.unwrap()  # an Error: raised here, as trio's call would
else:  # pragma: no cover
    async def _park():
        await wait_task_rescheduled(_refuse_abort)

# The pipeline's two schedule points (after an inline commit; before writing a batch
# ahead) the same way: trio's cancel_shielded_checkpoint is a coroutine around this one
# yield, and unwraps the Value(None) trio sends back (one object.__setattr__ of a frozen
# attrs class). That value is always a fresh Value(None): only anything else is unwrapped.
if _CancelShieldedCheckpoint is not None:
    @types.coroutine
    def _schedule_point():
        """``await trio.lowlevel.cancel_shielded_checkpoint()``, one generator deep."""
        sent = yield _CancelShieldedCheckpoint
        if type(sent) is not Value:
            sent.unwrap()
else:  # pragma: no cover
    _schedule_point = trio.lowlevel.cancel_shielded_checkpoint


def _wake(req: "Committing") -> None:
    """Reschedule ``req``'s parked task, if it is parked (at most once per park)."""
    task, req._parked_task = req._parked_task, None
    if task is not None:
        reschedule(task, _WOKEN)


def _ahead_share(pending: int, out: int) -> int:
    """How many of ``pending`` requests to write behind a batch of ``out`` still syncing.

    All of them, unless they outnumber that batch: then half of the two
    together, the rest staying queued for the batch after. Why: each sync
    answers one batch, and the writers a batch answers come back, commit
    again and form the batch after next, so a split like 63 + 1 of 64
    writers repeats forever (measured: 1, 63, 1, 63, ...). Then the loop
    runs 63 commits while one sync is out, and idles through the whole
    sync of the lone commit. Evening the two out once keeps it even, and
    the loop has half the writers to run while each sync is out.
    """
    if pending <= out:
        return min(pending, MAX_BATCH_TRANSACTIONS)
    return min((pending + out + 1) // 2, MAX_BATCH_TRANSACTIONS)


def _stamp_into(payload: bytes, offset: int, stamp: bytes) -> bytes:
    return payload[:offset] + stamp + payload[offset + 10 :]


def _stamped_mutations(req: "Committing", version: int) -> tuple[list[Mutation], list[bytes]]:
    """``req``'s mutations with its versionstamps filled in (it is at order 0 of the batch at
    ``version``), a new list, and its write points with the stamped keys added, a new list
    too (the transaction's own lists stay as it made them)."""
    stamp = version.to_bytes(8, "big") + b"\x00\x00"  # (_stamp(version, 0))
    muts = list(req._mutations)
    points = list(req._write_points)
    for index, kind, key, value, offset in req._stamped:  # (_stamp_into inlined: ~3 a commit in a turn)
        if kind == "key":
            final = key[:offset] + stamp + key[offset + 10 :]
            muts[index] = ("set", final, value)
            points.append(final)
        else:
            muts[index] = ("set", key, value[:offset] + stamp + value[offset + 10 :])
    return muts, points


class Engine:
    """Sequencer + resolver + commit proxy over one :class:`Store`."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        hooks: FaultHooks | None = None,
        rng: random.Random | None = None,
        mvcc_window: int = MVCC_WINDOW_VERSIONS,
    ) -> None:
        self.store = store
        self.clock = clock
        self.hooks = hooks or FaultHooks()  # (sets self.hooked: see the property)
        self.random = rng or random.Random()
        self.mvcc_window = mvcc_window
        self.resolver = Resolver()
        # A store that can write synchronously may say when (``can_apply_inline``)
        # and whether the engine should yield after such a write.
        self._can_apply_inline: Callable[[int], bool] = getattr(store, "can_apply_inline", lambda n: False)
        self._checkpoint_after_inline: bool = getattr(store, "checkpoint_after_inline", True)
        # A store that syncs off the event loop may accept a batch without being
        # awaited (``submit(version, mutations) -> job``, ``await job.wait()``):
        # the engine then hands it the next batch the moment one is durable.
        self._submit: Callable[[int, list[Mutation]], Any] | None = getattr(store, "submit", None)
        # Such a store may also take the next batch while one is still out
        # (``can_submit_ahead() -> bool``, asked each time): see _finish_submitted.
        self._submit_ahead: Callable[[], bool] | None = getattr(store, "can_submit_ahead", None)
        # A submitting store whose job waits refuse cancellation (``waits_refuse_cancel``)
        # lets the engine see a batch through without a shielded CancelScope (~48k
        # instructions entered and left): the pipeline's other waits are uncancellable already.
        self._waits_refuse_cancel: bool = self._submit is not None and bool(getattr(store, "waits_refuse_cancel", False))
        # A store may say whether it wrote a key at or after a version (``written_since(key,
        # version) -> bool``, true also for a key it is unsure of): the watch check after each
        # batch then asks it per watched key instead of walking the batch's mutations.
        self._written_since: Callable[[bytes, int], bool] | None = getattr(store, "written_since", None)
        self._last_version = store.committed_version()
        self._max_read_version = self._last_version
        self._applying_version: int | None = None  # the oldest batch out (written, not yet published)
        self._last_assigned = self._last_version  # the newest batch version handed out
        self._pending: list[Committing] = []
        self._writing = False
        self._handed_on = False  # the pipeline's owner gave it to a waiter (_hand): set per turn
        self._watches: dict[bytes, set[Watch]] = {}
        self._watch_count = 0
        self.closed = False
        self.stats = {"batches": 0, "commits": 0, "conflicts": 0, "too_old": 0, "inline_batches": 0,
                      "chained_batches": 0, "ahead_batches": 0}

    @property
    def hooks(self) -> FaultHooks:
        """The fault hooks (the simulator's, or a test's); assignable at any time."""
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: FaultHooks) -> None:
        self._hooks = hooks
        # Whether any hook can do something: the base class's do nothing, so without a
        # subclass every read and commit skips the calls (the transaction checks this too).
        self.hooked = type(hooks) is not FaultHooks

    # -- versions ---------------------------------------------------------

    def committed_version(self) -> int:
        return self._last_version

    def version_now(self) -> int:
        """The version a commit would get about now (for too-old checks)."""
        return max(self._last_version, int(self.clock() * VERSIONS_PER_SECOND))

    def read_version_for(self, snapshot_version: int) -> int:
        """The read version of a transaction whose storage snapshot is at ``snapshot_version``.

        Like FoundationDB's GRV it keeps advancing with the clock between
        commits (so an idle store's readers are not "too old"), but it stays
        below the version of any batch the snapshot does not contain, and every
        later commit gets a higher version (``_next_version``).
        """
        # (one per transaction that reads: comparisons, not max/min calls)
        rv = int(self.clock() * VERSIONS_PER_SECOND)
        if rv < snapshot_version:
            rv = snapshot_version
        else:
            applying = self._applying_version
            if applying is not None and snapshot_version < applying <= rv:
                rv = applying - 1  # (>= snapshot_version)
        if rv > self._max_read_version:
            self._max_read_version = rv
        return rv

    def _next_version(self) -> int:
        """Above every committed version and every read version handed out; else the clock's."""
        floor = self._last_version if self._last_version > self._max_read_version else self._max_read_version
        if self._last_assigned > floor:  # a batch still out (submitted ahead) has the newest version
            floor = self._last_assigned
        v = int(self.clock() * VERSIONS_PER_SECOND)
        v = v if v > floor else floor + 1
        self._last_assigned = v
        return v

    def check_read_version(self, read_version: int) -> None:
        # (Transaction._get has this inlined: change the two together)
        # version_now() inlined: called for every read after a transaction's first (~13 a turn)
        now = int(self.clock() * VERSIONS_PER_SECOND)
        if read_version < (now if now > self._last_version else self._last_version) - self.mvcc_window:
            raise KVError(1007, "read version is older than the MVCC window")

    # -- commits ----------------------------------------------------------

    async def commit(self, req: Committing) -> None:
        """Resolve and durably apply ``req``, a committing transaction (see Committing),
        with whatever else is pending.

        Not cancellable once called: a commit handed to the pipeline may or may
        not happen, so the caller must not walk away half-way (FoundationDB's
        rule: never cancel a commit). Waiters park uninterruptibly
        (``Abort.FAILED``) and the leader's batch is shielded; a cancellation
        arriving meanwhile is delivered at the caller's next checkpoint.

        Each waiter is woken exactly once per park: because its batch is done,
        or because it was chosen to lead the next batch. Finishing a batch
        wakes its members plus one new leader, never the whole queue.
        """
        if self.closed:
            raise KVError(2000, "database is closed")
        # (the slots the engine owns for the commit's course: see Committing)
        req._commit_answered = False
        req._commit_error = req._parked_task = req._lead_batch = None
        self._pending.append(req)
        while not req._commit_answered:
            if req._lead_batch is not None:
                # The batch ahead of ours handed us the one we are in, already
                # on its way to disk: see it through, then pass the pipeline on.
                lead, req._lead_batch = req._lead_batch, None
                self._handed_on = False
                try:
                    if self._waits_refuse_cancel:
                        await self._finish_submitted(*lead)
                    else:
                        with trio.CancelScope(shield=True):
                            await self._finish_submitted(*lead)
                finally:
                    # (also when it raised: a batch behind it may have been handed on first)
                    if not self._handed_on:
                        self._release_pipeline()
            elif not self._writing:
                self._writing = True
                inline = self._handed_on = False
                try:
                    batch = self._take_batch()
                    if batch and self._can_apply_inline(
                            len(batch[0]._mutations) if len(batch) == 1 else sum([len(r._mutations) for r in batch])):
                        # Nothing else could run meanwhile: resolve, write and
                        # finish without a thread hop or a cancel scope (no
                        # await happens in between, so nothing can cancel it).
                        inline = True
                        self.stats["inline_batches"] += 1
                        self._write_inline(batch)
                    elif batch:
                        if self._waits_refuse_cancel:  # (no await in there a cancellation can end)
                            await self._write_one_batch(batch)
                        else:
                            with trio.CancelScope(shield=True):
                                await self._write_one_batch(batch)
                finally:
                    if not self._handed_on:
                        self._release_pipeline()
                if inline and self._checkpoint_after_inline:
                    # A schedule point, so a loop of inline commits still lets I/O in. Every
                    # time (~19 us): skipping it unless something looked ready (runq, a ready
                    # epoll, a due timer; ~2 us to ask) was tried on 2026-11-30 and let a
                    # reader in between 4 of 10 commits, not 9 (test_lmdb_store): a task
                    # woken into trio's current batch is invisible from here.
                    await _schedule_point()
            else:
                req._parked_task = _trio_run.GLOBAL_RUN_CONTEXT.task  # (current_task() without the call)
                await _park()
        if req._commit_error is not None:
            raise req._commit_error

    def _release_pipeline(self) -> None:
        self._writing = False
        if self._pending:  # hand the pipeline to the next waiter
            _wake(self._pending[0])

    def _take_batch(self, most: int = MAX_BATCH_TRANSACTIONS) -> list[Committing]:
        """The next batch: the pending requests from the front, at most ``most`` of them
        (and within MAX_BATCH_TRANSACTIONS / MAX_BATCH_BYTES)."""
        assert 0 < most <= MAX_BATCH_TRANSACTIONS
        pending = self._pending
        if len(pending) == 1 and pending[0]._size <= MAX_BATCH_BYTES:  # a lone request (every inline commit)
            self._pending = []
            return pending
        if len(pending) <= most and sum(map(_request_size, pending)) <= MAX_BATCH_BYTES:
            # The usual case, the whole queue fits (the loop below would take it all):
            # summed in C, not one Python iteration per request.
            self._pending = []
            return pending
        n = size = 0
        for r in self._pending:
            if n >= most or (n and size + r._size > MAX_BATCH_BYTES):
                break
            n += 1
            size += r._size
        batch = self._pending[:n]
        del self._pending[:n]
        return batch

    def _resolve(self, batch: list[Committing]) -> tuple[int, list[Committing], list[Mutation]]:
        """Check ``batch`` in order against the MVCC window and the resolver.

        Returns the batch's version, the accepted requests (stamped, their
        writes recorded in the resolver) and their mutations in order; the
        rejected ones carry their error.

        The accepted requests' writes reach the resolver in one ``add`` per
        run of requests between two that read (all at the batch's version, so
        one call records exactly what one call per request would): a batch of
        blind writes, the common case under load, pays for one call, not one
        per commit. They are always added before a later request of the batch
        is checked, since each is checked against the ones accepted before it.
        A request without read conflicts cannot conflict and is not checked.
        """
        version = self._next_version()
        if len(batch) == 1:
            # A lone request (every commit of the memory engine, a lone durable one): the
            # loop below, for one request, without its lists. Its own list of mutations
            # serves when nothing is stamped: nothing writes to it.
            req = batch[0]
            if req._read_ranges or req._read_points:
                if req._read_version < version - self.mvcc_window:
                    req._commit_error = KVError(1007, "read version is older than the MVCC window")
                    self.stats["too_old"] += 1
                    return version, [], []
                if self.resolver.conflicts(req._read_ranges, req._read_version, req._read_points):
                    req._commit_error = KVError(1020)
                    self.stats["conflicts"] += 1
                    return version, [], []
            req._batch_version = version
            req._batch_order = 0
            if req._stamped:
                muts, points = _stamped_mutations(req, version)
            else:
                muts, points = req._mutations, req._write_points
            if points or req._write_ranges:
                self.resolver.add(version, req._write_ranges, points)
            return version, [req], muts
        accepted: list[Committing] = []
        mutations: list[Mutation] = []
        window_floor = version - self.mvcc_window
        resolver = self.resolver
        unadded_points: list[bytes] = []  # accepted writes not yet given to the resolver
        unadded_ranges: list[tuple[bytes, bytes]] = []
        for req in batch:
            if req._read_ranges or req._read_points:
                if req._read_version < window_floor:
                    req._commit_error = KVError(1007, "read version is older than the MVCC window")
                    self.stats["too_old"] += 1
                    continue
                if unadded_points or unadded_ranges:
                    resolver.add(version, unadded_ranges, unadded_points)
                    unadded_points, unadded_ranges = [], []
                if resolver.conflicts(req._read_ranges, req._read_version, req._read_points):
                    req._commit_error = KVError(1020)
                    self.stats["conflicts"] += 1
                    continue
            req._batch_version = version
            req._batch_order = len(accepted)
            base = len(mutations)
            mutations += req._mutations
            unadded_points += req._write_points
            if req._stamped:
                # (_stamped_mutations without its copies: the stamps go straight into the
                # batch's own lists; the request's lists stay as the transaction made them)
                stamp = _stamp(version, req._batch_order)
                for index, kind, key, value, offset in req._stamped:
                    if kind == "key":
                        final = key[:offset] + stamp + key[offset + 10 :]
                        mutations[base + index] = ("set", final, value)
                        unadded_points.append(final)
                    else:
                        mutations[base + index] = ("set", key, value[:offset] + stamp + value[offset + 10 :])
            if req._write_ranges:
                unadded_ranges += req._write_ranges
            accepted.append(req)
        if unadded_points or unadded_ranges:
            resolver.add(version, unadded_ranges, unadded_points)
        return version, accepted, mutations

    def _applied(self, version: int, accepted: list[Committing], mutations: list[Mutation]) -> dict:
        """Bookkeeping once a batch is durable; returns the hooks' injected failures."""
        self._last_version = version
        self.stats["batches"] += 1
        self.stats["commits"] += len(accepted)
        self.resolver.forget_before(version - self.mvcc_window)
        if self._watches:  # (most batches: none armed)
            self._check_watches(version, mutations)
        if not self.hooked:
            return {}
        requests = _hook_requests(accepted)
        failures = self._hooks.after_apply(version, requests)
        if not failures:
            return {}
        # (keyed by the hooks' requests: each one's transaction is what the pipeline answers)
        return {req.tag: failures[req] for req in requests if req in failures}

    def _deliver(self, batch: list[Committing], version: int, failures: dict) -> None:
        if failures:  # a fault hook's (the simulator's) injected errors: look each request up
            for req in batch:
                if req._commit_error is None and req in failures:
                    req._commit_error = failures[req]
                req._commit_answered = True
                _wake(req)
            return
        # The common case, once per commit: _wake inlined, and the runner's own
        # reschedule called (trio.lowlevel.reschedule looks the runner up each time).
        resched = _trio_run.GLOBAL_RUN_CONTEXT.runner.reschedule
        for req in batch:  # (an accepted request's commit version is its _batch_version)
            req._commit_answered = True
            task, req._parked_task = req._parked_task, None
            if task is not None:
                resched(task, _WOKEN)

    def _fail(self, batch: list[Committing], version: int, exc: BaseException) -> None:
        """A crash or a storage failure: nobody in the batch committed (or knows)."""
        log.debug("batch at version %d failed: %r", version, exc)
        for req in batch:
            if req._commit_error is None:
                req._commit_error = exc
            req._commit_answered = True
            _wake(req)

    def _write_inline(self, batch: list[Committing]) -> None:
        """Resolve, apply and answer ``batch`` with the store's ``apply_sync``, on the loop.

        A plain call, not a coroutine: it never suspends, so nothing can
        cancel it half-way (and the memory engine, whose every commit is a
        batch written this way, does not build a coroutine per commit).
        ``_write_one_batch`` is the same for a store that is awaited.
        """
        version, accepted, mutations = self._resolve(batch)
        try:
            failures = {}
            if accepted:
                if self.closed:  # the store is closed: nothing may be written
                    raise KVError(2000, "database is closed")
                if self.hooked:
                    self._hooks.before_apply(version, _hook_requests(accepted))
                self.store.apply_sync(version, mutations)
                failures = self._applied(version, accepted, mutations)
        except BaseException as exc:
            self._fail(batch, version, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._deliver(batch, version, failures)

    async def _write_one_batch(self, batch: list[Committing]) -> None:
        """Resolve, apply and answer ``batch`` through a store that is awaited (its sync helper).

        The caller shields it while the store writes. If it handed the
        pipeline on to a waiter of the next batch, ``_handed_on`` says so
        (see ``_finish_submitted``).
        """
        version, accepted, mutations = self._resolve(batch)
        if self._submit is not None:
            job = self._start(batch, version, accepted, mutations)
            if job is None:
                return
            await self._finish_submitted(batch, version, accepted, mutations, job)
            return
        try:
            failures = {}
            if accepted:
                if self.closed:  # the store is closed (its sync helper gone): nothing would ever answer
                    raise KVError(2000, "database is closed")
                if self.hooked:
                    self._hooks.before_apply(version, _hook_requests(accepted))
                self._applying_version = version
                try:
                    await self.store.apply(version, mutations)
                finally:
                    self._applying_version = None
                failures = self._applied(version, accepted, mutations)
        except BaseException as exc:
            self._fail(batch, version, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._deliver(batch, version, failures)

    def _start(self, batch: list[Committing], version: int, accepted: list[Committing],
               mutations: list[Mutation]) -> Any:
        """Hand a resolved batch to the store (written, its sync under way); None if it is already answered."""
        if not accepted:
            self._deliver(batch, version, {})
            return None
        try:
            if self.closed:  # the store is closed (its sync helper gone): nothing would ever answer
                raise KVError(2000, "database is closed")
            if self.hooked:
                self._hooks.before_apply(version, _hook_requests(accepted))
            job = self._submit(version, mutations)
        except BaseException as exc:
            self._fail(batch, version, exc)
            if not isinstance(exc, Exception):
                raise
            return None
        if self._applying_version is None:
            self._applying_version = version
        return job

    def _start_next(self, most: int = MAX_BATCH_TRANSACTIONS) -> tuple | None:
        """Take (at most ``most`` requests), resolve and hand to the store the next pending
        batch; None if nothing is pending (or every batch taken was answered without a
        write: all conflicts)."""
        while self._pending and not self.closed:
            nbatch = self._take_batch(most)
            nversion, naccepted, nmutations = self._resolve(nbatch)
            njob = self._start(nbatch, nversion, naccepted, nmutations)
            if njob is not None:
                self.stats["chained_batches"] += 1
                return (nbatch, nversion, naccepted, nmutations, njob)
        return None

    def _hand(self, lead: tuple) -> None:
        """Give a batch that is out to its first waiter, who sees it through.

        The pipeline is then that waiter's: ``_handed_on`` tells the task
        giving it away (``commit``) not to release it, whether it returns or
        raises.
        """
        # Every request of that batch is a parked waiter (or already woken and
        # not yet run): its first one waits for it, then passes the pipeline on.
        waiter = lead[0][0]
        waiter._lead_batch = lead
        self._handed_on = True
        _wake(waiter)

    async def _finish_submitted(self, batch: list[Committing], version: int, accepted: list[Committing],
                                mutations: list[Mutation], job: Any) -> None:
        """Wait for a submitted batch, then hand on the next one before answering this one.

        Why: the commits that arrived while this batch was on disk are the
        next batch. Resolving it and giving it to the store here, as
        soon as this one is durable and before this batch's tasks are woken,
        keeps the disk busy; otherwise it idled while the loop ran this
        batch's woken tasks before the next leader got its turn. Versions
        stay in order: without a batch ahead, this one is booked
        (``_applied``, which publishes it in the store) before the next one
        is resolved and submitted.

        Ahead: a store that can (``can_submit_ahead``) is given the next
        batch while this one is still out, once the tasks running alongside
        this one had their turn (one checkpoint: the rest of this scheduler
        round, e.g. the previous batch's woken tasks, queue their commits).
        The loop hears a sync only between task steps, so otherwise the next
        batch's sync started only after the loop's current round; written
        behind this one, its sync starts as soon as this one's returns.
        Batches are still waited for, published and answered in version order.
        The batch written ahead takes at most its share of the queue
        (``_ahead_share``: about half of the commits out and queued), so the
        two batches in turn stay about even.

        If a waiter of the next batch now owns the pipeline, ``_hand`` set
        ``_handed_on``.
        """
        nxt = None
        if self._submit_ahead is not None and not self.closed:
            await _schedule_point()
            if self._pending and not self.closed and self._submit_ahead():
                nxt = self._start_next(_ahead_share(len(self._pending), len(batch)))
                if nxt is not None:
                    self.stats["ahead_batches"] += 1
        try:
            await job.wait()
        except BaseException as exc:
            self._applying_version = nxt[1] if nxt is not None else None
            self._failed_submitted(batch, version, exc, nxt)
            return
        self._applying_version = nxt[1] if nxt is not None else None
        try:
            failures = self._applied(version, accepted, mutations)
        except BaseException as exc:  # a fault hook: the batch is durable, nobody hears
            self._failed_submitted(batch, version, exc, nxt)
            return
        lead = nxt if nxt is not None else self._start_next()
        self._deliver(batch, version, failures)
        if lead is not None:
            self._hand(lead)

    def _failed_submitted(self, batch: list[Committing], version: int, exc: BaseException,
                          nxt: tuple | None) -> None:
        """A submitted batch failed (``exc``): its members carry the error; the batch
        written behind it, if any, is handed on to its waiter, who sees it through
        (and hears the store's verdict on it). An ``Exception`` is the members'
        answer and ends here; anything else (``KeyboardInterrupt``, a simulated
        crash) also propagates from this task, after the hand-over (``_hand``
        marks the pipeline given away, so ``commit`` does not release it too)."""
        self._fail(batch, version, exc)
        if nxt is not None:
            self._hand(nxt)
        if not isinstance(exc, Exception):
            raise exc

    # -- watches ----------------------------------------------------------

    def arm_watch(self, watch: Watch) -> None:
        """Activate ``watch`` after its transaction committed (or read-only finished)."""
        if watch.ready:
            return
        snap = self.store.snapshot()
        try:
            current = snap.get(watch.key)
        finally:
            snap.close()
        if current != watch.seen:
            watch._fire()
            return
        if self._watch_count >= MAX_WATCHES:
            watch._fire(KVError(1032))
            return
        self._watches.setdefault(watch.key, set()).add(watch)
        self._watch_count += 1
        watch.armed = True

    def _unregister_watch(self, watch: Watch) -> None:
        s = self._watches.get(watch.key)
        if s is not None and watch in s:
            s.discard(watch)
            self._watch_count -= 1
            if not s:
                del self._watches[watch.key]

    def _touched_watched_keys(self, mutations: list[Mutation]) -> Iterator[bytes]:
        watched = self._watches
        for m in mutations:
            if m[0] == "set":
                if m[1] in watched:
                    yield m[1]
            elif m[0] == "atomic":
                if m[2] in watched:
                    yield m[2]
            else:
                begin, end = m[1], m[2]
                for k in list(watched):
                    if begin <= k < end:
                        yield k

    def _check_watches(self, version: int, mutations: list[Mutation]) -> None:
        if not self._watches:
            return
        written_since = self._written_since
        if written_since is not None:
            # The store's own record of what it wrote, asked once per watched key (a runtime
            # keeps a few armed), not a pass over the batch's mutations (~47 a turn). It may
            # name a key the batch did not change (a batch written ahead of this one): an
            # armed watch's key holds the value it saw until a batch changes it (arm_watch
            # compares, and every batch that changes it is checked), so comparing again only
            # costs a read.
            keys = [k for k in self._watches if written_since(k, version)]
        else:
            keys = set(self._touched_watched_keys(mutations))
        if not keys:
            return
        snap = self.store.snapshot()
        try:
            for k in keys:
                current = snap.get(k)
                for w in list(self._watches.get(k, ())):
                    if current != w.seen:
                        w._fire()
        finally:
            snap.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for ws in list(self._watches.values()):
            for w in list(ws):
                w._fire(KVError(1101, "database closed"))
        self.store.close()

