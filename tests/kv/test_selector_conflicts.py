"""Read conflict ranges of range reads with KeySelector bounds, as FoundationDB records them.

FoundationDB's RYW client (fdbclient/ReadYourWrites.cpp, ``ReadYourWritesTransaction::getRange``
then ``RYWImpl::addConflictRange`` for ``GetRangeReq<false>``/``GetRangeReq<true>``; see
docs/kv-api.md, "Range reads with key selectors") records ONE conflict range per range read,
built from the selectors' own keys (after ``removeOrEqual``) and the rows returned, not the
conflict ranges of resolving each selector with ``get_key``. So a write just past an end
selector's resolved key does not conflict, and with a limit an end selector of offset <= 0
keeps the read's conflict up to its key. Every case runs on every backend (``db``); the
store holds a c e g i unless said.
"""

from __future__ import annotations

from kv import KeySelector
from kvtest_helpers import clearer, conflicts, setter, write

_KEYS = (b"a", b"c", b"e", b"g", b"i")


async def _fill(db) -> None:
    await write(db, *((k, b"v") for k in _KEYS))


def _keys(rows) -> list[bytes]:
    return [r.key for r in rows]


async def test_end_selector_first_greater_or_equal_conflicts_up_to_its_key(db):
    # [a, fgoe(d)): conflict [a, d). Resolving fgoe(d) with get_key would add [d, e\x00).
    await _fill(db)

    async def reads(tr):
        assert _keys(await tr.get_range(b"a", KeySelector.first_greater_or_equal(b"d"))) == [b"a", b"c"]

    assert not await conflicts(db, reads, setter((b"e", b"w")))  # the resolved end itself
    assert not await conflicts(db, reads, setter((b"d5", b"")))
    assert await conflicts(db, reads, setter((b"b", b"")))
    assert await conflicts(db, reads, setter((b"c", b"w")))


async def test_end_selector_first_greater_than_conflicts_up_to_key_after(db):
    # first_greater_than(e) is fgoe(e\x00) (removeOrEqual): conflict [a, e\x00)
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.first_greater_or_equal(b"a"), KeySelector.first_greater_than(b"e"))
        assert _keys(rows) == [b"a", b"c", b"e"]

    assert not await conflicts(db, reads, setter((b"f", b"")))
    assert not await conflicts(db, reads, setter((b"g", b"w")))
    assert await conflicts(db, reads, setter((b"e", b"w")))
    assert await conflicts(db, reads, clearer(b"e"))


async def test_limited_read_with_backward_end_selector_keeps_conflict_to_the_end_key(db):
    # end last_less_or_equal(g) = (g\x00, offset 0): the limit does not cut the conflict
    # ("rangeEnd = read.end.offset > 0 && result.more ? begin : end"): [a, g\x00)
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(b"a", KeySelector.last_less_or_equal(b"g"), limit=1)
        assert _keys(rows) == [b"a"]

    assert await conflicts(db, reads, setter((b"d", b"")))  # past the last row, before the end key
    assert await conflicts(db, reads, setter((b"g", b"w")))
    assert not await conflicts(db, reads, setter((b"h", b"")))


async def test_limited_read_with_forward_end_selector_is_cut_at_the_last_row(db):
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(b"a", KeySelector.first_greater_than(b"g"), limit=2)
        assert _keys(rows) == [b"a", b"c"]

    assert not await conflicts(db, reads, setter((b"d", b"")))
    assert not await conflicts(db, reads, setter((b"g", b"w")))
    assert await conflicts(db, reads, setter((b"b", b"")))


async def test_begin_selector_with_offset_conflicts_from_its_key(db):
    # fgoe(a)+2 resolves to e: the rows and what shifts the begin, [a, keyAfter(last row))
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.first_greater_or_equal(b"a") + 2, b"z", limit=1)
        assert _keys(rows) == [b"e"]

    assert await conflicts(db, reads, setter((b"b", b"")))  # would move the begin
    assert await conflicts(db, reads, clearer(b"e"))
    assert not await conflicts(db, reads, setter((b"f", b"")))


