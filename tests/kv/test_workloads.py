"""Ports of FoundationDB's workload checks (fdbserver/workloads/*.actor.cpp).

* ConflictRange: a range read's transaction conflicts exactly when another
  commit changed what that read returned (plain and read-your-writes forms).
* AtomicOps: concurrent atomic ops logged beside their parameters; the
  stored value must equal the ops folded over the log.
* VersionStamp: every versionstamped key/value carries the committing
  transaction's stamp, whose version is its commit version.
* Watches: a chain of watchers relays a value down a ring of keys.

Plus Atomic.h's byte semantics, case by case. Runs on every backend.
"""

from __future__ import annotations

import os
import random
import struct
import uuid

import pytest
import trio

from kv import KVError
from kv.tuple import Subspace, Versionstamp
from kvtest_helpers import commit_code, dump, le64, read, write

# ---------------------------------------------------------------------------
# ConflictRange
# ---------------------------------------------------------------------------


def _k(i: int) -> bytes:
    return b"%010d" % i


@pytest.mark.parametrize("ryw", [False, True], ids=["plain", "read_your_writes"])
async def test_conflict_range_workload(db, ryw):
    rng = random.Random(20261129 + ryw)
    KEYS = 40
    stats = {"conflict": 0, "clean": 0}
    for iteration in range(30):
        random_sets = iteration % 2 == 0
        inserted: set[int] = set()
        cleared_set: set[int] = set()
        cb = ce = 0
        if ryw:
            a, b = rng.randrange(KEYS - 1), rng.randrange(KEYS - 1)
            cb, ce = min(a, b), max(a, b) + 1
        tr0 = db.create_transaction()
        tr0.clear_range(_k(0), _k(KEYS + 2))
        for i in range(KEYS):
            if rng.random() > 0.5:
                if ryw and cb <= i < ce:
                    cleared_set.add(i)
                else:
                    inserted.add(i)
                    tr0.set(_k(i), uuid.UUID(int=rng.getrandbits(128)).bytes)
        await tr0.commit()
        if not inserted:
            continue

        # a random range read that returns something
        while True:
            begin, end = _k(rng.randrange(KEYS)), _k(rng.randrange(KEYS))
            limit = rng.randrange(1, KEYS)
            reverse = rng.random() < 0.5
            tr1 = db.create_transaction()
            original = list(await tr1.get_range(begin, end, limit=limit, reverse=reverse))
            if original:
                break
        if ryw:
            tr1 = db.create_transaction()
            for i in cleared_set:
                tr1.set(_k(i), uuid.UUID(int=rng.getrandbits(128)).bytes)
            await tr1.commit()

        tr3 = db.create_transaction()  # same read version as the writer's would be
        await tr3.get_read_version()
        tr2 = db.create_transaction()
        for _ in range(rng.randint(2, 4)):
            for _attempt in range(5):
                p = rng.randrange(KEYS)
                if random_sets and p not in inserted:
                    inserted.add(p)
                    tr2.set(_k(p), uuid.UUID(int=rng.getrandbits(128)).bytes)
                    break
                if not random_sets and p in inserted:
                    inserted.discard(p)
                    tr2.clear(_k(p))
                    break
        await tr2.commit()

        if ryw:
            tr3.clear_range(_k(cb), _k(ce))
        else:
            tr3.clear(_k(KEYS + 1))
        await tr3.get_range(begin, end, limit=limit, reverse=reverse)
        code = await commit_code(tr3)
        assert code in (None, 1020)
        if code == 1020:
            stats["conflict"] += 1
            if ryw:
                trc = db.create_transaction()
                trc.clear_range(_k(cb), _k(ce))
                await trc.commit()
        else:
            stats["clean"] += 1
        tr4 = db.create_transaction()
        now = list(await tr4.get_range(begin, end, limit=limit, reverse=reverse))
        if code == 1020:
            # plain key ranges have none of the selector cases FoundationDB excuses:
            # a conflict means the answer changed
            assert now != original, ("conflict but results unchanged", begin, end, limit, reverse)
        else:
            assert now == original, ("no conflict but results changed", begin, end, limit, reverse)
    assert stats["conflict"] and stats["clean"], stats


# ---------------------------------------------------------------------------
# Atomic.h semantics
# ---------------------------------------------------------------------------

U = lambda n, size=8: n.to_bytes(size, "little")  # noqa: E731

