"""Read-your-writes against a model (FoundationDB's RyowCorrectness / WriteDuringRead idea).

Hypothesis drives random sequences of writes (set, clear, clear_range, every
atomic op) and reads (get, get_multi, get_range forward/reverse/limited,
get_key with any selector, snapshot variants) through transactions, and
compares every answer with a plain sorted-dict model of what the transaction
should see. Keys are chosen to collide, to sit on either side of each other,
and to exceed 510 bytes (the LMDB engine stores such keys in buckets), so
the merge of stored rows and buffered writes is exercised at its edges.
"""

from __future__ import annotations

import bisect
import os
import tempfile

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv import KeySelector
from kvtest_helpers import open_backend

LONG = b"L" * 515
KEY_POOL = [
    b"",
    b"a",
    b"a\x00",
    b"ab",
    b"b",
    b"b\xff",
    b"c",
    b"L" * 509,
    b"L" * 510,
    b"L" * 511,
    b"L" * 510 + b"\x00",
    LONG,
    LONG + b"1",
    LONG + b"2",
    b"L" * 600,
    b"M" * 520,
    b"z",
    b"\xfe\xff",
]
keys = st.sampled_from(KEY_POOL)
values = st.binary(max_size=6)
ATOMICS = ["add", "bit_and", "bit_or", "bit_xor", "max", "min", "byte_min", "byte_max", "append_if_fits", "compare_and_clear"]

ops = st.one_of(
    st.tuples(st.just("set"), keys, values),
    st.tuples(st.just("clear"), keys),
    st.tuples(st.just("clear_range"), keys, keys),
    st.tuples(st.just("atomic"), st.sampled_from(ATOMICS), keys, st.binary(max_size=3)),
    st.tuples(st.just("get"), keys, st.booleans()),
    st.tuples(st.just("get_multi"), st.lists(keys, max_size=3)),
    st.tuples(st.just("get_range"), keys, keys, st.integers(0, 4), st.booleans(), st.booleans()),
    st.tuples(st.just("get_key"), keys, st.booleans(), st.integers(-3, 3), st.booleans()),
    st.tuples(st.just("commit")),
)


def apply_atomic(op: str, existing: bytes | None, param: bytes) -> bytes | None:
    """Atomic.h, written independently of kv.atomic."""
    if op == "compare_and_clear":
        return None if existing is None or existing == param else existing
    if existing is None:
        return param
    n = len(param)
    fitted = existing[:n].ljust(n, b"\x00")
    a, b = int.from_bytes(fitted, "little"), int.from_bytes(param, "little")
    if op == "add":
        return ((a + b) % (1 << 8 * n)).to_bytes(n, "little") if n else b""
    if op == "bit_and":
        return (a & b).to_bytes(n, "little")
    if op == "bit_or":
        return (a | b).to_bytes(n, "little")
    if op == "bit_xor":
        return (a ^ b).to_bytes(n, "little")
    if op == "max":
        return fitted if a > b else param
    if op == "min":
        return fitted if a < b else param
    if op == "byte_min":
        return min(existing, param)
    if op == "byte_max":
        return max(existing, param)
    if op == "append_if_fits":
        return existing + param if len(existing) + n <= 100_000 else existing
    raise AssertionError(op)


def model_get_key(view: dict[bytes, bytes], key: bytes, or_equal: bool, offset: int) -> bytes:
    ks = sorted(view)
    anchor = (bisect.bisect_right(ks, key) if or_equal else bisect.bisect_left(ks, key)) - 1
    target = anchor + offset
    if target < 0:
        return b""
    if target >= len(ks):
        return b"\xff"
    return ks[target]


