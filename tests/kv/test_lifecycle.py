"""A transaction's life after commit, cancel and on_error, as FoundationDB's client has it.

Runs on every backend (memory, lmdb, fdb-capi over the stand-in libfdb_c, and a real
cluster when SUREFOOT_FDB_CLUSTER_FILE is set). Sources, apple/foundationdb (quoted in
docs/kv-api.md, "A transaction's lifecycle"):

* fdbclient/ReadYourWrites.cpp (and ReadYourWrites.actor.cpp before it, the same logic
  since 6.x): ``RYWImpl::commit`` sets ``commitStarted = true`` first and clears it on
  failure only below API 410 (``if (!ryw->tr.apiVersionAtLeast(410)) { ryw->commitStarted
  = false; ... }``); every read, write, watch, get_versionstamp and commit starts with
  ``if (checkUsedDuringCommit()) return/throw used_during_commit();`` and only then looks
  at ``resetPromise``; ``checkUsedDuringCommit()`` itself fails ``resetPromise`` with
  used_during_commit when the commit has started; ``resetRyow()`` (reset and a successful
  onError) clears ``commitStarted`` and makes a new ``resetPromise``.
* ``RYWImpl::onError`` begins ``if (ryw->resetPromise.isSet()) throw
  ryw->resetPromise.getFuture().getError();``, and ``cancel()`` is
  ``resetPromise.sendError(transaction_cancelled())``; when onError fails (the error is
  not retryable, or the retry limit is hit) at API >= 610 it leaves
  ``resetPromise.sendError(transaction_cancelled())``.
* fdbclient/NativeAPI.cpp: after a successful commit ``commitAndWatch`` calls
  ``setupWatches()``, which hands every watch to the database and ends
  ``watches.clear()``; reset (``resetImpl``) only runs ``cancelWatches()`` over that
  (now empty) list; RYW ``cancel()`` only sets resetPromise. The docs say the same:
  "If an uncommitted transaction is reset or destroyed, then any watches it created will
  be set with the transaction_cancelled error" (documentation/sphinx/source/
  api-common.rst.inc, transaction-watch-error-blurb).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kv import KeySelector, KVError
from kvtest_helpers import MARKER, commit_code, raises_code, read, write


async def _failed_commit(db, key: bytes = b"k"):
    """A transaction whose commit just failed with not_committed (1020)."""
    await write(db, (key, b"0"))
    tr = db.create_transaction()
    assert await tr.get(key) == b"0"
    await write(db, (key, b"1"))  # a conflicting commit after tr's read version
    tr.set(key, b"mine")
    assert await commit_code(tr) == 1020
    return tr


async def _every_use_is(tr, code: int) -> None:
    with raises_code(code):
        await tr.get(b"k")
    with raises_code(code):
        await tr.get_range(b"a", b"z")
    with raises_code(code):
        await tr.get_key(KeySelector.first_greater_or_equal(b"a"))
    with raises_code(code):
        await tr.snapshot.get(b"k")
    with raises_code(code):
        tr.set(b"k", b"v")
    with raises_code(code):
        tr.clear(b"k")
    with raises_code(code):
        tr.clear_range(b"a", b"b")
    with raises_code(code):
        tr.add(b"n", b"\x01")
    with raises_code(code):
        tr.add_read_conflict_key(b"k")
    with raises_code(code):
        tr.add_write_conflict_key(b"k")
    with raises_code(code):
        tr.watch(b"k")
    with raises_code(code):
        await tr.commit()


# -- (a) after a failed commit -------------------------------------------------


async def test_a_failed_commit_leaves_every_use_used_during_commit(db):
    # RYW commitStarted stays set after a failed commit (API >= 410): used_during_commit (2017)
    tr = await _failed_commit(db)
    await _every_use_is(tr, 2017)
    with raises_code(2017):  # (those refusals set resetPromise: see the next test)
        await tr.on_error(KVError(1020))
    tr.reset()
    tr.set(b"k", b"after-reset")
    await tr.commit()
    assert await read(db, b"k") == b"after-reset"


async def test_on_error_straight_after_a_failed_commit_retries(db):
    tr = await _failed_commit(db)
    await tr.on_error(KVError(1020))  # the retry loop's way out: resetRyow clears commitStarted
    assert await tr.get(b"k") == b"1"
    tr.set(b"k", b"retried")
    await tr.commit()
    assert await read(db, b"k") == b"retried"


async def test_a_failed_commit_is_usable_again_after_reset(db):
    tr = await _failed_commit(db)
    with raises_code(2017):
        tr.set(b"k", b"again")
    tr.reset()
    tr.set(b"k", b"after-reset")
    await tr.commit()
    assert await read(db, b"k") == b"after-reset"


async def test_a_use_refused_after_a_failed_commit_makes_on_error_fail_with_it(db):
    # checkUsedDuringCommit() also does resetPromise.sendError(used_during_commit()) (if it is
    # not set yet), and RYWImpl::onError throws a set resetPromise before retrying anything:
    # touching the transaction between a failed commit and on_error turns the retry into 2017.
    tr = await _failed_commit(db)
    with raises_code(2017):
        await tr.get(b"k")
    with raises_code(2017):
        await tr.on_error(KVError(1020))
    with raises_code(2017):  # still frozen: that on_error did not reset it
        tr.set(b"k", b"again")
    tr.cancel()  # resetPromise is set already: cancel changes nothing
    with raises_code(2017):
        await tr.on_error(KVError(1020))
    tr.reset()
    tr.set(b"k", b"after-reset")
    await tr.commit()
    assert await read(db, b"k") == b"after-reset"


async def test_a_commit_refused_as_too_large_also_started_the_commit(db):
    # commitStarted is set before the commit finds the transaction too large (2101)
    tr = db.create_transaction()
    tr.options.set_size_limit(1_000)
    tr.set(b"big", b"v" * 2_000)
    with raises_code(2101):
        await tr.commit()
    with raises_code(2017):
        tr.set(b"small", b"v")
    with raises_code(2017):
        await tr.get(b"big")
    tr.reset()
    tr.set(b"small", b"v")
    await tr.commit()
    assert await read(db, b"small") == b"v" and await read(db, b"big") is None


async def test_get_read_version_answers_after_a_commit_and_leaves_the_retry_alone(db):
    # RYW getReadVersion checks resetPromise only, never checkUsedDuringCommit: after a commit
    # (failed or not) it answers the commit's read version, and sets nothing.
    await write(db, (b"k", b"0"))
    tr = db.create_transaction()
    rv = await tr.get_read_version()
    assert await tr.get(b"k") == b"0"
    await write(db, (b"k", b"1"))
    tr.set(b"k", b"mine")
    assert await commit_code(tr) == 1020
    assert await tr.get_read_version() == rv
    await tr.on_error(KVError(1020))  # retries: nothing was refused
    assert await tr.get(b"k") == b"1"
    tr.set(b"k2", b"v")
    rv2 = await tr.get_read_version()
    await tr.commit()
    assert await tr.get_read_version() == rv2
    tr.cancel()
    with raises_code(1025):  # resetPromise
        await tr.get_read_version()

    blind = db.create_transaction()
    blind.set(b"k3", b"v")
    await blind.commit()
    assert 0 < await blind.get_read_version() < blind.get_committed_version()


# -- (b) on_error after cancel -------------------------------------------------


@pytest.mark.parametrize("code", [1020, 1007, 1021])
async def test_on_error_after_cancel_is_transaction_cancelled(db, code):
    # RYWImpl::onError: a set resetPromise (cancel()) is thrown before anything is retried
    tr = db.create_transaction()
    tr.set(b"k", b"v")
    tr.cancel()
    with raises_code(1025):
        await tr.on_error(KVError(code))
    with raises_code(1025):  # still cancelled: on_error did not reset it
        await tr.get(b"k")
    with raises_code(1025):
        tr.get_versionstamp()
    tr.reset()  # "The transaction can be used again after it is reset" (transaction-cancel-blurb)
    tr.set(b"k", b"after-reset")
    await tr.commit()
    assert await read(db, b"k") == b"after-reset"


async def test_on_error_that_fails_leaves_the_transaction_cancelled(db):
    # RYWImpl::onError's catch, API >= 610: resetPromise.sendError(transaction_cancelled())
    tr = db.create_transaction()
    with raises_code(2000):
        await tr.on_error(KVError(2000))  # not retryable: rethrown
    with raises_code(1025):
        await tr.get(b"k")
    with raises_code(1025):
        await tr.on_error(KVError(1020))
    tr.reset()
    assert await tr.get(b"k") is None

    tr = db.create_transaction()
    tr.options.set_retry_limit(0)
    with raises_code(1020):
        await tr.on_error(KVError(1020))  # retry limit hit: rethrown
    with raises_code(1025):
        tr.set(b"k", b"v")
    with raises_code(1025):
        await tr.commit()
    assert await read(db, b"k") is None


async def test_the_commit_state_is_checked_before_cancel(db):
    # checkUsedDuringCommit() comes before resetPromise in every call
    tr = db.create_transaction()
    tr.set(b"k", b"v")
    await tr.commit()
    tr.cancel()
    with raises_code(2017):
        await tr.get(b"k")
    with raises_code(2017):
        tr.set(b"k", b"w")
    with raises_code(1025):  # on_error looks at resetPromise only
        await tr.on_error(KVError(1020))
    tr.reset()
    assert await tr.get(b"k") == b"v"


# -- (c) what a successful commit's watches outlive ----------------------------


@pytest.mark.parametrize("then", ["cancel", "reset", "on_error"])
async def test_a_committed_watch_outlives_cancel_reset_and_on_error(db, then):
    # After a successful commit the watches belong to the database (NativeAPI setupWatches:
    # watches.clear()); cancel/reset/on_error of the transaction leave them armed.
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    assert await tr.get(b"w") == b"0"
    w = tr.watch(b"w")
    tr.set(MARKER, b"1")
    await tr.commit()
    if then == "cancel":
        tr.cancel()
    elif then == "reset":
        tr.reset()
    else:
        await tr.on_error(KVError(1020))
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready
    await write(db, (b"w", b"changed"))
    with trio.fail_after(10):
        await w  # fires, without an error


async def test_a_read_only_commits_watch_outlives_cancel(db):
    await write(db, (b"w", b"0"))
    tr = db.create_transaction()
    assert await tr.get(b"w") == b"0"
    w = tr.watch(b"w")
    await tr.commit()  # read-only: activates the watch all the same
    tr.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert not w.ready
    await write(db, (b"w", b"changed"))
    with trio.fail_after(10):
        await w


async def test_a_failed_commits_watch_keeps_the_commit_error_after_on_error(db):
    # commitAndWatch copies the commit's error to the watch (cancelWatches(e)); a later
    # on_error with another code does not overwrite it.
    tr2 = db.create_transaction()
    await tr2.get(b"x")
    w = tr2.watch(b"y")  # (not a key tr2 writes: its own write would fire the watch at once)
    await write(db, (b"x", b"0"))
    tr2.set(MARKER, b"mine")
    assert await commit_code(tr2) == 1020
    await tr2.on_error(KVError(1007))
    with raises_code(1020):
        with trio.fail_after(10):
            await w
