"""kv.engine.new_commit_request, CommitRequest's one constructor (Transaction's commit builds
its request through it): every slot set, the caller's lists handed over."""

import trio

import kv
from kv.engine import CommitRequest, new_commit_request


def _slots(req):
    return {name: getattr(req, name) for name in CommitRequest.__slots__}


def test_slots_hold_the_arguments_and_the_result_defaults():
    args = (7, [(b"a", b"b")], [(b"c", b"d")], [("set", b"k", b"v")], [b"r"], [b"w"],
            [(0, "key", b"k", b"v", 0)], 42, object())
    made = new_commit_request(*args)
    assert type(made) is CommitRequest
    given = ("read_version", "read_ranges", "write_ranges", "mutations", "read_points", "write_points",
             "stamped", "size", "tag")
    assert _slots(made) == {**dict(zip(given, args)), "version": -1, "batch_version": -1, "order": -1,
                            "error": None, "done": False, "task": None, "lead": None}
    # the lists are the caller's own (handed over, not copied)
    for name, arg in zip(given, args):
        assert getattr(made, name) is arg
    short = new_commit_request(1, [], [], [])
    assert (short.read_points, short.write_points, short.stamped, short.size, short.tag) == ((), (), (), 0, None)
    assert made.stamp is None
    made.batch_version, made.order = 5, 3
    assert made.stamp == (5).to_bytes(8, "big") + (3).to_bytes(2, "big")
    assert repr(made).startswith("<CommitRequest rv=7 version=-1 order=3")


def test_every_slot_set():
    made = new_commit_request(1, [], [], [], (), (), (), 0, None)
    for name in CommitRequest.__slots__:
        getattr(made, name)  # AttributeError if the function forgot one


def test_commit_hands_engine_a_full_request(tmp_path):
    seen = []

    async def main():
        for url in ("memory:", f"lmdb:{tmp_path}/data"):
            db = await kv.open(url)
            engine = db._engine
            orig = engine.commit

            async def spy(req):
                seen.append((dict(_slots(req)), req))
                await orig(req)

            engine.commit = spy
            tr = db.create_transaction()
            tr.set(b"k", b"v")
            await tr.commit()

            async def fn(tr):
                tr.set(b"k2", b"v2")
            await db.transact(fn)
            engine.commit = orig
            before = [s for s, _ in seen[-2:]]
            for s, req in seen[-2:]:
                assert type(req) is CommitRequest
                assert req.done and req.error is None and req.version > 0
            for s in before:  # as new_commit_request leaves them, when handed to the engine
                assert (s["version"], s["batch_version"], s["order"], s["error"], s["done"], s["task"],
                        s["lead"]) == (-1, -1, -1, None, False, None, None)
                assert s["mutations"] and s["write_points"]
            assert await db.transact(lambda tr: tr.get(b"k2")) == b"v2"
            await db.close()

    trio.run(main)
    assert len(seen) == 4
