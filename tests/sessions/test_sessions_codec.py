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


def test_every_hot_key_is_the_tuple_encoding_of_its_documented_parts():
    """The sessions and ledger keyspaces build hot keys from cached packed prefixes: each
    must equal the tuple encoding of the parts their module docstrings list."""
    from ledger.keyspace import LedgerKeyspace
    from sessions.keyspace import SessionsKeyspace

    root = kv.Subspace((b"root",))
    s, L = SessionsKeyspace(root), LedgerKeyspace(root)
    sb, lb = root["s"], root["l"]
    for tag in ("realm/subject", "r\x00/s", "é/ü"):
        for x in ("abc", "x\x00y", "é" * 40, ""):
            assert s.conversation(tag, x) == sb.pack(("o", tag, "cv", x))
            assert s.events(tag, x).raw_prefix == sb.pack(("o", tag, "jn", x, "e"))
            assert s.emitted(tag, x) == sb.pack(("o", tag, "jn", x, "n"))
            assert s.trimmed(tag, x) == sb.pack(("o", tag, "jn", x, "t"))
            assert s.watermark(tag, x) == sb.pack(("o", tag, "jn", x, "w"))
            assert s.head(tag, x) == sb.pack(("o", tag, "ss", x, "h"))
            assert s.meta(tag, x) == sb.pack(("o", tag, "ss", x, "meta"))
            assert s.messages(tag, x).raw_prefix == sb.pack(("o", tag, "ss", x, "m"))
            assert s.session_listing(tag, x) == sb.pack(("o", tag, "sl", x))
            assert L.submission(tag, x) == lb.pack(("o", tag, "sub", x))
            assert L.submission_body(tag, x).raw_prefix == lb.pack(("o", tag, "sbd", x))
            assert L.submission_cursor(tag, x) == lb.pack(("o", tag, "sbc", x))
            assert L.conversation_state(tag, x) == lb.pack(("o", tag, "cs", x))
            for seq in (0, 1, 255, 256, 70_000):
                assert L.fifo(tag, x, seq) == lb.pack(("o", tag, "q", x, seq))
                assert L.history(tag, x, seq) == lb.pack(("o", tag, "h", x, seq))
            assert L.run(x) == lb.pack(("run", x))
            assert L.outcome(x).raw_prefix == lb.pack(("out", x))
            assert L.lease(x) == lb.pack(("rl", x))
            assert L.cancel(x) == lb.pack(("cx", x))
            assert L.usage_step(x, tag) == lb.pack(("u", x, "s", tag))
            assert L.usage_total(x, tag) == lb.pack(("u", x, "t", tag))
