"""A watch inside its own transaction, as FoundationDB's read-your-writes client has it.

Runs on every backend. Sources, apple/foundationdb:

* documentation/sphinx/source/api-common.rst.inc, transaction-watch-committed-blurb: "Until the
  transaction that created it has been committed, a watch will not report changes made by
  *other* transactions. In contrast, a watch will immediately report changes made by the
  transaction itself."
* fdbclient/ReadYourWrites.cpp: ``set`` ends ``RYWImpl::triggerWatches(this, key, value)``,
  ``clear`` ``triggerWatches(this, r, Optional<ValueRef>())`` and ``atomicOp``
  ``triggerWatches(this, k, Optional<ValueRef>(), false)``; ``triggerWatches`` fires a watch
  on the key when the value is not known (an atomic op) or differs from the value the watch
  read (``valuePresent``) or was last set to (``setPresent``), and otherwise only records it.
* ``RYWImpl::watch`` reads the key with ``readWithConflictRange(ryw, GetValueReq(key),
  Snapshot::False)``: a watch adds a read conflict on its key (none when the transaction
  wrote the key itself: ``updateConflictMap`` skips its own sets and clears).
"""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from kvtest_helpers import MARKER, commit_code, raises_code, read, write

_FIRES_WITHIN = 5  # seconds; the embedded engines fire at the call


async def _fires(w) -> None:
    with trio.fail_after(_FIRES_WITHIN):
        await w


async def _does_not_fire_yet(w) -> None:
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(0.05)  # (the stand-in and a cluster answer from another thread)
    assert not w.ready


@pytest.mark.parametrize("how", ["set", "clear", "clear_range", "add", "versionstamped_value"])
async def test_a_watch_reports_its_own_transactions_later_write_at_once(db, how):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    assert await tr.get(b"w") == b"0"
    w = tr.watch(b"w")
    if how == "set":
        tr.set(b"w", b"1")
    elif how == "clear":
        tr.clear(b"w")
    elif how == "clear_range":
        tr.clear_range(b"v", b"x")
    elif how == "add":
        tr.add(b"w", struct.pack("<q", 0))  # an atomic op fires whatever it would compute
    else:
        tr.set_versionstamped_value(b"w", b"\x00" * 10 + struct.pack("<I", 0))
    await _fires(w)  # before (and without) any commit
    tr.cancel()
    assert await read(db, b"w") == b"0"


async def test_an_own_write_of_the_value_the_watch_saw_does_not_fire_it(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    assert await tr.get(b"w") == b"0"
    w = tr.watch(b"w")
    tr.set(b"w", b"0")
    tr.set(MARKER, b"1")
    await tr.commit()
    await _does_not_fire_yet(w)
    await write(db, (b"w", b"1"))
    await _fires(w)


async def test_clearing_an_absent_watched_key_does_not_fire(db):
    tr = db.create_transaction()
    w = tr.watch(b"w")
    tr.clear(b"w")
    tr.clear_range(b"v", b"x")
    tr.set(MARKER, b"1")
    await tr.commit()
    await _does_not_fire_yet(w)
    await write(db, (b"w", b"now"))
    await _fires(w)


async def test_a_watch_reads_its_key_for_conflicts(db):
    # RYWImpl::watch's read is not a snapshot read: a write to the watched key after the
    # transaction's read version makes its commit fail, and the watch gets that error.
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    await tr.get(b"other")  # the read version
    w = tr.watch(b"w")
    await write(db, (b"w", b"1"))
    tr.set(MARKER, b"1")
    assert await commit_code(tr) == 1020
    with raises_code(1020):
        await _fires(w)


async def test_a_watch_on_a_key_the_transaction_wrote_adds_no_read_conflict(db):
    tr = db.create_transaction()
    await tr.get(b"other")
    tr.set(b"w", b"mine")
    w = tr.watch(b"w")
    await write(db, (b"w", b"theirs"))  # write/write: no conflict
    await tr.commit()
    assert await read(db, b"w") == b"mine"
    await _does_not_fire_yet(w)
    await write(db, (b"w", b"later"))
    await _fires(w)