async def test_reverse_limited_read_does_not_conflict_on_the_begin_selectors_resolution(db):
    # reverse, begin first_greater_than(b) = (b\x00, 1), limit 1: [i, z) only
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.first_greater_than(b"b"), b"z", limit=1, reverse=True)
        assert _keys(rows) == [b"i"]

    assert not await conflicts(db, reads, setter((b"c", b"w")))
    assert not await conflicts(db, reads, setter((b"h", b"")))
    assert await conflicts(db, reads, setter((b"j", b"")))
    assert await conflicts(db, reads, setter((b"i", b"w")))


async def test_reverse_limited_read_with_backward_begin_selector(db):
    # begin last_less_than(c) (resolves to a), end f, reverse, limit 1: rows [e];
    # "rangeBegin = begin.offset <= 1 && more ? end : begin", then min with the last row: [e, f)
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.last_less_than(b"c"), b"f", limit=1, reverse=True)
        assert _keys(rows) == [b"e"]

    assert not await conflicts(db, reads, setter((b"b", b"")))
    assert not await conflicts(db, reads, setter((b"d", b"")))
    assert await conflicts(db, reads, setter((b"e5", b"")))


async def test_reverse_read_with_backward_begin_selector_conflicts_from_the_resolved_key(db):
    # no limit: [min(c, first row a), f) = [a, f); a key before a changes nothing
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.last_less_than(b"c"), b"f", reverse=True)
        assert _keys(rows) == [b"e", b"c", b"a"]

    assert not await conflicts(db, reads, setter((b"0", b"")))
    assert await conflicts(db, reads, setter((b"b", b"")))
    assert await conflicts(db, reads, clearer(b"a"))


async def test_begin_selector_before_the_first_key_conflicts_from_the_start(db):
    # last_less_than(a): nothing below a, readToBegin: ["", d)
    await _fill(db)

    async def reads(tr):
        assert _keys(await tr.get_range(KeySelector.last_less_than(b"a"), b"d")) == [b"a", b"c"]

    assert await conflicts(db, reads, setter((b"0", b"")))
    assert not await conflicts(db, reads, setter((b"d", b"")))


async def test_end_selector_past_the_last_key_conflicts_to_the_end(db):
    # fgoe(e)+5: fewer keys than that from e on, readThroughEnd: [d, \xff)
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(b"d", KeySelector.first_greater_or_equal(b"e") + 5)
        assert _keys(rows) == [b"e", b"g", b"i"]

    assert await conflicts(db, reads, setter((b"z", b"")))
    assert not await conflicts(db, reads, setter((b"b", b"")))


async def test_selectors_inverted_by_key_and_offset_read_nothing_and_conflict_nowhere(db):
    # "begin.offset >= end.offset && begin.getKey() >= end.getKey()": RangeResult(), no conflict
    await _fill(db)

    async def reads(tr):
        rows = await tr.get_range(KeySelector.first_greater_or_equal(b"e"), KeySelector.first_greater_or_equal(b"c"))
        assert rows == []

    assert not await conflicts(db, reads, setter((b"c", b"w")))
    assert not await conflicts(db, reads, setter((b"e", b"w")))
    assert not await conflicts(db, reads, setter((b"d", b"")))


async def test_empty_resolved_range_conflicts_between_the_keys(db):
    # begin last_less_than(f) resolves to e, end fgoe(e) to e: empty; conflict [e, f) (keys swapped)
    await _fill(db)

    async def reads(tr):
        assert await tr.get_range(KeySelector.last_less_than(b"f"), KeySelector.first_greater_or_equal(b"e")) == []

    assert await conflicts(db, reads, clearer(b"e"))
    assert await conflicts(db, reads, setter((b"e5", b"")))
    assert not await conflicts(db, reads, setter((b"d", b"")))
    assert not await conflicts(db, reads, setter((b"f", b"")))


async def test_iterated_range_with_selector_end_conflicts_as_the_awaited_one(db):
    await _fill(db)

    async def reads(tr):
        got = [r.key async for r in tr.get_range(b"a", KeySelector.first_greater_than(b"e"))]
        assert got == [b"a", b"c", b"e"]

    assert not await conflicts(db, reads, setter((b"f", b"")))
    assert await conflicts(db, reads, setter((b"d", b"")))


