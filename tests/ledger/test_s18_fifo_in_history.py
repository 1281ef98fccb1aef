"""Session 18: a conversation's FIFO is its history after the active run.

A queued submit writes its history entry only (no ("o", T, "q", conv, seq) key); the settle of
the active run makes the first unsettled run after it in the history active, skipping runs
cancelled while queued. Runs queued by older code (a FIFO entry each, and run records without
"q") are still found, in order, and their entries cleared by their settles.
"""

from __future__ import annotations

from ledger import CANCELLED, COMPLETED, Ledger, completed
from ledger.runs import FIFO_WINDOW
from sessions import Owner, Sessions
from sessions.codec import dumps, loads
from sessions.owners import as_tag

OWNER = Owner("test", "u1")
TAG = as_tag(OWNER)


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _range_ids(db, r):
    tr = db.create_transaction()
    return [row.value.decode() for row in await tr.get_range(r.start, r.stop)]


async def _fifo_ids(db, L, conv="c"):
    return await _range_ids(db, L.keys.fifo_range(TAG, conv))


async def _history_ids(db, L, conv="c"):
    return await _range_ids(db, L.keys.history_range(TAG, conv))


async def _run_through(L, n):
    """Claim and settle ``n`` runs one at a time; the run ids in the order they were claimed."""
    order = []
    for _ in range(n):
        lease = await L.claim("w", lease_seconds=10)
        assert lease is not None
        order.append(lease.run_id)
        assert await L.claim("w2", lease_seconds=10) is None  # one active run a conversation
        await L.settle(lease, completed(lease.run_id))
    assert await L.claim("w", lease_seconds=10) is None
    return order


async def test_a_queued_submit_writes_its_history_entry_and_no_fifo_key(db, clock):
    s, L = make(db, clock)
    acks = [await L.submit(f"s{i}", {"i": i}, None, owner=OWNER, conversation="c") for i in range(4)]
    ids = [a.run_id for a in acks]
    assert await _fifo_ids(db, L) == []
    assert await _history_ids(db, L) == ids
    assert await L.active_run(OWNER, "c") == ids[0]
    for rid in ids:
        tr = db.create_transaction()
        assert loads(await tr.get(L.keys.run(rid)))["q"] is False
    assert await _run_through(L, 4) == ids
    assert await L.active_run(OWNER, "c") is None
    assert [(await L.get_run(r)).state for r in ids] == [COMPLETED] * 4


async def test_the_next_run_skips_runs_cancelled_while_queued_past_a_window(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    dead = [await L.submit(f"x{i}", {}, None, owner=OWNER, conversation="c") for i in range(2 * FIFO_WINDOW + 3)]
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    c = await L.submit("c", {}, None, owner=OWNER, conversation="c")
    for x in dead:
        assert await L.cancel(x.run_id) == CANCELLED
    assert await L.active_run(OWNER, "c") == a.run_id
    assert await _run_through(L, 3) == [a.run_id, b.run_id, c.run_id]
    # all cancelled after the last: the settle finds none and the conversation is idle
    d = await L.submit("d", {}, None, owner=OWNER, conversation="c")
    tail = [await L.submit(f"y{i}", {}, None, owner=OWNER, conversation="c") for i in range(FIFO_WINDOW + 1)]
    for y in tail:
        await L.cancel(y.run_id)
    assert await _run_through(L, 1) == [d.run_id]
    assert await L.active_run(OWNER, "c") is None
    e = await L.submit("e", {}, None, owner=OWNER, conversation="c")
    assert await L.active_run(OWNER, "c") == e.run_id
    assert (await L.claim("w", lease_seconds=10)).run_id == e.run_id


async def test_a_cancelled_active_unclaimed_run_hands_over_to_the_next(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {}, None, owner=OWNER, conversation="c")
    b = await L.submit("b", {}, None, owner=OWNER, conversation="c")
    assert await L.cancel(a.run_id) == CANCELLED
    assert await L.active_run(OWNER, "c") == b.run_id
    assert await _run_through(L, 1) == [b.run_id]


async def test_runs_queued_by_the_older_layout_are_found_and_their_entries_cleared(db, clock):
    """The layout before session 18: every queued run had a FIFO entry ("q", conv, seq) -> run
    id besides its history entry, and its record no "q" field (so does a run active from its
    submit written before session 17)."""
    s, L = make(db, clock)
    acks = [await L.submit(f"s{i}", {"i": i}, None, owner=OWNER, conversation="c") for i in range(5)]
    ids = [a.run_id for a in acks]
    new = await L.submit("new", {}, None, owner=OWNER, conversation="c")  # this layout, behind them

    async def older_layout(tr):  # idempotent: blind sets of the older layout's records
        for rid in ids:
            run = loads(await tr.get(L.keys.run(rid)))
            assert run.pop("q") is False
            tr.set(L.keys.run(rid), dumps(run))
            tr.set(L.keys.fifo(TAG, "c", run["seq"]), rid.encode())

    await db.transact(older_layout)
    assert await _fifo_ids(db, L) == ids
    # a queued run of the older layout cancelled: its entry goes with it
    assert await L.cancel(ids[2]) == CANCELLED
    assert await _fifo_ids(db, L) == ids[:2] + ids[3:]
    order = await _run_through(L, 5)
    assert order == ids[:2] + ids[3:] + [new.run_id]
    assert await _fifo_ids(db, L) == []
    assert await _history_ids(db, L) == ids + [new.run_id]
    assert await L.active_run(OWNER, "c") is None
    # and the conversation goes on in this layout
    nxt = await L.submit("next", {}, None, owner=OWNER, conversation="c")
    assert await L.active_run(OWNER, "c") == nxt.run_id
    assert await _fifo_ids(db, L) == []


async def test_list_runs_still_lists_queued_runs_in_order(db, clock):
    s, L = make(db, clock)
    acks = [await L.submit(f"s{i}", {}, None, owner=OWNER, conversation="c") for i in range(3)]
    runs = await L.list_runs(OWNER, "c")
    assert [r.id for r in runs] == [a.run_id for a in acks]
    assert [r.state for r in runs] == ["queued"] * 3
