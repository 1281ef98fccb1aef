"""Session 18: a queued submit remembers the conversation-state bytes it wrote and their
decoding (Ledger._cs_seen); the next submit reading the same bytes copies the dict. A memo of
a pure function of the bytes: bytes written by another process, or by a transaction that did
not commit, are decoded; the FIFO and the sequence numbers stay right."""

from __future__ import annotations

import pytest

from ledger import Ledger, completed
from ledger import runs
from sessions import Owner, Sessions
from sessions.codec import loads

OWNER = Owner("test", "u1")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _cs(db, L, conv="c"):
    from sessions.owners import as_tag

    tr = db.create_transaction()
    return loads(await tr.get(L.keys.conversation_state(as_tag(OWNER), conv)))


async def test_two_processes_submitting_to_one_conversation_keep_its_sequence(db, clock):
    s1, A = make(db, clock)
    B = Ledger(db, journal=s1.journal, clock=clock)  # another process's ledger, same store
    acks = []
    for i in range(8):
        L = A if i % 3 else B
        acks.append(await L.submit(f"s{i}", {"i": i}, None, owner=OWNER, conversation="c"))
    assert await _cs(db, A) == {"active": acks[0].run_id, "tail": 8}
    assert A._cs_seen and B._cs_seen
    infos = await A.list_runs(OWNER, "c")
    assert [r.id for r in infos] == [a.run_id for a in acks]
    order = []
    for _ in range(8):
        lease = await A.claim("w", lease_seconds=10)
        order.append(lease.run_id)
        await A.settle(lease, completed())
    assert order == [a.run_id for a in acks]


async def test_a_submit_that_did_not_commit_leaves_nothing_wrong_behind(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")  # queued: remembered

    class Boom(Exception):
        pass

    async def fn(tr):  # never commits
        await L.submit_tr(tr, "x", {}, None, owner=OWNER, conversation="c")
        raise Boom

    with pytest.raises(Boom):
        await db.transact(fn)
    # the memo now holds bytes with tail 3 that were never stored; the store says tail 2
    assert await _cs(db, L) == {"active": a.run_id, "tail": 2}
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    assert await _cs(db, L) == {"active": a.run_id, "tail": 3}
    assert [r.id for r in await L.list_runs(OWNER, "c")] == [a.run_id, b.run_id, c.run_id]
    # the active run settles (writes the state itself): the next submit decodes what it reads
    lease = await L.claim("w", lease_seconds=10)
    await L.settle(lease, completed())
    d = await L.submit("d", {}, None, owner=OWNER, conversation="c")
    assert await _cs(db, L) == {"active": b.run_id, "tail": 4}
    assert [r.id for r in await L.list_runs(OWNER, "c")] == [a.run_id, b.run_id, c.run_id, d.run_id]


async def test_the_memo_is_bounded(db, clock, monkeypatch):
    monkeypatch.setattr(runs, "_CS_SEEN_SIZE", 4)
    s, L = make(db, clock)
    for k in range(10):
        for i in range(2):
            await L.submit(f"s{k}-{i}", {}, None, owner=OWNER, conversation=f"c{k}")
        assert len(L._cs_seen) <= 4
    for k in range(10):
        assert (await _cs(db, L, f"c{k}"))["tail"] == 2
