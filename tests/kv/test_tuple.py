"""kv.tuple: FoundationDB's tuple encoding, byte for byte, without libfdb_c.

The reference for Versionstamp packing is FoundationDB's own ``fdb.tuple``
code run with a stand-in ``fdb.impl`` (the only thing it touches libfdb_c
for is an ``isinstance(tr_version, fdb.impl.Value)`` test), plus encodings
written out by hand from FoundationDB's design/tuple.md.
"""

from __future__ import annotations

import math
import struct
import types
import uuid

import fdb
import fdb.tuple as fdbt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv.tuple as kt
from kv.tuple import Subspace, Versionstamp


@pytest.fixture
def fdb_reference(monkeypatch):
    """fdb.tuple itself, able to pack Versionstamps (a dummy fdb.impl.Value)."""

    class _NotAValue:  # nothing is an instance of it
        pass

    monkeypatch.setattr(fdb, "impl", types.SimpleNamespace(Value=_NotAValue), raising=False)
    assert not fdb.is_api_version_selected()  # so fdb uses the 4-byte offset (API >= 520)
    return fdbt


def test_plain_import_of_fdb_tuple_cannot_pack_versionstamps():
    # Why kv.tuple exists: without libfdb_c FoundationDB's pack fails on any stamp.
    if hasattr(fdb, "impl"):
        pytest.skip("fdb.impl is loaded in this process")
    with pytest.raises(AttributeError):
        fdbt.pack((Versionstamp(b"\x00" * 10, 1),))
    assert kt.pack((Versionstamp(b"\x00" * 10, 1),)) == b"\x33" + b"\x00" * 10 + b"\x00\x01"


# Known encodings (FoundationDB design/tuple.md and hand-derived from it).
KNOWN = [
    ((b"foo\x00bar",), bytes.fromhex("01666f6f00ff62617200")),
    (("F\u00d4O\u0000bar",), bytes.fromhex("0246c3944f00ff62617200")),
    (((b"foo\x00bar", None, ()),), bytes.fromhex("0501666f6f00ff6261720000ff050000")),
    ((-5551212,), bytes.fromhex("11ab4b93")),
    ((fdbt.SingleFloat(-42.0),), bytes.fromhex("203dd7ffff")),
    ((0,), b"\x14"),
    ((None,), b"\x00"),
    ((True, False), b"\x27\x26"),
    ((Versionstamp(b"\xaa" * 10, 0x1234),), b"\x33" + b"\xaa" * 10 + b"\x12\x34"),
    (
        (1, (Versionstamp(b"\x01" * 10, 0), None)),
        b"\x15\x01" + b"\x05" + b"\x33" + b"\x01" * 10 + b"\x00\x00" + b"\x00\xff" + b"\x00",
    ),
]


@pytest.mark.parametrize("t,expected", KNOWN)
def test_known_encodings(t, expected):
    assert kt.pack(t) == expected
    assert fdbt.unpack(expected) == t


def test_pack_with_versionstamp_known_bytes():
    got = kt.pack_with_versionstamp(("foo", Versionstamp.incomplete(7)))
    assert got == b"\x02foo\x00" + b"\x33" + b"\xff" * 10 + b"\x00\x07" + struct.pack("<I", 6)
    got = kt.pack_with_versionstamp(("a", (1, Versionstamp.incomplete(5)), 2), prefix=b"P")
    body, off = got[:-4], struct.unpack("<I", got[-4:])[0]
    assert off == 8 and body[off : off + 10] == b"\xff" * 10
    assert fdbt.unpack(body, prefix_len=1) == ("a", (1, Versionstamp.incomplete(5)), 2)


def test_pack_with_versionstamp_errors():
    with pytest.raises(ValueError, match="No incomplete"):
        kt.pack_with_versionstamp(("x", 1))
    with pytest.raises(ValueError, match="Multiple"):
        kt.pack_with_versionstamp((Versionstamp.incomplete(), (Versionstamp.incomplete(1),)))
    with pytest.raises(ValueError, match="Incomplete versionstamp"):
        kt.pack((Versionstamp.incomplete(),))
    with pytest.raises(ValueError, match="Incomplete versionstamp"):
        kt.range(((Versionstamp.incomplete(),),))


def test_complete_sorts_before_incomplete_and_by_version():
    a = kt.pack((Versionstamp(b"\x00" * 9 + b"\x01", 5),))
    b = kt.pack((Versionstamp(b"\x00" * 9 + b"\x02", 0),))
    inc = kt.pack_with_versionstamp((Versionstamp.incomplete(0),))[:-4]
    assert a < b < inc


# --- property tests against FoundationDB's own encoder -------------------

_stamps = st.builds(
    Versionstamp, st.binary(min_size=10, max_size=10), st.integers(0, 0xFFFF)
)
_scalars = st.one_of(
    st.none(),
    st.binary(max_size=12),
    st.text(max_size=8),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.booleans(),
    st.uuids(),
    _stamps,
)
_elements = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=10)
_tuples = st.lists(_elements, max_size=5).map(tuple)


def _insert_incomplete(t, path, user):
    """Put one incomplete stamp into t at a position chosen by `path`."""
    items = list(t)
    idx = path[0] % (len(items) + 1)
    if len(path) > 1 and idx < len(items) and isinstance(items[idx], tuple):
        items[idx] = _insert_incomplete(items[idx], path[1:], user)
    else:
        items.insert(idx, Versionstamp.incomplete(user))
    return tuple(items)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=_tuples, prefix=st.binary(max_size=5))
