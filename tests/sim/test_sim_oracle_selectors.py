"""The oracle and range reads with key selectors: the sim passes them to kv as they are.

kv records FoundationDB's one read conflict range for such a read (tests/kv/test_selector_conflicts.py);
the sim's recording transaction used to resolve each selector itself with a get_key, whose wider
conflict ranges aborted writes production commits, and left kv's selector-range path unchecked.
Now the read is kv's, and the oracle re-resolves both selectors at the serialization point and
compares the rows (only the rows: a resolved end key past them may move without a conflict).

Each test runs recording transactions on a memory engine whose after-apply hook hands every
commit to an :class:`~sim.oracle.Oracle`, as the world's does; the store holds a c e g i.
"""

from __future__ import annotations

import pytest
import trio

import kv
import kv.transaction
from kv import KeySelector
from kv.engine import FaultHooks
from sim.oracle import Oracle, RecordingDatabase

_KEYS = (b"a", b"c", b"e", b"g", b"i")


class _OracleHooks(FaultHooks):
    def __init__(self) -> None:
        self.oracle = Oracle()

    def after_apply(self, version, batch):
        for order, req in enumerate(batch):
            self.oracle.committed(version, order, req)
        return None


def _interleave(read, write) -> tuple[str, list[str]]:
    """T1 does ``read`` (and then sets a marker); T2 does ``write`` and commits; then T1 commits.
    Returns T1's fate ("committed" or "conflict") and the oracle's problems."""
    hooks = _OracleHooks()
    engine = kv.MemoryEngine(hooks=hooks)
    db = RecordingDatabase(engine.engine, None)

    async def main() -> str:
        async def fill(tr):  # (idempotent: blind sets)
            for k in _KEYS:
                tr.set(k, b"v")

        await db.transact(fill)
        t1 = db.create_transaction()
        await read(t1)
        t1.set(b"marker", b"1")
        await db.transact(write)
        try:
            await t1.commit()
        except kv.KVError as e:
            assert e.code == 1020, e
            return "conflict"
        return "committed"

    fate = trio.run(main)
    return fate, hooks.oracle.check(engine.engine)


async def _reads_to_d(tr):  # [a, fgoe(d)): a c; FoundationDB's conflict [a, d)
    rows = await tr.get_range(b"a", KeySelector.first_greater_or_equal(b"d"))
    assert [r.key for r in rows] == [b"a", b"c"]


def _set(key: bytes):
    async def fn(tr):  # (idempotent: a blind set)
        tr.set(key, b"w")
    return fn


@pytest.mark.parametrize("key,fate", [(b"e", "committed"), (b"d5", "committed"), (b"b", "conflict"),
                                      (b"c", "conflict")])
def test_a_selector_range_conflicts_as_kv_records_it_and_the_oracle_agrees(key, fate):
    """A write at the end selector's resolved key (e) or just before it (d5) changes no row:
    it commits, as in production, and the history serializes; a write among the rows conflicts.
    (Resolved with a get_key, as before, the end selector's read of [d, e\\x00) made the write
    at e abort T1.)"""
    got, problems = _interleave(_reads_to_d, _set(key))
    assert got == fate and problems == []


def test_a_backward_selector_range_is_replayed_by_its_rows():
    """begin last_less_than(e) resolves to c; a write at d moves that resolution (and conflicts);
    one at b, before the rows, does not."""

    async def reads(tr):
        rows = await tr.get_range(KeySelector.last_less_than(b"e"), KeySelector.first_greater_than(b"g"))
        assert [r.key for r in rows] == [b"c", b"e", b"g"]

    assert _interleave(reads, _set(b"b")) == ("committed", [])
    assert _interleave(reads, _set(b"d")) == ("conflict", [])
    assert _interleave(reads, _set(b"h")) == ("committed", [])


def test_the_oracle_names_a_selector_range_kv_left_without_its_conflict(monkeypatch):
    """kv's selector-range path recording no conflict range (a planted bug): a write among the
    rows commits under the read, and the oracle reports that the rows the read saw are not what
    the serial order gives — which the sim could not see while it resolved selectors itself."""
    add = kv.transaction.Transaction._add_read_range
    selector_range = kv.transaction.Transaction._selector_range
    in_selector_read = []

    def selector_range_without_conflict(self, *a, **k):
        in_selector_read.append(True)
        try:
            return selector_range(self, *a, **k)
        finally:
            in_selector_read.pop()

    def add_read_range(self, begin, end):
        if not in_selector_read:
            add(self, begin, end)

    monkeypatch.setattr(kv.transaction.Transaction, "_selector_range", selector_range_without_conflict)
    monkeypatch.setattr(kv.transaction.Transaction, "_add_read_range", add_read_range)
    fate, problems = _interleave(_reads_to_d, _set(b"b"))
    assert fate == "committed"
    assert len(problems) == 1 and "saw 2 rows, serial order gives 3" in problems[0], problems
