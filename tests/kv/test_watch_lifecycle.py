"""Four lifecycle rules of FoundationDB's client, checked on every backend (``db``).

Sources (apple/foundationdb; docs/kv-api.md, "A transaction's lifecycle", cites them):

(i) ``cancel()`` of an uncommitted transaction does not fail its watches: RYW ``cancel()`` is
    ``resetPromise.sendError(transaction_cancelled())`` only, and ``RYWImpl::watch`` waits on
    ``resetPromise`` only until the watch's read is done (kv's is done when ``watch()``
    returns); after that the watch waits in NativeAPI's ``watches``, failed by
    ``cancelWatches()`` (transaction_cancelled) at reset or destruction, or by a commit.
(ii) an ``on_error`` that retries fails uncommitted watches with transaction_cancelled (1025),
    not with the error it was given: NativeAPI ``Transaction::onError`` calls ``reset()``,
    which runs ``cancelWatches()`` with its default error.
(iii) a versionstamped key fires watches: another transaction's on its final key (the commit
    proxy makes it a SetValue of that key, which the storage server's watch sees), and the
    watching transaction's own at once on the key with the stamp's lower bound placed
    (``RYW atomicOp``: ``transformVersionstampKey(k, readVersion + 1, 0)``, the 4-byte offset
    suffix kept, then ``triggerWatches(k, valueKnown=false)``).
(iv) a transaction whose timeout ran out: ``on_error`` throws transaction_timed_out (the
    timebomb set ``resetPromise`` with it, and ``RYWImpl::onError`` throws a set
    ``resetPromise`` first) and leaves it: later uses are 1031, not 1025, until ``reset()``.
"""

from __future__ import annotations

import gc
import struct

import pytest
import trio
import trio.testing

from kv import KVError
from kvtest_helpers import MARKER, raises_code, write


async def _fails_with(w, code: int) -> None:
    with raises_code(code):
        with trio.fail_after(10):
            await w


async def _pending(w) -> None:
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready


# -- (i) cancel() ---------------------------------------------------------------


async def _read_done(tr) -> None:
    """Let the watch's own read finish before cancel(): a watch whose read is still in flight
    does fail with 1025 at cancel() (RYWImpl::watch waits on ``resetPromise || val``). kv's
    embedded engines read at watch(); through libfdb_c the read is queued, and a later read
    of the same transaction is answered after it (the stand-in runs them in order; on a
    cluster this only makes it likely)."""
    await tr.get(b"w")


async def test_cancel_right_after_watch_ends_in_1025_either_way(db):
    # Through libfdb_c the watch's read may still be in flight at cancel() (then the watch
    # fails with 1025 at once) or done (then it waits for the reset). The embedded engines'
    # watch() has read already: cancel() always leaves it pending there.
    tr = db.create_transaction()
    w = tr.watch(b"w")
    tr.cancel()
    await trio.testing.wait_all_tasks_blocked()
    if getattr(db, "_engine", None) is not None:
        assert not w.ready
    if not w.ready:
        tr.reset()
    await _fails_with(w, 1025)


