"""The kv contract (issue 2, section 3), point by point, on every backend.

Each test runs on ``memory``, ``lmdb`` and (with SUREFOOT_FDB_CLUSTER_FILE)
``fdb``. The expected behaviour is FoundationDB's
(../shared/reference/fdb-semantics.md); where the test asserts something
easy to miss, the comment cites the rule.
"""

from __future__ import annotations

import struct

import pytest
import trio

import kv
from kv import KeySelector, KVError
from kv.tuple import Subspace, Versionstamp
from kvtest_helpers import (
    open_backend,
    MARKER,
    clearer,
    commit_code,
    conflicts,
    dump,
    from_le64,
    le64,
    raises_code,
    read,
    setter,
    write,
)

# ---------------------------------------------------------------------------
# Read versions
# ---------------------------------------------------------------------------


async def test_read_version_is_taken_lazily_at_first_read(db):
    tr = db.create_transaction()  # no read yet: no read version
    await write(db, (b"k", b"v1"))  # acknowledged before tr's first read
    assert await tr.get(b"k") == b"v1"


async def test_read_version_sees_every_acknowledged_commit(db):
    for i in range(5):
        w = db.create_transaction()
        w.set(b"k", b"%d" % i)
        await w.commit()
        cv = w.get_committed_version()
        tr = db.create_transaction()
        assert await tr.get_read_version() >= cv
        assert await tr.get(b"k") == b"%d" % i


async def test_read_version_is_stable_within_a_transaction(db):
    await write(db, (b"k", b"old"))
    tr = db.create_transaction()
    rv = await tr.get_read_version()
    await write(db, (b"k", b"new"), (b"k2", b"x"))
    assert await tr.get(b"k") == b"old"
    assert await tr.get(b"k2") is None
    assert await tr.get_read_version() == rv
    assert [r.key for r in await tr.get_range(b"k", b"l")] == [b"k"]


async def test_read_only_commit_has_version_minus_one(db):
    tr = db.create_transaction()
    await tr.get(b"k")
    await tr.commit()
    assert tr.get_committed_version() == -1


async def test_committed_version_increases(db):
    versions = []
    for i in range(3):
        tr = db.create_transaction()
        tr.set(b"k", b"%d" % i)
        await tr.commit()
        versions.append(tr.get_committed_version())
    assert versions == sorted(versions) and len(set(versions)) == 3


async def test_transact_returns_result(db):
    async def fn(tr):
        tr.set(b"a", b"1")
        return 42

    assert await db.transact(fn) == 42
    assert await read(db, b"a") == b"1"


# ---------------------------------------------------------------------------
# Read your writes
# ---------------------------------------------------------------------------


async def test_ryw_get_sees_sets_clears_and_atomics(db):
    await write(db, (b"a", b"1"), (b"b", b"2"), (b"n", le64(10)))
    tr = db.create_transaction()
    tr.set(b"a", b"x")
    tr.clear(b"b")
    tr.add(b"n", le64(5))
    tr.add(b"fresh", le64(7))  # absent key: the op stores its parameter
    assert await tr.get(b"a") == b"x"
    assert await tr.get(b"b") is None
    assert from_le64(await tr.get(b"n")) == 15
    assert from_le64(await tr.get(b"fresh")) == 7
    tr.add(b"n", le64(1))
    assert from_le64(await tr.get(b"n")) == 16
    tr.clear_range(b"a", b"c")
    assert await tr.get(b"a") is None
    tr.set(b"a", b"again")
    assert await tr.get(b"a") == b"again"
    assert await tr.get_multi([b"a", b"b", b"n"]) == [b"again", None, le64(16)]
    # snapshot reads see own writes too
    assert await tr.snapshot.get(b"a") == b"again"
    await tr.commit()
    assert await dump(db) == [(b"a", b"again"), (b"fresh", le64(7)), (b"n", le64(16))]


@pytest.fixture
async def ryw_tr(db):
    # stored: a c e g i ; own writes: set b, clear c, add e, set h, clear_range [f, g\x00) incl. g
    await write(db, *[(k, le64(ord(k))) for k in (b"a", b"c", b"e", b"g", b"i")])
    tr = db.create_transaction()
    tr.set(b"b", b"B")
    tr.clear(b"c")
    tr.add(b"e", le64(1000))
    tr.clear_range(b"f", b"g\x00")
    tr.set(b"h", b"H")
    return tr


EXPECTED_RYW = [(b"a", le64(97)), (b"b", b"B"), (b"e", le64(101 + 1000)), (b"h", b"H"), (b"i", le64(105))]


async def test_ryw_get_range_forward(ryw_tr):
    rows = await ryw_tr.get_range(b"a", b"z")
    assert [(r.key, r.value) for r in rows] == EXPECTED_RYW


async def test_ryw_get_range_reverse(ryw_tr):
    rows = await ryw_tr.get_range(b"a", b"z", reverse=True)
    assert [(r.key, r.value) for r in rows] == EXPECTED_RYW[::-1]


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5, 6])
async def test_ryw_get_range_limits(ryw_tr, limit):
    fwd = await ryw_tr.get_range(b"a", b"z", limit=limit)
    rev = await ryw_tr.get_range(b"a", b"z", limit=limit, reverse=True)
    assert [(r.key, r.value) for r in fwd] == EXPECTED_RYW[:limit]
    assert [(r.key, r.value) for r in rev] == EXPECTED_RYW[::-1][:limit]


async def test_ryw_get_range_async_iteration_and_subranges(ryw_tr):
    got = [(r.key, r.value) async for r in ryw_tr.get_range(b"a", b"z")]
    assert got == EXPECTED_RYW
    got = [r.key async for r in ryw_tr.get_range(b"b", b"h", reverse=True)]
    assert got == [b"e", b"b"]
    assert await ryw_tr.get_range(b"c", b"c") == []
    assert await ryw_tr.get_range(b"h", b"c") == []  # begin > end: empty


async def test_get_range_iteration_pages_through_many_rows(db):
    rows = [(b"r%05d" % i, b"v%d" % i) for i in range(2500)]
    for i in range(0, len(rows), 500):
        await write(db, *rows[i : i + 500])
    tr = db.create_transaction()
    got = [(r.key, r.value) async for r in tr.get_range(b"r", b"s")]
    assert got == rows
    got = [r.key async for r in tr.get_range(b"r", b"s", reverse=True, limit=1200)]
    assert got == [k for k, _ in rows[::-1][:1200]]
    assert len(await tr.get_range(b"r", b"s", limit=2001)) == 2001


