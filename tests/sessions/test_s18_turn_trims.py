"""Session 18 (helper-74): a turn's sessions work trimmed — an append remembers a session's
checked owner, id and keys (Transcripts._append_keys), and Journal.emit with ``before`` makes
only its own event's ref (emit_many_tr(last_ref_only=True)). Each must write and refuse what
it did before: the same keys, the same head, the same errors after a pair is remembered, and
the ref's cursor the one a replay reads for the last event."""

from __future__ import annotations

import pytest

from sessions import Owner, Sessions, events
from sessions import transcript as transcript_mod
from sessions.errors import InvalidOwner
from sessions.codec import fastpack

OWNER = Owner("test", "u1")
TAG = OWNER.tag


async def _keys(db, r):
    return [row.key for row in await db.transact(lambda tr: tr.get_range(r.start, r.stop))]  # read-only


async def test_remembered_appends_write_the_keyspace_keys_and_head(db):
    t = Sessions(db).transcripts

    async def turn(tr, i):  # guarded by expected_head (a retry conflicts; none in this test)
        page, head = await t.read_tail_for_append_tr(tr, TAG, "s")
        return await t.append_tr(tr, TAG, "s", [{"i": i}], expected_head=i, create=page is None, head=head)

    for i in range(3):
        assert await db.transact(lambda tr: turn(tr, i)) == i + 1
    assert (TAG, "s") in t._appends
    # an Owner and its tag are one session; the remembered pair answers both
    assert await t.append(OWNER, "s", [{"i": 3}], expected_head=3) == 4
    assert await t.append(TAG, "s", [{"i": 4}], expected_head=4) == 5
    prefix = t.keys.messages(TAG, "s").raw_prefix
    assert await _keys(db, t.keys.messages(TAG, "s").range()) == [fastpack(prefix, (i, 0)) for i in range(5)]
    assert t._appends[(TAG, "s")] == (TAG, t.keys.head(TAG, "s"), prefix)
    info = await t.get(OWNER, "s")
    assert info.head == 5
    assert [m.data["i"] for m in (await t.read(OWNER, "s")).messages] == list(range(5))


async def test_a_remembered_session_lets_no_bad_owner_or_session_id_through(db):
    t = Sessions(db).transcripts
    await t.create(TAG, "s")
    await t.append(TAG, "s", [{"i": 0}])  # (TAG, "s") now remembered

    async def append(owner, sid):  # refused before anything is written
        return await db.transact(lambda tr: t.append_tr(tr, owner, sid, [{"i": 1}]))

    for bad_owner in ("no-slash", "a/b/c", "", 5, None):
        with pytest.raises((InvalidOwner, ValueError, TypeError)):
            await append(bad_owner, "s")
    for bad_sid in ("", "s" * 513, None, 3, ["s"], {"s": 1}):
        with pytest.raises(ValueError):
            await append(TAG, bad_sid)
        with pytest.raises(ValueError):
            await db.transact(lambda tr: t.read_tail_for_append_tr(tr, TAG, bad_sid))
    with pytest.raises(ValueError):
        await db.transact(lambda tr: t.read_tail_for_append_tr(tr, TAG, "s", limit=0))
    assert (await t.get(TAG, "s")).head == 1


async def test_forgetting_the_remembered_keys_changes_nothing(db, monkeypatch):
    monkeypatch.setattr(transcript_mod, "APPEND_KEYS_ENTRIES", 2)
    t = Sessions(db).transcripts
    for round_ in range(3):
        for sid in ("a", "b", "c", "d"):  # more sessions than entries: the dict is cleared as it fills
            if round_ == 0:
                await t.create(TAG, sid)
            assert await t.append(TAG, sid, [{"r": round_}], expected_head=round_) == round_ + 1
            assert len(t._appends) <= 2
    for sid in ("a", "b", "c", "d"):
        assert [m.data["r"] for m in (await t.read(TAG, sid)).messages] == [0, 1, 2]


async def test_emit_with_before_returns_the_last_events_ref(db):
    j = Sessions(db).journal
    before = [(events.PART_UPDATED, {"i": 0}), (events.PART_UPDATED, {"i": 1})]

    async def fn(tr):  # fresh conversation, no retries in this test
        first = await j.emit(tr, OWNER, "c", events.RUN_QUEUED, {"run_id": "r"})
        last = await j.emit(tr, OWNER, "c", events.RUN_COMPLETED, {"run_id": "r"}, before=before)
        many = await j.emit_many_tr(tr, OWNER, "c", [*before, (events.RUN_FAILED, {})], last_ref_only=True)
        return first, last, many

    first, last, many = await db.transact(fn)
    assert (first.order, last.order) == (0, 3)
    assert last.type == events.RUN_COMPLETED
    assert len(many) == 1 and many[0].order == 6 and many[0].type == events.RUN_FAILED
    page = await j.read(OWNER, "c")
    assert [e.type for e in page.events] == [events.RUN_QUEUED, events.PART_UPDATED, events.PART_UPDATED,
                                             events.RUN_COMPLETED, events.PART_UPDATED, events.PART_UPDATED,
                                             events.RUN_FAILED]
    assert [await first.cursor(), await last.cursor(), await many[0].cursor()] == [
        page.events[0].cursor, page.events[3].cursor, page.events[6].cursor]


@pytest.mark.parametrize("sid", ["s", "with\x00nul", "ünïcode", "x" * 512])
def test_head_and_messages_are_the_keyspace_keys(sid):
    from sessions.keyspace import SessionsKeyspace

    import kv

    for k in (SessionsKeyspace(), SessionsKeyspace(kv.Subspace((b"other-root",)))):
        assert k.head_and_messages(TAG, sid) == (k.head(TAG, sid), k.messages(TAG, sid).raw_prefix)
        assert k.head(TAG, sid) == k.base.pack(("o", TAG, "ss", sid, "h"))
        assert k.messages(TAG, sid).raw_prefix == k.base.pack(("o", TAG, "ss", sid, "m"))
