"""Value encoding shared by sessions and ledger: CBOR values, little-endian
counters (FoundationDB's atomic ``add`` operand) and chunked values.

Chunking exists because a kv value is at most 100,000 bytes
(``kv.limits.VALUE_SIZE_LIMIT``) while a transcript message, an attachment or a
run's result may be larger. A chunked value is written in *one* transaction as
keys ``sub.pack((i,))`` for i = 0..n-1, so a reader sees all chunks or none;
readers concatenate the range in key order.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import struct
from typing import Any, Callable

import cbor2

import kv

__all__ = [
    "fastpack", "pack_str", "pack_uint", "dumps", "loads", "canonical_dumps", "canonical_hash", "canonical_dumps_and_hash", "pack_i64", "unpack_i64",
    "CHUNK_SIZE", "split_chunks", "write_chunks", "read_chunks", "encoded_size", "id_source",
    "Encoded", "cbor_uint", "own_dumps",
]

#: Bytes per chunk: under the 100,000-byte value limit with room for nothing else.
CHUNK_SIZE = 90_000
assert CHUNK_SIZE < kv.limits.VALUE_SIZE_LIMIT


#: ``dumps(value) -> bytes``: CBOR-encode a value (dicts, lists, str, bytes, ints, floats,
#: bools, None). ``loads(data) -> value``: decode one. cbor2's own C functions, bound here
#: rather than wrapped in a ``def``: a turn encodes ~35 values and decodes a few, and a
#: wrapper was one more Python frame for each.
dumps: Callable[[Any], bytes] = cbor2.dumps
loads: Callable[[bytes | memoryview], Any] = cbor2.loads


def own_dumps() -> Callable[[Any], bytes]:
    """A :func:`dumps` of one's own, for an object used from one thread only (a Journal or
    Transcripts, bound to their database's trio run): one default-options encoder made here,
    its ``encode_to_bytes``. ``cbor2.dumps`` builds a CBOREncoder and its output file every
    call, ~1,200 of the ~5,600 instructions a small map costs; the same bytes (cbor2.dumps is
    that encoder with the same defaults), and nothing is carried from a call to the next (a
    buffer of its own per call: calls nested in one another and calls after an error are
    whole). Not shared between threads: two threads encoding with one encoder at once get each
    other's output (tests/sessions/test_s19_codec_encoder.py shows it), which is why the
    module's :func:`dumps` stays cbor2.dumps."""
    return cbor2.CBOREncoder(io.BytesIO()).encode_to_bytes


class Encoded(bytes):
    """A value already CBOR-encoded (by :func:`dumps`), to be stored as those bytes where an
    API would encode a value: :meth:`sessions.Journal.emit_many_tr` takes one as an event's
    data. For a value whose encoding the caller already has (a transcript message, encoded
    to be appended, is also a ``message.added`` event's ``message``): cbor2 takes ~15,000
    instructions to encode such a message again. The caller answers for the bytes being
    one well-formed CBOR item."""

    __slots__ = ()


#: CBOR heads of the unsigned ints 0..23 (the value in the head byte itself).
_CBOR_TINY = [bytes((i,)) for i in range(24)]


def cbor_uint(n: int) -> bytes:
    """``dumps(n)`` for an int ``n >= 0``, without cbor2's per-call setup (~2,500
    instructions): CBOR's shortest unsigned form, as cbor2 writes it."""
    if n < 24:
        return _CBOR_TINY[n]
    if n < 0x100:
        return b"\x18" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\x19" + n.to_bytes(2, "big")
    if n < 0x100000000:
        return b"\x1a" + n.to_bytes(4, "big")
    if n < 0x10000000000000000:
        return b"\x1b" + n.to_bytes(8, "big")
    return dumps(n)


def canonical_dumps(value: Any) -> bytes:
    """Canonical CBOR (sorted map keys, shortest floats): what :func:`canonical_hash` hashes."""
    return cbor2.dumps(value, canonical=True)


