"""Session 18: ledger.runs._in_canonical_order checks a map's key classes once per remembered
shape (not per key per call), and Ledger.submit builds its acknowledgement inline. The request
body must stay cbor2's canonical encoding byte for byte, whatever the keys."""

from __future__ import annotations

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import encode_request
from ledger import runs


class S(str):
    pass


def _canonical(value, schema=None):
    return cbor2.dumps({"delivery": value, "result_schema": schema}, canonical=True)


def _same(value, schema=None):
    body, digest = encode_request(value, schema)
    assert body == _canonical(value, schema), value
    import hashlib
    assert digest == hashlib.sha256(body).hexdigest()


keys = st.one_of(st.text(max_size=6), st.sampled_from(["type", "text", "role", "content", "é", "ab"]),
                 st.builds(S, st.text(max_size=3)), st.integers(-3, 3), st.floats(allow_nan=False))
leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                   st.binary(max_size=4), st.floats(allow_nan=False))
values = st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(keys, kids, max_size=5)), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(values, st.one_of(st.none(), values))
def test_request_bodies_are_the_canonical_encoding(value, schema):
    try:
        expected = _canonical(value, schema)
    except (cbor2.CBOREncodeError, ValueError, TypeError):
        return  # (a value cbor2 itself refuses: not a request)
    body, _ = encode_request(value, schema)
    assert body == expected


def test_keys_of_other_classes_in_a_remembered_shape_and_out_of_it():
    runs._KEY_ORDER.clear()
    _same({"type": "text", "text": "a"})          # remembers ("type", "text")
    _same({S("type"): "text", S("text"): "b"})   # equal keys of a str subclass: found, same bytes
    runs._KEY_ORDER.clear()
    _same({S("type"): "text", S("text"): "b"})   # a shape first seen with subclass keys
    assert ("type", "text") not in runs._KEY_ORDER  # not remembered (checked per call instead)
    _same({"type": "text", "text": "c"})
    _same({1: "a", "b": 2})                       # a non-str key: cbor2's canonical mode
    _same({1.5: "a"})                             # one key, a float: canonical mode
    _same({S("k"): [1, {"z": 1, "y": 2}]})        # one subclass key
    _same({f"k{i}": i for i in range(runs._KEY_ORDER_KEYS + 3)} | {7: 0})  # past the memo's size


async def test_submit_acknowledges_as_its_pending_result_does(db, clock):
    from ledger import Ledger, QUEUED
    from sessions import Owner, Sessions

    owner = Owner("test", "u1")
    s = Sessions(db, clock=clock)
    L = Ledger(db, journal=s.journal, clock=clock)
    ack = await L.submit("a", {"x": 1}, None, owner=owner, conversation="c")
    again = await L.submit("a", {"x": 1}, None, owner=owner, conversation="c")
    assert ack.created and not again.created
    assert (ack.run_id, ack.cursor, ack.status) == (again.run_id, again.cursor, QUEUED)
    page = await s.journal.read(owner, "c", limit=10)
    assert page.events[0].cursor == ack.cursor
