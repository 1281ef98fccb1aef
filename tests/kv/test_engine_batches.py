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
