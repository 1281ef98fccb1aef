"""How a submission is stored: one versionstamped record holding its run.queued position and
(when small) its request; large requests in chunks; records of the older three-key layout
still read."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import QUEUED, Ledger, SubmissionConflict, encode_request
from ledger.runs import INLINE_REQUEST_BYTES
from sessions import Owner, Sessions, events
from sessions.codec import canonical_hash, dumps, write_chunks

OWNER = Owner("test", "u1")


def make(db):
    s = Sessions(db)
    return s, Ledger(db, journal=s.journal)


async def test_a_submission_is_one_key_with_its_position_and_request(db):
    s, L = make(db)
    ack = await L.submit("one", {"text": "hi"}, {"type": "object"}, owner=OWNER, conversation="c")
    sub = L.keys.submission(OWNER.tag, "one")
    body = L.keys.submission_body(OWNER.tag, "one").range()

    async def read(tr):
        return (await tr.get(sub), await tr.get(L.keys.submission_cursor(OWNER.tag, "one")),
                await tr.get_range(body.start, body.stop))

    raw, cursor_key, chunks = await db.transact(read)
    assert raw[:1] == b"\x01" and raw[1:13].hex() == ack.cursor  # the stamped position of run.queued
    assert cursor_key is None and chunks == []  # no separate cursor key, no chunk
    page = await s.journal.read(OWNER, "c")
    assert [(e.cursor, e.type) for e in page.events] == [(ack.cursor, events.RUN_QUEUED)]
    again = await L.submit("one", {"text": "hi"}, {"type": "object"}, owner=OWNER, conversation="c")
    assert (again.run_id, again.cursor, again.created, again.status) == (ack.run_id, ack.cursor, False, QUEUED)
    assert await L.get_request(ack.run_id) == ({"text": "hi"}, {"type": "object"})
    lease = await L.claim("w")
    assert await db.transact(lambda tr: L.request_tr(tr, lease)) == ({"text": "hi"}, {"type": "object"})


async def test_a_request_over_the_inline_size_goes_to_chunks_and_reads_back(db):
    _, L = make(db)
    big = {"text": "x" * (INLINE_REQUEST_BYTES + 10)}
    ack = await L.submit("big", big, None, owner=OWNER, conversation="c")
    body = L.keys.submission_body(OWNER.tag, "big").range()
    chunks = await db.transact(lambda tr: tr.get_range(body.start, body.stop))
    assert len(chunks) == 1 and len(chunks[0].value) > INLINE_REQUEST_BYTES
    assert await L.get_request(ack.run_id) == (big, None)
    lease = await L.claim("w")
    assert await db.transact(lambda tr: L.request_tr(tr, lease)) == (big, None)
    again = await L.submit("big", big, None, owner=OWNER, conversation="c")
    assert (again.run_id, again.cursor, again.created) == (ack.run_id, ack.cursor, False)
    with pytest.raises(SubmissionConflict):
        await L.submit("big", {"text": "y"}, None, owner=OWNER, conversation="c")


async def test_a_record_of_the_older_layout_is_still_read(db):
    """Before: the record a bare CBOR map, its position under "sbc", its request in chunks."""
    _, L = make(db)
    ack = await L.submit("new", {"text": "hi"}, None, owner=OWNER, conversation="c")
    body, digest = encode_request({"text": "old"}, None)
    position = bytes(range(12))

    async def write_old(tr):  # idempotent: fixed values
        tr.set(L.keys.submission(OWNER.tag, "old"), dumps({
            "id": "old", "owner": OWNER.tag, "conversation": "c", "hash": digest, "attempt": 0,
            "created": 1.0, "run_id": ack.run_id, "policy": "queue"}))
        write_chunks(tr, L.keys.submission_body(OWNER.tag, "old"), body)
        tr.set(L.keys.submission_cursor(OWNER.tag, "old"), position)

    await db.transact(write_old)
    again = await L.submit("old", {"text": "old"}, None, owner=OWNER, conversation="c")
    assert (again.run_id, again.cursor, again.created) == (ack.run_id, position.hex(), False)
    assert await db.transact(lambda tr: L._request(tr, OWNER.tag, "old")) == {
        "delivery": {"text": "old"}, "result_schema": None}
    with pytest.raises(SubmissionConflict):
        await L.submit("old", {"text": "other"}, None, owner=OWNER, conversation="c")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(delivery=_json, schema=_json)
def test_the_request_body_is_the_canonical_cbor_of_the_whole_map(delivery, schema):
    """encode_request builds the outer map itself: byte for byte cbor2's canonical encoding."""
    body, digest = encode_request(delivery, schema)
    assert body == cbor2.dumps({"delivery": delivery, "result_schema": schema}, canonical=True)
    assert digest == canonical_hash({"delivery": delivery, "result_schema": schema})
