"""Session 18: Journal.emit_many_tr's per-emit work trimmed — a str owner already emitted to
with a conversation skips as_tag, the 2-byte orders and the count operands come from tables
(with the computed form past them), the order reservation is inline, the append keys are
built from the journal prefix. Each must write what it wrote before: the same keys, values,
positions and emitted count, and refuse the same inputs."""

from __future__ import annotations

import pytest

from kv.tuple import Versionstamp
from sessions import Owner, Sessions, events
from sessions.codec import unpack_i64
from sessions.journal import _ADD_N_CACHED, _ORDER_BYTES_CACHED, _stamped_event_key

OWNER = Owner("test", "u1")
TAG = OWNER.tag


async def _event_rows(db, j, tag, conv):
    sub = j.keys.events(tag, conv)
    r = sub.range()
    return await db.transact(lambda tr: tr.get_range(r.start, r.stop))  # read-only


async def test_orders_past_the_tables_give_the_tuple_layer_keys_and_one_count(db):
    j = Sessions(db).journal
    first = _ORDER_BYTES_CACHED - 3  # the first emit ends inside the order table, the second crosses it
    second = _ADD_N_CACHED + 5       # and adds more than the operand table holds

    async def fn(tr):  # fresh conversation, no retries in this test
        a = await j.emit_many_tr(tr, TAG, "c", [(events.PART_UPDATED, {"i": i}) for i in range(first)])
        b = await j.emit_many_tr(tr, OWNER, "c", [(events.PART_UPDATED, {"i": first + i}) for i in range(second)])
        return a + b

    refs = await db.transact(fn)
    n = first + second
    assert [r.order for r in refs] == list(range(n))
    rows = await _event_rows(db, j, TAG, "c")
    sub = j.keys.events(TAG, "c")
    stamp = bytes(rows[0].key[len(sub.raw_prefix) + 1:][:10])
    assert [row.key for row in rows] == [sub.pack((Versionstamp(stamp, i),)) for i in range(n)]
    cursors = [await r.cursor() for r in refs]
    page = await j.read(OWNER, "c", limit=n)
    assert [e.cursor for e in page.events] == cursors
    assert [e.data["i"] for e in page.events] == list(range(n))
    raw = await db.transact(lambda tr: tr.get(j.keys.emitted(TAG, "c")))  # read-only
    assert unpack_i64(raw) == n
    # the hand-split key parts are _stamped_event_key's (checked against kv.tuple elsewhere)
    head, tail, emitted = j._appends[(TAG, "c")]
    for order in (0, 255, 256, 65_535):
        assert head + order.to_bytes(2, "big") + tail == _stamped_event_key(sub.raw_prefix, order)
    assert emitted == j.keys.emitted(TAG, "c")


async def test_a_remembered_conversation_does_not_let_a_bad_owner_or_conversation_through(db):
    j = Sessions(db).journal
    await j.emit_one(TAG, "c", events.PART_UPDATED, {"i": 0})  # (TAG, "c") now remembered

    async def emit(owner, conv, items):
        return await db.transact(lambda tr: j.emit_many_tr(tr, owner, conv, items, refs=False))

    for owner in ("not a tag", "", "x" * 10_000):
        with pytest.raises(ValueError):
            await emit(owner, "c", [(events.PART_UPDATED, {})])
        with pytest.raises(ValueError):
            await emit(owner, "c", [])
    for conv in ("", "c" * 513):
        with pytest.raises(ValueError):
            await emit(TAG, conv, [(events.PART_UPDATED, {})])
        with pytest.raises(ValueError):
            await emit(TAG, conv, [])
    with pytest.raises(ValueError):  # an unknown (or unhashable) event type, remembered pair or not
        await emit(TAG, "c", [("made.up", {})])
    with pytest.raises(ValueError):
        await emit(TAG, "c", [(["x"], {})])
    assert await emit(TAG, "c", []) == []
    # an Owner and its tag string are one conversation: same keys, one count
    await emit(OWNER, "c", [(events.PART_UPDATED, {"i": 1})])
    await emit(TAG, "c", [(events.PART_UPDATED, {"i": 2})])
    page = await j.read(TAG, "c")
    assert [e.data["i"] for e in page.events] == [0, 1, 2]
    raw = await db.transact(lambda tr: tr.get(j.keys.emitted(TAG, "c")))  # read-only
    assert unpack_i64(raw) == 3


async def test_an_emit_refused_for_size_writes_nothing_of_its_batch(db):
    from sessions import TooLarge

    j = Sessions(db).journal

    async def fn(tr):
        try:
            await j.emit_many_tr(tr, TAG, "c", [(events.PART_UPDATED, {"i": 0}),
                                                 (events.MESSAGE_ADDED, {"x": "z" * 100_000})])
        except TooLarge:
            pass
        return await j.emit_many_tr(tr, TAG, "c", [(events.PART_UPDATED, {"i": 1})])

    refs = await db.transact(fn)
    assert [r.order for r in refs] == [0]
    page = await j.read(TAG, "c")
    assert [e.data["i"] for e in page.events] == [1]
    assert [row.key[-2:] for row in await _event_rows(db, j, TAG, "c")] == [b"\x00\x00"]