async def test_selector_range_over_own_writes_skips_them_in_its_conflict(db):
    # updateConflictMap: keys the transaction set itself are not read from the database
    await _fill(db)

    async def reads(tr):
        tr.set(b"d", b"mine")
        rows = await tr.get_range(b"a", KeySelector.last_less_than(b"e") + 1)
        assert _keys(rows) == [b"a", b"c", b"d"]

    assert not await conflicts(db, reads, setter((b"d", b"theirs")))
    assert await conflicts(db, reads, setter((b"b", b"")))
    assert not await conflicts(db, reads, setter((b"f", b"")))


async def test_snapshot_selector_range_conflicts_nowhere(db):
    await _fill(db)

    async def reads(tr):
        rows = await tr.snapshot.get_range(KeySelector.last_less_than(b"c"), KeySelector.first_greater_than(b"e"))
        assert _keys(rows) == [b"a", b"c", b"e"]

    assert not await conflicts(db, reads, setter((b"b", b"")))
    assert not await conflicts(db, reads, setter((b"e", b"w")))


# ---------------------------------------------------------------------------
# Safety, black-box: a write the recorded conflict range lets through cannot change the read
# ---------------------------------------------------------------------------

import trio  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import kv  # noqa: E402

_ALPHABET = [bytes([c]) for c in b"bdfhjl"]
_selector = st.builds(
    KeySelector, st.sampled_from([b""] + _ALPHABET + [b"c", b"g", b"\xff"]), st.booleans(), st.integers(-3, 4)
)


def _resolve(keys: list[bytes], sel: KeySelector) -> int:
    """Brute force: the position in sorted ``keys`` a selector lands on (may be off either end)."""
    k = sel.key + b"\x00" if sel.or_equal else sel.key
    return sum(1 for x in keys if x < k) + sel.offset - 1


def _model(keys: list[bytes], b: KeySelector, e: KeySelector, limit: int, reverse: bool) -> list[bytes]:
    lo = min(max(_resolve(keys, b), 0), len(keys))
    hi = min(max(_resolve(keys, e), 0), len(keys))
    out = keys[lo:hi]
    if reverse:
        out.reverse()
    return out[:limit] if limit else out


@settings(max_examples=250, deadline=None)
@given(
    present=st.sets(st.sampled_from(_ALPHABET)),
    begin=_selector,
    end=_selector,
    limit=st.integers(0, 3),
    reverse=st.booleans(),
    written=st.sampled_from([b"a", b"c", b"e", b"g", b"i", b"k", b"m", b"0"] + _ALPHABET),
    clear=st.booleans(),
)
def test_selector_range_rows_and_conflict_are_safe(present, begin, end, limit, reverse, written, clear):
    """On the memory engine: rows equal a brute-force resolution, and whenever another
    transaction's write (a set or clear of ``written``) does not fail the reader's commit,
    reading again after it returns the same rows (the conflict range covers what the rows
    depend on)."""
    keys = sorted(present)

    async def main() -> None:
        db = await kv.open("memory:")
        async with db:
            await write(db, *((k, b"v") for k in keys))
            if begin.key > b"\xff" or end.key > b"\xff":
                return
            tr = db.create_transaction()
            rows = await tr.get_range(begin, end, limit=limit, reverse=reverse)
            assert _keys(rows) == _model(keys, begin, end, limit, reverse)
            await db.transact(clearer(written) if clear else setter((written, b"w")))
            tr.set(b"\x00marker", b"")
            try:
                await tr.commit()
                conflicted = False
            except kv.KVError as err:
                assert err.code == 1020
                conflicted = True
            if not conflicted:
                after = sorted(set(keys) - {written}) if clear else sorted(set(keys) | {written})
                assert clear or written not in _keys(rows), written  # its value changed
                assert _model(after, begin, end, limit, reverse) == _keys(rows), (written, clear)

    trio.run(main)
