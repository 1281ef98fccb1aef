"""Transcripts: head-guarded appends, chunking, size refusal, forks (100,000 messages)."""

from __future__ import annotations

import pytest
import trio

from sessions import NotFound, Owner, SessionConflict, Sessions, TooLarge
from sessions.transcript import MAX_APPEND_BYTES

OWNER = Owner("test", "u1")


async def test_two_appenders_race_one_wins_history_contiguous(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    results: dict[str, object] = {}

    async def appender(name: str) -> None:
        try:
            results[name] = await t.append(OWNER, "s", [{"who": name, "i": i} for i in range(3)], expected_head=0)
        except SessionConflict as e:
            results[name] = e

    for _ in range(1):
        async with trio.open_nursery() as n:
            n.start_soon(appender, "a")
            n.start_soon(appender, "b")
    wins = [k for k, v in results.items() if v == 3]
    losses = [k for k, v in results.items() if isinstance(v, SessionConflict)]
    assert len(wins) == 1 and len(losses) == 1
    assert results[losses[0]].actual == 3
    msgs = (await t.read(OWNER, "s")).messages
    assert [m.seq for m in msgs] == [0, 1, 2]
    assert {m.data["who"] for m in msgs} == {wins[0]}


async def test_many_unguarded_appenders_never_interleave(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")

    async def appender(name: int) -> None:
        for _ in range(5):
            await t.append(OWNER, "s", [{"w": name, "k": k} for k in range(4)])

    async with trio.open_nursery() as n:
        for w in range(6):
            n.start_soon(appender, w)
    msgs = await t.read_all(OWNER, "s")
    assert [m.seq for m in msgs] == list(range(6 * 5 * 4))
    for i in range(0, len(msgs), 4):  # each append's 4 messages stay together, in order
        block = msgs[i:i + 4]
        assert len({m.data["w"] for m in block}) == 1
        assert [m.data["k"] for m in block] == [0, 1, 2, 3]


async def test_large_message_is_chunked_transparently(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    big = {"role": "tool", "content": "x" * 350_000, "blob": bytes(range(256)) * 1000}
    await t.append(OWNER, "s", [{"role": "user", "content": "hi"}, big, {"role": "assistant", "content": "ok"}])
    page = await t.read(OWNER, "s")
    assert [m.data for m in page.messages] == [{"role": "user", "content": "hi"}, big,
                                                {"role": "assistant", "content": "ok"}]
    assert (await t.read(OWNER, "s", start=1, limit=1)).messages[0].data == big


async def test_append_past_transaction_limit_refused_before_writing(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    await t.append(OWNER, "s", [{"n": 0}])
    huge = [{"content": "y" * 1_000_000} for _ in range(MAX_APPEND_BYTES // 1_000_000 + 1)]
    with pytest.raises(TooLarge):
        await t.append(OWNER, "s", huge)
    assert await t.head(OWNER, "s") == 1
    assert [m.data for m in (await t.read(OWNER, "s")).messages] == [{"n": 0}]


async def test_expected_head_conflict_and_paging(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    for i in range(0, 50, 10):
        await t.append(OWNER, "s", [{"i": j} for j in range(i, i + 10)], expected_head=i)
    with pytest.raises(SessionConflict):
        await t.append(OWNER, "s", [{"i": 0}], expected_head=10)
    p1 = await t.read(OWNER, "s", 0, 20)
    assert [m.seq for m in p1.messages] == list(range(20)) and p1.next_seq == 20 and p1.head == 50
    p3 = await t.read(OWNER, "s", 40, 20)
    assert [m.data["i"] for m in p3.messages] == list(range(40, 50)) and p3.next_seq is None


async def test_append_after_1021_is_applied_once(db, inject_1021):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    hooks = inject_1021(db, b"ss", n=1)
    assert await t.append(OWNER, "s", [{"n": 1}], expected_head=0) == 1
    assert hooks.injected == 1
    assert await t.head(OWNER, "s") == 1


async def test_composite_transaction_guarded_by_append_token(db, inject_1021):
    s = Sessions(db)
    t, j = s.transcripts, s.journal
    await t.create(OWNER, "s")
    token = b"turn-1"

    async def turn(tr):  # guarded: the append token says whether a previous attempt committed
        if await t.appended_tr(tr, OWNER, "s", token):
            return "already"
        await t.append_tr(tr, OWNER, "s", [{"role": "assistant", "content": "hi"}], expected_head=0, token=token)
        await j.emit(tr, OWNER, "s", "message.added", {"seq": 0})
        return "done"

    hooks = inject_1021(db, b"ss", n=1)
    assert await db.transact(turn) == "already"
    assert hooks.injected == 1
    assert await t.head(OWNER, "s") == 1
    assert len((await j.read(OWNER, "s")).events) == 1


async def _fill(t, sid: str, n: int, batch: int = 5_000) -> None:
    await t.create(OWNER, sid)
    for i in range(0, n, batch):
        await t.append(OWNER, sid, [{"i": j, "role": "user"} for j in range(i, min(n, i + batch))], expected_head=i)


@pytest.mark.parametrize("by_reference", [True, False])
async def test_fork_100k_all_or_nothing_for_concurrent_reader(db, by_reference):
    s = Sessions(db)
    t = s.transcripts
    n = 100_000
    await _fill(t, "parent", n)
    seen = {"missing": 0, "whole": 0}
    done = trio.Event()

    async def reader() -> None:
        while not done.is_set():
            try:
                info = await t.get(OWNER, "fork")
            except NotFound:
                seen["missing"] += 1
            else:
                assert info.head == n
                last = await t.read(OWNER, "fork", n - 3, 3)
                first = await t.read(OWNER, "fork", 0, 3)
                assert [m.data["i"] for m in first.messages + last.messages] == [0, 1, 2, n - 3, n - 2, n - 1]
                seen["whole"] += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(0)
        info = await t.fork(OWNER, "parent", n, new_session_id="fork", by_reference=by_reference)
        await trio.sleep(0.01)
        done.set()
    assert info.head == n and info.parent == "parent"
    assert seen["whole"] >= 1
    # The parent's later appends do not reach the fork.
    await t.append(OWNER, "parent", [{"i": "later"}])
    assert await t.head(OWNER, "fork") == n
    assert (await t.read(OWNER, "fork", n - 1, 5)).messages[-1].data["i"] == n - 1
    # And the fork's own appends do not reach the parent.
    await t.append(OWNER, "fork", [{"i": "fork-own"}], expected_head=n)
    assert (await t.read(OWNER, "fork", n, 5)).messages[0].data["i"] == "fork-own"
    assert (await t.read(OWNER, "parent", n, 5)).messages[0].data["i"] == "later"
    if not by_reference:
        msgs = await t.read_all(OWNER, "fork", page=5_000)
        assert [m.data["i"] for m in msgs[:n]] == list(range(n))


async def test_fork_of_fork_and_midpoint(db):
    t = Sessions(db).transcripts
    await _fill(t, "a", 30, batch=7)
    f1 = await t.fork(OWNER, "a", 20)
    await t.append(OWNER, f1.id, [{"i": "f1-20"}, {"i": "f1-21"}])
    f2 = await t.fork(OWNER, f1.id, 21)
    msgs = await t.read_all(OWNER, f2.id)
    assert [m.data["i"] for m in msgs] == list(range(20)) + ["f1-20"]
    with pytest.raises(ValueError):
        await t.fork(OWNER, "a", 31)
    f3 = await t.fork(OWNER, "a", 0)
    assert (await t.read(OWNER, f3.id)).messages == []


async def test_staging_fork_reads_as_missing_and_is_cleaned_up(db, clock):
    t = Sessions(db, clock=clock).transcripts
    await _fill(t, "p", 10)
    # Simulate a crash after the sentinel: write the staging head as the copy fork would.
    from sessions.codec import dumps

    async def sentinel(tr):  # idempotent: plain sets
        tr.set(t.keys.head(OWNER.tag, "half"), dumps({"owner": OWNER.tag, "n": 0, "base": 0, "seg": [],
                                                      "tok": None, "staging": True, "fork_of": ["p", 10],
                                                      "created_us": int(clock() * 1e6)}))
        tr.set(t.keys.staging_fork(int(clock() * 1e6), OWNER.tag, "half"), b"")
        tr.set(t.keys.messages(OWNER.tag, "half").pack((0, 0)), b"\xa0")

    await db.transact(sentinel)
    with pytest.raises(NotFound):
        await t.read(OWNER, "half")
    with pytest.raises(NotFound):
        await t.append(OWNER, "half", [{"x": 1}])
    assert await t.cleanup_staging(older_than=60) == 0
    clock.advance(120)
    assert await t.cleanup_staging(older_than=60) == 1
    with pytest.raises(NotFound):
        await t.get(OWNER, "half")
    # the id is free again, and a copy fork with that id completes
    info = await t.fork(OWNER, "p", 10, new_session_id="half", by_reference=False)
    assert info.head == 10
    assert [m.data["i"] for m in await t.read_all(OWNER, "half")] == list(range(10))


async def test_create_is_idempotent_and_lists(db):
    t = Sessions(db).transcripts
    a = await t.create(OWNER, "x", title="first")
    b = await t.create(OWNER, "x", title="ignored")
    assert a.id == b.id and b.title == "first"
    await t.create(OWNER, "y")
    assert await t.list(OWNER) == ["x", "y"]


async def test_append_with_create_makes_the_session_as_create_then_append_would(db):
    t = Sessions(db).transcripts
    with pytest.raises(NotFound):
        await db.transact(lambda tr: t.append_tr(tr, OWNER, "new", [{"i": 0}], expected_head=0))
    assert await db.transact(lambda tr: t.append_tr(tr, OWNER, "new", [{"i": 0}, {"i": 1}], expected_head=0,
                                                    create=True)) == 2
    await t.create(OWNER, "old")
    await t.append(OWNER, "old", [{"i": 0}, {"i": 1}])
    for sid in ("new", "old"):
        info = await t.get(OWNER, sid)
        assert (info.id, info.owner, info.head, info.parent) == (sid, OWNER.tag, 2, None) and info.created > 0
        assert [m.data for m in (await t.read(OWNER, sid)).messages] == [{"i": 0}, {"i": 1}]
    assert sorted(await t.list(OWNER)) == ["new", "old"]
    # an existing session: create=True appends as usual, guarded by the head
    assert await db.transact(lambda tr: t.append_tr(tr, OWNER, "new", [{"i": 2}], expected_head=2, create=True)) == 3
    with pytest.raises(SessionConflict):
        await db.transact(lambda tr: t.append_tr(tr, OWNER, "new", [{"i": 9}], expected_head=2, create=True))


async def test_read_tail_for_append_hands_the_head_to_the_append(db):
    """read_tail_for_append_tr: (None, head) for a new session, which the append then creates;
    (page, head) for an existing one, appended to without reading the head again, still
    guarded (a concurrent append conflicts); a HeadRead serves one append only."""
    t = Sessions(db).transcripts

    async def tail_then_append(tr, sid, msgs):
        page, head = await t.read_tail_for_append_tr(tr, OWNER, sid, 100)
        first = 0 if page is None else page.head
        n = await t.append_tr(tr, OWNER, sid, msgs, expected_head=first, create=page is None, head=head)
        return page, n

    page, n = await db.transact(lambda tr: tail_then_append(tr, "s", [{"i": 0}]))
    assert page is None and n == 1
    page, n = await db.transact(lambda tr: tail_then_append(tr, "s", [{"i": 1}, {"i": 2}]))
    assert [m.data for m in page.messages] == [{"i": 0}] and (page.head, n) == (1, 3)
    assert [m.data["i"] for m in (await t.read(OWNER, "s")).messages] == [0, 1, 2]
    info = await t.get(OWNER, "s")
    assert (info.head, info.owner) == (3, OWNER.tag)

    # without create, a missing session is NotFound as ever
    async def no_create(tr):
        page, head = await t.read_tail_for_append_tr(tr, OWNER, "missing", 100)
        assert page is None
        return await t.append_tr(tr, OWNER, "missing", [{"i": 0}], head=head)

    with pytest.raises(NotFound):
        await db.transact(no_create)

    # the head the append trusts was read in its transaction: a competing append conflicts it
    tr = db.create_transaction()
    page, head = await t.read_tail_for_append_tr(tr, OWNER, "s", 100)
    await t.append(OWNER, "s", [{"other": True}])
    await t.append_tr(tr, OWNER, "s", [{"mine": True}], expected_head=3, head=head)
    with pytest.raises(Exception) as e:
        await tr.commit()
    assert getattr(e.value, "code", None) == 1020
    assert [m.data for m in (await t.read(OWNER, "s", 3)).messages] == [{"other": True}]

    async def twice(tr):
        page, head = await t.read_tail_for_append_tr(tr, OWNER, "s", 100)
        await t.append_tr(tr, OWNER, "s", [{"a": 1}], head=head)
        await t.append_tr(tr, OWNER, "s", [{"a": 2}], head=head)

    with pytest.raises(AssertionError):
        await db.transact(twice)


async def test_an_append_sees_a_head_another_writer_moved(db):
    """The decoded-head memo is keyed by the stored bytes: a head written by another
    Transcripts (another process) is decoded afresh, so the guard sees it."""
    a, b = Sessions(db).transcripts, Sessions(db).transcripts
    await a.create(OWNER, "s")
    assert await a.append(OWNER, "s", [{"by": "a"}], expected_head=0) == 1
    assert await b.append(OWNER, "s", [{"by": "b"}], expected_head=1) == 2
    with pytest.raises(SessionConflict) as e:
        await a.append(OWNER, "s", [{"by": "a"}], expected_head=1)
    assert e.value.actual == 2
    assert await a.append(OWNER, "s", [{"by": "a"}], expected_head=2) == 3
    assert [m.data["by"] for m in (await b.read(OWNER, "s")).messages] == ["a", "b", "a"]
