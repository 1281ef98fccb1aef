"""Session 17: the journal no longer writes a conversation record ("cv"); a conversation exists
once its emitted-count key does (every emit adds to it, ``ensure_conversation_tr`` adds 0). A
conversation stored by the older layout (a "cv" record, with or without events) reads as before
and takes new emits.
"""

from __future__ import annotations

import pytest

from sessions import NotFound, Owner, Sessions, events
from sessions.codec import dumps, loads, unpack_i64

OWNER = Owner("test", "u1")
OTHER = Owner("test", "u2")


async def _get(db, key):
    return await db.transact(lambda tr: tr.get(key))  # read-only


async def test_an_emit_writes_no_conversation_record_and_the_count_makes_it_exist(db):
    j = Sessions(db).journal
    with pytest.raises(NotFound):
        await j.read(OWNER, "c")
    await j.emit_one(OWNER, "c", events.RUN_QUEUED, {"i": 0})
    assert await _get(db, j.keys.conversation(OWNER.tag, "c")) is None
    assert unpack_i64(await _get(db, j.keys.emitted(OWNER.tag, "c"))) == 1
    page = await j.read(OWNER, "c")
    assert [e.data for e in page.events] == [{"i": 0}]
    assert await j.tail_cursor(OWNER, "c") == page.events[0].cursor
    with pytest.raises(NotFound):  # another owner's conversation of the same name does not exist
        await j.read(OTHER, "c")


async def test_ensure_conversation_adds_zero_and_writes_no_record(db):
    j = Sessions(db).journal

    async def ensure(tr, conv):  # idempotent: an add of 0
        await j.ensure_conversation_tr(tr, OWNER, conv)

    await db.transact(lambda tr: ensure(tr, "empty"))
    await db.transact(lambda tr: ensure(tr, "empty"))
    assert await _get(db, j.keys.conversation(OWNER.tag, "empty")) is None
    assert unpack_i64(await _get(db, j.keys.emitted(OWNER.tag, "empty"))) == 0
    page = await j.read(OWNER, "empty")
    assert page.events == [] and page.first_retained is None and page.next_cursor is None
    # on a conversation with events it changes nothing
    await j.emit_many(OWNER, "busy", [(events.RUN_QUEUED, {}), (events.RUN_STARTED, {})])
    await db.transact(lambda tr: ensure(tr, "busy"))
    assert unpack_i64(await _get(db, j.keys.emitted(OWNER.tag, "busy"))) == 2
    assert len((await j.read(OWNER, "busy")).events) == 2


async def test_conversations_of_the_older_layout_still_read_and_take_emits(db):
    """The older layout's records written as it wrote them: a "cv" record {"owner": T} by the
    first emit (beside the count) or by ensure_conversation_tr alone (no count)."""
    j = Sessions(db).journal

    async def older(tr):  # a test without retries
        tr.set(j.keys.conversation(OWNER.tag, "bare"), dumps({"owner": OWNER.tag}))  # ensure_conversation_tr
        tr.set(j.keys.conversation(OWNER.tag, "old"), dumps({"owner": OWNER.tag}))  # the first emit's record
        await j.emit(tr, OWNER, "old", events.RUN_QUEUED, {"i": 0})
        tr.set(j.keys.conversation(OTHER.tag, "forged"), dumps({"owner": OWNER.tag}))  # a foreign tag

    await db.transact(older)
    page = await j.read(OWNER, "bare")
    assert page.events == [] and page.next_cursor is None
    assert [e.data for e in (await j.read(OWNER, "old")).events] == [{"i": 0}]
    with pytest.raises(NotFound):
        await j.read(OTHER, "forged")
    await j.emit_one(OWNER, "bare", events.RUN_STARTED, {"i": 1})
    await j.emit_one(OWNER, "old", events.RUN_STARTED, {"i": 1})
    assert [e.data for e in (await j.read(OWNER, "bare")).events] == [{"i": 1}]
    assert [e.data for e in (await j.read(OWNER, "old")).events] == [{"i": 0}, {"i": 1}]
    assert unpack_i64(await _get(db, j.keys.emitted(OWNER.tag, "old"))) == 2
    assert loads(await _get(db, j.keys.conversation(OWNER.tag, "old"))) == {"owner": OWNER.tag}  # left as it was


async def test_a_retried_emit_transaction_makes_the_conversation_once(db):
    """An emit reads nothing: a transaction retried after a conflict emits again from scratch,
    and only the committed attempt's event and count remain."""
    j = Sessions(db).journal
    attempts = []

    async def fn(tr):  # a test: the first attempt is made to conflict
        attempts.append(1)
        await j.emit(tr, OWNER, "r", events.RUN_QUEUED, {"n": len(attempts)})
        if len(attempts) == 1:
            await tr.get(b"\x02h62-probe")
            async def bump(t2):  # idempotent: one key set
                t2.set(b"\x02h62-probe", b"x")

            await db.transact(bump)
        return len(attempts)

    assert await db.transact(fn) == 2
    assert [e.data for e in (await j.read(OWNER, "r")).events] == [{"n": 2}]
    assert unpack_i64(await _get(db, j.keys.emitted(OWNER.tag, "r"))) == 1
