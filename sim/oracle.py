"""The kv serializability oracle (D. Scherer's versionstamp oracle, fdb-semantics.md section 4).

Every transaction of the simulated processes is a :class:`RecordingTransaction`:
it logs, out of band, each non-snapshot read with its result and the number
of its own mutations buffered at that moment.  The engine's ``after_apply``
hook hands the oracle each committed transaction with its commit version
and its order in the batch — exactly the versionstamp, i.e. the
serialization order, and the truth about every ``commit_unknown_result``.

:class:`Oracle` replays the committed transactions in versionstamp order
over a model dictionary, as they commit (the engine hands them over in
that order).  For each one it re-executes the logged
reads against (model state at its serialization point) overlaid with its
own earlier mutations, and demands the same answers: a transaction that
read something another transaction serialized before it had overwritten
is a serializability violation.  Finally (:meth:`Oracle.check`) the model
must equal what the engine holds (nothing lost, nothing half-applied).
Linear in the history; the history itself is not kept.

Snapshot reads are not checked (they add no conflict and may legitimately
see an older value); neither are read-only transactions (their read version
orders them, and they commit nothing).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING, Any, Awaitable

import trio

import kv
from kv.atomic import apply_atomic
from kv.engine import CommitRequest, _stamp_into
from kv.selectors import KeySelector
from kv.transaction import Transaction

if TYPE_CHECKING:
    from .world import Process, World

__all__ = ["Oracle", "RecordingDatabase", "RecordingTransaction"]

_SYSTEM = b"\xff"
# Serializability problems reported per run (the first ones tell the story).
MAX_PROBLEMS = 5


class RecordingTransaction(Transaction):
    """A real kv transaction that also logs its non-snapshot reads for the oracle."""

    # The read log and the write number belong to one attempt: kv starts every attempt's state,
    # a new transaction's included, in _clear_state.
    def _clear_state(self) -> None:
        super()._clear_state()  # type: ignore[misc]
        self._sim_log: list[tuple] = []
        self._sim_k = None

    def _network(self, commit: bool = False) -> Awaitable[None] | None:
        """Simulated network latency: what to await before a read or commit is answered (None: at once).

        A read or commit may yield, so transactions really interleave.  (The
        memory engine answers reads synchronously and a lone commit without a
        checkpoint; without this, concurrent transactions would never overlap
        and conflicts would never be exercised.)  A wait is the world clock's
        cheap sleep (:meth:`VirtualClock.sleep`).  A plain method returning the
        awaitable, not a coroutine: most reads are answered at once, and each
        read then creates no coroutine for the decision.  The delay is
        :meth:`World.latency`'s, the one place the latency distribution lives
        (the clogged path draws from it too).
        """
        world = self.db.world
        if world is None:
            return None
        proc = self.db.process
        clock = world.clock
        if proc is not None and proc.clogged_until and proc.clogged_until > clock._now:
            return self._clogged(world, proc, commit)  # cut off from the store (clogged)
        delay = world.latency(commit)
        if delay is None:
            return None  # answered at once
        return clock.sleep(delay) if delay else _checkpoint()

    @staticmethod
    async def _clogged(world: "World", proc: "Process", commit: bool) -> None:
        await proc.wait_unclogged()
        delay = world.latency(commit)
        if delay is None:
            return
        if delay:
            await world.clock.sleep(delay)
        else:
            await trio.lowlevel.checkpoint()

    async def get(self, key: bytes) -> bytes | None:
        # (kv's get awaits _get: the non-snapshot read, ~100 a run, is done here in one coroutine
        # less; snapshot reads, get_multi and commit's watch values still come through _get below)
        wait = self._network()
        if wait is not None:
            await wait
        value = await _TRANSACTION_GET(self, key, False)
        self._sim_log.append(("get", len(self._mutations), key, value))
        return value

    async def _get(self, key: bytes, snapshot: bool) -> bytes | None:
        wait = self._network()
        if wait is not None:
            await wait
        value = await _TRANSACTION_GET(self, key, snapshot)
        if not snapshot:
            self._sim_log.append(("get", len(self._mutations), key, value))
        return value

    async def _get_range(self, begin: Any, end: Any, limit: int, reverse: bool, snapshot: bool) -> list:
        wait = self._network()
        if wait is not None:
            await wait
        rows = await _TRANSACTION_GET_RANGE(self, begin, end, limit, reverse, snapshot)
        if not snapshot:
            if type(begin) is bytes and type(end) is bytes:
                self._sim_log.append(("range", len(self._mutations), begin, end, limit, reverse, list(rows)))
            else:
                # Key selectors go to kv as they are (until session 17 they were resolved here,
                # each with a get_key: its read conflict from the selector's key to the resolved
                # one, wider than the one conflict range kv records for the read as FoundationDB's
                # client does — so kv's own selector-range path, the one production runs, went
                # unchecked, and a write just past an end selector's resolved key aborted in the
                # sim what commits in production).  The oracle re-resolves both selectors at the
                # serialization point and demands the same rows, and only the rows: a resolved
                # end key past them may move without a conflict (tests/kv/test_selector_conflicts.py).
                self._sim_log.append(("srange", len(self._mutations), _selector(begin), _selector(end),
                                      limit, reverse, list(rows)))
        return rows

    async def _get_key(self, sel: KeySelector, snapshot: bool) -> bytes:
        wait = self._network()
        if wait is not None:
            await wait
        result = await super()._get_key(sel, snapshot)
        if not snapshot:
            self._sim_log.append(("key", len(self._mutations), sel.key, sel.or_equal, sel.offset, result))
        return result

    async def commit(self) -> None:
        hooks = self._engine._hooks  # (the attribute behind kv's hooks property: no Python frame)
        if self._mutations or self._write_ranges:
            wait = self._network(commit=True)
            if wait is not None:
                await wait
        try:
            await super().commit()
        finally:
            crash_after = getattr(hooks, "crash_after", None)
            if crash_after is not None and crash_after(self):
                from .faults import Crash

                raise Crash(f"after write {self._sim_k}")


def _selector(bound: Any) -> tuple[bytes, bool, int]:
    """A range bound as (key, or_equal, offset): a plain key is first_greater_or_equal(key)."""
    if type(bound) is bytes:
        return bound, False, 1
    return bound.key, bound.or_equal, bound.offset


# kv's own read paths, bound once (the overrides above call them on every read)
_TRANSACTION_GET = Transaction._get
_TRANSACTION_GET_RANGE = Transaction._get_range
_checkpoint = trio.lowlevel.checkpoint


class RecordingDatabase(kv.Database):
    """A database handle owned by one simulated process; its transactions record for the oracle."""

    def __init__(self, engine: Any, process: "Process | None", world: "World | None" = None,
                 stats: dict[str, int] | None = None) -> None:
        super().__init__(engine, url="memory:", owns_engine=False)
        self.process = process
        self.world = world if world is not None else (process.world if process is not None else None)
        # where transactions are counted (the world's stats; the checks' handle, which has no world
        # because its requests see no simulated network, passes them explicitly)
        self.stats = stats if stats is not None else (self.world.stats if self.world is not None else None)

    def create_transaction(self) -> Transaction:
        if self._engine.closed:
            raise kv.KVError(2000, "database is closed")
        if self.stats is not None:
            self.stats["transactions"] += 1
        return RecordingTransaction(self)


class _Model(dict):  # type: ignore[type-arg]
    """The oracle's model of the store: a dict of its keys and values, with the keys in order.

    (Was a sortedcontainers SortedDict: its Python-level ``__setitem__``, ``irange`` and ``copy``
    ran on every applied mutation, every replayed range read and every snapshot — ~0.1-0.2k keys
    here, where ``bisect.insort`` into one list is cheap, and a copy is two C-level copies.)
    Mutate it through :meth:`put`, :meth:`discard` and :meth:`clear_range` only, which keep
    ``order`` in step; reads are the dict's (``get``, ``[]``, ``in``) and :meth:`keys_in`.
    """

    __slots__ = ("order",)

    def __init__(self) -> None:
        super().__init__()
        self.order: list[bytes] = []  # every key, sorted

    def put(self, key: bytes, value: bytes) -> None:
        if key not in self:
            insort(self.order, key)
        self[key] = value

    def discard(self, key: bytes) -> None:
        if key in self:
            del self[key]
            order = self.order
            del order[bisect_left(order, key)]

    def clear_range(self, begin: bytes, end: bytes) -> None:
        order = self.order
        i, j = bisect_left(order, begin), bisect_left(order, end)
        for k in order[i:j]:
            del self[k]
        del order[i:j]

    def keys_in(self, begin: bytes, end: bytes, reverse: bool = False) -> list[bytes]:
        """The keys in [begin, end), in order (reversed if asked)."""
        order = self.order
        keys = order[bisect_left(order, begin):bisect_left(order, end)]
        if reverse:
            keys.reverse()
        return keys

    def sorted_items(self) -> list[tuple[bytes, bytes]]:
        return [(k, self[k]) for k in self.order]

    def copy(self) -> "_Model":  # (a snapshot's: sim.resume)
        new = _Model()
        dict.update(new, self)
        new.order = self.order.copy()
        return new


class _Overlay:
    """The model state at a serialization point, with one transaction's own mutations on top."""

    def __init__(self, base: _Model) -> None:
        self.base = base
        self.writes: dict[bytes, bytes | None] = {}
        self.clears: list[tuple[bytes, bytes]] = []

    def get(self, key: bytes) -> bytes | None:
        if key in self.writes:
            return self.writes[key]
        for b, e in self.clears:
            if b <= key < e:
                return None
        return self.base.get(key)

    def apply(self, m: tuple) -> None:
        kind = m[0]
        if kind == "set":
            self.writes[m[1]] = m[2]
        elif kind == "clear":
            b, e = m[1], m[2]
            for k in [k for k in self.writes if b <= k < e]:
                self.writes[k] = None
            self.clears.append((b, e))
        else:
            _, op, key, param = m
            self.writes[key] = apply_atomic(op, self.get(key), param)

    def range(self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False) -> list[tuple[bytes, bytes]]:
        """The rows in [begin, end) (the first ``limit`` of them, 0 = all, in the order asked)."""
        base = self.base
        if not self.writes and not self.clears:  # the common case: reads come before writes
            out = []
            for k in base.keys_in(begin, end, reverse):
                out.append((k, base[k]))
                if len(out) == limit:
                    break
            return out
        keys = set(base.keys_in(begin, end))
        keys.update(k for k in self.writes if begin <= k < end)
        out = []
        for k in sorted(keys, reverse=reverse):
            v = self.get(k)
            if v is not None:
                out.append((k, v))
                if len(out) == limit:
                    break
        return out


