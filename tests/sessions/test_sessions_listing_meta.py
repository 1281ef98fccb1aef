"""Session 17: a new session's metadata is its listing entry's value, not a key of its own
("meta"); a session of the older layout (an empty listing value and a "meta" record) reads as
before: its info, forks of it, the listing.
"""

from __future__ import annotations

import pytest

from sessions import NotFound, Owner, Sessions
from sessions.codec import dumps, loads

OWNER = Owner("test", "u1")
OTHER = Owner("test", "u2")


async def _get(db, key):
    return await db.transact(lambda tr: tr.get(key))  # read-only


async def test_a_new_sessions_metadata_is_its_listing_value(db):
    s = Sessions(db).transcripts
    info = await s.create(OWNER, "s1", title="hello", extra={"k": 1})
    assert await _get(db, s.keys.meta(OWNER.tag, "s1")) is None
    meta = loads(await _get(db, s.keys.session_listing(OWNER.tag, "s1")))
    assert meta["owner"] == OWNER.tag and meta["id"] == "s1" and meta["title"] == "hello" and meta["extra"] == {"k": 1}
    got = await s.get(OWNER, "s1")
    assert (got.title, got.extra, got.created) == ("hello", {"k": 1}, info.created)
    assert await s.create(OWNER, "s1") == got  # idempotent create returns the stored one
    await s.append(OWNER, "s1", [{"role": "user", "text": "a"}, {"role": "user", "text": "b"}])
    # an append that creates its session (the loop's) writes the listing value too
    await db.transact(lambda tr: s.append_tr(tr, OWNER, "s2", [{"role": "user"}], create=True))  # a test without retries
    assert loads(await _get(db, s.keys.session_listing(OWNER.tag, "s2")))["id"] == "s2"
    assert await _get(db, s.keys.meta(OWNER.tag, "s2")) is None
    assert await s.list(OWNER) == ["s1", "s2"]
    fork = await s.fork(OWNER, "s1", 1, new_session_id="f1", title="fork")
    assert (fork.parent, fork.fork_at, fork.title) == ("s1", 1, "fork")
    assert await _get(db, s.keys.meta(OWNER.tag, "f1")) is None
    got = await s.get(OWNER, "f1")
    assert (got.parent, got.fork_at, got.title, got.head) == ("s1", 1, "fork", 1)
    # the same fork again is recognised as this fork (its metadata read from the listing)
    assert (await s.fork(OWNER, "s1", 1, new_session_id="f1", title="fork")).parent == "s1"
    copy = await s.fork(OWNER, "s1", 2, new_session_id="f2", by_reference=False)
    assert (copy.parent, copy.fork_at) == ("s1", 2)
    assert (await s.get(OWNER, "f2")).parent == "s1"
    assert await s.list(OWNER) == ["f1", "f2", "s1", "s2"]


async def test_sessions_of_the_older_layout_still_read(db):
    """A session as the older layout stored it: head, a "meta" record and an empty listing
    value; its info, its forks (which take its project) and the listing read as before."""
    sessions = Sessions(db)
    s = sessions.transcripts
    pid = (await sessions.projects.create(OWNER, "p")).id
    meta = {"owner": OWNER.tag, "id": "old", "created": 12.5, "project": pid, "parent": None,
            "fork_at": None, "title": "t", "extra": {"x": 2}}

    async def older(tr):  # a test without retries
        tr.set(s.keys.head(OWNER.tag, "old"), dumps({"owner": OWNER.tag, "n": 0, "base": 0, "seg": [], "tok": None}))
        tr.set(s.keys.meta(OWNER.tag, "old"), dumps(meta))
        tr.set(s.keys.session_listing(OWNER.tag, "old"), b"")

    await db.transact(older)
    info = await s.get(OWNER, "old")
    assert (info.created, info.project, info.title, info.extra, info.head) == (12.5, pid, "t", {"x": 2}, 0)
    assert (await s.create(OWNER, "old")).created == 12.5
    await s.append(OWNER, "old", [{"role": "user", "text": "a"}])
    fork = await s.fork(OWNER, "old", 1, new_session_id="nf")
    assert (fork.project, fork.parent) == (pid, "old")
    copy = await s.fork(OWNER, "old", 1, new_session_id="cf", by_reference=False)
    assert copy.project == pid
    assert (await s.get(OWNER, "cf")).project == pid
    assert await s.list(OWNER) == ["cf", "nf", "old"]
    # a foreign owner tag in an older record is refused as before
    async def forged(tr):  # a test without retries
        tr.set(s.keys.head(OTHER.tag, "x"), dumps({"owner": OTHER.tag, "n": 0, "base": 0, "seg": [], "tok": None}))
        tr.set(s.keys.meta(OTHER.tag, "x"), dumps(dict(meta, owner=OWNER.tag)))
        tr.set(s.keys.session_listing(OTHER.tag, "x"), b"")

    await db.transact(forged)
    with pytest.raises(NotFound):
        await s.get(OTHER, "x")