def canonical_hash(value: Any) -> str:
    """SHA-256 hex over canonical CBOR (sorted map keys), stable across processes."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).hexdigest()


def canonical_dumps_and_hash(value: Any) -> tuple[bytes, str]:
    """The canonical CBOR of ``value`` and :func:`canonical_hash` of it, from one encoding
    (a value stored canonically needs no second encoding to be hashed)."""
    body = cbor2.dumps(value, canonical=True)
    return body, hashlib.sha256(body).hexdigest()


def pack_i64(n: int) -> bytes:
    """An atomic-``add`` operand / counter value: 8 bytes little-endian signed."""
    return struct.pack("<q", n)


def unpack_i64(data: bytes | None) -> int:
    if data is None:
        return 0
    # An ``add`` on an absent key stores the operand; shorter values are zero-extended.
    return struct.unpack("<q", data.ljust(8, b"\x00")[:8])[0]


def split_chunks(data: bytes, size: int = CHUNK_SIZE) -> list[bytes]:
    assert 0 < size <= CHUNK_SIZE
    if not data:
        return [b""]
    return [data[i:i + size] for i in range(0, len(data), size)]


def encoded_size(data: bytes) -> int:
    return len(data)


def write_chunks(tr: Any, sub: "kv.Subspace", data: bytes) -> int:
    """Write ``data`` as chunks under ``sub``; returns the chunk count.

    The caller must own ``sub`` exclusively (write-once values, or a cleared
    range) so no stale higher-numbered chunk survives.
    """
    chunks = split_chunks(data)
    for i, chunk in enumerate(chunks):
        tr.set(fastpack(sub.raw_prefix, (i,)), chunk)
    return len(chunks)


async def read_chunks(tr: Any, sub: "kv.Subspace") -> bytes | None:
    """Concatenate every chunk under ``sub``; None when there is none."""
    r = sub.range()
    rows = await tr.get_range(r.start, r.stop)
    if not rows:
        return None
    return b"".join(row.value for row in rows)


def id_source() -> Callable[[], str]:
    """A source of unique ids (hex, 32 characters like ``uuid.uuid4().hex`` for the first 2**32
    of a source, longer after): 12 random bytes
    drawn once from ``os.urandom`` plus a counter, instead of a syscall per id.

    Unique within the source by the counter and across sources (processes, restarts) by the
    96-bit random prefix. The ids are not secrets (nothing here treats an id as a
    capability: owners are checked on every read). Drawing the prefix from ``os.urandom``
    keeps simulated runs, which patch it, byte-identical."""
    prefix, seq = os.urandom(12).hex(), itertools.count()
    return lambda: prefix + format(next(seq), "08x")


def _enc(part: Any) -> bytes:
    """FoundationDB's tuple encoding of one element: kv.tuple's own (its fast path covers
    str, bytes, int and None), so there is one encoder to keep equal to FoundationDB's."""
    return kv.tuple.pack((part,))


#: Tuple codes of the integers 0..255 (keys number messages, chunks, FIFO slots with them).
_SMALL_INTS = [b"\x14"] + [bytes((0x15, i)) for i in range(1, 256)]


def pack_str(part: str) -> bytes:
    """The tuple encoding of one str part: keyspaces append it to a cached packed prefix
    (tuple encoding concatenates), so a key costs one part's encoding, not all of them."""
    b = part.encode()
    # ``0 not in b``, not ``b"\x00" not in b``: a bytes operand makes CPython try it as an
    # int first, raising and formatting a TypeError it then discards (~2,000 instructions
    # per key part; a submit builds several).
    return (b"\x02" + b + b"\x00") if 0 not in b else _enc(part)


#: Non-negative ints below this pack as the tuple code 0x14 + their byte length, then their
#: big-endian bytes; from it on (2**64 - 1 included, as FoundationDB's tuple layer does) as a
#: bignum, which pack_uint leaves to kv.tuple.
_UINT_INLINE_LIMIT = (1 << 64) - 1
_UINT_CODES = [bytes((0x14 + n,)) for n in range(9)]


def pack_uint(n: int) -> bytes:
    """The tuple encoding of one non-negative int part (what ``pack_str`` is for a str part).
    Keys carry microsecond timestamps (~2**51: the ledger's ready and lease-expiry indexes)
    and sequence numbers past 255 (FIFO, history): through kv.tuple's generic packer they
    cost ~2% of a submission's instructions (a submit builds three such keys)."""
    if n < 256 and n >= 0:
        return _SMALL_INTS[n]
    if 0 <= n < _UINT_INLINE_LIMIT:
        size = (n.bit_length() + 7) >> 3
        return _UINT_CODES[size] + n.to_bytes(size, "big")
    return _enc(n)


def fastpack(prefix: bytes, parts: tuple) -> bytes:
    """``kv.Subspace(raw_prefix=prefix).pack(parts)``, several times faster for str,
    bytes and non-negative int parts (tuple encoding concatenates element by
    element); any other type goes through kv.tuple. Tests check it against kv.tuple.

    Every key of every transaction is built here, so the common parts (a str
    without NUL, a small int) are encoded inline rather than by a call per part."""
    out = prefix
    for p in parts:
        t = type(p)
        if t is str:
            b = p.encode()
            out += (b"\x02" + b + b"\x00") if 0 not in b else _enc(p)  # (0: see pack_str)
        elif t is int and p >= 0:
            out += _SMALL_INTS[p] if p < 256 else pack_uint(p)
        else:
            out += _enc(p)
    return out
