"""FoundationDB's tuple layer, usable without libfdb_c, plus :class:`Subspace`.

Everything except Versionstamp *packing* is FoundationDB's own code
(``fdb.tuple``), re-exported so keys are byte-for-byte FoundationDB keys on
every backend.  The one thing we replace is the packing of tuples that hold a
:class:`Versionstamp`: ``fdb.tuple.Versionstamp.to_bytes`` tests
``isinstance(tr_version, fdb.impl.Value)``, and ``fdb.impl`` only exists after
``fdb.api_version()`` has loaded libfdb_c, so ``fdb.tuple.pack`` fails on any
Versionstamp (complete or not) on machines without the library.  Our encoder
walks the tuple itself, encodes Versionstamps (at any nesting depth) by hand
and hands every other element to ``fdb.tuple._encode`` unchanged, so the
bytes are FoundationDB's by construction.  The tests compare against
``fdb.tuple.unpack`` and against known encodings from the FoundationDB docs.

Fast paths: the keys surefoot itself builds hold only ``None``, ``bytes``,
``str`` and ``int`` (every layer packs several per transaction), and
``fdb.tuple`` spends several µs a key dispatching through its general
encoder. ``pack`` encodes exactly those four types directly, with the
encodings of recently seen strings cached (the same owner tags,
conversation ids and record names recur in every key), and hands any other
tuple, whole, to the general path. Same bytes: the tests compare with
``fdb.tuple`` on generated tuples. (``unpack`` is FoundationDB's: a direct
decoder measured no faster.)

The versionstamp offset suffix is always 4 bytes little-endian: surefoot runs
FoundationDB at API 730/800, and the 2-byte form only exists below API 520.
"""

from __future__ import annotations

import builtins
import functools
import struct
from typing import Any, Iterable

import fdb.tuple as _fdbt
from fdb.tuple import (  # noqa: F401  (re-exported: FoundationDB's own tuple layer)
    SingleFloat,
    Versionstamp,
    compare,
    has_incomplete_versionstamp,
    unpack,
)

__all__ = [
    "pack",
    "unpack",
    "range",
    "pack_with_versionstamp",
    "has_incomplete_versionstamp",
    "compare",
    "Versionstamp",
    "SingleFloat",
    "Subspace",
    "VERSIONSTAMP_CODE",
    "VERSIONSTAMP_OFFSET_SIZE",
]

_tuple = builtins.tuple  # the builtin; this module's own name is `tuple`

VERSIONSTAMP_CODE = 0x33
NESTED_CODE = 0x05
# FoundationDB's versionstamp offset suffix from API 520 on (uint32 little-endian).
VERSIONSTAMP_OFFSET_SIZE = 4
_OFFSET = struct.Struct("<I")
_INCOMPLETE_TR_VERSION = b"\xff" * 10
_USER_VERSION = struct.Struct(">H")

assert len(_INCOMPLETE_TR_VERSION) == Versionstamp._TR_VERSION_LEN


def _versionstamp_bytes(vs: Versionstamp) -> bytes:
    """The 12 bytes FoundationDB writes for ``vs``, without touching fdb.impl."""
    tr = vs.tr_version
    if tr is None:
        tr = _INCOMPLETE_TR_VERSION
    else:
        # A future-like object (fdb.impl.Value from get_versionstamp) exposes .value.
        if not isinstance(tr, (bytes, bytearray)):
            tr = getattr(tr, "value", tr)
        tr = bytes(tr)
        if len(tr) != Versionstamp._TR_VERSION_LEN:
            raise ValueError(f"Versionstamp tr_version must be 10 bytes, got {len(tr)}")
    return tr + _USER_VERSION.pack(vs.user_version)


def _contains_versionstamp(value: Any) -> bool:
    if isinstance(value, Versionstamp):
        return True
    if isinstance(value, (_tuple, list)):
        return any(_contains_versionstamp(v) for v in value)
    return False


def _encode(value: Any, nested: bool = False) -> tuple[bytes, int]:
    """Return ``(bytes, pos)`` like ``fdb.tuple._encode``: pos is the offset of an
    incomplete versionstamp's 10 version bytes inside ``bytes``, or -1."""
    if isinstance(value, Versionstamp):
        pos = -1 if value.is_complete() else 1
        return bytes((VERSIONSTAMP_CODE,)) + _versionstamp_bytes(value), pos
    if isinstance(value, (_tuple, list)) and _contains_versionstamp(value):
        parts, pos = _reduce(_encode(v, True) for v in value)
        return b"".join([bytes((NESTED_CODE,)), *parts, b"\x00"]), (-1 if pos < 0 else pos + 1)
    # No Versionstamp anywhere below: FoundationDB's own encoder.
    return _fdbt._encode(value, nested)


def _reduce(children: Iterable[tuple[bytes, int]]) -> tuple[list[bytes], int]:
    pos = -1
    length = 0
    parts: list[bytes] = []
    for data, child_pos in children:
        if child_pos >= 0:
            if pos >= 0:
                raise ValueError("Multiple incomplete versionstamps included in tuple")
            pos = length + child_pos
        length += len(data)
        parts.append(data)
    return parts, pos


