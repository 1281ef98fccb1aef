"""A submission's arguments are checked once, before its transaction (ledger.runs._checked_submission).

``submit`` and ``submit_and_claim`` check them before ``db.transact`` and call the
transaction body positionally; ``submit_tr`` checks them itself. Whichever entry point, a bad
argument is a ValueError and nothing is written: no run, no journal event, no submission
(the same id then submits normally). And a good submit through each entry point stores the
same request (body and hash) and acknowledges the same way.
"""

from __future__ import annotations

import pytest

from ledger import QUEUED, RUNNING, Ledger, encode_request
from ledger.runs import MAX_MAX_ATTEMPTS, MAX_REQUEST_BYTES
from sessions import Owner, Sessions
from sessions.errors import NotFound

OWNER = Owner("test", "args")

BAD = [
    ("empty submission id", dict(submission_id="")),
    ("submission id too long", dict(submission_id="x" * 513)),
    ("empty conversation", dict(conversation="")),
    ("unknown policy", dict(policy="sometimes")),
    ("max_attempts 0", dict(max_attempts=0)),
    ("max_attempts too many", dict(max_attempts=MAX_MAX_ATTEMPTS + 1)),
    ("negative ceiling", dict(limits={"max_total_tokens": -1})),
    ("owner with a slash", dict(owner="a/b/c")),
    ("request too large", dict(delivery={"text": "x" * (MAX_REQUEST_BYTES + 1)})),
]


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _call(L, how, *, submission_id="s1", delivery=None, owner=OWNER, conversation="c",
                policy="queue", limits=None, max_attempts=10):
    delivery = {"text": "hi"} if delivery is None else delivery
    if how == "submit":
        return await L.submit(submission_id, delivery, None, owner=owner, conversation=conversation,
                              policy=policy, limits=limits, max_attempts=max_attempts)
    if how == "submit_and_claim":
        ack, _ = await L.submit_and_claim(submission_id, delivery, None, owner=owner, conversation=conversation,
                                          worker_id="w", policy=policy, limits=limits,
                                          max_attempts=max_attempts)
        return ack

    async def fn(tr):  # guarded: submit_tr reads the submission record first
        return await L.submit_tr(tr, submission_id, delivery, None, owner=owner, conversation=conversation,
                                 policy=policy, limits=limits, max_attempts=max_attempts)

    pending = await L.db.transact(fn)
    return await pending.result()


@pytest.mark.parametrize("how", ["submit", "submit_and_claim", "submit_tr"])
@pytest.mark.parametrize("name,bad", BAD, ids=[b[0] for b in BAD])
async def test_a_bad_argument_is_refused_and_nothing_is_written(db, clock, how, name, bad):
    if name == "empty submission id" and how != "submit_tr":
        pytest.skip("submit and submit_and_claim make an id for an empty one")
    s, L = make(db, clock)
    with pytest.raises(ValueError):
        await _call(L, how, **bad)
    assert await L.list_runs(OWNER, "c") == []
    with pytest.raises(NotFound):  # not even the conversation's journal record
        await s.journal.read(OWNER, "c")
    # the id was not taken: the same id with good arguments makes the run
    ack = await _call(L, how)
    assert ack.created and ack.status in (QUEUED, RUNNING)
    assert [r.id for r in await L.list_runs(OWNER, "c")] == [ack.run_id]


@pytest.mark.parametrize("how", ["submit", "submit_and_claim", "submit_tr"])
async def test_every_entry_point_stores_the_same_request_and_is_idempotent(db, clock, how):
    s, L = make(db, clock)
    delivery = {"role": "user", "content": [{"type": "text", "text": "hello"}], "z": 1, "aa": [2, {"b": 3, "a": 4}]}
    ack = await _call(L, how, delivery=delivery)
    assert await L.get_request(ack.run_id, owner=OWNER) == (delivery, None)
    again = await _call(L, how, delivery=delivery)
    assert (again.run_id, again.created) == (ack.run_id, False)
    assert again.cursor == ack.cursor
    # the stored hash is encode_request's: the same delivery re-ordered is the same request,
    # a different one is a conflict
    reordered = dict(reversed(list(delivery.items())))
    assert encode_request(reordered, None) == encode_request(delivery, None)
    assert (await _call(L, how, delivery=reordered)).run_id == ack.run_id
    from ledger import SubmissionConflict
    with pytest.raises(SubmissionConflict):
        await _call(L, how, delivery={**delivery, "z": 2})
    assert len(await L.list_runs(OWNER, "c")) == 1


def test_key_order_remembered_per_shape_gives_the_canonical_bytes():
    """ledger.runs remembers a map shape's canonical key order (_KEY_ORDER): maps of one shape
    with other values, shapes that differ only in insertion order, a str-subclass key in a
    remembered shape, a map past _KEY_ORDER_KEYS keys, and the memo's clearing when full all
    still encode byte for byte as cbor2's canonical mode."""
    import cbor2

    from ledger import runs

    class S(str):
        pass

    def same(value):
        body, _ = encode_request(value, None)
        assert body == cbor2.dumps({"delivery": value, "result_schema": None}, canonical=True), value

    for i in range(3):
        same({"role": "user", "content": [{"type": "text", "text": f"hi {i}"}]})
        same({"content": [{"text": f"hi {i}", "type": "text"}], "role": "user"})
    same({S("role"): "user", "content": []})  # the shape ("role", "content") is remembered
    same({f"k{i}": i for i in range(runs._KEY_ORDER_KEYS + 5)})
    same({"é": 1, "z": 2, "ab": 3})
    for i in range(runs._KEY_ORDER_SIZE + 10):
        same({f"a{i}": 1, "b": [i]})
    assert 0 < len(runs._KEY_ORDER) <= runs._KEY_ORDER_SIZE