async def test_get_range_none_bounds_mean_whole_keyspace(db):
    await write(db, (b"", b"empty-key"), (b"\xfe", b"last"))
    tr = db.create_transaction()
    assert [r.key for r in await tr.get_range(None, None)] == [b"", b"\xfe"]


# ---------------------------------------------------------------------------
# Conflicts: 1020 iff a later committed write intersects the read conflict ranges
# ---------------------------------------------------------------------------


async def test_get_conflicts_with_a_later_write_of_the_key(db):
    await write(db, (b"k", b"0"))

    async def reads(tr):
        await tr.get(b"k")

    assert await conflicts(db, reads, setter((b"k", b"1")))
    # [k, k\x00) only: neighbours do not conflict
    assert not await conflicts(db, reads, setter((b"k\x00", b"1")))
    assert not await conflicts(db, reads, setter((b"j\xff", b"1")))
    # a clear of the key (even of an absent key) conflicts
    assert await conflicts(db, reads, clearer(b"k"))


async def test_get_of_absent_key_conflicts_with_its_creation(db):
    async def reads(tr):
        assert await tr.get(b"nothing") is None

    assert await conflicts(db, reads, setter((b"nothing", b"now")))


async def test_conflict_needs_commit_after_read_version(db):
    # A write committed *before* the read version never conflicts (rule is strict RV < CV).
    tr = db.create_transaction()
    await write(db, (b"k", b"1"))
    assert await tr.get(b"k") == b"1"
    tr.set(MARKER, b"x")
    assert await commit_code(tr) is None


async def test_get_range_conflicts_on_the_whole_range(db):
    await write(db, (b"b", b"1"))

    async def reads(tr):
        await tr.get_range(b"a", b"c")

    assert await conflicts(db, reads, setter((b"a", b"1")))
    assert await conflicts(db, reads, setter((b"bb", b"1")))  # a key the read did not return
    assert not await conflicts(db, reads, setter((b"c", b"1")))  # end is exclusive
    assert await conflicts(db, reads, clearer(b"b"))


async def test_clear_range_write_conflicts_with_point_reads_inside(db):
    async def reads(tr):
        await tr.get(b"m")

    async def clear_range(tr):
        tr.clear_range(b"a", b"z")

    assert await conflicts(db, reads, clear_range)

    async def clear_outside(tr):
        tr.clear_range(b"a", b"m")  # end exclusive

    assert not await conflicts(db, reads, clear_outside)


@pytest.fixture
async def five_keys(db):
    await write(db, *[(b"a%d" % i, b"v") for i in range(1, 6)])
    return db


async def test_get_range_limit_cuts_conflict_at_last_key(five_keys):
    db = five_keys

    async def reads(tr):
        rows = await tr.get_range(b"a", b"b", limit=2)
        assert [r.key for r in rows] == [b"a1", b"a2"]

    # conflict range is [a, keyAfter(a2))
    assert await conflicts(db, reads, setter((b"a2", b"x")))
    assert await conflicts(db, reads, setter((b"a15", b"x")))
    assert await conflicts(db, reads, setter((b"a", b"x")))
    assert not await conflicts(db, reads, setter((b"a2\x00", b"x")))
    assert not await conflicts(db, reads, setter((b"a3", b"x")))
    assert not await conflicts(db, reads, clearer(b"a5"))


async def test_get_range_reverse_limit_cut_is_mirrored(five_keys):
    db = five_keys

    async def reads(tr):
        rows = await tr.get_range(b"a", b"b", limit=2, reverse=True)
        assert [r.key for r in rows] == [b"a5", b"a4"]

    # conflict range is [a4, b)
    assert await conflicts(db, reads, setter((b"a4", b"x")))
    assert await conflicts(db, reads, setter((b"a45", b"x")))
    assert await conflicts(db, reads, setter((b"a9", b"x")))
    assert not await conflicts(db, reads, setter((b"a3\xff", b"x")))
    assert not await conflicts(db, reads, clearer(b"a1"))
    assert not await conflicts(db, reads, setter((b"b", b"x")))


async def test_get_range_limit_not_reached_conflicts_on_whole_range(five_keys):
    db = five_keys

    async def reads(tr):
        assert len(await tr.get_range(b"a", b"b", limit=10)) == 5

    assert await conflicts(db, reads, setter((b"a9", b"x")))


async def test_snapshot_reads_add_no_conflicts(db):
    await write(db, (b"k", b"0"))

    async def reads(tr):
        await tr.snapshot.get(b"k")
        await tr.snapshot.get_range(b"a", b"z")
        await tr.snapshot.get_key(KeySelector.first_greater_or_equal(b"a"))
        await tr.snapshot.get_multi([b"k", b"q"])

    assert not await conflicts(db, reads, setter((b"k", b"1"), (b"q", b"1")))


async def test_reads_served_from_own_writes_add_no_conflicts(db):
    await write(db, (b"k", b"0"))

    async def own_set(tr):
        tr.set(b"k", b"mine")
        assert await tr.get(b"k") == b"mine"

    assert not await conflicts(db, own_set, setter((b"k", b"theirs")))

    async def own_clear(tr):
        tr.clear(b"k")
        assert await tr.get(b"k") is None

    assert not await conflicts(db, own_clear, setter((b"k", b"theirs")))

    async def own_clear_range(tr):
        tr.clear_range(b"a", b"m")
        assert await tr.get_range(b"a", b"m") == []

    assert not await conflicts(db, own_clear_range, setter((b"c", b"theirs")))


async def test_range_read_over_partly_own_writes_conflicts_only_elsewhere(db):
    async def reads(tr):
        tr.clear_range(b"c", b"f")
        await tr.get_range(b"a", b"z")

    assert not await conflicts(db, reads, setter((b"d", b"theirs")))
    assert await conflicts(db, reads, setter((b"g", b"theirs")))
    assert await conflicts(db, reads, setter((b"b", b"theirs")))


