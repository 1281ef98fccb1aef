"""Owners: tags refuse '/', and a foreign record is exactly a missing one."""

from __future__ import annotations

import pytest

from sessions import InvalidOwner, NotFound, Owner, Sessions, as_tag, owner_tag, parse_tag


def test_owner_tags_refuse_slash_and_empty():
    with pytest.raises(InvalidOwner):
        owner_tag("a/b", "c")
    with pytest.raises(InvalidOwner):
        owner_tag("a", "b/c")
    with pytest.raises(InvalidOwner):
        Owner("", "x")
    with pytest.raises(InvalidOwner):
        Owner("x", "")
    with pytest.raises(InvalidOwner):
        parse_tag("a/b/c")
    assert owner_tag("realm", "subject") == "realm/subject"
    assert parse_tag("realm/subject") == Owner("realm", "subject")
    assert as_tag(Owner("r", "s")) == as_tag("r/s") == "r/s"


async def _message(coro) -> str:
    with pytest.raises(NotFound) as info:
        await coro
    return str(info.value)


async def test_foreign_session_is_missing(db):
    s = Sessions(db)
    alice, bob = Owner("web", "alice"), Owner("web", "bob")
    await s.transcripts.create(alice, "conv-1")
    await s.transcripts.append(alice, "conv-1", [{"role": "user", "content": "secret"}])
    foreign = await _message(s.transcripts.read(bob, "conv-1"))
    missing = await _message(s.transcripts.read(bob, "conv-nope"))
    assert foreign == missing.replace("conv-nope", "conv-1")
    with pytest.raises(NotFound):
        await s.transcripts.append(bob, "conv-1", [{"role": "user", "content": "x"}])
    with pytest.raises(NotFound):
        await s.transcripts.fork(bob, "conv-1", 1)
    assert await s.transcripts.list(bob) == []
    assert (await s.transcripts.read(alice, "conv-1")).messages[0].data["content"] == "secret"


async def test_foreign_journal_cursor_is_not_found(db):
    s = Sessions(db)
    alice, bob = Owner("web", "alice"), Owner("web", "bob")
    cursor = await s.journal.emit_one(alice, "c", "message.added", {"n": 1})
    foreign = await _message(s.journal.read(bob, "c", after=cursor))
    missing = await _message(s.journal.read(bob, "other", after=cursor))
    assert foreign == missing.replace("other", "c")
    page = await s.journal.read(alice, "c", after=None)
    assert [e.cursor for e in page.events] == [cursor]