ATOMIC_CASES = [
    # (op, existing, param, expected)
    ("add", None, U(5), U(5)),
    ("add", U(5), U(7), U(12)),
    ("add", U(2**64 - 1), U(2), U(1)),  # wraps
    ("add", b"\x01\x02\x03", b"\x01", b"\x02"),  # existing truncated to len(param)
    ("add", b"\x01", b"\x01\x00\x00", b"\x02\x00\x00"),  # existing zero-extended
    ("add", b"", U(3), U(3)),
    ("bit_and", None, b"\x0f", b"\x0f"),  # absent: stores param (API >= 510)
    ("bit_and", b"\xff\xf0", b"\x3c", b"\x3c"),  # existing truncated to len(param)
    ("bit_or", b"\x01", b"\x02\x04", b"\x03\x04"),
    ("bit_xor", b"\xff\x00", b"\x0f\x0f", b"\xf0\x0f"),
    ("max", U(5), U(9), U(9)),
    ("max", U(9), U(5), U(9)),
    ("max", b"\x00\x01", b"\xff", b"\xff"),  # existing truncated to len(param): 0 vs 255
    ("max", None, U(3), U(3)),
    ("min", U(5), U(9), U(5)),
    ("min", None, U(9), U(9)),  # absent: stores param (API >= 510)
    ("min", b"\x05", b"\x00\x01", b"\x05\x00"),  # zero-extended existing is smaller
    ("byte_min", b"abc", b"abd", b"abc"),
    ("byte_min", b"b", b"abc", b"abc"),
    ("byte_min", None, b"zz", b"zz"),
    ("byte_max", b"abc", b"abd", b"abd"),
    ("byte_max", b"ab", b"a", b"ab"),
    ("append_if_fits", b"ab", b"cd", b"abcd"),
    ("append_if_fits", None, b"cd", b"cd"),
    ("append_if_fits", b"x" * 99_999, b"yz", b"x" * 99_999),  # would exceed 100,000: unchanged
    ("append_if_fits", b"x" * 99_998, b"yz", b"x" * 99_998 + b"yz"),
    ("compare_and_clear", b"same", b"same", None),
    ("compare_and_clear", b"same", b"diff", b"same"),
    ("compare_and_clear", None, b"x", None),
]


@pytest.mark.parametrize("op,existing,param,expected", ATOMIC_CASES)
async def test_atomic_op_bytes(db, op, existing, param, expected):
    if existing is not None:
        await write(db, (b"a", existing))
    # applied at commit on the stored value...
    tr = db.create_transaction()
    getattr(tr, op)(b"a", param)
    await tr.commit()
    assert await read(db, b"a") == expected
    # ...and in the transaction's own view, identically
    await write(db, clears=(b"a",)) if existing is None else await write(db, (b"a", existing))
    tr = db.create_transaction()
    getattr(tr, op)(b"a", param)
    assert await tr.get(b"a") == expected


# ---------------------------------------------------------------------------
# AtomicOps workload
# ---------------------------------------------------------------------------


def _fold(op: str, params: list[bytes]) -> bytes:
    """The stored value after ``op`` with each param, from an absent key (any order)."""
    ints = [int.from_bytes(p, "little") for p in params]
    if op == "add":
        r = sum(ints) % 2**64
    elif op == "bit_and":
        r = ints[0]
        for i in ints[1:]:
            r &= i
    elif op == "bit_or":
        r = 0
        for i in ints:
            r |= i
    elif op == "bit_xor":
        r = 0
        for i in ints:
            r ^= i
    elif op == "max":
        r = max(ints)
    elif op == "min":
        r = min(ints)
    elif op == "byte_min":
        return min(params)
    elif op == "byte_max":
        return max(params)
    else:
        raise ValueError(op)
    return r.to_bytes(8, "little")


@pytest.mark.parametrize("op", ["add", "bit_and", "bit_or", "bit_xor", "max", "min", "byte_min", "byte_max"])
async def test_atomic_ops_workload(db, op):
    ops, log = Subspace(("ops",)), Subspace(("log",))
    groups = 4
    rng = random.Random(op)

    async def client(cid):
        for n in range(25):
            g = rng.randrange(groups)
            param = struct.pack("<Q", rng.getrandbits(64 if op != "add" else 20))
            txid = os.urandom(8)

            async def fn(tr):  # no reads: never conflicts; guarded by the unique log key on retry
                if await tr.snapshot.get(log.pack((g, txid))) is not None:
                    return
                getattr(tr, op)(ops.pack((g,)), param)
                tr.set(log.pack((g, txid)), param)

            await db.transact(fn)
            if n % 5 == 0:
                await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        for c in range(8):
            nursery.start_soon(client, c)

    logged: dict[int, list[bytes]] = {}
    for k, v in await dump(db, *(lambda r: (r.start, r.stop))(log.range())):
        logged.setdefault(log.unpack(k)[0], []).append(v)
    assert sum(len(v) for v in logged.values()) == 200
    for g, params in logged.items():
        assert await read(db, ops.pack((g,))) == _fold(op, params), (op, g)


