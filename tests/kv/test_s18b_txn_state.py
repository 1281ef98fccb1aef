"""A new transaction's per-attempt state is exactly the state every later attempt (reset,
on_error) starts from."""

from __future__ import annotations

import kv
from kv.transaction import Transaction
from kvtest_helpers import open_backend

# not per-attempt: the handle, the options that survive on_error, the clock and backoff
_KEPT = {"db", "_engine", "_started", "_backoff", "_retries", "__weakref__", "__dict__",
         # the engine's while it commits the transaction (kv.engine.Committing): set by
         # Engine.commit and at resolve, unset before the first commit
         "_batch_version", "_batch_order", "_commit_error", "_commit_answered", "_parked_task", "_lead_batch"}


def _state(tr: Transaction) -> dict:
    out = {}
    for name in Transaction.__slots__:
        if name in _KEPT:
            continue
        value = getattr(tr, name)
        out[name] = (type(value), value if type(value) is not dict else dict(value))
    return out


async def test_new_transaction_state_is_a_fresh_attempts(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    new = db.create_transaction()
    fresh = _state(new)
    # a used transaction, reset: _reset_state -> _clear_state
    tr = db.create_transaction()
    await tr.get(b"a")
    tr.set(b"b", b"1")
    tr.clear_range(b"c", b"d")
    tr.add(b"e", b"\x01")
    tr.set_versionstamped_key(b"k" + b"\x00" * 10 + b"\x01\x00\x00\x00", b"v")
    tr.add_read_conflict_range(b"x", b"y")
    tr.add_write_conflict_range(b"x", b"y")
    tr.reset()
    assert _state(tr) == fresh
    # and one retried (on_error): the same per-attempt state
    tr2 = db.create_transaction()
    await tr2.get(b"a")
    tr2.set(b"b", b"1")
    await tr2.on_error(kv.KVError(1020))
    assert _state(tr2) == fresh
    # the shared empty containers are shared, the lists a write appends to are its own
    assert new._clears is tr._clears and new._read_points is tr._read_points
    assert new._mutations is not tr._mutations and new._write_points is not tr._write_points
    assert new._writes is None  # (the write map is built at its first use)
    assert new._slow is False and new._timeout is None
    await db.close()


async def test_new_transaction_works_as_a_reset_one(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    tr = db.create_transaction()
    tr.set(b"a", b"1")
    assert await tr.get(b"a") == b"1"
    await tr.commit()
    assert tr.get_committed_version() > 0
    tr.reset()
    assert await tr.get(b"a") == b"1"
    await db.close()
