"""The hand-written key packer equals FoundationDB's tuple layer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import kv
from sessions.codec import fastpack

parts = st.one_of(st.text(), st.binary(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                  st.booleans(), st.none())


@settings(max_examples=400, deadline=None)
@given(prefix=st.binary(max_size=8), t=st.lists(parts, max_size=5))
def test_fastpack_matches_kv_tuple(prefix, t):
    assert fastpack(prefix, tuple(t)) == kv.Subspace(raw_prefix=prefix).pack(tuple(t))


def test_fastpack_matches_kv_tuple_on_the_inline_paths():
    """Small ints and NUL-free strings are encoded inline (the hot path): every int around
    the one-byte boundary, strings with and without NUL, mixed with other types."""
    for i in list(range(-3, 300)) + [65535, 65536, 1 << 63, (1 << 64) - 1, 1 << 64]:
        for t in ((i,), ("o", i, "x"), (b"\x00b", i, "a\x00b", True, None)):
            assert fastpack(b"\x15p", t) == kv.Subspace(raw_prefix=b"\x15p").pack(t), t


def test_id_source_ids_are_unique_within_and_across_sources():
    from sessions.codec import id_source

    a, b = id_source(), id_source()
    ids = [a() for _ in range(10_000)] + [b() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_canonical_hash_ignores_key_order_and_sees_values():
    from sessions.codec import canonical_hash

    a = {"delivery": {"message": "hi", "agent": "x", "é": [1, {"b": 2, "a": 1}]}, "result_schema": None}
    b = {"result_schema": None, "delivery": {"é": [1, {"a": 1, "b": 2}], "agent": "x", "message": "hi"}}
    assert canonical_hash(a) == canonical_hash(b)
    assert canonical_hash(a) != canonical_hash({**a, "result_schema": {"type": "string"}})
    assert canonical_hash({"x": 1.5}) != canonical_hash({"x": 1})
