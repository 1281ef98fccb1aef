"""Session 19: the commit pipeline carries the committing Transaction itself (kv.engine's
``Committing``), not a CommitRequest built per commit. The engine reads the attempt's own lists
and owns six slots of the transaction for the commit's course; the fault hooks still see
CommitRequests (made only when hooks are installed) and key their failures by them."""

from __future__ import annotations

import trio

import kv
from kv import KVError
from kv.engine import CommitRequest
from kvtest_helpers import open_backend, raises_code

_STAMPED_KEY = b"vs/" + b"\x00" * 10 + (3).to_bytes(4, "little")  # the stamp at offset 3


class Recorder(kv.FaultHooks):
    """Records what each hook call saw; fails the requests ``fail`` picks with 1021."""

    def __init__(self, fail=None) -> None:
        self.before: list[tuple[int, list]] = []
        self.after: list[tuple[int, list]] = []
        self.fail = fail

    def before_apply(self, version, batch) -> None:
        self.before.append((version, [(r.tag, r.order, r.mutations) for r in batch]))
        for r in batch:
            assert type(r) is CommitRequest and r.batch_version == version

    def after_apply(self, version, batch):
        self.after.append((version, [(r.tag, r.order, r.mutations, r.stamp) for r in batch]))
        if self.fail is None:
            return None
        out = {r: KVError(1021, "injected") for r in batch if self.fail(r)}
        out[object()] = KVError(1021, "not a request of the batch: ignored")
        return out


async def test_engine_is_handed_the_transaction(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    engine = db._engine
    handed = []
    orig = engine.commit

    async def spy(req):
        handed.append(req)
        await orig(req)

    engine.commit = spy
    tr = db.create_transaction()
    tr.set(b"a", b"1")
    mutations, points = tr._mutations, tr._write_points
    await tr.commit()
    seen = {}

    async def fn(tr):  # idempotent: a plain set
        tr.set(b"b", b"2")
        tr.set_versionstamped_key(_STAMPED_KEY, b"x")
        seen["tr"], seen["vs"] = tr, tr.get_versionstamp()

    await db.transact(fn)
    engine.commit = orig
    assert handed == [tr, seen["tr"]]
    for t in handed:
        assert t._commit_answered and t._commit_error is None
        assert t._parked_task is None and t._lead_batch is None
        assert t.get_committed_version() == t._batch_version > 0
    # the lists were read in place, and left as the transaction made them (the stamped key's
    # final key joins a copy of the write points, not the transaction's list)
    assert tr._mutations is mutations and mutations == [("set", b"a", b"1")]
    assert tr._write_points is points and points == [b"a"]
    assert seen["tr"]._write_points == [b"b"]
    stamp = await seen["vs"]
    assert stamp == seen["tr"]._batch_version.to_bytes(8, "big") + seen["tr"]._batch_order.to_bytes(2, "big")

    async def read(tr):  # read-only
        return await tr.get(b"vs/" + stamp)

    assert await db.transact(read) == b"x"


async def test_a_transaction_commits_again_after_on_error_and_reset(embedded, tmp_path):
    db = await open_backend(embedded, tmp_path / "data")
    tr = db.create_transaction()
    await tr.get(b"n")
    other = db.create_transaction()
    other.set(b"n", b"1")
    await other.commit()
    tr.set(b"n", b"2")
    with raises_code(1020):
        await tr.commit()
    assert tr._commit_error is not None  # (the engine's verdict, kept until the next commit)
    await tr.on_error(KVError(1020))
    assert await tr.get(b"n") == b"1"
    tr.set(b"n", b"3")
    await tr.commit()  # the engine's slots start afresh
    first = tr.get_committed_version()
    assert tr._commit_error is None and first == tr._batch_version
    tr.reset()
    tr.set(b"n", b"4")
    await tr.commit()
    assert tr.get_committed_version() > first


async def test_hooks_see_commit_requests_of_one_batch_in_order(tmp_path):
    """Concurrent commits on LMDB, none inline, so batches hold several transactions: each hook
    call sees the batch's transactions as CommitRequests in batch order, the same in
    before_apply and after_apply, with each one's stamp; a failure keyed by a request reaches
    that transaction only."""
    db = await kv.open(f"lmdb:{tmp_path}/data")
    engine = db._engine
    engine._can_apply_inline = lambda n: False
    hooks = Recorder(fail=lambda r: r.mutations[0][1] == b"k/05")
    engine.hooks = hooks
    outcome = {}
    stamps = {}

    async def one(i):
        tr = db.create_transaction()
        key = b"k/%02d" % i
        tr.set(key, b"v")
        tr.set_versionstamped_value(b"sv/%02d" % i, b"\x00" * 10 + (0).to_bytes(4, "little"))
        vs = tr.get_versionstamp()
        try:
            await tr.commit()
        except KVError as e:
            outcome[key] = e.code
            return
        outcome[key] = tr
        stamps[key] = await vs

    async with trio.open_nursery() as n:
        for i in range(16):
            n.start_soon(one, i)
    assert outcome.pop(b"k/05") == 1021
    assert len(outcome) == 15
    assert [v for v, _ in hooks.before] == [v for v, _ in hooks.after]
    assert max(len(b) for _, b in hooks.after) > 1  # (batches of several: what this test is about)
    seen = set()
    for (version, before), (_, after) in zip(hooks.before, hooks.after):
        assert [(t, o, m) for t, o, m, _ in after] == before
        for order, (t, o, m, stamp) in enumerate(after):
            assert o == order and t._batch_version == version and t._batch_order == order
            assert m is t._mutations
            assert stamp == version.to_bytes(8, "big") + order.to_bytes(2, "big")
            key = m[0][1]
            seen.add(key)
            if key != b"k/05":
                assert outcome[key] is t and stamps[key] == stamp
                assert t.get_committed_version() == version
    assert len(seen) == 16
    await db.close()