async def run_sequence(db, sequence) -> None:
    committed: dict[bytes, bytes] = {}
    view: dict[bytes, bytes] = {}
    tr = db.create_transaction()
    for step, op in enumerate(sequence):
        kind = op[0]
        where = (step, op)
        if kind == "set":
            tr.set(op[1], op[2])
            view[op[1]] = op[2]
        elif kind == "clear":
            tr.clear(op[1])
            view.pop(op[1], None)
        elif kind == "clear_range":
            b, e = sorted((op[1], op[2]))
            tr.clear_range(b, e)
            for k in [k for k in view if b <= k < e]:
                del view[k]
        elif kind == "atomic":
            _, name, k, param = op
            getattr(tr, name)(k, param)
            new = apply_atomic(name, view.get(k), param)
            if new is None:
                view.pop(k, None)
            else:
                view[k] = new
        elif kind == "get":
            reader = tr.snapshot if op[2] else tr
            assert await reader.get(op[1]) == view.get(op[1]), where
        elif kind == "get_multi":
            assert await tr.get_multi(op[1]) == [view.get(k) for k in op[1]], where
        elif kind == "get_range":
            _, b, e, limit, reverse, snap = op
            reader = tr.snapshot if snap else tr
            expected = sorted((k, v) for k, v in view.items() if b <= k < e)
            if reverse:
                expected.reverse()
            if limit:
                expected = expected[:limit]
            got = [(r.key, r.value) for r in await reader.get_range(b, e, limit=limit, reverse=reverse)]
            assert got == expected, where
            if not limit:
                assert [(r.key, r.value) async for r in reader.get_range(b, e, reverse=reverse)] == expected, where
        elif kind == "get_key":
            _, k, or_equal, offset, snap = op
            reader = tr.snapshot if snap else tr
            got = await reader.get_key(KeySelector(k, or_equal, offset))
            assert got == model_get_key(view, k, or_equal, offset), where
        elif kind == "commit":
            await tr.commit()
            committed = dict(view)
            tr = db.create_transaction()
            view = dict(committed)
    await tr.commit()
    committed = dict(view)

    async def everything(tr):  # read-only
        return [(r.key, r.value) for r in await tr.get_range(b"", b"\xff")]

    assert await db.transact(everything) == sorted(committed.items())


@pytest.mark.parametrize("backend_name", ["memory", "lmdb"])
@settings(
    max_examples=int(os.environ.get("SUREFOOT_KV_RYW_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(sequence=st.lists(ops, min_size=1, max_size=40))
def test_reads_match_the_model(backend_name, sequence):
    async def main():
        with tempfile.TemporaryDirectory() as tmp:
            db = await open_backend(backend_name, os.path.join(tmp, "data"))
            try:
                await run_sequence(db, sequence)
            finally:
                await db.close()

    trio.run(main)


async def test_reads_match_the_model_on_every_backend(db):
    """A fixed mixed sequence, so FoundationDB (when configured) runs it too."""
    seq = [
        ("set", b"a", b"1"), ("set", LONG + b"1", b"x"), ("commit",),
        ("atomic", "add", b"a", b"\x05"), ("clear_range", b"L" * 510, LONG + b"2"),
        ("set", b"L" * 511, b"y"), ("get_range", b"", b"\xfe", 0, False, False),
        ("get_range", b"", b"\xfe", 2, True, False), ("get_key", LONG, False, 1, False),
        ("get_key", b"b", True, -1, True), ("atomic", "compare_and_clear", b"a", b"\x06"),
        ("get", b"a", False), ("commit",), ("get_range", b"", b"\xfe", 0, True, True),
    ]
    await run_sequence(db, seq)


@pytest.mark.parametrize("seed", range(3))
async def test_limited_range_reads_through_dense_own_writes(db, seed):
    """Pages of stored rows mostly hidden by the transaction's own clears."""
    import random

    rng = random.Random(seed)
    stored = {b"d%04d" % i: b"s%d" % i for i in range(0, 600, 2)}
    items = sorted(stored.items())
    for i in range(0, len(items), 100):
        async def load(tr, chunk=items[i : i + 100]):  # idempotent: plain sets
            for k, v in chunk:
                tr.set(k, v)

        await db.transact(load)
    tr = db.create_transaction()
    view = dict(stored)
    for k in rng.sample(sorted(stored), 240):
        tr.clear(k)
        del view[k]
    for i in rng.sample(range(1, 600, 2), 40):
        tr.set(b"d%04d" % i, b"own")
        view[b"d%04d" % i] = b"own"
    b, e = b"d0100", b"d0500"
    tr.clear_range(b"d0300", b"d0350")
    for k in [k for k in view if b"d0300" <= k < b"d0350"]:
        del view[k]
    expected = sorted((k, v) for k, v in view.items() if b <= k < e)
    for limit in (0, 1, 7, 33, 100, 1000):
        for reverse in (False, True):
            want = expected[::-1] if reverse else expected
            want = want[:limit] if limit else want
            got = [(r.key, r.value) for r in await tr.get_range(b, e, limit=limit, reverse=reverse)]
            assert got == want, (limit, reverse)