async def test_range_read_skips_keys_the_transaction_set_or_cleared(db):
    # ReadYourWrites.cpp updateConflictMap: within a read range, only unmodified
    # segments and dependent (atomic) operations add read conflicts; a key this
    # transaction set or cleared is answered from its writes and adds none.
    await write(db, (b"c", b"0"), (b"d", b"0"))

    async def reads(tr):
        tr.set(b"d", b"mine")
        tr.clear(b"c")
        await tr.get_range(b"a", b"z")

    assert not await conflicts(db, reads, setter((b"d", b"theirs")))
    assert not await conflicts(db, reads, setter((b"c", b"theirs")))
    assert await conflicts(db, reads, setter((b"d\x00", b"theirs")))
    assert await conflicts(db, reads, setter((b"b", b"theirs")))


async def test_range_read_over_own_atomic_op_still_conflicts_there(db):
    await write(db, (b"n", le64(1)))

    async def reads(tr):
        tr.add(b"n", le64(1))
        await tr.get_range(b"a", b"z")

    assert await conflicts(db, reads, setter((b"n", le64(5))))


async def test_explicit_read_conflict_range_skips_own_writes(db):
    async def reads(tr):
        tr.set(b"q", b"mine")
        tr.add_read_conflict_range(b"p", b"r")

    assert not await conflicts(db, reads, setter((b"q", b"theirs")))
    assert await conflicts(db, reads, setter((b"p", b"theirs")))


async def test_atomic_ops_add_no_read_conflict(db):
    await write(db, (b"n", le64(1)))
    tr = db.create_transaction()
    await tr.get_read_version()
    tr.add(b"n", le64(10))
    await write(db, (b"n", le64(100)))
    assert await commit_code(tr) is None
    # the add applies on top of the value committed before it: 100 + 10
    assert from_le64(await read(db, b"n")) == 110


async def test_read_after_atomic_op_brings_the_conflict_back(db):
    await write(db, (b"n", le64(1)))

    async def add_then_read(tr):
        tr.add(b"n", le64(10))
        assert from_le64(await tr.get(b"n")) == 11

    assert await conflicts(db, add_then_read, setter((b"n", le64(100))))


async def test_write_write_never_conflicts(db):
    t1 = db.create_transaction()
    t2 = db.create_transaction()
    await t1.get_read_version()
    await t2.get_read_version()
    t1.set(b"k", b"1")
    t1.clear_range(b"a", b"z")
    t2.set(b"k", b"2")
    await t2.commit()
    assert await commit_code(t1) is None
    assert await read(db, b"k") is None  # t1 serialized last: its clear_range wins


async def test_explicit_read_conflict_range_and_key(db):
    async def reads(tr):
        tr.add_read_conflict_range(b"p", b"r")

    assert await conflicts(db, reads, setter((b"q", b"1")))
    assert not await conflicts(db, reads, setter((b"r", b"1")))

    async def read_key(tr):
        tr.add_read_conflict_key(b"solo")

    assert await conflicts(db, read_key, setter((b"solo", b"1")))
    assert not await conflicts(db, read_key, setter((b"solo\x00", b"1")))


async def test_explicit_write_conflict_range_conflicts_without_a_write(db):
    async def reads(tr):
        await tr.get(b"w")

    async def writes(tr):
        tr.add_write_conflict_range(b"v", b"x")
        tr.set(b"elsewhere", b"1")

    assert await conflicts(db, reads, writes)

    async def write_key(tr):
        tr.add_write_conflict_key(b"w")

    assert await conflicts(db, reads, write_key)


async def test_next_write_no_write_conflict_range(db):
    async def reads(tr):
        await tr.get(b"k")

    async def quiet(tr):
        tr.options.set_next_write_no_write_conflict_range()
        tr.set(b"k", b"1")

    assert not await conflicts(db, reads, quiet)
    await db.transact(quiet)
    assert await read(db, b"k") == b"1"  # the write itself happened

    async def only_next(tr):
        tr.options.set_next_write_no_write_conflict_range()
        tr.set(b"other", b"1")
        tr.set(b"k", b"2")  # this one has its conflict range again

    assert await conflicts(db, reads, only_next)


async def test_get_key_conflict_spans_reference_to_result(db):
    await write(db, (b"a", b""), (b"c", b""), (b"e", b""))

    async def reads(tr):
        assert await tr.get_key(KeySelector.first_greater_or_equal(b"b")) == b"c"

    assert await conflicts(db, reads, setter((b"b5", b"")))  # would change the answer
    assert await conflicts(db, reads, clearer(b"c"))
    assert not await conflicts(db, reads, setter((b"d", b"")))
    assert not await conflicts(db, reads, setter((b"a5", b"")))


async def test_get_key_backward_conflict_spans_result_to_reference(db):
    await write(db, (b"a", b""), (b"c", b""), (b"e", b""))

    async def reads(tr):
        assert await tr.get_key(KeySelector.last_less_than(b"d")) == b"c"

    assert await conflicts(db, reads, setter((b"c5", b"")))  # would become the answer
    assert await conflicts(db, reads, clearer(b"c"))
    assert not await conflicts(db, reads, setter((b"b", b"")))
    assert not await conflicts(db, reads, setter((b"d", b"")))  # last_less_than: d itself is outside


async def test_set_versionstamped_key_conflicts_on_its_final_key(db):
    log = Subspace(("log",))

    async def tail_reader(tr):
        await tr.get_range(log.range().start, log.range().stop)

    async def append(tr):
        tr.set_versionstamped_key(log.pack_with_versionstamp((Versionstamp.incomplete(),)), b"entry")

    assert await conflicts(db, tail_reader, append)

    async def other_reader(tr):
        await tr.get_range(b"a", log.key())  # below the log

    assert not await conflicts(db, other_reader, append)


async def test_within_one_batch_later_transactions_see_earlier_writes_as_conflicts(db):
    # Many transactions read k and write k at the same read version, committed
    # concurrently: exactly one can commit (whatever batches they land in).
    await write(db, (b"k", b"0"))
    trs = [db.create_transaction() for _ in range(8)]
    for i, tr in enumerate(trs):
        assert await tr.get(b"k") == b"0"
        tr.set(b"k", b"%d" % (i + 1))
    codes: list[int | None] = []

    async def go(tr):
        codes.append(await commit_code(tr))

    async with trio.open_nursery() as n:
        for tr in trs:
            n.start_soon(go, tr)
    assert sorted(codes, key=lambda c: c or 0) == [None] + [1020] * 7


