"""The group-commit pipeline's resolution order inside one batch.

Within a batch, each transaction is checked against the ones accepted before it
(FoundationDB's resolver): a read of a key that an earlier transaction of the
same batch wrote is a conflict (1020), a read of a key only a *later* one
writes is not, and a rejected transaction takes no place in the batch's
versionstamp order. The engine hands the accepted writes to its resolver once
per run of blind writes rather than once per commit (``Engine._resolve``), so
these tests build batches that mix blind writes, readers and rejected readers
and check every outcome.

A batch is formed by holding the store's first write on a gate: the commits
that arrive meanwhile queue up, in the order they arrived, and become the next
batch.
"""

from __future__ import annotations

import trio
import trio.testing

import kv
from kv.database import Database
from kv.engine import Engine
from kv.memory import MemoryStore


class _GatedStore(MemoryStore):
    """A memory store whose writes wait for ``gate`` (never inline), so commits queue up."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.batches: list[int] = []  # mutations per applied batch

    def can_apply_inline(self, mutations: int) -> bool:
        return False

    async def apply(self, version: int, mutations) -> None:
        await self.gate.wait()
        self.batches.append(len(mutations))
        self.apply_sync(version, mutations)


async def _run_batch(db: Database, store: _GatedStore, steps) -> dict[str, object]:
    """Commit a blocker, then each step in order (each parked in the queue before the
    next starts), open the gate; return each step's outcome: its versionstamp or error code."""
    outcomes: dict[str, object] = {}

    async def blocker() -> None:
        tr = db.create_transaction()  # idempotent: a plain set
        tr.set(b"blocker", b"1")
        await tr.commit()

    async def step(name, body) -> None:
        tr = db.create_transaction()  # each body is a plain set after reads: idempotent
        await body(tr)
        stamp = tr.get_versionstamp()
        try:
            await tr.commit()
        except kv.KVError as e:
            outcomes[name] = e.code
        else:
            outcomes[name] = await stamp

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocker)
        await trio.testing.wait_all_tasks_blocked()
        for name, body in steps:
            nursery.start_soon(step, name, body)
            await trio.testing.wait_all_tasks_blocked()  # read, then parked in the queue: arrival order fixed
        store.gate.set()
    return outcomes


def _db() -> tuple[Database, _GatedStore]:
    store = _GatedStore()
    return Database(Engine(store), url="memory:gated"), store


async def test_a_read_of_a_key_an_earlier_transaction_of_the_batch_wrote_conflicts():
    db, store = _db()

    async def write_x(tr):
        tr.set(b"x", b"new")

    async def read_x(tr):
        assert await tr.get(b"x") is None
        tr.set(b"from-read-x", b"1")

    async def read_y(tr):
        assert await tr.get(b"y") is None
        tr.set(b"from-read-y", b"1")

    async def read_w(tr):  # w is written by a *later* transaction of the batch: no conflict
        assert await tr.get(b"w") is None
        tr.set(b"from-read-w", b"1")

    async def write_w(tr):
        tr.set(b"w", b"1")

    async def read_range_over_x(tr):  # a range read meets x too
        assert await tr.get_range(b"a", b"z") == []
        tr.set(b"zz", b"1")

    async def write_y_range(tr):  # a range clear: a range write, not a point
        tr.clear_range(b"y", b"y\xff")

    async def read_y_again(tr):
        assert await tr.get(b"y") is None
        tr.set(b"from-read-y-again", b"1")

    out = await _run_batch(db, store, [
        ("write_x", write_x), ("read_x", read_x), ("read_y", read_y), ("read_w", read_w),
        ("write_w", write_w), ("read_range_over_x", read_range_over_x), ("write_y_range", write_y_range),
        ("read_y_again", read_y_again),
    ])
    assert store.batches == [1, 5], store.batches  # the blocker, then one batch of the accepted five
    assert out["read_x"] == 1020
    assert out["read_range_over_x"] == 1020
    assert out["read_y_again"] == 1020
    accepted = ["write_x", "read_y", "read_w", "write_w", "write_y_range"]
    stamps = [out[name] for name in accepted]
    assert all(isinstance(s, bytes) for s in stamps), out
    # one commit version, and the batch order counts accepted transactions only, in arrival order
    assert len({s[:8] for s in stamps}) == 1
    assert [int.from_bytes(s[8:], "big") for s in stamps] == [0, 1, 2, 3, 4]
    async def check(tr):  # read-only
        return [await tr.get(k) for k in (b"x", b"w", b"from-read-x", b"from-read-y", b"from-read-w", b"zz")]

    assert await db.transact(check) == [b"new", b"1", None, b"1", b"1", None]