def test_pack_equals_fdb(fdb_reference, t, prefix):
    ours = kt.pack(t, prefix=prefix)
    assert ours == fdb_reference.pack(t, prefix=prefix)
    back = fdbt.unpack(ours, prefix_len=len(prefix))
    assert kt.pack(back) == ours[len(prefix) :]
    assert kt.range(t) == fdb_reference.range(t)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t=_tuples,
    path=st.lists(st.integers(0, 10), min_size=1, max_size=4),
    user=st.integers(0, 0xFFFF),
    prefix=st.binary(max_size=5),
)
def test_pack_with_versionstamp_equals_fdb(fdb_reference, t, path, user, prefix):
    t = _insert_incomplete(t, path, user)
    ours = kt.pack_with_versionstamp(t, prefix=prefix)
    assert ours == fdb_reference.pack_with_versionstamp(t, prefix=prefix)
    body, off = ours[:-4], struct.unpack("<I", ours[-4:])[0]
    assert body[off : off + 10] == b"\xff" * 10
    # Completing the stamp in place gives the packing of the completed tuple.
    version = bytes(range(1, 11))
    filled = body[:off] + version + body[off + 10 :]
    assert kt.unpack(filled, prefix_len=len(prefix)) == _complete(t, version)
    assert kt.pack(_complete(t, version), prefix=prefix) == filled


def _complete(t, version):
    out = []
    for v in t:
        if isinstance(v, Versionstamp) and not v.is_complete():
            out.append(v.completed(version))
        elif isinstance(v, tuple):
            out.append(_complete(v, version))
        else:
            out.append(v)
    return tuple(out)


def test_floats_and_big_ints_round_trip():
    for v in [0.0, -0.0, math.inf, -math.inf, 1e300, -1e-300, 2**64, -(2**64), 2**200]:
        packed = kt.pack((v,))
        assert packed == fdbt.pack((v,))
        assert kt.pack(fdbt.unpack(packed)) == packed


# --- Subspace ------------------------------------------------------------

def test_subspace_matches_fdb_subspace():
    from fdb.subspace_impl import Subspace as FdbSubspace

    ours = Subspace(("app", 1), raw_prefix=b"\x01")
    theirs = FdbSubspace(("app", 1), rawPrefix=b"\x01")
    assert ours.key() == theirs.key()
    assert ours.pack(("x", 2)) == theirs.pack(("x", 2))
    assert ours["child"].key() == theirs["child"].key()
    assert ours.range(("x",)) == theirs.range(("x",))
    assert ours.range() == theirs.range()
    assert ours.unpack(ours.pack(("x", 2))) == ("x", 2)
    assert ours.contains(ours.pack((5,))) and not ours.contains(b"\x02other")
    with pytest.raises(ValueError):
        ours.unpack(b"\x02other")
    assert ours.subspace(("a", "b")) == ours["a"]["b"]
    assert ours.as_foundationdb_key() == ours.key()


def test_subspace_pack_with_versionstamp(fdb_reference):
    from fdb.subspace_impl import Subspace as FdbSubspace

    sub = Subspace(("log",))
    t = ("ev", Versionstamp.incomplete(3))
    got = sub.pack_with_versionstamp(t)
    assert got == FdbSubspace(("log",)).pack_with_versionstamp(t)
    off = struct.unpack("<I", got[-4:])[0]
    assert got[:off].startswith(sub.key()) and got[off : off + 10] == b"\xff" * 10
    # A completed key unpacks inside the subspace.
    done = got[:off] + b"\x00" * 9 + b"\x07" + got[off + 10 : -4]
    assert sub.unpack(done) == ("ev", Versionstamp(b"\x00" * 9 + b"\x07", 3))
    assert sub.range().start < done < sub.range().stop


def test_subspace_with_uuid_and_versionstamp_prefix():
    u = uuid.UUID(int=7)
    vs = Versionstamp(b"\x05" * 10, 9)
    sub = Subspace((u, vs))
    assert sub.unpack(sub.pack(("k",))) == ("k",)
    assert fdbt.unpack(sub.key()) == (u, vs)


# The fast path (None/bytes/str/int only) must give fdb.tuple's bytes exactly,
# including at every integer length boundary and around the 8-byte limit.
_boundary_ints = st.sampled_from(
    [0, 1, -1, 2**64 - 2, 2**64 - 1, 2**64, -(2**64 - 2), -(2**64 - 1), -(2**64)]
    + [s * ((1 << (8 * n)) + d) for n in range(1, 9) for d in (-1, 0, 1) for s in (1, -1)]
)
_simple = st.one_of(
    st.none(),
    st.binary(max_size=12),
    st.text(max_size=12),  # includes NUL and non-ASCII
    st.integers(-(2**66), 2**66),
    _boundary_ints,
)


@settings(max_examples=500, deadline=None)
@given(t=st.lists(_simple, max_size=6).map(tuple), prefix=st.binary(max_size=5))
def test_fast_pack_of_simple_tuples_equals_fdb(t, prefix):
    ours = kt.pack(t, prefix=prefix)
    assert ours == fdbt.pack(t, prefix=prefix)
    assert kt.unpack(ours, prefix_len=len(prefix)) == t
    assert Subspace(raw_prefix=prefix).pack(t) == ours


def test_fast_pack_leaves_bool_and_subclasses_to_the_general_encoder():
    class Tag(str):
        pass

    for t in [(True,), (False, 1), (Tag("x"), 2), ("a", True)]:
        assert kt.pack(t) == fdbt.pack(t)
    assert kt.pack((True,)) != kt.pack((1,))  # bools are not ints in the tuple layer
