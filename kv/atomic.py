"""The byte semantics of FoundationDB's atomic operations (fdbclient/Atomic.h, V2 forms).

Pure functions of (existing value or None, parameter) -> new value or None
(None = the key is cleared). The memory and LMDB engines and the transaction's
read-your-writes view all apply them through :func:`apply_atomic`, so a value
read back inside a transaction is the value that later commits.
"""

from __future__ import annotations

from .limits import VALUE_SIZE_LIMIT

__all__ = ["ADD", "BIT_AND", "BIT_OR", "BIT_XOR", "APPEND_IF_FITS", "MAX", "MIN",
           "BYTE_MIN", "BYTE_MAX", "COMPARE_AND_CLEAR", "OP_NAMES", "apply_atomic"]

# FoundationDB's MutationType opcodes.
ADD = 2
BIT_AND = 6
BIT_OR = 7
BIT_XOR = 8
APPEND_IF_FITS = 9
MAX = 12
MIN = 13
BYTE_MIN = 16
BYTE_MAX = 17
COMPARE_AND_CLEAR = 20

OP_NAMES = {ADD: "add", BIT_AND: "bit_and", BIT_OR: "bit_or", BIT_XOR: "bit_xor",
            APPEND_IF_FITS: "append_if_fits", MAX: "max", MIN: "min",
            BYTE_MIN: "byte_min", BYTE_MAX: "byte_max", COMPARE_AND_CLEAR: "compare_and_clear"}


def _fit(existing: bytes, n: int) -> bytes:
    """Zero-extend or truncate ``existing`` to ``n`` bytes (little-endian view)."""
    if len(existing) >= n:
        return existing[:n]
    return existing + b"\x00" * (n - len(existing))


def apply_atomic(op: int, existing: bytes | None, param: bytes) -> bytes | None:
    if op == COMPARE_AND_CLEAR:
        return None if existing == param else existing
    if existing is None:
        # From API 510 every operation stores the parameter on an absent key.
        return param
    n = len(param)
    if op == ADD:
        if n == 0:
            return b""
        # (existing[:n], not _fit: zero-extending a little-endian value does not change it;
        # a call less for every counter add, ~8 a turn)
        total = int.from_bytes(existing[:n], "little") + int.from_bytes(param, "little")
        return (total % (1 << (8 * n))).to_bytes(n, "little")
    if op in (BIT_AND, BIT_OR, BIT_XOR):
        a = int.from_bytes(existing[:n], "little")  # (as ADD's: no _fit needed for the value)
        b = int.from_bytes(param, "little")
        r = a & b if op == BIT_AND else a | b if op == BIT_OR else a ^ b
        return r.to_bytes(n, "little")
    if op in (MAX, MIN):
        fitted = _fit(existing, n)
        a = int.from_bytes(fitted, "little")
        b = int.from_bytes(param, "little")
        if op == MAX:
            return fitted if a >= b else param
        return fitted if a <= b else param
    if op == BYTE_MIN:
        return min(existing, param)
    if op == BYTE_MAX:
        return max(existing, param)
    if op == APPEND_IF_FITS:
        if len(existing) + n > VALUE_SIZE_LIMIT:
            return existing
        return existing + param
    raise ValueError(f"unknown atomic opcode {op}")