# ---------------------------------------------------------------------------
# transaction_too_old (1007): only with read conflict ranges
# ---------------------------------------------------------------------------


async def test_too_old_with_read_conflicts(clocked):
    db, clock = clocked
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    await tr.get(b"k")
    await clock.advance(6)
    await write(db, (b"unrelated", b"1"))
    tr.set(b"k", b"1")
    assert await commit_code(tr) == 1007


async def test_blind_writes_are_never_too_old(clocked):
    db, clock = clocked
    tr = db.create_transaction()
    await tr.get_read_version()
    await clock.advance(6)
    await write(db, (b"unrelated", b"1"))
    tr.set(b"k", b"blind")
    tr.add(b"n", le64(1))
    assert await commit_code(tr) is None
    assert await read(db, b"k") == b"blind"


async def test_snapshot_reads_are_never_too_old_at_commit(clocked):
    db, clock = clocked
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    assert await tr.snapshot.get(b"k") == b"0"
    await clock.advance(6)
    tr.set(b"k", b"1")
    assert await commit_code(tr) is None


async def test_within_the_window_is_not_too_old(clocked):
    db, clock = clocked
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    await tr.get(b"k")
    await clock.advance(3)
    tr.set(b"k", b"1")
    assert await commit_code(tr) is None


async def test_reading_past_the_window_is_too_old(clocked):
    db, clock = clocked
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    await tr.get(b"k")
    await clock.advance(6)
    await write(db, (b"k", b"1"))
    with raises_code(1007):
        await tr.get(b"other")


async def test_snapshot_survives_many_later_commits_within_the_window(clocked):
    # MVCC history is compacted as batches go by; a reader inside the window
    # must still see exactly its snapshot.
    db, clock = clocked
    await write(db, *[(b"m%03d" % i, b"old") for i in range(50)])
    tr = db.create_transaction()
    assert await tr.get(b"m000") == b"old"
    for n in range(200):
        await clock.advance(0.02)  # 4 s in total: inside the 5 s window
        async def churn(t, n=n):  # idempotent: plain sets/clears
            t.set(b"m%03d" % (n % 50), b"new%d" % n)
            t.clear(b"m%03d" % ((n + 7) % 50))
            t.set(b"n%03d" % n, b"x")
        await db.transact(churn)
    rows = await tr.snapshot.get_range(b"m", b"o")
    assert rows == [(b"m%03d" % i, b"old") for i in range(50)]
    assert await tr.snapshot.get(b"m049") == b"old"


async def test_transact_retries_too_old(clocked):
    db, clock = clocked
    attempts = 0

    async def fn(tr):
        nonlocal attempts
        attempts += 1
        await tr.get(b"k")
        if attempts == 1:
            await clock.advance(6)
        tr.set(b"k", b"done")

    await db.transact(fn)
    assert attempts == 2 and await read(db, b"k") == b"done"


# ---------------------------------------------------------------------------
# Versionstamps
# ---------------------------------------------------------------------------

OFFSET = struct.Struct("<I")


async def test_versionstamp_in_key_and_value_is_the_transactions_stamp(db):
    log = Subspace(("log",))
    tr = db.create_transaction()
    tr.set_versionstamped_key(log.pack_with_versionstamp(("ev", Versionstamp.incomplete(7))), b"payload")
    tr.set_versionstamped_value(b"pointer", b"pre" + b"\x00" * 10 + b"post" + OFFSET.pack(3))
    vs = tr.get_versionstamp()
    await tr.commit()
    stamp = await vs
    assert len(stamp) == 10
    assert stamp[:8] == tr.get_committed_version().to_bytes(8, "big")
    rows = await dump(db, *(lambda r: (r.start, r.stop))(log.range()))
    assert rows == [(log.pack(("ev", Versionstamp(stamp, 7))), b"payload")]
    assert log.unpack(rows[0][0]) == ("ev", Versionstamp(stamp, 7))
    assert await read(db, b"pointer") == b"pre" + stamp + b"post"


async def test_one_stamp_many_user_versions(db):
    log = Subspace(("log",))
    tr = db.create_transaction()
    for user in (3, 1, 2):
        tr.set_versionstamped_key(log.pack_with_versionstamp((Versionstamp.incomplete(user),)), b"%d" % user)
    vs = tr.get_versionstamp()
    await tr.commit()
    stamp = await vs
    rows = await dump(db, log.range().start, log.range().stop)
    assert [log.unpack(k)[0] for k, _ in rows] == [Versionstamp(stamp, u) for u in (1, 2, 3)]
    assert [v for _, v in rows] == [b"1", b"2", b"3"]


async def test_versionstamps_unique_and_increasing_in_commit_order(db):
    stamps = []
    for i in range(20):
        tr = db.create_transaction()
        tr.set_versionstamped_value(b"last", b"\x00" * 10 + OFFSET.pack(0))
        vs = tr.get_versionstamp()
        await tr.commit()
        stamps.append(await vs)
    assert stamps == sorted(stamps) and len(set(stamps)) == 20
    assert await read(db, b"last") == stamps[-1]


async def test_versionstamp_of_read_only_transaction_errors(db):
    tr = db.create_transaction()
    await tr.get(b"k")
    vs = tr.get_versionstamp()
    await tr.commit()
    with raises_code(2021):
        await vs


async def test_versionstamp_first_asked_after_commit_is_refused_not_left_pending(db):
    # FoundationDB answers used_during_commit (2017) once a commit started, until reset; an
    # awaitable nobody will ever set would hang the caller forever.
    tr = db.create_transaction()
    tr.set(b"vs-late", b"1")
    await tr.commit()
    with raises_code(2017):
        tr.get_versionstamp()
    # a failed commit too, until on_error resets the transaction
    tr3 = db.create_transaction()
    await tr3.get(b"vs-late")
    tr4 = db.create_transaction()
    tr4.set(b"vs-late", b"3")
    await tr4.commit()
    tr3.set(b"vs-late", b"4")
    with raises_code(1020) as err:
        await tr3.commit()
    with raises_code(2017):
        tr3.get_versionstamp()
    # ...and that refusal fails RYW's resetPromise with 2017, so on_error raises it
    # (tests/kv/test_lifecycle.py); reset() starts over
    with raises_code(2017):
        await tr3.on_error(err.value)
    tr3.reset()
    tr3.set(b"vs-late", b"5")
    vs = tr3.get_versionstamp()
    await tr3.commit()
    assert len(await vs) == 10