class Oracle:
    """Checks each committed transaction as it commits, in versionstamp order; :meth:`check` reports.

    The engine hands over committed batches in version order and each batch's
    transactions in their order, which *is* the serialization order the
    replay needs, so the model advances commit by commit: a transaction's
    logged reads are re-executed against the model as it stands (everything
    serialized before it) plus its own earlier mutations, then its mutations
    are applied.  Same verdicts as replaying a recorded history after the
    run, without keeping or sorting the history.
    """

    def __init__(self) -> None:
        self.model = _Model()  # the store as the serial order of committed transactions makes it
        self.problems: list[str] = []
        self.transactions = 0
        self._last: tuple[int, int] = (-1, -1)

    def committed(self, version: int, order: int, req: CommitRequest) -> None:
        """One committed transaction (from the engine's ``after_apply`` hook)."""
        self.transactions += 1
        if (version, order) <= self._last:
            self._problem(f"transaction at versionstamp ({version}, {order}) committed after {self._last}")
        self._last = (version, order)
        muts = req.mutations
        if req.stamped:
            muts = list(muts)
            stamp = req.stamp
            for index, kind, key, value, offset in req.stamped:
                if kind == "key":
                    muts[index] = ("set", _stamp_into(key, offset, stamp), value)
                else:
                    muts[index] = ("set", key, _stamp_into(value, offset, stamp))
        model = self.model
        log = getattr(req.tag, "_sim_log", None)
        if log and len(self.problems) < MAX_PROBLEMS:
            ov = None
            mi = 0
            for entry in log:
                upto = entry[1]
                if not upto and entry[0] == "get":
                    # (most reads: a get before the transaction wrote anything, answered by the model
                    # itself — what _check_read's overlay would answer, without building it)
                    key, seen = entry[2], entry[3]
                    want = model.get(key)
                    if want != seen:
                        self._problem(f"transaction at versionstamp ({version}, {order}): "
                                      f"get {key!r} saw {seen!r}, serial order gives {want!r}")
                    continue
                if ov is None:
                    ov = _Overlay(model)
                while mi < upto:
                    ov.apply(muts[mi])
                    mi += 1
                bad = self._check_read(ov, entry)
                if bad:
                    self._problem(f"transaction at versionstamp ({version}, {order}): {bad}")
        order = model.order
        for m in muts:
            if m[0] == "set":  # (most mutations: _Model.put inlined, without _apply's call)
                key = m[1]
                if key not in model:
                    insort(order, key)
                model[key] = m[2]
            else:
                _apply(model, m)

    def _problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def check(self, engine: Any) -> list[str]:
        """What did not serialize (empty when all is well); then the store must equal the model."""
        problems = list(self.problems)
        if len(problems) >= MAX_PROBLEMS:
            return problems
        snap = engine.store.snapshot()
        actual = snap.range(b"", _SYSTEM, False, 0)
        snap.close()
        expected = self.model.sorted_items()
        if actual != expected:
            a, e = dict(actual), dict(expected)
            diff = sorted(set(a) ^ set(e) | {k for k in set(a) & set(e) if a[k] != e[k]})
            problems.append(f"store differs from the replayed history at {len(diff)} key(s), first {diff[0]!r}")
        return problems

    @staticmethod
    def _check_read(ov: _Overlay, entry: tuple) -> str | None:
        kind = entry[0]
        if kind == "get":
            _, _, key, seen = entry
            want = ov.get(key)
            if want != seen:
                return f"get {key!r} saw {seen!r}, serial order gives {want!r}"
        elif kind == "range":
            _, _, begin, end, limit, reverse, seen = entry
            rows = ov.range(begin, end, limit, reverse)
            if rows != seen:
                return f"get_range [{begin!r}, {end!r}) saw {len(seen)} rows, serial order gives {len(rows)} (or other values)"
        elif kind == "srange":
            _, _, bsel, esel, limit, reverse, seen = entry
            begin, end = _resolve_selector(ov, *bsel), _resolve_selector(ov, *esel)
            rows = ov.range(begin, end, limit, reverse) if begin < end else []
            if rows != seen:
                return (f"get_range [{bsel}, {esel}) saw {len(seen)} rows, serial order gives {len(rows)} "
                        f"(or other values)")
        elif kind == "key":
            _, _, ref, or_equal, offset, seen = entry
            want = _resolve_selector(ov, ref, or_equal, offset)
            if want != seen:
                return f"get_key({ref!r}, {or_equal}, {offset}) saw {seen!r}, serial order gives {want!r}"
        return None


def _resolve_selector(ov: _Overlay, ref: bytes, or_equal: bool, offset: int) -> bytes:
    from kv.resolver import key_after

    if ref > _SYSTEM:
        ref = _SYSTEM
    if offset <= 0:
        hi = key_after(ref) if or_equal else ref
        need = 1 - offset
        rows = ov.range(b"", hi, need, reverse=True) if hi > b"" else []
        return rows[need - 1][0] if len(rows) >= need else b""
    lo = key_after(ref) if or_equal else ref
    rows = ov.range(lo, _SYSTEM, offset) if lo < _SYSTEM else []
    return rows[offset - 1][0] if len(rows) >= offset else _SYSTEM


def _apply(model: _Model, m: tuple) -> None:
    kind = m[0]
    if kind == "set":
        model.put(m[1], m[2])
    elif kind == "clear":
        model.clear_range(m[1], m[2])
    else:
        _, op, key, param = m
        v = apply_atomic(op, model.get(key), param)
        if v is None:
            model.discard(key)
        else:
            model.put(key, v)