def _pack_maybe_with_versionstamp(t: _tuple, prefix: bytes | None) -> tuple[bytes, int]:
    if not isinstance(t, _tuple):
        raise TypeError(f"tuple pack expects a tuple, got {type(t)!r}")
    prefix = b"" if prefix is None else bytes(prefix)
    parts, pos = _reduce(_encode(v) for v in t)
    data = prefix + b"".join(parts)
    if pos >= 0:
        pos += len(prefix)
    return data, pos


STRING_CACHE_SIZE = 4096  # encoded str elements kept by pack (a few hundred KiB at most)
_INT_ZERO = 0x14
_INT_FAST_LIMIT = (1 << 64) - 1  # fdb.tuple's _size_limits[-1]: beyond it, the long integer codes


@functools.lru_cache(maxsize=STRING_CACHE_SIZE)
def _str_element(v: str) -> bytes:
    b = v.encode("utf-8")
    return b"\x02" + (b.replace(b"\x00", b"\x00\xff") if 0 in b else b) + b"\x00"


def _pack_simple(t: _tuple) -> bytes | None:
    """``t`` packed, if it holds only None/bytes/str/int (not bool), else None."""
    parts = []
    for v in t:
        cls = type(v)
        if cls is str:
            parts.append(_str_element(v))
        elif cls is bytes:
            parts.append(b"\x01" + (v.replace(b"\x00", b"\x00\xff") if 0 in v else v) + b"\x00")
        elif cls is int:
            if v > 0:
                if v >= _INT_FAST_LIMIT:
                    return None
                n = (v.bit_length() + 7) // 8
                parts.append(bytes((_INT_ZERO + n,)) + v.to_bytes(n, "big"))
            elif v == 0:
                parts.append(b"\x14")
            else:
                if -v >= _INT_FAST_LIMIT:
                    return None
                n = ((-v).bit_length() + 7) // 8
                parts.append(bytes((_INT_ZERO - n,)) + ((1 << (8 * n)) - 1 + v).to_bytes(n, "big"))
        elif v is None:
            parts.append(b"\x00")
        else:
            return None
    return b"".join(parts)


def pack(t: _tuple, prefix: bytes | None = None) -> bytes:
    """FoundationDB's ``fdb.tuple.pack``; also packs complete Versionstamps."""
    if type(t) is _tuple:
        data = _pack_simple(t)
        if data is not None:
            return data if not prefix else bytes(prefix) + data
    data, pos = _pack_maybe_with_versionstamp(t, prefix)
    if pos >= 0:
        raise ValueError("Incomplete versionstamp included in vanilla tuple pack")
    return data


def pack_with_versionstamp(t: _tuple, prefix: bytes | None = b"") -> bytes:
    """Pack ``t`` (exactly one incomplete Versionstamp, at any depth) for
    ``set_versionstamped_key``/``_value``: the packed bytes followed by the
    4-byte little-endian offset of the stamp's 10 version bytes."""
    data, pos = _pack_maybe_with_versionstamp(t, prefix)
    if pos < 0:
        raise ValueError("No incomplete versionstamp included in tuple pack with versionstamp")
    return data + _OFFSET.pack(pos)


def range(t: _tuple) -> slice:  # noqa: A001  (FoundationDB's name)
    """All keys of tuples that extend ``t``: ``slice(pack(t)+b'\\x00', pack(t)+b'\\xff')``."""
    if not isinstance(t, _tuple):
        raise TypeError(f"tuple range expects a tuple, got {type(t)!r}")
    p = pack(t)
    return slice(p + b"\x00", p + b"\xff")


class Subspace:
    """A key prefix (raw bytes + packed tuple), FoundationDB's Subspace with
    snake_case constructor arguments; pure Python, Versionstamps included."""

    __slots__ = ("raw_prefix",)

    def __init__(self, prefix_tuple: _tuple = (), raw_prefix: bytes = b"") -> None:
        self.raw_prefix: bytes = pack(_tuple(prefix_tuple), prefix=bytes(raw_prefix))

    def __repr__(self) -> str:
        return f"Subspace(raw_prefix={self.raw_prefix!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Subspace) and other.raw_prefix == self.raw_prefix

    def __hash__(self) -> int:
        return hash(("Subspace", self.raw_prefix))

    def __getitem__(self, item: Any) -> "Subspace":
        return Subspace((item,), self.raw_prefix)

    def subspace(self, t: _tuple) -> "Subspace":
        return Subspace(t, self.raw_prefix)

    def key(self) -> bytes:
        return self.raw_prefix

    # FoundationDB's bindings accept objects with this method wherever a key goes.
    def as_foundationdb_key(self) -> bytes:
        return self.raw_prefix

    def pack(self, t: _tuple = ()) -> bytes:
        return pack(t, prefix=self.raw_prefix)

    def pack_with_versionstamp(self, t: _tuple = ()) -> bytes:
        return pack_with_versionstamp(t, prefix=self.raw_prefix)

    def unpack(self, key: bytes) -> _tuple:
        if not self.contains(key):
            raise ValueError("Cannot unpack key that is not in subspace.")
        return unpack(key, prefix_len=len(self.raw_prefix))

    def range(self, t: _tuple = ()) -> slice:
        r = range(t)
        return slice(self.raw_prefix + r.start, self.raw_prefix + r.stop)

    def contains(self, key: bytes) -> bool:
        return key.startswith(self.raw_prefix)