async def test_concurrent_commits_get_batch_order_suffix(db, backend):
    stamps: dict[int, bytes] = {}

    async def appender(i):
        tr = db.create_transaction()
        tr.set_versionstamped_key(b"log/" + b"\x00" * 10 + b"/%03d" % i + OFFSET.pack(4), b"%d" % i)
        tr.set_versionstamped_value(b"last", b"\x00" * 10 + OFFSET.pack(0))
        vs = tr.get_versionstamp()
        await tr.commit()
        stamps[i] = await vs

    async with trio.open_nursery() as n:
        for i in range(40):
            n.start_soon(appender, i)
    values = list(stamps.values())
    assert len(set(values)) == 40
    # the last transaction in serialization order wrote "last": the greatest stamp
    assert await read(db, b"last") == max(values)
    # each stamp is in the log at its own key
    rows = await dump(db, b"log/", b"log0")
    assert [r[0][4:14] for r in rows] == sorted(values)
    by_version: dict[bytes, list[int]] = {}
    for s in values:
        by_version.setdefault(s[:8], []).append(int.from_bytes(s[8:], "big"))
    if backend != "fdb":
        # One engine resolver: the batch suffix is the order among accepted
        # transactions, 0..n-1.
        for orders in by_version.values():
            assert sorted(orders) == list(range(len(orders)))
    if backend == "lmdb":
        assert len(by_version) < 40  # commits arriving during a batch's fsync formed later batches


async def test_versionstamps_never_reused_after_reopen(embedded, tmp_path):
    engine = kv.MemoryEngine()
    path = tmp_path / "data"

    async def reopen():
        return engine.database() if embedded == "memory" else await open_backend("lmdb", path)

    seen = []
    for _round in range(3):
        db = await reopen()
        for _ in range(3):
            tr = db.create_transaction()
            tr.set_versionstamped_key(b"log/" + b"\x00" * 10 + OFFSET.pack(4), b"")
            vs = tr.get_versionstamp()
            await tr.commit()
            seen.append(await vs)
        await db.close()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    db = await reopen()
    rows = await dump(db, b"log/", b"log0")
    assert [k[4:] for k, _ in rows] == seen
    await db.close()


async def test_reader_sees_a_hole_free_prefix_of_a_versionstamp_log(db):
    observed: list[list[bytes]] = []
    done = trio.Event()

    async def appender(i):
        for j in range(8):
            async def fn(tr):  # never conflicts: no reads, unique keys
                tr.set_versionstamped_key(b"log/" + b"\x00" * 10 + OFFSET.pack(4), b"%d.%d" % (i, j))

            await db.transact(fn)
            await trio.sleep(0)

    async def reader():
        while not done.is_set():
            async def fn(tr):
                return [r.key for r in await tr.get_range(b"log/", b"log0")]

            observed.append(await db.transact(fn))
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        n.start_soon(reader)
        async with trio.open_nursery() as writers:
            for i in range(6):
                writers.start_soon(appender, i)
        done.set()
    final = [k for k, _ in await dump(db, b"log/", b"log0")]
    assert len(final) == 48
    assert observed
    for seen in observed:
        assert seen == final[: len(seen)]  # a prefix: nothing appears later below a key already seen


async def test_versionstamped_writes_are_unreadable_in_their_transaction(db):
    tr = db.create_transaction()
    tr.set_versionstamped_key(b"log/" + b"\x00" * 10 + OFFSET.pack(4), b"v")
    with raises_code(1036):
        await tr.get_range(b"log/", b"log0")
    tr2 = db.create_transaction()
    tr2.set_versionstamped_value(b"vv", b"\x00" * 10 + OFFSET.pack(0))
    with raises_code(1036):
        await tr2.get(b"vv")
    assert await tr2.get(b"other") is None  # other keys stay readable


async def test_versionstamped_key_validation(db):
    tr = db.create_transaction()
    with raises_code(2000):
        tr.set_versionstamped_key(b"short" + OFFSET.pack(0), b"v")  # < 14 bytes
    with raises_code(2000):
        tr.set_versionstamped_key(b"x" * 12 + OFFSET.pack(5), b"v")  # offset + 10 > len


# ---------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------


async def test_key_and_value_size_limits_raise_at_once(db):
    tr = db.create_transaction()
    tr.set(b"k" * kv.limits.KEY_SIZE_LIMIT, b"v")  # exactly at the limit: fine
    tr.set(b"big", b"v" * kv.limits.VALUE_SIZE_LIMIT)
    with raises_code(2102):
        tr.set(b"k" * (kv.limits.KEY_SIZE_LIMIT + 1), b"v")
    with raises_code(2103):
        tr.set(b"k", b"v" * (kv.limits.VALUE_SIZE_LIMIT + 1))
    with raises_code(2102):
        tr.add(b"k" * (kv.limits.KEY_SIZE_LIMIT + 1), le64(1))
    with raises_code(2103):
        tr.append_if_fits(b"k", b"v" * (kv.limits.VALUE_SIZE_LIMIT + 1))
    # a too-large key cannot exist: reading it answers None, clearing it does nothing
    assert await tr.get(b"q" * (kv.limits.KEY_SIZE_LIMIT + 1)) is None
    tr.clear(b"q" * (kv.limits.KEY_SIZE_LIMIT + 1))
    with raises_code(2004):
        tr.clear(b"\xff" + b"q" * kv.limits.KEY_SIZE_LIMIT)  # the legal range is checked first
    await tr.commit()
    assert len(await read(db, b"big")) == kv.limits.VALUE_SIZE_LIMIT
    assert await read(db, b"k" * kv.limits.KEY_SIZE_LIMIT) == b"v"


async def test_transaction_size_limit_raises_at_commit(db):
    tr = db.create_transaction()
    value = b"x" * 99_000
    for i in range(102):  # ~10.1 MB: every set is accepted...
        tr.set(b"chunk%03d" % i, value)
    with raises_code(2101):  # ...and the commit refuses
        await tr.commit()
    assert await read(db, b"chunk000") is None