async def test_the_resolver_remembers_every_write_of_a_batch_of_blind_writes():
    db, store = _db()
    names = [b"k%d" % i for i in range(10)]
    steps = []
    for k in names:
        async def write(tr, k=k):
            tr.set(k, b"v")
        steps.append((k.decode(), write))
    # one reader per key, each reading it before the batch and committing after it
    readers = []
    for k in names:
        tr = db.create_transaction()
        assert await tr.get(k) is None
        tr.set(b"reader", b"1")  # idempotent: a plain set
        readers.append(tr)
    out = await _run_batch(db, store, steps)
    assert store.batches == [1, 10]
    assert [int.from_bytes(out[k.decode()][8:], "big") for k in names] == list(range(10))
    for k, tr in zip(names, readers):  # each key alone is enough for a conflict
        try:
            await tr.commit()
        except kv.KVError as e:
            assert e.code == 1020
        else:
            raise AssertionError(f"a read of {k!r} before the batch did not conflict")


# -- the batch written behind one still syncing (Engine._finish_submitted, _ahead_share) --------


class _HeldJob:
    """One submitted batch of ``_SyncingStore``: answered when the test says so."""

    def __init__(self, store: "_SyncingStore", version: int, mutations) -> None:
        self.store, self.version, self.mutations = store, version, list(mutations)
        self.answered = trio.Event()

    async def wait(self) -> None:
        await self.answered.wait()
        assert self.store.out[0] is self, "batches must be waited for in submission order"
        self.store.out.pop(0)
        self.store.apply_sync(self.version, self.mutations)  # published once "durable", in version order


class _SyncingStore(MemoryStore):
    """A memory store that takes batches the way the LMDB store does (``submit``, then
    ``await job.wait()``; a second batch may go out behind one still syncing), each
    answered only when the test calls ``answer_oldest``."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[_HeldJob] = []  # submitted, not yet answered, oldest first
        self.sizes: list[int] = []  # mutations per submitted batch, in submission order

    def can_apply_inline(self, mutations: int) -> bool:
        return False

    def can_submit_ahead(self) -> bool:
        return len(self.out) < 2

    def submit(self, version: int, mutations) -> _HeldJob:
        job = _HeldJob(self, version, mutations)
        self.out.append(job)
        self.sizes.append(len(mutations))
        return job

    def answer_oldest(self) -> None:
        self.out[0].answered.set()


async def test_a_lopsided_pair_of_batches_is_evened_out():
    """One writer's batch is syncing while nine others queue: the nine go next (one
    batch), and the lone writer's next commit is written behind them. From then on the
    two groups would alternate 9, 1, 9, 1 (each sync's writers come back as the batch
    after next) and the loop would idle through every lone commit's sync. Writing only
    half of the two groups behind a small batch evens them out at once: 5 and 5."""
    store = _SyncingStore()
    db = Database(Engine(store), url="memory:syncing")
    commits_each = 6

    async def writer(name: bytes) -> None:
        for i in range(commits_each):
            tr = db.create_transaction()
            tr.set(b"%s/%d" % (name, i), b"v")  # blind write: idempotent
            await tr.commit()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, b"lone")
        await trio.testing.wait_all_tasks_blocked()
        assert store.sizes == [1]  # out, its sync held
        for w in range(9):
            nursery.start_soon(writer, b"crowd%d" % w)
        await trio.testing.wait_all_tasks_blocked()
        assert store.sizes == [1]  # the nine are queued behind it
        while store.out:  # answer each batch once everything else has had its turn
            store.answer_oldest()
            await trio.testing.wait_all_tasks_blocked()
    sizes = store.sizes
    # the nine, the lone writer's next commit behind them; then half of the ten behind that
    assert sizes[:4] == [1, 9, 1, 5], sizes
    assert max(sizes[3:]) == 5, sizes  # and even from then on (not 9, 1, 9, 1, ...)
    assert sum(sizes) == 10 * commits_each

    async def count(tr):  # read-only
        return len(await tr.get_range(b"", b"\xff"))

    assert await db.transact(count) == 10 * commits_each


class _Boom(BaseException):
    """Not an Exception: what KeyboardInterrupt or the simulator's Crash look like to the engine."""


