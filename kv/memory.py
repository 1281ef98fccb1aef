"""The memory engine: MVCC in a dict of version histories, for tests and the simulator.

Not durable across processes, but *is* the "disk" of a simulated process:
a :class:`MemoryEngine` holds the committed data and versions and outlives
any number of :class:`~kv.Database` handles, so the simulator restarts a
runtime by dropping its handle and calling :meth:`MemoryEngine.database`
again on what survived.

Each key keeps a short history ``[(version, value or None), ...]``; a
snapshot at version V reads the newest entry <= V. Entries older than the
MVCC window are compacted away, which is safe because a read version that
old is refused with ``transaction_too_old``.
"""

from __future__ import annotations

import bisect
import random
import time
from collections import deque
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Callable

from sortedcontainers import SortedList

from .atomic import apply_atomic
from .keyindex import add_sorted
from .engine import Engine, FaultHooks, Mutation
from .limits import MVCC_WINDOW_VERSIONS

if TYPE_CHECKING:
    from .database import Database

__all__ = ["MemoryStore", "MemoryEngine", "MemoryState"]

_COMPACT_EVERY = 64  # batches between history compactions
_version_of = itemgetter(0)  # a history entry (version, value) -> its version, for bisect


class _MemorySnapshot:
    __slots__ = ("_store", "version")

    def __init__(self, store: "MemoryStore", version: int) -> None:
        self._store = store
        self.version = version

    def get(self, key: bytes) -> bytes | None:
        hist = self._store._hist.get(key)
        if not hist:
            return None
        v = self.version
        if hist[-1][0] <= v:
            return hist[-1][1]
        for ver, val in reversed(hist):
            if ver <= v:
                return val
        return None

    def range(self, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        if begin >= end:
            return out
        # get() inlined: range reads (journal pages, claim windows) are a hot path of the simulator.
        store = self._store
        if store._unindexed:
            store._index()
        hists = store._hist
        v = self.version
        for k in store._keys.irange(begin, end, inclusive=(True, False), reverse=reverse):
            hist = hists[k]
            ver, val = hist[-1]
            if ver > v:
                val = None
                for ver, old in reversed(hist):
                    if ver <= v:
                        val = old
                        break
            if val is not None:
                out.append((k, val))
                if limit and len(out) >= limit:
                    break
        return out

    def close(self) -> None:
        pass


class MemoryStore:
    """Versioned key-value data in memory; ``apply`` is atomic by construction."""

    def __init__(self, mvcc_window: int = MVCC_WINDOW_VERSIONS) -> None:
        self._hist: dict[bytes, list[tuple[int, bytes | None]]] = {}
        # The keys with a history, in order, for range reads and range clears. Keys first
        # written since the last such walk wait in _unindexed (a dict insert is a fraction
        # of a sorted one, and write-only traffic never pays for the order): measured at
        # 64 concurrent blind writers, ~8% of a commit's CPU. A key is in exactly one of
        # the two while it has a history.
        self._keys: SortedList = SortedList()
        self._unindexed: dict[bytes, None] = {}  # a dict of None: never tracked by the collector
        self._version = 0
        self._recent: deque[tuple[int, list[bytes]]] = deque()
        self._mvcc_window = mvcc_window
        self._applied = 0
        self.stats = {"batches": 0, "bytes_written": 0, "fsyncs": 0}

    def committed_version(self) -> int:
        return self._version

    def snapshot(self) -> _MemorySnapshot:
        return _MemorySnapshot(self, self._version)

    def _index(self) -> None:
        """Bring the ordered key list up to date (before any walk over it)."""
        add_sorted(self._keys, sorted(self._unindexed))
        self._unindexed.clear()

    def _forget_key(self, key: bytes) -> None:
        if key in self._unindexed:
            del self._unindexed[key]
        else:
            self._keys.discard(key)

    def _latest(self, key: bytes) -> bytes | None:
        hist = self._hist.get(key)
        return hist[-1][1] if hist else None

    def written_since(self, key: bytes, version: int) -> bool:
        """Whether ``key``'s newest entry is at ``version`` or later (the engine's watch check);
        true too for a key without a history (a deletion compaction dropped: unsure)."""
        hist = self._hist.get(key)
        return hist is None or hist[-1][0] >= version

    def _put(self, version: int, key: bytes, value: bytes | None, touched: list[bytes]) -> None:
        hist = self._hist.get(key)
        if hist is None:
            if value is None:
                return
            self._hist[key] = [(version, value)]
            self._unindexed[key] = None
        elif hist[-1][0] == version:
            hist[-1] = (version, value)
        else:
            hist.append((version, value))
        touched.append(key)

    async def apply(self, version: int, mutations: list[Mutation]) -> None:
        self.apply_sync(version, mutations)

    # A memory write never waits, so the engine always writes inline (no
    # shielded cancel scope: that was a third of a commit's CPU) and, as
    # before, a lone commit does not yield: the simulator's schedules, which
    # decide where transactions interleave, stay exactly as they were.
    checkpoint_after_inline = False

    def can_apply_inline(self, mutations: int) -> bool:
        return True

    def apply_sync(self, version: int, mutations: list[Mutation]) -> None:
        assert version > self._version, (version, self._version)
        touched: list[bytes] = []
        nbytes = 0
        hists, unindexed = self._hist, self._unindexed
        for m in mutations:
            kind = m[0]
            if kind == "set":  # the common case, _put inlined
                key, value = m[1], m[2]
                hist = hists.get(key)
                if hist is None:
                    hists[key] = [(version, value)]
                    unindexed[key] = None
                elif hist[-1][0] == version:
                    hist[-1] = (version, value)
                else:
                    hist.append((version, value))
                touched.append(key)
                nbytes += len(key) + len(value)
            elif kind == "clear":
                begin, end = m[1], m[2]
                if len(end) == len(begin) + 1 and end[-1] == 0 and end.startswith(begin):
                    # one key (tr.clear(k), most clears): looked up, not found by a walk
                    # (_latest and _put inlined: ~3 a turn, each key there with a value)
                    hist = hists.get(begin)
                    if hist and hist[-1][1] is not None:
                        if hist[-1][0] == version:
                            hist[-1] = (version, None)
                        else:
                            hist.append((version, None))
                        touched.append(begin)
                else:
                    if unindexed:
                        self._index()
                    for k in list(self._keys.irange(begin, end, inclusive=(True, False))):
                        if self._latest(k) is not None:
                            self._put(version, k, None, touched)
                nbytes += len(m[1]) + len(m[2])
            else:  # ("atomic", op, key, param): _latest and _put inlined (~8 a turn: counters)
                _, op, key, param = m
                hist = hists.get(key)
                value = apply_atomic(op, hist[-1][1] if hist else None, param)
                if hist is None:
                    if value is not None:
                        hists[key] = [(version, value)]
                        unindexed[key] = None
                        touched.append(key)
                else:
                    if hist[-1][0] == version:
                        hist[-1] = (version, value)
                    else:
                        hist.append((version, value))
                    touched.append(key)
                nbytes += len(key) + len(param)
        self._version = version
        self._recent.append((version, touched))
        self.stats["batches"] += 1
        self.stats["bytes_written"] += nbytes
        self._applied += 1
        if self._applied % _COMPACT_EVERY == 0:
            self._compact(version - self._mvcc_window)

    def _compact(self, floor: int) -> None:
        """Forget history no read version >= ``floor`` can see.

        Each key a batch older than ``floor`` touched keeps its newest entry <= ``floor``
        (what a reader at ``floor`` sees) and everything after it; a key whose only entry
        left is a deletion <= ``floor`` goes altogether.

        A key is visited once per compaction however many of the popped batches touched it,
        and its cut is found by a bisection on the versions in place: a hot key rewritten by
        every batch has thousands of entries inside the window, and building the list of
        its versions for every batch that touched it made compaction O(history) per write
        (in a py-spy of a turn workload on the memory engine with one hot conversation,
        46% of its CPU). Store-level, one hot key and one fresh key a batch, 1,000 versions a
        batch (so the window holds 5,000 of its entries): 540.6k -> 18.6k instructions a
        batch (cachegrind, batches 2,000-8,000), ~79 -> ~3 us CPU.
        """
        recent = self._recent
        if not recent or recent[0][0] >= floor:
            return
        popped = []
        while recent and recent[0][0] < floor:
            popped.append(recent.popleft()[1])
        hists = self._hist
        # a dict of None, not a set: keeps the batches' order (and is never tracked by the collector)
        for k in dict.fromkeys(chain.from_iterable(popped)):
            hist = hists.get(k)
            if not hist:
                continue
            if len(hist) > 1:
                i = bisect.bisect_right(hist, floor, key=_version_of) - 1
                if i <= 0:
                    continue
                del hist[:i]
                if len(hist) > 1:
                    continue
            # one entry left: a deletion nobody can see past goes with its key
            if hist[0][1] is None and hist[0][0] <= floor:
                del hists[k]
                self._forget_key(k)

    def close(self) -> None:
        pass

    def _copy_state(self) -> tuple:
        """The committed data, its history and counters (see :class:`MemoryState`)."""
        return ({key: hist[:] for key, hist in self._hist.items()}, self._keys.copy(), dict(self._unindexed),
                self._version, deque(self._recent), self._applied, dict(self.stats))

    def _adopt_state(self, state: tuple) -> None:
        (self._hist, self._keys, self._unindexed, self._version, self._recent, self._applied,
         stats) = state
        self.stats.update(stats)  # (in place: a holder of .stats keeps seeing the live counters)


class MemoryState:
    """A copy of a :class:`MemoryEngine`'s committed state, from :meth:`MemoryEngine.snapshot_state`.

    For the simulator and tests only (``sim.resume`` starts a crash run from the state at its
    crash point instead of re-running the history up to it); not a backup facility, and
    unrelated to a transaction's read snapshot.

    What it copies: every key's version history (so MVCC reads at older versions still
    answer), the ordered key index, the store's version, compaction bookkeeping and
    stats, and the engine's version counters (last committed, highest read version handed
    out, last assigned) and stats. What it does not: the resolver's recent writes, armed
    watches, commits in flight, the hooks, clock and rng. So it describes an engine at
    rest, and is restored into one nothing has used yet, as after a restart: every
    transaction of the old process is gone and each new one reads at a later version,
    against which an empty resolver is exact.

    Cost: O(size) on both sides: one new list per key (the versions and values themselves
    are immutable and shared), plus copies of the index and bookkeeping. A state is
    restored at most once (its copies become the engine's); take another to restore twice.
    """

    __slots__ = ("_store", "_engine", "_restored")

    def __init__(self, store: tuple, engine: tuple) -> None:
        self._store = store
        self._engine = engine
        self._restored = False


class MemoryEngine:
    """The memory "cluster": data, versions, resolver and pipeline in one object.

    ``clock`` (seconds) drives commit versions and the MVCC window, so the
    simulator can run it on virtual time; ``hooks`` injects faults; ``rng``
    makes the retry backoff reproducible.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        hooks: FaultHooks | None = None,
        rng: random.Random | None = None,
        mvcc_window: int = MVCC_WINDOW_VERSIONS,
    ) -> None:
        self.store = MemoryStore(mvcc_window)
        self.engine = Engine(self.store, clock=clock, hooks=hooks, rng=rng, mvcc_window=mvcc_window)

    def database(self) -> "Database":
        from .database import Database

        return Database(self.engine, url="memory:", owns_engine=False)

    def snapshot_state(self) -> MemoryState:
        """A copy of the committed state, for :meth:`restore_state` (see :class:`MemoryState`)."""
        e = self.engine
        return MemoryState(self.store._copy_state(),
                           (e._last_version, e._max_read_version, e._last_assigned, dict(e.stats)))

    def restore_state(self, state: MemoryState) -> None:
        """Make ``state`` this engine's committed state (an engine nothing is using: see
        :class:`MemoryState`). The state's copies are taken over, not copied again, so a
        state can be restored only once."""
        if state._restored:
            raise RuntimeError("a MemoryState is restored at most once (its copies became an engine's)")
        e = self.engine
        assert not e._pending and not e._writing, "restore_state into an engine with commits in flight"
        state._restored = True
        self.store._adopt_state(state._store)
        e._last_version, e._max_read_version, e._last_assigned, stats = state._engine
        e.stats.update(stats)