def _big_ranges(n=600, width=8990):
    return [(b"%05d" % i + b"a" * width, b"%05d" % i + b"b" * width) for i in range(n)]


@pytest.mark.parametrize("kind", ["clear_range", "read_conflict", "write_conflict"])
async def test_transaction_size_counts_clear_bounds_and_conflict_ranges(db, kind):
    # ~10.8 MB of range bounds and no values: still too large (FoundationDB
    # counts cleared-range bounds and read and write conflict ranges).
    tr = db.create_transaction()
    for b, e in _big_ranges():
        if kind == "clear_range":
            tr.clear_range(b, e)
        elif kind == "read_conflict":
            tr.add_read_conflict_range(b, e)
        else:
            tr.add_write_conflict_range(b, e)
    tr.set(b"k", b"v")
    with raises_code(2101):
        await tr.commit()
    assert await read(db, b"k") is None


async def test_keys_at_or_above_ff_are_outside_the_legal_range(db):
    tr = db.create_transaction()
    for op in (
        lambda: tr.set(b"\xff", b"v"),
        lambda: tr.set(b"\xff\x00sys", b"v"),
        lambda: tr.clear(b"\xff"),
        lambda: tr.add(b"\xffn", le64(1)),
        lambda: tr.clear_range(b"a", b"\xff\x01"),
    ):
        with raises_code(2004):
            op()
    with raises_code(2004):
        await tr.get(b"\xff/anything")
    with raises_code(2004):
        await tr.get_range(b"a", b"\xff\x01")
    tr.clear_range(b"a", b"\xff")  # up to \xff exactly is legal


async def test_selectors_past_ff_are_outside_the_legal_range(db):
    """A selector's own key past \\xff is 2004 (RYW getKey: "key.getKey() > getMaxReadKey()";
    getRange checks both bounds' keys before resolving either); \\xff itself is legal, and
    resolving past the last key answers \\xff."""
    await write(db, (b"a", b"1"))
    tr = db.create_transaction()
    past = KeySelector.first_greater_or_equal(b"\xff\x01")
    with raises_code(2004):
        await tr.get_key(past)
    with raises_code(2004):
        await tr.snapshot.get_key(KeySelector.last_less_than(b"\xff\x00"))
    with raises_code(2004):
        await tr.get_range(b"", past)
    with raises_code(2004):
        await tr.get_range(KeySelector.first_greater_or_equal(b"a"), past)
    with raises_code(2004):
        await tr.get_range(past, b"\xff")
    assert await tr.get_key(KeySelector.first_greater_than(b"a")) == b"\xff"
    assert await tr.get_key(KeySelector.last_less_than(b"\xff")) == b"a"
    assert [r.key for r in await tr.get_range(b"", KeySelector.first_greater_or_equal(b"\xff"))] == [b"a"]


async def test_inverted_ranges(db):
    tr = db.create_transaction()
    with raises_code(2005):
        tr.clear_range(b"b", b"a")
    with raises_code(2005):
        tr.add_read_conflict_range(b"b", b"a")
    with raises_code(2005):
        tr.add_write_conflict_range(b"b", b"a")
    tr.clear_range(b"b", b"b")  # empty: a no-op
    assert await tr.get_range(b"b", b"a") == []  # reads of an inverted range are empty


# ---------------------------------------------------------------------------
# Watches
# ---------------------------------------------------------------------------


async def _wait_watch(w, seconds=10):
    with trio.fail_after(seconds):
        await w


