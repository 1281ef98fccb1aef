"""Session 18 (helper-74): a submit's sessions work trimmed — an Owner's tag made once, a
conversation id's str tested by class first, a one-event emit set without a second loop, a
ref's cursor encoded inline. Each must give what it gave before: the same tags, the same
refusals, the same keys, and cursors equal to encode_cursor's and to what a replay reads."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from sessions import Owner, Sessions, events
from sessions.errors import InvalidOwner
from sessions.journal import (_ORDER_BYTES_CACHED, MAX_CONVERSATION_ID, EventRef, check_conversation_id,
                              encode_cursor)
from sessions.owners import as_tag, owner_tag, parse_tag


def test_an_owner_tag_is_realm_slash_subject_and_not_part_of_equality_or_repr():
    o = Owner("realm", "subject")
    assert o.tag == "realm/subject" == as_tag(o) == str(o) == owner_tag("realm", "subject")
    assert o == Owner("realm", "subject") and hash(o) == hash(Owner("realm", "subject"))
    assert o != Owner("realm", "other")
    assert repr(o) == "Owner(realm='realm', subject='subject')"
    assert dataclasses.asdict(o) == {"realm": "realm", "subject": "subject"}  # (a tool result's JSON)
    assert [f.name for f in dataclasses.fields(o)] == ["realm", "subject"]
    assert not hasattr(o, "__dict__")
    assert parse_tag("a/b").tag == "a/b"
    for c in (copy.copy(o), copy.deepcopy(o), *(pickle.loads(pickle.dumps(o, protocol=p)) for p in range(6))):
        assert c == o and c.tag == "realm/subject"
    r = dataclasses.replace(o, subject="s2")
    assert r.tag == "realm/s2" == as_tag(r)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.realm = "x"  # type: ignore[misc]
    with pytest.raises(InvalidOwner):
        Owner("a/b", "c")


def test_conversation_ids_refused_and_accepted_as_before():
    class S(str):
        pass

    assert check_conversation_id("c") == "c"
    assert check_conversation_id(S("c")) == "c"
    assert check_conversation_id("x" * MAX_CONVERSATION_ID)
    for bad in ("", "x" * (MAX_CONVERSATION_ID + 1), None, 5, b"c", ["c"]):
        with pytest.raises(ValueError):
            check_conversation_id(bad)  # type: ignore[arg-type]


class _Ready:
    """An already-resolved versionstamp awaitable (what a committed transaction hands back)."""

    def __init__(self, stamp: bytes) -> None:
        self.stamp = stamp

    def __await__(self):
        if False:
            yield
        return self.stamp


@pytest.mark.parametrize("order", [0, 1, _ORDER_BYTES_CACHED - 1, _ORDER_BYTES_CACHED, 65_534])
async def test_a_ref_cursor_is_encode_cursor_of_stamp_and_order(order):
    stamp = bytes(range(1, 11))
    ref = EventRef(_Ready(stamp), order, events.RUN_QUEUED)
    c = await ref.cursor()
    assert c == encode_cursor(stamp + order.to_bytes(2, "big"))
    assert await ref.cursor() == c  # remembered


async def test_one_event_emits_at_any_order_read_back_at_their_cursors(db):
    """One-event emits (the submit's shape) in one transaction, before and past the order
    table: each lands at its own key and its ref's cursor is the one a replay reads."""
    j = Sessions(db).journal
    owner = Owner("test", "u1")
    n = _ORDER_BYTES_CACHED + 3

    async def fn(tr):  # fresh conversation, no retries in this test
        return [(await j.emit_many_tr(tr, owner, "c", [(events.PART_UPDATED, {"i": i})], first_ref_only=True))[0]
                for i in range(n)]

    refs = await db.transact(fn)
    assert [r.order for r in refs] == list(range(n))
    cursors = [await r.cursor() for r in refs]
    page = await j.read(owner, "c", limit=n)
    assert [e.cursor for e in page.events] == cursors
    assert [e.data["i"] for e in page.events] == list(range(n))
    # and a submit-like single emit in its own transaction, then a live follow from before it
    ref = await db.transact(lambda tr: j.emit(tr, owner, "c", events.RUN_QUEUED, {"run_id": "r"}))
    cursor = await ref.cursor()
    page = await j.read(owner, "c", after=cursors[-1])
    assert [(e.cursor, e.type, e.data) for e in page.events] == [(cursor, events.RUN_QUEUED, {"run_id": "r"})]