async def test_append_if_fits_and_compare_and_clear_workload(db):
    async def client(cid):
        for n in range(20):
            async def fn(tr):  # not idempotent, but nothing here can raise 1021
                tr.append_if_fits(b"journal", b"%02d:%03d;" % (cid, n))
                tr.add(b"count", le64(1))

            await db.transact(fn)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        for c in range(6):
            nursery.start_soon(client, c)
    chunks = (await read(db, b"journal")).split(b";")[:-1]
    assert sorted(chunks) == sorted(b"%02d:%03d" % (c, n) for c in range(6) for n in range(20))
    # each client's appends are in its own commit order
    for c in range(6):
        mine = [x for x in chunks if x.startswith(b"%02d:" % c)]
        assert mine == sorted(mine)

    async def drain(tr):
        tr.compare_and_clear(b"count", le64(120))

    await db.transact(drain)
    assert await read(db, b"count") is None


# ---------------------------------------------------------------------------
# VersionStamp workload
# ---------------------------------------------------------------------------


async def test_versionstamp_workload(db):
    keys, vals = Subspace(("vsk",)), Subspace(("vsv",))
    committed: dict[int, tuple[int, bytes]] = {}

    async def client(cid):
        for n in range(15):
            ident = cid * 1000 + n
            tr = db.create_transaction()
            tr.set_versionstamped_key(keys.pack_with_versionstamp((Versionstamp.incomplete(n), ident)), struct.pack(">I", ident))
            tr.set_versionstamped_value(vals.pack((ident,)), b"\x00" * 10 + struct.pack(">I", ident) + struct.pack("<I", 0))
            vs = tr.get_versionstamp()
            await tr.commit()
            committed[ident] = (tr.get_committed_version(), await vs)

    async with trio.open_nursery() as nursery:
        for c in range(6):
            nursery.start_soon(client, c)

    krows = await dump(db, *(lambda r: (r.start, r.stop))(keys.range()))
    assert len(krows) == 90
    previous = None
    for k, v in krows:
        stamp_t, ident = keys.unpack(k)
        assert struct.unpack(">I", v)[0] == ident
        version, stamp = committed[ident]
        assert stamp_t == Versionstamp(stamp, stamp_t.user_version)
        assert stamp[:8] == version.to_bytes(8, "big")
        assert previous is None or stamp > previous[:10]  # keys sorted == commit order
        previous = stamp
        assert await read(db, vals.pack((ident,))) == stamp + struct.pack(">I", ident)
    # commit versions are ordered like the stamps
    by_stamp = sorted(committed.values(), key=lambda cv: cv[1])
    assert [v for v, _ in by_stamp] == sorted(v for v, _ in by_stamp)


# ---------------------------------------------------------------------------
# Watches workload
# ---------------------------------------------------------------------------


async def test_watches_workload(db):
    N, ROUNDS = 8, 6
    ring = [b"watch/%02d" % i for i in range(N + 1)]

    async def relay(i):
        """Copy ring[i] to ring[i+1] whenever it changes (a watcher node)."""
        while True:
            tr = db.create_transaction()
            v = await tr.get(ring[i])
            if v is not None and v != await tr.get(ring[i + 1]):
                tr.set(ring[i + 1], v)
            w = tr.watch(ring[i])
            try:
                await tr.commit()
                await w
            except KVError as e:
                assert e.code == 1020, e

    async def wait_for(key, value):
        while True:
            tr = db.create_transaction()
            if await tr.get(key) == value:
                return
            w = tr.watch(key)
            await tr.commit()
            await w

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(N):
                nursery.start_soon(relay, i)
            for r in range(1, ROUNDS + 1):
                await write(db, (ring[0], b"round-%d" % r))
                await wait_for(ring[N], b"round-%d" % r)
            nursery.cancel_scope.cancel()
    assert [v for _, v in await dump(db, b"watch/", b"watch0")] == [b"round-%d" % ROUNDS] * (N + 1)
