"""Projects (overrides never shared) and attachments (pending -> ready -> deleting)."""

from __future__ import annotations

import base64

import pytest

from sessions import MAX_ATTACHMENT_BYTES, NotFound, Owner, Sessions, TooLarge, render_agent_config
from sessions.attachments import ATTACHMENT_CHUNK, PENDING, READY
from sessions.errors import InvalidState

ALICE, BOB = Owner("web", "alice"), Owner("web", "bob")


async def test_foreign_project_is_missing(db):
    p = Sessions(db).projects
    info = await p.create(ALICE, "research", project_id="p1")
    with pytest.raises(NotFound) as foreign:
        await p.get(BOB, "p1")
    with pytest.raises(NotFound) as missing:
        await p.get(BOB, "p2")
    assert str(foreign.value) == str(missing.value).replace("p2", "p1")
    with pytest.raises(NotFound):
        await p.set_agent_overrides(BOB, "p1", "helper", {"model": "x"})
    with pytest.raises(NotFound):
        await p.delete(BOB, "p1")
    assert await p.list(BOB) == []
    assert [x.id for x in await p.list(ALICE)] == [info.id]


async def test_agent_overrides_apply_at_render_and_never_touch_the_base(db):
    s = Sessions(db)
    base = {"name": "helper", "model": "echo", "params": {"temperature": 0.2, "max_tokens": 100}}
    snapshot = {"name": "helper", "model": "echo", "params": {"temperature": 0.2, "max_tokens": 100}}
    await s.projects.create(ALICE, "a", project_id="p")
    await s.projects.create(BOB, "b", project_id="p")
    await s.projects.set_agent_overrides(ALICE, "p", "helper", {"params": {"temperature": 0.9}})
    alice = render_agent_config(base, await s.projects.agent_overrides(ALICE, "p", "helper"))
    bob = render_agent_config(base, await s.projects.agent_overrides(BOB, "p", "helper"))
    assert alice["params"] == {"temperature": 0.9, "max_tokens": 100}
    assert bob == base == snapshot
    await s.projects.set_agent_overrides(ALICE, "p", "helper", None)
    assert await s.projects.agent_overrides(ALICE, "p", "helper") == {}


async def test_project_sessions_listing(db):
    s = Sessions(db)
    await s.projects.create(ALICE, "a", project_id="p")
    await s.transcripts.create(ALICE, "s1", project="p")
    await s.projects.add_session(ALICE, "p", "s2")
    assert await s.projects.sessions(ALICE, "p") == ["s1", "s2"]
    assert await s.transcripts.list(ALICE, project="p") == ["s1", "s2"]
    await s.projects.delete(ALICE, "p")
    with pytest.raises(NotFound):
        await s.projects.sessions(ALICE, "p")


async def test_attachment_roundtrip_cap_and_foreign(db):
    a = Sessions(db).attachments
    data = bytes(range(256)) * 700  # 179,200 bytes: three chunks
    info = await a.upload(ALICE, base64.b64encode(data).decode(), media_type="image/png", filename="x.png")
    assert info.state == READY and info.size == len(data)
    assert await a.read(ALICE, info.id) == data
    with pytest.raises(NotFound):
        await a.read(BOB, info.id)
    with pytest.raises(TooLarge):
        await a.upload(ALICE, b"x" * (MAX_ATTACHMENT_BYTES + 1), media_type="text/plain")
    with pytest.raises(TooLarge):
        await a.upload(ALICE, base64.b64encode(b"x" * (MAX_ATTACHMENT_BYTES + 10)).decode(), media_type="text/plain")
    await a.delete(ALICE, info.id)
    with pytest.raises(NotFound):
        await a.get(ALICE, info.id)


async def test_crash_mid_upload_leaves_pending_never_ready(db, clock):
    a = Sessions(db, clock=clock).attachments
    info = await a.begin(ALICE, media_type="text/plain")
    await a.write_chunk(ALICE, info.id, 0, b"a" * ATTACHMENT_CHUNK)
    await a.write_chunk(ALICE, info.id, 2, b"c")  # chunk 1 never arrived: the uploader "crashed"
    with pytest.raises(InvalidState):
        await a.finish(ALICE, info.id)
    assert (await a.get(ALICE, info.id)).state == PENDING
    with pytest.raises(InvalidState):
        await a.read(ALICE, info.id)
    assert await a.cleanup_pending(older_than=60) == 0  # too young
    done = await a.upload(ALICE, b"complete", media_type="text/plain")
    clock.advance(3600)
    assert await a.cleanup_pending(older_than=60) == 1  # only the abandoned one
    with pytest.raises(NotFound):
        await a.get(ALICE, info.id)
    assert await a.read(ALICE, done.id) == b"complete"


async def test_declared_hash_mismatch_is_refused(db):
    a = Sessions(db).attachments
    info = await a.begin(ALICE, media_type="text/plain", sha256="0" * 64)
    await a.write_chunk(ALICE, info.id, 0, b"hello")
    with pytest.raises(InvalidState):
        await a.finish(ALICE, info.id)