class _FailingJob(_HeldJob):
    async def wait(self) -> None:
        await self.answered.wait()
        if self.store.fail_next is not None:
            assert self.store.out[0] is self
            self.store.out.pop(0)
            exc, self.store.fail_next = self.store.fail_next, None
            raise exc
        await super().wait()


class _FailingStore(_SyncingStore):
    """``_SyncingStore`` whose next answered batch may raise ``fail_next`` instead; it
    checks that never more than two batches are out (the pipeline has one owner)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next: BaseException | None = None

    def submit(self, version: int, mutations) -> _HeldJob:
        assert len(self.out) < 2, "a third batch out: two tasks own the pipeline"
        job = _FailingJob(self, version, mutations)
        self.out.append(job)
        self.sizes.append(len(mutations))
        return job


async def test_a_base_exception_from_a_batch_with_one_written_behind_it_propagates_once():
    """A batch fails with something that is not an ``Exception`` while the next
    batch is already written behind it: every member of the failed batch gets it
    (raised once each: their leader raises it, the others get it as their answer),
    the batch behind is handed on and commits, and the pipeline is not released
    twice (a third batch never goes out beside the two)."""
    store = _FailingStore()
    db = Database(Engine(store), url="memory:failing")
    outcomes: dict[bytes, object] = {}

    async def commit(key: bytes) -> None:
        tr = db.create_transaction()
        tr.set(key, b"v")  # blind write: idempotent
        try:
            await tr.commit()
            outcomes[key] = "ok"
        except _Boom:
            outcomes[key] = "boom"

    async def lone() -> None:
        await commit(b"lone/0")
        await commit(b"lone/1")  # written behind the crowd's batch

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lone)
        await trio.testing.wait_all_tasks_blocked()
        for w in range(3):
            nursery.start_soon(commit, b"crowd/%d" % w)
        await trio.testing.wait_all_tasks_blocked()
        store.answer_oldest()  # lone/0 durable: the crowd's batch goes out, lone/1 behind it
        await trio.testing.wait_all_tasks_blocked()
        assert store.sizes == [1, 3, 1] and len(store.out) == 2
        store.fail_next = _Boom()
        store.answer_oldest()  # the crowd's batch fails
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(commit, b"late")  # queued while lone/1 is still out
        await trio.testing.wait_all_tasks_blocked()
        assert len(store.out) == 1  # lone/1 only: the late commit waits for the pipeline
        while store.out:
            store.answer_oldest()
            await trio.testing.wait_all_tasks_blocked()
    assert outcomes == {b"lone/0": "ok", b"crowd/0": "boom", b"crowd/1": "boom", b"crowd/2": "boom",
                        b"lone/1": "ok", b"late": "ok"}

    async def keys(tr):  # read-only
        return [r.key for r in await tr.get_range(b"", b"\xff")]

    assert await db.transact(keys) == [b"late", b"lone/0", b"lone/1"]
