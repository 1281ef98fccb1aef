"""The journal: positions, replay == live, resume, retention, guarded emits, coalescing."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from sessions import Coalescer, CursorBehind, InvalidCursor, NotFound, Owner, Sessions, TooLarge, events

OWNER = Owner("test", "u1")


async def test_emits_in_one_transaction_get_ordered_distinct_positions(db):
    j = Sessions(db).journal

    async def fn(tr):  # fresh conversation, no guard needed in a test without retries
        return [await j.emit(tr, OWNER, "c", events.PART_UPDATED, {"i": i}) for i in range(5)]

    refs = await db.transact(fn)
    cursors = [await r.cursor() for r in refs]
    assert len(set(cursors)) == 5 and cursors == sorted(cursors)
    page = await j.read(OWNER, "c")
    assert [e.cursor for e in page.events] == cursors
    assert [e.data["i"] for e in page.events] == list(range(5))


async def test_unknown_event_type_and_oversized_event_refused(db):
    j = Sessions(db).journal
    with pytest.raises(ValueError):
        await j.emit_one(OWNER, "c", "made.up", {})
    with pytest.raises(TooLarge):
        await j.emit_one(OWNER, "c", events.MESSAGE_ADDED, {"x": "z" * 100_000})
    with pytest.raises(InvalidCursor):
        await j.emit_one(OWNER, "c", events.MESSAGE_ADDED, {})
        await j.read(OWNER, "c", after="nonsense")


async def test_replayed_positions_equal_live_ones_and_resume_from_middle(db):
    j = Sessions(db).journal
    first = await j.emit_one(OWNER, "c", events.RUN_QUEUED, {"n": 0})
    live: list = []

    async def follower(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for e in j.follow(OWNER, "c", after=first):
            live.append(e)
            if len(live) == 40:
                return

    async def emitter(k: int) -> None:
        for i in range(10):
            await j.emit_many(OWNER, "c", [(events.PART_UPDATED, {"k": k, "i": i}), (events.PART_UPDATED, {"k": k})])
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        await n.start(follower)
        n.start_soon(emitter, 1)
        n.start_soon(emitter, 2)
    replay = (await j.read(OWNER, "c", after=first, limit=1000)).events
    assert [(e.cursor, e.type, e.data) for e in live] == [(e.cursor, e.type, e.data) for e in replay]
    assert len({e.cursor for e in live}) == 40  # no duplicate
    # resume from the middle
    mid = replay[17].cursor
    rest = (await j.read(OWNER, "c", after=mid, limit=1000)).events
    assert [e.cursor for e in rest] == [e.cursor for e in replay[18:]]
    # a page at a time reaches the same sequence
    got, cur = [], first
    while True:
        page = await j.read(OWNER, "c", after=cur, limit=7)
        got.extend(page.events)
        cur = page.next_cursor
        if not page.more:
            break
    assert [e.cursor for e in got] == [e.cursor for e in replay]


async def test_follow_from_start_then_live_no_gap_no_duplicate(db):
    j = Sessions(db).journal
    for i in range(5):
        await j.emit_one(OWNER, "c", events.MESSAGE_ADDED, {"i": i})
    seen: list[int] = []

    async def follower(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for e in j.follow(OWNER, "c", page_size=3):
            seen.append(e.data["i"])
            if len(seen) == 25:
                return

    async with trio.open_nursery() as n:
        await n.start(follower)
        for i in range(5, 25):
            await j.emit_one(OWNER, "c", events.MESSAGE_ADDED, {"i": i})
            if i % 4 == 0:
                await trio.sleep(0.001)
    assert seen == list(range(25))


async def test_a_second_run_continues_the_order(db):
    s = Sessions(db)
    c1 = [await s.journal.emit_one(OWNER, "c", events.RUN_STARTED, {"run": 1, "i": i}) for i in range(3)]
    # a "new process": fresh objects on the same database
    s2 = Sessions(db)
    c2 = [await s2.journal.emit_one(OWNER, "c", events.RUN_STARTED, {"run": 2, "i": i}) for i in range(3)]
    assert c1 + c2 == sorted(c1 + c2)
    page = await s2.journal.read(OWNER, "c", after=c1[-1])
    assert [e.data["run"] for e in page.events] == [2, 2, 2]


async def test_retention_reports_first_retained_position(db):
    j = Sessions(db, retention=10).journal
    cursors = [await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i}) for i in range(35)]
    removed = await j.trim(OWNER, "c")
    assert removed == 25
    page = await j.read(OWNER, "c", after=cursors[3])
    assert page.behind is True
    assert page.first_retained == cursors[25]
    assert [e.data["i"] for e in page.events] == list(range(25, 35))
    ok = await j.read(OWNER, "c", after=cursors[25])
    assert ok.behind is False and [e.data["i"] for e in ok.events] == list(range(26, 35))
    with pytest.raises(CursorBehind) as info:
        async for _ in j.follow(OWNER, "c", after=cursors[0]):
            pass
    assert info.value.first_retained == cursors[25]
    # retention 0 keeps everything
    keep_all = Sessions(db, retention=0).journal
    for i in range(5):
        await keep_all.emit_one(OWNER, "d", events.PART_UPDATED, {"i": i})
    assert await keep_all.trim(OWNER, "d") == 0
    assert len((await keep_all.read(OWNER, "d")).events) == 5
    # ... and tracks no growth for a trimmer (with no trimmer running, that map kept an
    # entry for every conversation ever emitted to)
    assert not keep_all._grown and not keep_all._due


async def test_trimming_does_not_block_concurrent_appends(db):
    j = Sessions(db, retention=20).journal
    for i in range(100):
        await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i})

    async def appender():
        for i in range(100, 160):
            await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i})

    async with trio.open_nursery() as n:
        n.start_soon(appender)
        n.start_soon(j.trim, OWNER, "c")
    await j.trim(OWNER, "c")
    page = await j.read(OWNER, "c", limit=1000)
    assert [e.data["i"] for e in page.events] == list(range(140, 160))


async def test_maybe_trim_and_trimmer_service(db):
    j = Sessions(db, retention=10).journal
    j.trim_slack = 5
    for i in range(30):
        await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i})
    async with trio.open_nursery() as n:
        await n.start(partial(j.run_trimmer, interval=0.05))
        for i in range(30, 40):
            await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i})
        with trio.fail_after(5):
            while len((await j.read(OWNER, "c", limit=100)).events) > 10:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert [e.data["i"] for e in (await j.read(OWNER, "c")).events] == list(range(30, 40))


async def test_emit_many_after_1021_does_not_duplicate(db, inject_1021):
    j = Sessions(db).journal
    await j.emit_one(OWNER, "c", events.RUN_QUEUED, {})
    hooks = inject_1021(db, b"jn", n=1)
    cursors = await j.emit_many(OWNER, "c", [(events.MESSAGE_ADDED, {"a": 1}), (events.MESSAGE_ADDED, {"a": 2})])
    assert hooks.injected == 1
    page = await j.read(OWNER, "c")
    assert [e.data for e in page.events] == [{}, {"a": 1}, {"a": 2}]
    assert [e.cursor for e in page.events[1:]] == cursors


async def test_read_of_unknown_conversation_is_not_found(db):
    j = Sessions(db).journal
    with pytest.raises(NotFound):
        await j.read(OWNER, "nope")

    async def fn(tr):  # idempotent: creates a marker record only
        await j.ensure_conversation_tr(tr, OWNER, "empty")

    await db.transact(fn)
    page = await j.read(OWNER, "empty")
    assert page.events == [] and page.first_retained is None and page.next_cursor is None


async def test_coalescer_batches_deltas_without_reordering(db):
    j = Sessions(db).journal
    await j.emit_one(OWNER, "c", events.RUN_STARTED, {})
    clock = [0.0]
    co = Coalescer(j, OWNER, "c", clock=lambda: clock[0], max_deltas=100, max_bytes=10_000)
    text = []
    for i in range(1_000):
        part = 0 if i < 600 else 1
        tok = f"t{i} "
        text.append((part, tok))
        await co.add({"part": part, "delta": tok})
    await co.flush()
    assert co.flushes <= 12, co.flushes  # 1,000 deltas, ~10 commits, not 1,000
    page = await j.read(OWNER, "c", limit=1000)
    ups = [e for e in page.events if e.type == events.PART_UPDATED]
    got = [(e.data["part"], e.data["delta"]) for e in ups]
    # concatenated per part, in order, never reordered
    assert "".join(d for p, d in got if p == 0) == "".join(t for p, t in text if p == 0)
    assert "".join(d for p, d in got if p == 1) == "".join(t for p, t in text if p == 1)
    parts_in_order = [p for p, _ in got]
    assert parts_in_order == sorted(parts_in_order)


async def test_coalescer_drain_before_other_events_keeps_order_across_retries(db):
    j = Sessions(db).journal
    co = Coalescer(j, OWNER, "c", max_delay=1e9, max_deltas=1000)
    await co.add({"part": 0, "delta": "hel"})
    await co.add({"part": 0, "delta": "lo"})
    attempts = [0]

    async def fn(tr):  # guarded in the loop by its lease check; here: retried once on purpose
        attempts[0] += 1
        ref = await co.emit(tr, events.MESSAGE_ADDED, {"text": "hello"})
        if attempts[0] == 1:
            from kv import KVError
            raise KVError(1020)
        return ref

    await db.transact(fn)
    await co.flush()  # nothing left
    page = await j.read(OWNER, "c")
    assert [(e.type, e.data) for e in page.events] == [
        (events.PART_UPDATED, {"part": 0, "delta": "hello"}),
        (events.MESSAGE_ADDED, {"text": "hello"}),
    ]
    assert co.pending == 0


def test_hand_built_event_keys_are_tuple_layer_keys():
    import kv
    from kv.tuple import Versionstamp
    from sessions.journal import _position_of, _stamped_event_key
    from sessions.keyspace import SessionsKeyspace

    sub = SessionsKeyspace().events("r/s", "conv")
    for order in (0, 1, 258, 65_535):
        assert _stamped_event_key(sub.raw_prefix, order) == sub.pack_with_versionstamp((Versionstamp(user_version=order),))
    stamp = bytes(range(10))
    key = sub.pack((Versionstamp(stamp, 7),))
    assert _position_of(sub.raw_prefix, key) == stamp + (7).to_bytes(2, "big")
    assert kv.tuple.unpack(key[len(sub.raw_prefix):])[0].user_version == 7


async def test_follow_on_behind_continue_resumes_from_first_retained(db):
    j = Sessions(db, retention=5).journal
    cursors = [await j.emit_one(OWNER, "c", events.PART_UPDATED, {"i": i}) for i in range(12)]
    await j.trim(OWNER, "c")
    got = []
    async for e in j.follow(OWNER, "c", after=cursors[0], on_behind="continue"):
        got.append(e.data["i"])
        if len(got) == 5:
            break
    assert got == list(range(7, 12))


async def test_emit_many_tr_is_that_many_emits_in_order_with_one_count_bump(db):
    from sessions.codec import unpack_i64

    j = Sessions(db).journal
    items = [(events.MESSAGE_ADDED, {"i": 0}), (events.USAGE_UPDATED, {"i": 1}), (events.TOOL_STARTED, {"i": 2})]

    async def fn(tr):  # fresh conversation, a test without retries
        first = await j.emit(tr, OWNER, "c", events.RUN_STARTED, {"i": -1})
        return [first] + await j.emit_many_tr(tr, OWNER, "c", items)

    refs = await db.transact(fn)
    assert [r.order for r in refs] == [0, 1, 2, 3]
    page = await j.read(OWNER, "c")
    assert [(e.type, e.data["i"]) for e in page.events] == [(events.RUN_STARTED, -1)] + [(t, d["i"]) for t, d in items]
    assert [e.cursor for e in page.events] == [await r.cursor() for r in refs]
    emitted = await db.transact(lambda tr: tr.get(j.keys.emitted(OWNER.tag, "c")))
    assert unpack_i64(emitted) == 4
    assert await db.transact(lambda tr: j.emit_many_tr(tr, OWNER, "c", [])) == []
    with pytest.raises(ValueError):  # validated before anything is written
        await db.transact(lambda tr: j.emit_many_tr(tr, OWNER, "c2", [(events.RUN_STARTED, {}), ("made.up", {})]))
    with pytest.raises(NotFound):
        await j.read(OWNER, "c2")


async def test_emit_many_tr_without_refs_writes_the_same_events(db):
    """refs=False (a caller that wants no positions back) changes nothing stored: the same
    events in the same order after the same earlier ones, the same count."""
    from sessions.codec import unpack_i64

    j = Sessions(db).journal
    items = [(events.MESSAGE_ADDED, {"i": 0}), (events.TOOL_STARTED, {"i": 1})]
    for conv, refs in (("with", True), ("without", False)):
        async def fn(tr, conv=conv, refs=refs):  # fresh conversations, a test without retries
            await j.emit(tr, OWNER, conv, events.RUN_STARTED, {"i": -1})
            return await j.emit_many_tr(tr, OWNER, conv, items, refs=refs)

        out = await db.transact(fn)
        assert len(out) == (2 if refs else 0)
    pages = [await j.read(OWNER, c) for c in ("with", "without")]
    assert [[(e.type, e.data) for e in p.events] for p in pages][0] == [(e.type, e.data) for e in pages[1].events]
    assert [e.cursor[-4:] for e in pages[0].events] == [e.cursor[-4:] for e in pages[1].events]  # orders 0, 1, 2
    for c in ("with", "without"):
        assert unpack_i64(await db.transact(lambda tr, c=c: tr.get(j.keys.emitted(OWNER.tag, c)))) == 3


async def test_a_conversation_noted_committed_is_not_looked_up_again_by_emits(db):
    j = Sessions(db).journal
    await j.emit_one(OWNER, "c", events.RUN_QUEUED, {})
    key = j.keys.conversation(OWNER.tag, "c")
    reads = []

    class SnapshotSpy:  # tr.snapshot, recording the keys read through its get
        def __init__(self, view):
            self._view = view

        def __getattr__(self, name):
            return getattr(self._view, name)

        async def get(self, k):
            reads.append(k)
            return await self._view.get(k)

    class TransactionSpy:  # tr as the journal sees it (every backend's: nothing patched on tr)
        def __init__(self, tr):
            self._tr = tr

        def __getattr__(self, name):
            return getattr(self._tr, name)

        @property
        def snapshot(self):
            return SnapshotSpy(self._tr.snapshot)

    async def fn(tr):  # a test without retries
        await j.emit(TransactionSpy(tr), OWNER, "c", events.RUN_STARTED, {})

    await db.transact(fn)
    assert reads == []  # (session 17, helper-62: no create-if-missing read at all now; the count's add makes it)
    j.note_committed(OWNER, "c")
    reads.clear()
    await db.transact(fn)
    assert reads == []
    assert [e.type for e in (await j.read(OWNER, "c")).events] == [events.RUN_QUEUED, events.RUN_STARTED, events.RUN_STARTED]
