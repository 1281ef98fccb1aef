"""SyncHelper.done() takes its answer whatever happens to the waiting task (kv/walsync.py).

It adds a shielded cancel scope of its own only when the caller's innermost
scope is not a shield already (the engine's always is): these hold it to both
halves of that.
"""

from __future__ import annotations

import trio

from kv import walsync
from kv.wal import LogWriter
from kv.walsync import SyncHelper


async def test_already_shielded_sees_only_an_innermost_shield():
    assert not walsync._already_shielded()
    with trio.CancelScope(shield=True):
        assert walsync._already_shielded()
        with trio.CancelScope():  # a scope inside the shield could cancel: not shielded
            assert not walsync._already_shielded()
        with trio.CancelScope(shield=True):
            assert walsync._already_shielded()
    assert not walsync._already_shielded()


async def test_a_cancelled_unshielded_waiter_still_takes_its_answer(tmp_path):
    wal_dir = tmp_path / "wal"
    wal_dir.mkdir()
    log = LogWriter(wal_dir)
    helper = SyncHelper(wal_dir)
    try:
        for shielded_by_caller in (False, True, False):
            log.write(b"x" * 10)
            helper.request(log.number, log.wfd)
            with trio.CancelScope() as outer:
                outer.cancel()  # already cancelled: an unshielded wait would raise at once
                if shielded_by_caller:
                    with trio.CancelScope(shield=True):
                        await helper.done()
                else:
                    await helper.done()
            assert helper._out == 0 and not helper._answers  # the answer was taken, not left for the next
            log.synced(10)
    finally:
        helper.close()
        log.close()
