"""Session 18: the fast paths of set_versionstamped_value and commit give the same results
(errors and their order, size accounting, conflicts, versionstamps) as the full checks."""

from __future__ import annotations

import struct

import trio

import kv
from kv import KVError
from kvtest_helpers import open_backend, raises_code, read

OFFSET = struct.Struct("<I")


async def _db(embedded, tmp_path):
    return await open_backend(embedded, tmp_path / "data")


async def test_versionstamped_value_errors_in_order(embedded, tmp_path):
    db = await _db(embedded, tmp_path)
    tr = db.create_transaction()
    big_key = b"k" * (kv.limits.KEY_SIZE_LIMIT + 1)
    with raises_code(2102):  # the key is checked before the value's offset
        tr.set_versionstamped_value(big_key, b"ab")
    with raises_code(2004):
        tr.set_versionstamped_value(b"\xffk", b"ab")
    with raises_code(2000):  # no 4-byte offset suffix
        tr.set_versionstamped_value(b"k", b"abc")
    with raises_code(2000):  # the stamp does not fit the value
        tr.set_versionstamped_value(b"k", b"\x00" * 9 + OFFSET.pack(0))
    with raises_code(2000):
        tr.set_versionstamped_value(b"k", b"\x00" * 12 + OFFSET.pack(3))
    with raises_code(2103):  # the value without its suffix is what the limit counts
        tr.set_versionstamped_value(b"k", b"\x00" * (kv.limits.VALUE_SIZE_LIMIT + 1) + OFFSET.pack(0))
    # exactly at the limit, the suffix not counted: accepted
    tr.set_versionstamped_value(b"k", b"\x00" * kv.limits.VALUE_SIZE_LIMIT + OFFSET.pack(0))
    with raises_code(1036):  # unreadable in its own transaction
        await tr.get(b"k")
    tr.set_versionstamped_value(bytearray(b"k2"), bytearray(b"\x00" * 10 + OFFSET.pack(0)))
    vs = tr.get_versionstamp()
    await tr.commit()
    stamp = await vs
    assert (await read(db, b"k"))[:10] == stamp
    assert await read(db, b"k2") == stamp
    with raises_code(2017):  # used after its commit
        tr.set_versionstamped_value(b"k3", b"\x00" * 10 + OFFSET.pack(0))
    tr.reset()
    tr.cancel()
    with raises_code(1025):
        tr.set_versionstamped_value(b"k3", b"\x00" * 10 + OFFSET.pack(0))
    await db.close()


async def test_versionstamped_value_size_accounting(embedded, tmp_path):
    # key 4 bytes, value 30 bytes without its suffix: 4 + 30, and its write conflict
    # range [key, key + \x00) 4 + 5: 43 bytes exactly, without one: 34.
    db = await _db(embedded, tmp_path)
    value = b"p" * 10 + b"\x00" * 10 + b"q" * 10 + OFFSET.pack(10)
    for no_conflict, size in ((False, 43), (True, 34)):
        if size < kv.limits.MIN_SIZE_LIMIT:
            continue
        for limit, ok in ((size, True), (size - 1, False)):
            tr = db.create_transaction()
            tr.options.set_size_limit(limit)
            if no_conflict:
                tr.options.set_next_write_no_write_conflict_range()
            tr.set_versionstamped_value(b"vkey", value)
            if ok:
                await tr.commit()
            else:
                with raises_code(2101):
                    await tr.commit()
    await db.close()


async def test_versionstamped_value_write_conflict(embedded, tmp_path):
    db = await _db(embedded, tmp_path)
    for no_conflict in (False, True):
        reader = db.create_transaction()
        assert await reader.get(b"vkey%d" % no_conflict) is None
        reader.set(b"other", b"x")
        writer = db.create_transaction()
        if no_conflict:
            writer.options.set_next_write_no_write_conflict_range()
        writer.set_versionstamped_value(b"vkey%d" % no_conflict, b"\x00" * 10 + OFFSET.pack(0))
        await writer.commit()
        if no_conflict:
            await reader.commit()  # the write recorded no conflict range
        else:
            with raises_code(1020):
                await reader.commit()
    await db.close()


async def test_commit_results_on_the_fast_path(embedded, tmp_path):
    """A blind write's commit takes the last committed version as its read version and
    reports its own commit version; a watch and a versionstamp are still answered."""
    db = await _db(embedded, tmp_path)
    tr = db.create_transaction()
    tr.set(b"a", b"1")
    await tr.commit()
    first = tr.get_committed_version()
    assert await tr.get_read_version() < first
    tr2 = db.create_transaction()
    tr2.set(b"a", b"2")
    await tr2.commit()
    assert await tr2.get_read_version() == first
    assert tr2.get_committed_version() > first
    tr3 = db.create_transaction()
    w = tr3.watch(b"a")
    vs = tr3.get_versionstamp()
    tr3.set(b"b", b"3")
    await tr3.commit()
    assert (await vs)[:8] == tr3.get_committed_version().to_bytes(8, "big")
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(w.wait)
            await db.transact(lambda t: _set(t, b"a", b"4"))
    # a failed commit answers the versionstamp with its error
    tr4 = db.create_transaction()
    tr4.options.set_size_limit(kv.limits.MIN_SIZE_LIMIT)
    tr4.set(b"c", b"x" * 64)
    vs4 = tr4.get_versionstamp()
    with raises_code(2101):
        await tr4.commit()
    try:
        await vs4
    except KVError as e:
        assert e.code == 2101
    else:
        raise AssertionError("the versionstamp of a failed commit was answered")
    await db.close()


async def _set(tr, key, value):
    tr.set(key, value)


async def test_read_conflicts_count_toward_the_size_limit(embedded, tmp_path):
    """Read conflicts count as FoundationDB counts them: a key read 2 * len + 1 ([key, key + \\x00)),
    a range its two bounds; reads answered by the transaction's own writes add nothing."""
    db = await _db(embedded, tmp_path)
    # 41 (a 20-byte key read) + 2 ([a, b) read) + 34 (a set of 1 + 30 bytes and its conflict)
    # + 3 ([c, d) less the written key c: [c\x00, d) is 2 + 1)
    size = 41 + 2 + 34 + 3
    for limit, ok in ((size, True), (size - 1, False)):
        tr = db.create_transaction()
        tr.options.set_size_limit(limit)
        assert await tr.get(b"r" * 20) is None
        assert await tr.get_range(b"a", b"b") == []
        tr.set(b"c", b"v" * 30)
        assert await tr.get(b"c") == b"v" * 30  # its own write: no conflict, no size
        assert await tr.snapshot.get(b"q" * 20) is None  # a snapshot read: none either
        assert await tr.get_range(b"c", b"d") == [(b"c", b"v" * 30)]
        if ok:
            await tr.commit()
        else:
            with raises_code(2101):
                await tr.commit()
    await db.close()
