"""Session 19: a Ledger encodes its records and its submits' requests with a cbor2 encoder of
its own (sessions.codec.own_dumps), not cbor2.dumps: the stored bytes must stay cbor2.dumps'
(and the request body cbor2's canonical encoding) byte for byte, and an encoding that fails
must leave the next one whole."""

from __future__ import annotations

import cbor2
import pytest

from ledger import Ledger, completed, encode_request
from ledger.runs import _SUB_HEAD
from sessions import Owner, Sessions

OWNER = Owner("test", "u1")


def make(db, clock):
    s = Sessions(db, clock=clock)
    return s, Ledger(db, journal=s.journal, clock=clock)


async def _raw(db, key):
    return await db.transact(lambda tr: tr.get(key))  # read-only


async def test_every_record_a_ledger_writes_is_cbor2s_encoding(db, clock):
    s, L = make(db, clock)
    delivery = {"role": "user", "content": [{"type": "text", "text": "hé " * 30, "z": [1, None, True]}],
                "b": b"\x00\xff", "n": -2**70}
    a = await L.submit("a", delivery, {"type": "object", "required": ["x"]}, owner=OWNER, conversation="c",
                       limits={"max_output_tokens": 7})
    b = await L.submit("b", {"x": 1.5}, None, owner=OWNER, conversation="c")
    keys = [L.keys.run(a.run_id), L.keys.run(b.run_id), L.keys.conversation_state(OWNER.tag, "c")]
    for key in keys:
        raw = await _raw(db, key)
        assert raw == cbor2.dumps(cbor2.loads(raw))
    for sid, d, schema in (("a", delivery, {"type": "object", "required": ["x"]}), ("b", {"x": 1.5}, None)):
        raw = await _raw(db, L.keys.submission(OWNER.tag, sid))
        rec = cbor2.loads(raw[_SUB_HEAD:])
        assert raw[_SUB_HEAD:] == cbor2.dumps(rec)
        assert rec["body"] == cbor2.dumps({"delivery": d, "result_schema": schema}, canonical=True)
        assert rec["hash"] == encode_request(d, schema)[1]
    lease = await L.claim("w", lease_seconds=10)
    assert await _raw(db, L.keys.lease(lease.run_id)) == cbor2.dumps(cbor2.loads(await _raw(db, L.keys.lease(lease.run_id))))
    await L.settle(lease, completed({"answer": [1, 2.25, "x"]}))
    raw = await _raw(db, L.keys.run(a.run_id))
    run = cbor2.loads(raw)
    assert raw == cbor2.dumps(run) and run["out"] == cbor2.dumps(completed({"answer": [1, 2.25, "x"]}))
    assert (await L.get_run(a.run_id)).outcome["result"] == {"answer": [1, 2.25, "x"]}


async def test_an_encoding_that_fails_leaves_the_next_one_whole(db, clock):
    s, L = make(db, clock)
    a = await L.submit("a", {"x": 1}, None, owner=OWNER, conversation="c")
    lease = await L.claim("w", lease_seconds=10)
    with pytest.raises(Exception):
        await L.settle(lease, completed({"bad": object()}))  # cbor2 cannot encode it
    with pytest.raises(Exception):
        await L.submit("bad", {"x": object()}, None, owner=OWNER, conversation="c")
    await L.settle(lease, completed("ok"))
    raw = await _raw(db, L.keys.run(a.run_id))
    assert raw == cbor2.dumps(cbor2.loads(raw))
    assert (await L.get_run(a.run_id)).outcome["result"] == "ok"
    b = await L.submit("b", {"y": [1, {"k": "v"}]}, None, owner=OWNER, conversation="c")
    raw = await _raw(db, L.keys.submission(OWNER.tag, "b"))
    assert cbor2.loads(raw[_SUB_HEAD:])["body"] == cbor2.dumps(
        {"delivery": {"y": [1, {"k": "v"}]}, "result_schema": None}, canonical=True)
    assert (await L.get_request(b.run_id)) == ({"y": [1, {"k": "v"}]}, None)
