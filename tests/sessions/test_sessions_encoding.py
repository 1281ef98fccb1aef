"""Stored bytes that are built by hand for speed equal what the plain encoder writes.

The journal builds an event's value as its parts' encodings concatenated (not one
``dumps([type, data, ts, eid])``): readers, other processes and earlier data depend on the
bytes, so they must be exactly cbor2's.
"""

from __future__ import annotations

import cbor2
import pytest

from sessions import Owner, Sessions, events
from sessions.codec import Encoded, cbor_uint, loads

OWNER = Owner("test", "u1")

DATAS = [
    None, 0, -1, 2**63, 1.5, 0.1, float("inf"), "", "héllo", b"\x00\xff", True, [], (), {},
    {"run_id": "r", "seq": 3, "role": "assistant",
     "message": {"role": "assistant", "content": [{"type": "tool_call", "id": "c1", "name": "noop", "arguments": {}}],
                 "usage": {"input_tokens": 12, "output_tokens": 3}}},
    {"nested": [[1, [2, {"x": None}]], {"y": [b"z"]}]},
]


async def test_event_values_are_the_bytes_of_one_cbor_array(db):
    j = Sessions(db).journal
    ts = [1_700_000_000.25]
    j.clock = lambda: ts[0]
    types = sorted(events.EVENT_TYPES)
    items = [(types[i % len(types)], d) for i, d in enumerate(DATAS)]
    for eid, ts[0] in [(None, 1_700_000_000.25), ("an-eid", 1_700_000_000.25), (None, 0.0), (None, -0.0), (None, 5),
                       (None, float("inf")), (None, 1e300), (None, 2**70)]:
        conv = f"c-{eid}-{ts[0]}"
        await db.transact(lambda tr, conv=conv, eid=eid: j.emit_many_tr(tr, OWNER, conv, items, eid=eid, refs=False))
        sub = j.keys.events(OWNER.tag, conv)
        rows = await db.transact(lambda tr, sub=sub: tr.get_range(sub.range().start, sub.range().stop))
        assert [r.value for r in rows] == [cbor2.dumps([t, d, ts[0], eid]) for t, d in items]
        page = await j.read(OWNER, conv)
        assert [(e.type, e.ts, e.eid) for e in page.events] == [(t, ts[0], eid) for t, _ in items]
        assert [e.data for e in page.events] == [loads(cbor2.dumps(d)) for _, d in items]


async def test_an_unknown_type_or_unencodable_data_writes_nothing(db):
    j = Sessions(db).journal
    with pytest.raises(ValueError):
        await db.transact(lambda tr: j.emit_many_tr(tr, OWNER, "c", [(events.RUN_QUEUED, {}), ("made.up", {})]))
    with pytest.raises(cbor2.CBOREncodeError):
        await db.transact(lambda tr: j.emit_many_tr(tr, OWNER, "c", [(events.RUN_QUEUED, {}), (events.RUN_STARTED, object())]))
    sub = j.keys.events(OWNER.tag, "c")
    assert await db.transact(lambda tr: tr.get_range(sub.range().start, sub.range().stop)) == []


def test_cbor_uint_is_cbor2s_encoding():
    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 2**70]
    for n in edges + list(range(0, 70_000, 7)):
        assert cbor_uint(n) == cbor2.dumps(n), n


async def test_encoded_data_is_stored_as_its_bytes(db):
    j = Sessions(db).journal
    data = {"run_id": "r", "seq": 300, "message": {"role": "user", "content": [{"type": "text", "text": "hi"}]}}
    await db.transact(lambda tr: j.emit_many_tr(tr, OWNER, "c", [(events.MESSAGE_ADDED, data),
                                                                  (events.MESSAGE_ADDED, Encoded(cbor2.dumps(data)))]))
    sub = j.keys.events(OWNER.tag, "c")
    rows = await db.transact(lambda tr: tr.get_range(sub.range().start, sub.range().stop))
    assert len(rows) == 2 and rows[0].value == rows[1].value
    assert [e.data for e in (await j.read(OWNER, "c")).events] == [data, data]
