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

# What encode_request orders in Python before an ordinary encoding (dicts with str keys, ASCII
# or not, of any length, lists, tuples, str, int of any size, bool, bytes, None) and what it
# leaves to cbor2's canonical mode (floats, sets, non-str keys, dict subclasses) — mixed.
_key = st.text(max_size=30) | st.sampled_from(["a", "b", "aa", "ab", "ba", "é", "z", "role", "type", "text"])
_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63) | st.text() | st.binary(max_size=4),
    lambda inner: (st.lists(inner, max_size=5) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(_key, inner, max_size=6)),
    max_leaves=30)
_other = st.recursive(
    _plain | st.floats() | st.frozensets(st.integers(), max_size=3),
    lambda inner: (st.lists(inner, max_size=4) | st.dictionaries(_key, inner, max_size=4)
                   | st.dictionaries(st.integers() | st.text(max_size=3), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(delivery=_json, schema=_json)
def test_the_request_body_is_the_canonical_cbor_of_the_whole_map(delivery, schema):
    """encode_request builds the outer map itself: byte for byte cbor2's canonical encoding."""
    body, digest = encode_request(delivery, schema)
    assert body == cbor2.dumps({"delivery": delivery, "result_schema": schema}, canonical=True)
    assert digest == canonical_hash({"delivery": delivery, "result_schema": schema})


@settings(max_examples=500, deadline=None)
@given(delivery=_plain | _other, schema=st.none() | _plain | _other)
def test_keys_put_in_canonical_order_in_python_give_the_same_bytes(delivery, schema):
    """The body's values are ordered in Python and encoded by cbor2's ordinary mode when they
    are JSON-like (ledger.runs._canonical_dumps): still byte for byte the canonical encoding,
    for non-ASCII keys, keys of one length, tuples and big ints, and for anything it hands to
    cbor2's canonical mode instead (floats, sets, non-str keys) wherever they are nested."""
    body, digest = encode_request(delivery, schema)
    assert body == cbor2.dumps({"delivery": delivery, "result_schema": schema}, canonical=True)
    assert digest == canonical_hash({"delivery": delivery, "result_schema": schema})


def test_a_request_with_a_float_or_an_ordered_dict_is_still_canonical():
    from collections import OrderedDict
    for value in ({"b": 1.5, "a": 1}, OrderedDict([("bb", 1), ("a", 2)]), [{"z": {"y": 0.1, "x": "s"}}],
                  {"key": {3, 1, 2}}, {1: "int key", "a": "str key"}):
        assert encode_request(value, value)[0] == cbor2.dumps(
            {"delivery": value, "result_schema": value}, canonical=True), value


def test_index_and_queue_keys_are_the_tuple_encoding_of_their_parts():
    """ready/expiry index keys (microsecond timestamps), FIFO and history keys (sequence
    numbers past 255) and outcome chunk keys pack their int part by hand (sessions.codec.pack_uint): the same
    bytes as the tuple layer, up to and past the 8-byte limit and 2**64 - 1 (a bignum)."""
    import kv
    from ledger.keyspace import LedgerKeyspace

    root = kv.Subspace((b"root",))
    keys, base = LedgerKeyspace(root), root["l"]
    ints = [0, 1, 23, 255, 256, 65_535, 65_536, 1_764_512_345_123_456, 2**56 - 1, 2**56,
            2**64 - 2, 2**64 - 1, 2**64, 2**70, -1, -300]
    for n in ints:
        for run_id in ("r1", "x\x00y", "é"):
            assert keys.ready(n, run_id) == base.pack(("rd", n, run_id)), n
            assert keys.expiry(n, run_id) == base.pack(("lx", n, run_id)), n
        if n >= 0:
            fifo, history = keys.fifo_and_history("realm/subject", "c", n)
            assert fifo == keys.fifo("realm/subject", "c", n) == base.pack(("o", "realm/subject", "q", "c", n))
            assert history == keys.history("realm/subject", "c", n) == base.pack(("o", "realm/subject", "h", "c", n))
    for i in (0, 1, 300):
        assert keys.outcome_chunk("r1", i) == keys.outcome("r1").pack((i,)) == base.pack(("out", "r1", i))
    assert keys.signal() == base.pack(("sig",))
    assert keys.ready_range() == base.range(("rd",)) and keys.expiry_range() == base.range(("lx",))
    assert keys.unpack(keys.ready(2**64 - 1, "r")) == ("rd", 2**64 - 1, "r")
