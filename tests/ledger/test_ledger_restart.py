"""What survives a restart of the embedded engine (close, reopen the same directory)."""

from __future__ import annotations

import kv
from ledger import Ledger, completed
from sessions import Owner, Sessions, events

OWNER = Owner("test", "restart")


async def test_lease_expiry_and_journal_order_survive_a_restart(tmp_path, clock):
    url = f"lmdb:{tmp_path / 'data'}"
    db = await kv.open(url)
    s = Sessions(db, clock=clock)
    L = Ledger(db, journal=s.journal, clock=clock)
    ack = await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")
    dead = await L.claim("worker-that-dies", lease_seconds=30)
    await s.transcripts.create(OWNER, "c")
    await s.transcripts.append(OWNER, "c", [{"role": "user", "content": "hi"}])
    before = (await s.journal.read(OWNER, "c")).events
    await db.close()  # the process "dies" holding the lease

    db = await kv.open(url)
    try:
        s = Sessions(db, clock=clock)
        L = Ledger(db, journal=s.journal, clock=clock)
        assert await L.claim("new-worker", lease_seconds=30) is None  # lease still valid after restart
        clock.advance(31)
        lease = await L.claim("new-worker", lease_seconds=30)
        assert lease.run_id == ack.run_id and lease.attempt == 2 and lease.token == dead.token + 1
        await L.settle(lease, completed("ok"))
        page = await s.journal.read(OWNER, "c")
        assert [e.cursor for e in page.events[:len(before)]] == [e.cursor for e in before]
        assert [e.type for e in page.events] == [events.RUN_QUEUED, events.RUN_STARTED, events.RUN_STARTED,
                                                 events.RUN_COMPLETED]
        assert [e.cursor for e in page.events] == sorted(e.cursor for e in page.events)
        assert [m.data for m in (await s.transcripts.read(OWNER, "c")).messages] == [{"role": "user", "content": "hi"}]
        assert (await L.submit("k", {"text": "hi"}, None, owner=OWNER, conversation="c")).outcome == completed("ok")
    finally:
        await db.close()
