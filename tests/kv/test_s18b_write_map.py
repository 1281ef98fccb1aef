"""Session 18 (b): the write map is built from the mutation log at its first use.

Until a transaction reads (or watches, or clears), its sets, atomic ops and versionstamped keys
and values are only logged; the first use replays the log into the map. Every case here runs
the same writes through two transactions, one whose map was forced to exist from the start
(so every write kept it, as before) and one left lazy, and requires the same map, the same
log, sizes and conflicts, and the same answers (or errors) to every later read and write.
"""

from __future__ import annotations

import struct

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv
from kv import KVError, KeySelector

OFFSET = struct.Struct("<I")
STAMP_BODY = b"s" + b"\x00" * 10  # a versionstamped key's body, the stamp at offset 1
KEYS = [b"a", b"b", b"c", STAMP_BODY, b"s\x00", b"s" + b"\x01" * 10, b"v"]
ATOMICS = ["add", "bit_and", "bit_or", "bit_xor", "max", "min", "byte_min", "byte_max",
           "append_if_fits", "compare_and_clear"]

keys = st.sampled_from(KEYS)
values = st.binary(max_size=4)
writes = st.one_of(
    st.tuples(st.just("set"), keys, values),
    st.tuples(st.just("atomic"), st.sampled_from(ATOMICS), keys, st.binary(max_size=3)),
    st.tuples(st.just("svk"), st.sampled_from([STAMP_BODY, b"s" + b"\x00" * 12]), values),
    st.tuples(st.just("svv"), keys, st.binary(max_size=3)),
    st.tuples(st.just("no_conflict")),
)
after = st.one_of(
    st.tuples(st.just("get"), keys, st.booleans()),
    st.tuples(st.just("range"), st.booleans(), st.integers(0, 3)),
    st.tuples(st.just("get_key"), keys, st.integers(-2, 2)),
    st.tuples(st.just("watch"), keys),
    st.tuples(st.just("clear"), keys),
    st.tuples(st.just("clear_range"), keys, keys),
    st.tuples(st.just("read_conflict"), keys, keys),
    st.tuples(st.just("write"), writes),
)


def _write(tr: kv.Transaction, op: tuple) -> None:
    kind = op[0]
    if kind == "set":
        tr.set(op[1], op[2])
    elif kind == "atomic":
        getattr(tr, op[1])(op[2], op[3])
    elif kind == "svk":
        tr.set_versionstamped_key(op[1] + OFFSET.pack(1), op[2])
    elif kind == "svv":
        tr.set_versionstamped_value(op[1], op[2] + b"\x00" * 10 + OFFSET.pack(len(op[2])))
    else:
        tr.options.set_next_write_no_write_conflict_range()


async def _after(tr: kv.Transaction, op: tuple):
    kind = op[0]
    if kind == "get":
        return await (tr.snapshot if op[2] else tr).get(op[1])
    if kind == "range":
        return [tuple(r) for r in await tr.get_range(b"", b"\xff", limit=op[2], reverse=op[1])]
    if kind == "get_key":
        return await tr.get_key(KeySelector(op[1], False, op[2]))
    if kind == "watch":
        w = tr.watch(op[1])
        return (w.seen, w.ready)
    if kind == "clear":
        tr.clear(op[1])
    elif kind == "clear_range":
        tr.clear_range(*sorted((op[1], op[2])))
    elif kind == "read_conflict":
        tr.add_read_conflict_range(*sorted((op[1], op[2])))
    else:
        _write(tr, op[1])
    return None


def _state(tr: kv.Transaction) -> tuple:
    return (tr._mutations, tr._stamped, tr._size, list(tr._write_points), list(tr._read_points),
            list(tr._read_ranges), list(tr._write_ranges), tr._next_write_no_conflict)


async def _both(db: kv.Database, first: list, then: list) -> None:
    eager, lazy = db.create_transaction(), db.create_transaction()
    assert lazy._writes is None
    eager._write_map()  # an empty map from the start: every write keeps it up to date
    for op in first:
        _write(eager, op)
        _write(lazy, op)
    assert lazy._writes is None  # nothing so far needed it
    assert _state(lazy) == _state(eager)
    for op in then:
        outcome = []
        for tr in (eager, lazy):
            try:
                outcome.append(("ok", await _after(tr, op)))
            except KVError as e:
                outcome.append(("error", e.code))
        assert outcome[0] == outcome[1], (op, outcome)
        assert lazy._write_map() == eager._writes, op
        assert _state(lazy) == _state(eager), op
    for tr in (eager, lazy):
        tr.cancel()


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(writes, max_size=10), then=st.lists(after, min_size=1, max_size=6))
def test_a_lazily_built_write_map_is_the_eagerly_kept_one(first, then):
    async def main():
        db = await kv.open("memory:")
        async def seed(tr):  # stored values under some keys, so reads merge both
            tr.set(b"a", b"\x07")
            tr.set(b"c", b"\x01\x02")
            tr.set(b"v", b"stored")
        await db.transact(seed)
        await _both(db, first, then)
        await db.close()

    trio.run(main)


async def test_replay_cases(tmp_path):
    """Fixed cases of the replay's branches on the LMDB engine, committed and read back."""
    db = await kv.open(f"lmdb:{tmp_path}/data")
    cases = [
        # a set then an atomic op on it, then a read: the op applies to the set value
        ([("set", b"a", b"\x01"), ("atomic", "add", b"a", b"\x02")], [("get", b"a", False)]),
        # an atomic op on an unwritten key: read applies it to the stored value
        ([("atomic", "add", b"c", b"\x05")], [("get", b"c", False), ("range", False, 0)]),
        # a versionstamped value makes its key unreadable; a later set makes it readable again
        ([("svv", b"b", b"x"), ("set", b"a", b"1")], [("get", b"b", False)]),
        ([("svv", b"b", b"x"), ("set", b"b", b"2")], [("get", b"b", False)]),
        ([("svv", b"b", b"x"), ("atomic", "add", b"b", b"\x01")], [("get", b"b", False)]),
        # a versionstamped key whose body is a key set before it: the set keeps its entry
        ([("set", STAMP_BODY, b"q"), ("svk", STAMP_BODY, b"v")], [("get", b"a", False), ("range", False, 0)]),
        # compare_and_clear on a set value clears it
        ([("set", b"a", b"\x01"), ("atomic", "compare_and_clear", b"a", b"\x01")], [("get", b"a", False)]),
        # a clear after lazy writes builds the map first
        ([("set", b"a", b"1"), ("set", b"b", b"2")], [("clear", b"a"), ("get", b"a", False), ("get", b"b", False)]),
        ([("set", b"a", b"1"), ("set", b"b", b"2")], [("clear_range", b"a", b"b"), ("range", False, 0)]),
        ([("no_conflict",), ("set", b"a", b"1")], [("watch", b"a"), ("watch", b"b")]),
    ]
    for first, then in cases:
        await _both(db, first, then)
    # and a lazy transaction's commit writes what it logged
    tr = db.create_transaction()
    tr.set(b"a", b"\x01")
    tr.add(b"a", b"\x02")
    tr.set_versionstamped_value(b"b", b"\x00" * 10 + OFFSET.pack(0))
    tr.set_versionstamped_key(STAMP_BODY + OFFSET.pack(1), b"k")
    vs = tr.get_versionstamp()
    assert tr._writes is None
    await tr.commit()
    stamp = await vs
    rows = await db.transact(lambda t: t.get_range(b"", b"\xff"))  # read-only
    assert [tuple(r) for r in rows] == [(b"a", b"\x03"), (b"b", stamp), (b"s" + stamp, b"k")]
    await db.close()