async def test_cancel_leaves_an_uncommitted_watch_pending_until_reset(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    w = tr.watch(b"w")
    await _read_done(tr)
    tr.cancel()
    await _pending(w)
    with raises_code(1025):
        await tr.commit()  # refused (resetPromise): the watch is not armed, nor failed
    with raises_code(1025):
        await tr.on_error(KVError(1020))
    await _pending(w)
    await write(db, (b"w", b"changed"))  # never armed: a change does not fire it
    await _pending(w)
    tr.reset()
    await _fails_with(w, 1025)


async def test_cancel_then_drop_fails_the_uncommitted_watch(db):
    # "If an uncommitted transaction is reset or destroyed, then any watches it created
    # will be set with the transaction_cancelled error"
    tr = db.create_transaction()
    w = tr.watch(b"w")
    await _read_done(tr)
    tr.cancel()
    await _pending(w)
    del tr
    gc.collect()
    await _fails_with(w, 1025)


# -- (ii) on_error that retries ---------------------------------------------------


@pytest.mark.parametrize("code", [1020, 1007, 1021])
async def test_on_error_retry_fails_uncommitted_watches_with_1025(db, code):
    tr = db.create_transaction()
    await tr.get(b"x")
    w = tr.watch(b"w")
    await tr.on_error(KVError(code))  # retried: the transaction was reset
    await _fails_with(w, 1025)
    assert await tr.get(b"x") is None  # usable again


async def test_failed_on_error_leaves_uncommitted_watch_to_reset(db):
    # a non-retryable error: onError sets resetPromise (1025) without resetting NativeAPI's
    # transaction, so its watches wait for reset (or destruction)
    tr = db.create_transaction()
    w = tr.watch(b"w")
    with raises_code(2000):
        await tr.on_error(KVError(2000))
    await _pending(w)
    tr.reset()
    await _fails_with(w, 1025)


# -- (iii) versionstamped keys ----------------------------------------------------


def _template(prefix: bytes) -> bytes:
    return prefix + b"\x00" * 10 + struct.pack("<I", len(prefix))


async def test_own_versionstamped_key_fires_a_watch_on_its_lower_bound_key(db):
    prefix = b"log/"
    tr = db.create_transaction()
    rv = await tr.get_read_version()
    low = prefix + (rv + 1).to_bytes(8, "big") + b"\x00\x00" + struct.pack("<I", len(prefix))
    hit = tr.watch(low)  # the stamped key with its lower bound, suffix and all
    final_like = tr.watch(prefix + (rv + 1).to_bytes(8, "big") + b"\x00\x00")  # without the suffix
    other = tr.watch(b"other")
    tr.set_versionstamped_key(_template(prefix), b"v")
    with trio.fail_after(10):
        await hit  # at once, without an error, before any commit
    await _pending(final_like)
    await _pending(other)
    tr.cancel()
    tr.reset()


async def test_another_transactions_versionstamped_key_fires_a_watch_on_its_final_key(clocked):
    db, _clock = clocked
    engine = getattr(db, "_engine", None)
    if engine is None:
        pytest.skip("predicting the next versionstamp needs the embedded engine's version counters")
    prefix = b"log/"
    watcher = db.create_transaction()
    await watcher.get_read_version()
    # The clock stands still: the next commit's version is one above every version handed out
    # (Engine._next_version); a lone commit is first in its batch.
    version = max(engine._last_version, engine._max_read_version) + 1
    target = prefix + version.to_bytes(8, "big") + b"\x00\x00"
    w = watcher.watch(target)
    await watcher.commit()  # read-only: arms the watch
    await _pending(w)

    writer = db.create_transaction()
    stamp = writer.get_versionstamp()
    writer.set_versionstamped_key(_template(prefix), b"v")
    await writer.commit()
    assert prefix + await stamp == target  # the prediction held
    with trio.fail_after(10):
        await w


# -- (iv) a timed-out transaction's on_error ----------------------------------------


@pytest.mark.parametrize("code", [1031, 1020])
async def test_timed_out_on_error_raises_and_leaves_1031(db, code):
    tr = db.create_transaction()
    tr.options.set_timeout(1)
    await trio.sleep(0.05)  # (real time: the timeout runs on the clock FoundationDB's does)
    with raises_code(1031):
        await tr.get(b"k")
    with raises_code(1031):
        await tr.on_error(KVError(code))
    with raises_code(1031):  # not the 1025 of a failed on_error: resetPromise holds 1031
        await tr.get(b"k")
    with raises_code(1031):
        tr.set(MARKER, b"1")
        await tr.commit()
    with raises_code(1031):
        await tr.on_error(KVError(1020))
    tr.reset()  # drops the timeout too
    assert await tr.get(b"k") is None
