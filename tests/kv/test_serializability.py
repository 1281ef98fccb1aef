"""Strict serializability under concurrency, checked with the precise oracle.

Hypothesis generates concurrent workloads (bank transfers with range reads;
FoundationDB's Cycle workload) run by several trio tasks against the memory
and LMDB engines. Every transaction also writes, in the same commit, a
versionstamped record of everything it read and wrote (Scherer's "precise
oracle", fdb-semantics.md section 4): the versionstamp order *is* the
serialization order, so replaying the records in key order from the initial
state must reproduce every value each transaction read, and the final state.
On top: bank totals are conserved in every snapshot, and the cycle stays one
cycle of the original length.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile

import cbor2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv
from kv import KVError
from kv.tuple import Subspace, Versionstamp
from kvtest_helpers import open_backend

ORACLE = Subspace(("oracle",))
BANK = Subspace(("bank",))
CYCLE = Subspace(("cycle",))

SETTINGS = settings(
    max_examples=int(os.environ.get("SUREFOOT_KV_SERIAL_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


def le(n: int) -> bytes:
    return struct.pack("<q", n)


def unle(b: bytes) -> int:
    return struct.unpack("<q", b)[0]


class Recorder:
    """Wraps a transaction and logs its reads and writes in order."""

    def __init__(self, tr) -> None:
        self.tr = tr
        self.ops: list[list] = []

    async def get(self, key: bytes) -> bytes | None:
        value = await self.tr.get(key)
        self.ops.append(["get", key, value])
        return value

    async def get_range(self, begin: bytes, end: bytes, limit: int = 0, reverse: bool = False) -> list[tuple[bytes, bytes]]:
        rows = [(r.key, r.value) for r in await self.tr.get_range(begin, end, limit=limit, reverse=reverse)]
        self.ops.append(["range", begin, end, limit, reverse, [list(r) for r in rows]])
        return rows

    def set(self, key: bytes, value: bytes) -> None:
        self.tr.set(key, value)
        self.ops.append(["set", key, value])

    def clear(self, key: bytes) -> None:
        self.tr.clear(key)
        self.ops.append(["clear", key])

    def add(self, key: bytes, param: bytes) -> None:
        self.tr.add(key, param)
        self.ops.append(["add", key, param])

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self.tr.clear_range(begin, end)
        self.ops.append(["clear_range", begin, end])

    def seal(self, txid: bytes) -> None:
        """The oracle record, written in the same transaction at its versionstamp."""
        self.tr.set_versionstamped_key(
            ORACLE.pack_with_versionstamp((Versionstamp.incomplete(),)), cbor2.dumps([txid, self.ops])
        )


def _range(state: dict[bytes, bytes], begin: bytes, end: bytes, limit: int, reverse: bool) -> list[list[bytes]]:
    rows = sorted((k, v) for k, v in state.items() if begin <= k < end)
    if reverse:
        rows.reverse()
    if limit:
        rows = rows[:limit]
    return [list(r) for r in rows]


async def replay_and_check(
    db, initial: dict[bytes, bytes], acknowledged: set[bytes], maybe: frozenset[bytes] = frozenset()
) -> dict[bytes, bytes]:
    """Replay the oracle log in versionstamp order; every read must match."""
    r = ORACLE.range()

    async def read_all(tr):  # read-only
        return [(x.key, x.value) for x in await tr.get_range(r.start, r.stop)]

    records = await db.transact(read_all)
    state = dict(initial)
    seen: set[bytes] = set()
    for position, (_key, raw) in enumerate(records):
        txid, ops = cbor2.loads(raw)
        assert txid not in seen, "a transaction committed twice"
        seen.add(txid)
        for op in ops:
            kind = op[0]
            if kind == "get":
                assert state.get(op[1]) == op[2], (position, txid, op)
            elif kind == "range":
                assert _range(state, op[1], op[2], op[3], op[4]) == op[5], (position, txid, op)
            elif kind == "set":
                state[op[1]] = op[2]
            elif kind == "clear":
                state.pop(op[1], None)
            elif kind == "clear_range":
                for k in [k for k in state if op[1] <= k < op[2]]:
                    del state[k]
            elif kind == "add":
                old = state.get(op[1])
                n = len(op[2])
                total = (int.from_bytes((old or b"").ljust(n, b"\x00")[:n], "little") + int.from_bytes(op[2], "little")) % (1 << 8 * n)
                state[op[1]] = total.to_bytes(n, "little")
            else:
                raise AssertionError(op)
    assert acknowledged <= seen, "an acknowledged transaction is missing from the log"
    assert seen <= acknowledged | maybe, "a transaction that failed for certain committed"

    async def everything(tr):  # read-only
        rows = await tr.get_range(b"", b"\xff")
        return {x.key: x.value for x in rows if not ORACLE.contains(x.key)}

    assert await db.transact(everything) == state, "replay reproduces the final state"
    return state


async def run_clients(db, plans, step) -> tuple[set[bytes], set[bytes]]:
    """Run one task per plan; ``step(rec, op)`` is one transaction's body.

    A manual retry loop (what ``db.transact`` does) so each attempt gets its
    own id: returns (acknowledged ids, ids whose commit raised 1021 and so
    may or may not have committed).
    """
    acknowledged: set[bytes] = set()
    maybe: set[bytes] = set()

    async def client(cid: int, plan) -> None:
        for n, op in enumerate(plan):
            tr = db.create_transaction()
            attempt = 0
            while True:
                txid = b"%d.%d.%d" % (cid, n, attempt)
                attempt += 1
                try:
                    rec = Recorder(tr)
                    await step(rec, op)
                    rec.seal(txid)  # guarded: the oracle settles any 1021 below
                    await tr.commit()
                    acknowledged.add(txid)
                    break
                except KVError as e:
                    if e.code == 1021:
                        maybe.add(txid)
                    await tr.on_error(e)

    async with trio.open_nursery() as nursery:
        for cid, plan in enumerate(plans):
            nursery.start_soon(client, cid, plan)
    return acknowledged, maybe


async def with_db(backend: str, fn):
    with tempfile.TemporaryDirectory() as tmp:
        db = await open_backend(backend, os.path.join(tmp, "data"))
        try:
            return await fn(db)
        finally:
            await db.close()


# ---------------------------------------------------------------------------
# Bank
# ---------------------------------------------------------------------------

ACCOUNTS = 8
START = 100

bank_ops = st.one_of(
    st.tuples(st.just("transfer"), st.integers(0, ACCOUNTS - 1), st.integers(0, ACCOUNTS - 1), st.integers(1, 60), st.integers(0, 2)),
    st.tuples(st.just("sweep"), st.integers(1, ACCOUNTS), st.booleans(), st.integers(0, ACCOUNTS - 1), st.integers(0, 2)),
    st.tuples(st.just("audit"), st.integers(0, 2)),
)
bank_plans = st.lists(st.lists(bank_ops, min_size=1, max_size=12), min_size=2, max_size=6)


async def yields(n: int) -> None:
    for _ in range(n):
        await trio.sleep(0)


async def bank_step(rec: Recorder, op) -> None:
    kind = op[0]
    if kind == "transfer":
        _, a, b, amount, y = op
        bal_a = unle(await rec.get(BANK.pack((a,))))
        await yields(y)
        bal_b = unle(await rec.get(BANK.pack((b,))))
        amount = min(amount, bal_a)
        if a != b and amount:
            rec.set(BANK.pack((a,)), le(bal_a - amount))
            rec.set(BANK.pack((b,)), le(bal_b + amount))
    elif kind == "sweep":
        # a range read with a limit: move the richest seen account's surplus to `dest`
        _, limit, reverse, dest, y = op
        r = BANK.range()
        rows = await rec.get_range(r.start, r.stop, limit=limit, reverse=reverse)
        await yields(y)
        src_key, src_val = max(rows, key=lambda kv_: unle(kv_[1]))
        dest_key = BANK.pack((dest,))
        if src_key != dest_key:
            dest_val = unle(await rec.get(dest_key))
            surplus = unle(src_val) // 2
            rec.set(src_key, le(unle(src_val) - surplus))
            rec.set(dest_key, le(dest_val + surplus))
    else:
        _, y = op
        r = BANK.range()
        rows = await rec.get_range(r.start, r.stop)
        await yields(y)
        assert sum(unle(v) for _, v in rows) == ACCOUNTS * START, "a snapshot saw money appear or vanish"
        rec.add(b"audits", le(1))


@pytest.mark.parametrize("backend_name", ["memory", "lmdb"])
@SETTINGS
@given(plans=bank_plans)
def test_bank_is_serializable(backend_name, plans):
    initial = {BANK.pack((i,)): le(START) for i in range(ACCOUNTS)}

    async def main(db):
        async def setup(tr):  # idempotent
            for k, v in initial.items():
                tr.set(k, v)

        await db.transact(setup)
        acknowledged, maybe = await run_clients(db, plans, bank_step)
        state = await replay_and_check(db, initial, acknowledged, maybe)
        assert sum(unle(state[k]) for k in initial) == ACCOUNTS * START
        assert all(unle(state[k]) >= 0 for k in initial)

    trio.run(with_db, backend_name, main)


# ---------------------------------------------------------------------------
# Cycle (fdbserver/workloads/Cycle.cpp)
# ---------------------------------------------------------------------------

NODES = 12

cycle_ops = st.one_of(
    st.tuples(st.just("relink"), st.integers(0, NODES - 1), st.integers(0, 2)),
    st.tuples(st.just("check"), st.integers(0, 2)),
)
cycle_plans = st.lists(st.lists(cycle_ops, min_size=1, max_size=15), min_size=2, max_size=6)


def walk(values: dict[int, int]) -> int:
    """Steps from node 0 back to node 0 (Cycle.cpp's check)."""
    i, steps = 0, 0
    while True:
        i = values[i]
        steps += 1
        if i == 0 or steps > NODES:
            return steps


async def cycle_step(rec: Recorder, op) -> None:
    if op[0] == "relink":
        # r -> r2 -> r3 -> r4 becomes r -> r3 -> r2 -> r4
        _, r, y = op
        r2 = unle(await rec.get(CYCLE.pack((r,))))
        r3 = unle(await rec.get(CYCLE.pack((r2,))))
        await yields(y)
        r4 = unle(await rec.get(CYCLE.pack((r3,))))
        rec.set(CYCLE.pack((r,)), le(r3))
        rec.set(CYCLE.pack((r2,)), le(r4))
        rec.set(CYCLE.pack((r3,)), le(r2))
    else:
        _, y = op
        r = CYCLE.range()
        await yields(y)
        rows = await rec.get_range(r.start, r.stop)
        values = {CYCLE.unpack(k)[0]: unle(v) for k, v in rows}
        assert len(values) == NODES and sorted(values.values()) == list(range(NODES))
        assert walk(values) == NODES, "Cycle got shorter or longer in a snapshot"
        rec.add(b"checks", le(1))


@pytest.mark.parametrize("backend_name", ["memory", "lmdb"])
@SETTINGS
@given(plans=cycle_plans)
def test_cycle_is_serializable(backend_name, plans):
    initial = {CYCLE.pack((i,)): le((i + 1) % NODES) for i in range(NODES)}

    async def main(db):
        async def setup(tr):  # idempotent
            for k, v in initial.items():
                tr.set(k, v)

        await db.transact(setup)
        acknowledged, maybe = await run_clients(db, plans, cycle_step)
        state = await replay_and_check(db, initial, acknowledged, maybe)
        values = {CYCLE.unpack(k)[0]: unle(v) for k, v in state.items() if CYCLE.contains(k)}
        assert len(values) == NODES
        assert walk(values) == NODES

    trio.run(with_db, backend_name, main)


# ---------------------------------------------------------------------------
# Random transactions over a small keyspace (every read kind, every write kind)
# ---------------------------------------------------------------------------

RKEYS = [b"r/%d" % i for i in range(6)]
rkey = st.sampled_from(RKEYS)
random_op = st.one_of(
    st.tuples(st.just("get"), rkey),
    st.tuples(st.just("range"), rkey, rkey, st.integers(0, 3), st.booleans()),
    st.tuples(st.just("set"), rkey, st.binary(min_size=1, max_size=3)),
    st.tuples(st.just("clear"), rkey),
    st.tuples(st.just("clear_range"), rkey, rkey),
    st.tuples(st.just("add"), rkey),
    st.tuples(st.just("yield"), st.integers(1, 3)),
)
random_plans = st.lists(st.lists(st.lists(random_op, min_size=1, max_size=6), min_size=1, max_size=8), min_size=2, max_size=5)


async def random_step(rec: Recorder, body) -> None:
    for op in body:
        kind = op[0]
        if kind == "get":
            await rec.get(op[1])
        elif kind == "range":
            b, e = sorted((op[1], op[2]))
            await rec.get_range(b, e, limit=op[3], reverse=op[4])
        elif kind == "set":
            rec.set(op[1], op[2])
        elif kind == "clear":
            rec.clear(op[1])
        elif kind == "clear_range":
            b, e = sorted((op[1], op[2]))
            rec.clear_range(b, e)
        elif kind == "add":
            rec.add(op[1], b"\x01")
        else:
            await yields(op[1])


@pytest.mark.parametrize("backend_name", ["memory", "lmdb"])
@SETTINGS
@given(plans=random_plans)
def test_random_transactions_are_serializable(backend_name, plans):
    initial = {k: b"init" for k in RKEYS[::2]}

    async def main(db):
        async def setup(tr):  # idempotent
            for k, v in initial.items():
                tr.set(k, v)

        await db.transact(setup)
        acknowledged, maybe = await run_clients(db, plans, random_step)
        await replay_and_check(db, initial, acknowledged, maybe)

    trio.run(with_db, backend_name, main)


class Buggify(kv.FaultHooks):
    """Client BUGGIFY, as FoundationDB injects it (NativeAPI.actor.cpp): 1020 or
    1007 before a commit, and 1021 *after a commit that did apply*."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.injected = {"1020": 0, "1007": 0, "1021": 0}

    def before_commit(self, tr) -> None:
        x = self.rng.random()
        if x < 0.05:
            self.injected["1020"] += 1
            raise KVError(1020, "buggify")
        if x < 0.08:
            self.injected["1007"] += 1
            raise KVError(1007, "buggify")

    def after_apply(self, version, batch):
        out = {}
        for req in batch:
            if self.rng.random() < 0.15:
                out[req] = KVError(1021, "buggify: applied, but the caller is told maybe")
        self.injected["1021"] += len(out)
        return out


@pytest.mark.parametrize("backend_name", ["memory", "lmdb"])
@SETTINGS
@given(plans=bank_plans, seed=st.integers(0, 2**32))
def test_bank_with_buggify_faults_is_serializable(backend_name, plans, seed):
    """Transfers are not idempotent, so a retried 1021 may run twice: the
    oracle still explains every read, and money is still conserved."""
    initial = {BANK.pack((i,)): le(START) for i in range(ACCOUNTS)}
    hooks = Buggify(seed)

    async def main():
        if backend_name == "memory":
            db = kv.MemoryEngine(hooks=hooks).database()
        else:
            from kv.engine import Engine
            from kv.lmdb_engine import LmdbStore

            tmp = tempfile.TemporaryDirectory()
            db = kv.Database(Engine(LmdbStore(os.path.join(tmp.name, "data")), hooks=hooks), url="lmdb:")

        async def setup(tr):  # idempotent
            for k, v in initial.items():
                tr.set(k, v)

        try:
            await db.transact(setup)
            acknowledged, maybe = await run_clients(db, plans, bank_step)
            state = await replay_and_check(db, initial, acknowledged, maybe)
            assert sum(unle(state[k]) for k in initial) == ACCOUNTS * START
        finally:
            await db.close()
            if backend_name == "lmdb":
                tmp.cleanup()

    trio.run(main)


async def test_oracle_catches_a_non_serializable_history(edb):
    """The checker itself: a record whose read no serial order explains fails replay."""
    initial = {b"x": le(1)}

    async def setup(tr):
        tr.set(b"x", le(1))

    await edb.transact(setup)

    async def lying(tr):  # claims to have read a value that was never there
        rec = Recorder(tr)
        await rec.get(b"x")
        rec.ops[-1][2] = le(999)
        rec.set(b"x", le(2))
        rec.seal(b"liar")

    await edb.transact(lying)
    with pytest.raises(AssertionError):
        await replay_and_check(edb, initial, {b"liar"})