async def test_watch_fires_after_a_later_committed_change(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    assert await tr.get(b"w") == b"0"
    w = tr.watch(b"w")
    await tr.commit()  # read-only commit is enough to activate it
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready
    await write(db, (b"w", b"1"))
    await _wait_watch(w)
    assert w.ready


async def test_watch_is_only_activated_at_commit(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    await tr.get(b"w")
    w = tr.watch(b"w")
    await write(db, (b"w", b"1"))  # changed before the watch's transaction committed
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready  # not active yet
    await tr.commit()
    await _wait_watch(w)  # differs from what tr saw: fires once active


async def test_watch_compares_with_own_write(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    tr.set(b"w", b"mine")
    w = tr.watch(b"w")
    await tr.commit()
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready  # the value is what the transaction wrote
    await write(db, (b"w", b"later"))
    await _wait_watch(w)


async def test_watch_fires_on_clear_and_clear_range(db):
    await write(db, (b"w1", b"0"), (b"w2", b"0"))
    tr = db.create_transaction()
    w1, w2 = tr.watch(b"w1"), tr.watch(b"w2")
    await tr.get_multi([b"w1", b"w2"])
    await tr.commit()
    await write(db, clears=(b"w1",))
    await _wait_watch(w1)

    async def clear_range(tr):
        tr.clear_range(b"w", b"x")

    await db.transact(clear_range)
    await _wait_watch(w2)


async def test_commit_error_is_copied_to_the_watch(db):
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    await tr.get(b"k")
    w = tr.watch(b"w")
    await write(db, (b"k", b"1"))
    tr.set(b"k", b"2")
    assert await commit_code(tr) == 1020
    with raises_code(1020):
        await _wait_watch(w)


async def test_reset_before_commit_cancels_the_watch(db):
    tr = db.create_transaction()
    w = tr.watch(b"w")
    tr.reset()
    with raises_code(1025):
        await _wait_watch(w)
    # cancel() alone leaves it pending (RYW cancel only sets resetPromise; see
    # tests/kv/test_watch_lifecycle.py); the reset after it fails it with 1025
    tr = db.create_transaction()
    w = tr.watch(b"w")
    await tr.get(b"w")  # (the watch's read done: one in flight would fail at cancel)
    tr.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready
    tr.reset()
    with raises_code(1025):
        await _wait_watch(w)


async def test_watch_cancel(db):
    tr = db.create_transaction()
    w = tr.watch(b"w")
    await tr.commit()
    w.cancel()
    with raises_code(1101):  # a cancelled future: operation_cancelled
        await _wait_watch(w)


# ---------------------------------------------------------------------------
# Retry loop, options and lifecycle
# ---------------------------------------------------------------------------


async def test_on_error_resets_for_retryable_errors(db):
    await write(db, (b"k", b"stored"))
    tr = db.create_transaction()
    tr.set(b"k", b"mine")
    await tr.on_error(KVError(1020))
    assert await tr.get(b"k") == b"stored"  # own writes forgotten
    await tr.commit()
    assert await read(db, b"k") == b"stored"


# fdb_error_predicate(RETRYABLE_NOT_COMMITTED) in bindings/c/fdb_c.cpp, names from error_definitions.h
@pytest.mark.parametrize("code,name", [
    (1042, "commit_proxy_memory_limit_exceeded"), (1078, "grv_proxy_memory_limit_exceeded"),
    (1223, "proxy_tag_throttled"), (1235, "transaction_throttled_hot_shard"), (1213, "tag_throttled"),
])
async def test_cluster_overload_errors_are_retryable_not_committed(db, code, name):
    err = KVError(code)
    assert (err.name, err.retryable, err.maybe_committed) == (name, True, False)
    tr = db.create_transaction()
    tr.set(b"k", b"mine")
    await tr.on_error(err)  # backs off and resets, as libfdb_c's on_error does
    assert await tr.get(b"k") is None


def test_error_names_are_foundationdbs():
    """Names from flow/include/flow/error_definitions.h: 4000 is unknown_error and 4100 (what the
    engines raise after a write-ahead log failure) internal_error; a code FoundationDB does not
    define here reads as unknown_error."""
    assert [KVError(c).name for c in (4000, 4100, 1021, 2017, 9999)] == [
        "unknown_error", "internal_error", "commit_unknown_result", "used_during_commit", "unknown_error"]
    assert not KVError(4100).retryable and not KVError(4100).maybe_committed


@pytest.mark.parametrize("code", [1025, 1031, 2000, 2004, 2005, 2017, 2101, 2102, 2103])
async def test_on_error_reraises_non_retryable(db, code):
    tr = db.create_transaction()
    with raises_code(code):
        await tr.on_error(KVError(code))


async def test_on_error_reraises_non_kv_errors(db):
    tr = db.create_transaction()
    with pytest.raises(ZeroDivisionError):
        await tr.on_error(ZeroDivisionError())


async def test_backoff_is_capped_and_randomised(edb, autojump_clock):
    # FoundationDB: sleep backoff*random01(), backoff from 0.01 s doubling up
    # to max_retry_delay; 1007/1009 sleep min(0.01, max) (virtual time here).
    tr = edb.create_transaction()
    tr.options.set_max_retry_delay(40)
    delays = []
    for _ in range(12):
        t0 = trio.current_time()
        await tr.on_error(KVError(1020))
        delays.append(trio.current_time() - t0)
    caps = [min(0.01 * 2**i, 0.04) for i in range(12)]
    assert all(0 <= d <= c + 1e-9 for d, c in zip(delays, caps)), delays
    assert len(set(delays)) > 1  # randomised
    t0 = trio.current_time()
    await tr.on_error(KVError(1007))
    assert trio.current_time() - t0 == pytest.approx(0.01)


async def test_retry_limit(db):
    attempts = 0

    async def always_conflicts(tr):
        nonlocal attempts
        attempts += 1
        await tr.get(b"hot")
        await write(db, (b"hot", b"%d" % attempts))  # a later commit of what we read
        tr.set(b"x", b"1")

    with raises_code(1020):
        await db.transact(always_conflicts, retry_limit=2)
    assert attempts == 3
    assert await read(db, b"x") is None

    tr = db.create_transaction()
    tr.options.set_retry_limit(0)
    with raises_code(1020):
        await tr.on_error(KVError(1020))


async def test_transact_retries_until_commit(db):
    attempts = 0

    async def flaky(tr):
        nonlocal attempts
        attempts += 1
        await tr.get(b"hot")
        if attempts < 4:
            await write(db, (b"hot", b"%d" % attempts))
        tr.set(b"x", b"%d" % attempts)

    await db.transact(flaky)
    assert attempts == 4 and await read(db, b"x") == b"4"


async def test_timeout(db):
    tr = db.create_transaction()
    tr.options.set_timeout(30)
    await trio.sleep(0.1)
    with raises_code(1031):
        await tr.get(b"k")
    with raises_code(1031):
        await tr.on_error(KVError(1031))  # not retryable

    async def slow(tr):
        await trio.sleep(0.1)
        tr.set(b"k", b"v")

    with raises_code(1031):
        await db.transact(slow, timeout=0.03)
    assert await read(db, b"k") is None


async def test_cancel(db):
    tr = db.create_transaction()
    tr.set(b"k", b"v")
    tr.cancel()
    with raises_code(1025):
        await tr.get(b"k")
    with raises_code(1025):
        tr.set(b"k", b"v")
    with raises_code(1025):
        await tr.commit()
    assert await read(db, b"k") is None
    tr.reset()  # a reset transaction is usable again
    tr.set(b"k", b"after-reset")
    await tr.commit()
    assert await read(db, b"k") == b"after-reset"


async def test_reset_forgets_writes_and_read_version(db):
    tr = db.create_transaction()
    await tr.get(b"k")
    tr.set(b"a", b"1")
    await write(db, (b"k", b"new"))
    tr.reset()
    assert await tr.get(b"a") is None
    assert await tr.get(b"k") == b"new"  # a fresh read version
    tr.set(MARKER, b"1")
    await tr.commit()
    assert await read(db, b"a") is None


async def test_reset_restores_default_options(db):
    # ReadYourWrites.cpp reset(): persistentOptions.clear(); options.reset(tr) —
    # unlike on_error, reset() drops timeout, retry_limit and max_retry_delay.
    tr = db.create_transaction()
    tr.options.set_retry_limit(0)
    tr.options.set_timeout(30)
    tr.reset()
    await trio.sleep(0.1)
    assert await tr.get(b"k") is None  # no timeout any more
    await tr.on_error(KVError(1020))  # no retry limit any more


async def test_options_survive_on_error(db):
    tr = db.create_transaction()
    tr.options.set_retry_limit(1)
    await tr.on_error(KVError(1020))
    with raises_code(1020):
        await tr.on_error(KVError(1020))


async def test_size_limit_option(db):
    tr = db.create_transaction()
    tr.options.set_size_limit(1_000)
    tr.set(b"k", b"v" * 2_000)
    with raises_code(2101):
        await tr.commit()
    tr.reset()  # not persistent
    tr.set(b"k", b"v" * 2_000)
    await tr.commit()
    assert len(await read(db, b"k")) == 2_000


async def test_snapshot_read_after_atomic_op_adds_no_conflict(db):
    await write(db, (b"n", le64(1)))

    async def reads(tr):
        tr.add(b"n", le64(1))
        assert from_le64(await tr.snapshot.get(b"n")) == 2

    assert not await conflicts(db, reads, setter((b"n", le64(5))))


async def test_used_during_commit(db):
    tr = db.create_transaction()
    tr.set(b"k", b"v")
    errors = []

    async def meddle():
        try:
            tr.set(b"k2", b"v2")
        except KVError as e:
            errors.append(e.code)

    async with trio.open_nursery() as n:
        n.start_soon(tr.commit)
        await trio.testing.wait_all_tasks_blocked()  # commit has started (and may have finished)
        await meddle()
    # FoundationDB: any use after commit() started and before reset() is used_during_commit
    assert errors == [2017]
    assert await read(db, b"k") == b"v" and await read(db, b"k2") is None


async def test_many_open_transactions_can_all_read(db):
    # FoundationDB transactions are cheap client objects; a server may hold
    # thousands of sessions, each mid-transaction. (LMDB has a fixed reader
    # table: 4,096 slots here.)
    await write(db, (b"k", b"v"))
    open_trs = []
    for _ in range(5_000):
        tr = db.create_transaction()
        assert await tr.get(b"k") == b"v"
        open_trs.append(tr)
    await write(db, (b"k", b"w"))
    assert all([await tr.get(b"k") == b"v" for tr in open_trs[::500]])  # each still at its snapshot
    for tr in open_trs:
        tr.cancel()


async def test_cancelled_committers_leave_the_pipeline_working(db):
    # A trio cancellation cannot abandon a commit half-way (it is shielded):
    # a cancelled committer's transaction is all-or-nothing, and everybody
    # else's commits still complete.
    done: set[int] = set()
    scopes: dict[int, trio.CancelScope] = {}

    async def committer(i: int) -> None:
        tr = db.create_transaction()
        tr.set(b"c/%02d/a" % i, b"x")
        tr.set(b"c/%02d/b" % i, b"x")
        with trio.CancelScope() as scope:
            scopes[i] = scope
            await tr.commit()
            done.add(i)

    async with trio.open_nursery() as nursery:
        for i in range(30):
            nursery.start_soon(committer, i)
        await trio.sleep(0)
        for i in range(0, 30, 2):
            if i in scopes:
                scopes[i].cancel()
    present = {}
    for k, _ in await dump(db, b"c/", b"c0"):
        present.setdefault(int(k.split(b"/")[1]), []).append(k)
    assert all(len(v) == 2 for v in present.values())  # all-or-nothing
    assert done <= set(present)  # every commit that returned is there
    assert set(range(1, 30, 2)) <= done  # the uncancelled ones all committed
    await write(db, (b"after", b"1"))
    assert await read(db, b"after") == b"1"


async def test_transactions_sharing_a_read_version_end_independently(db):
    import random

    rng = random.Random(3)
    live: list[tuple[object, bytes]] = []
    for round_ in range(30):
        await write(db, (b"v", b"%d" % round_))
        for _ in range(rng.randint(1, 4)):  # several transactions at this version
            tr = db.create_transaction()
            assert await tr.get(b"v") == b"%d" % round_
            live.append((tr, b"%d" % round_))
        rng.shuffle(live)
        for _ in range(rng.randint(0, len(live))):  # end some, in any order, any way
            tr, _seen = live.pop()
            how = rng.randrange(3)
            if how == 0:
                tr.cancel()
            elif how == 1:
                tr.reset()
            else:
                await tr.commit()
        for tr, seen in live:  # the others still read their own snapshot
            assert await tr.get(b"v") == seen


async def test_async_with_closes(backend, tmp_path):
    db = await open_backend(backend, tmp_path / "data")
    async with db:
        await write(db, (b"k", b"v"))
    with pytest.raises(KVError):
        db.create_transaction()


# ---------------------------------------------------------------------------
# Key selectors
# ---------------------------------------------------------------------------


@pytest.fixture
async def ace(db):
    await write(db, (b"a", b""), (b"c", b""), (b"e", b""))
    return db


@pytest.mark.parametrize(
    "selector,expected",
    [
        (KeySelector.first_greater_or_equal(b"b"), b"c"),
        (KeySelector.first_greater_or_equal(b"c"), b"c"),
        (KeySelector.first_greater_than(b"c"), b"e"),
        (KeySelector.last_less_than(b"c"), b"a"),
        (KeySelector.last_less_or_equal(b"c"), b"c"),
        (KeySelector.last_less_or_equal(b"d"), b"c"),
        (KeySelector.first_greater_or_equal(b"a") + 1, b"c"),
        (KeySelector.first_greater_than(b"a") + 1, b"e"),
        (KeySelector.last_less_or_equal(b"e") - 1, b"c"),
        (KeySelector.first_greater_or_equal(b"f"), b"\xff"),  # off the end: clamps
        (KeySelector.first_greater_than(b"a") + 5, b"\xff"),
        (KeySelector.last_less_than(b"a"), b""),  # off the start: clamps
        (KeySelector.last_less_or_equal(b"e") - 7, b""),
    ],
)
async def test_get_key(ace, selector, expected):
    tr = ace.create_transaction()
    assert await tr.get_key(selector) == expected


async def test_get_key_sees_own_writes(ace):
    tr = ace.create_transaction()
    tr.set(b"b", b"")
    tr.clear(b"c")
    assert await tr.get_key(KeySelector.first_greater_than(b"a")) == b"b"
    assert await tr.get_key(KeySelector.first_greater_than(b"b")) == b"e"
    assert await tr.get_key(KeySelector.last_less_than(b"e")) == b"b"


async def test_get_range_with_selectors(ace):
    tr = ace.create_transaction()
    rows = await tr.get_range(KeySelector.first_greater_than(b"a"), KeySelector.first_greater_than(b"e"))
    assert [r.key for r in rows] == [b"c", b"e"]
