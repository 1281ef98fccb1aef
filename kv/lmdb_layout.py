"""The embedded engine's LMDB layout: where each user key lives in the B-tree.

Shared by the store (``kv.lmdb_engine``, which reads it) and the
checkpointer (``kv.wal``, which writes it), so the layout is written down
once. One B-tree, LMDB's main database, because every named database a
transaction touches adds dirty pages (its own tree plus its record in the
main tree) to every write:

* ``b"k" + key``: the user's keys and values (the prefix because LMDB
  refuses the empty key, which FoundationDB allows). LMDB keys are limited
  to 511 bytes, so a key longer than ``SHORT`` (509) bytes lives in a
  *bucket* stored under its first ``BUCKET`` (510) bytes: a CBOR list of
  ``[key, value]`` pairs in key order. Every short key is at most 509 bytes,
  so buckets sort exactly where their keys would (see ``iter_range``), and
  range reads stay in key order.
* ``b"m" + name``: the engine's own records, after every ``b"k"`` key, so a
  range read never meets them:

  - ``mformat``: ``FORMAT``.
  - ``mapplied`` (8 bytes big-endian): the version of the newest batch the
    tree holds. Every batch at or below it is here; every later one is in
    the write-ahead log (``kv.wal``).
  - ``mversion`` (format 2 only, read when upgrading): a ceiling above
    every version format 2 had used.
"""

from __future__ import annotations

import os
from typing import Iterator

import cbor2
import lmdb

__all__ = ["FORMAT", "open_env", "get", "put", "delete", "clear", "iter_range", "read_range", "expand", "read_applied",
           "apply_effects", "SET", "DELETE", "CLEAR"]

PREFIX = b"k"      # every data key is stored as PREFIX + key (LMDB has no empty key)
PREFIX_END = b"l"  # first LMDB key after every data key
APPLIED_KEY = b"mapplied"
LEGACY_CEILING_KEY = b"mversion"
FORMAT_KEY = b"mformat"
FORMAT = b"3"      # 2: no write-ahead log, mversion a ceiling; 1 (before 2026-11-29): named databases
UPGRADABLE_FORMATS = (b"2",)  # opened and restamped as FORMAT (format 2 has no log: the tree is everything)
SHORT = 509        # longest key stored as itself
BUCKET = 510       # length of a bucket's key prefix (the long keys inside it share it)
MAP_SIZE = 1 << 38  # 256 GiB of address space; the file grows only as used
MAX_READERS = 16_384  # LMDB reader slots (the store shares one read transaction per checkpoint)

# Effects, as the write-ahead log records them (a batch's mutations with atomic ops already applied)
SET, DELETE, CLEAR = 0, 1, 2


def open_env(path: str | os.PathLike) -> lmdb.Environment:
    """The environment, opened the same way by the store and by the checkpointer process.

    ``sync=True, metasync=True``: a checkpoint is an ordinary durable LMDB
    commit, so the tree is always a consistent, synced state (even after a
    power loss) and the log only ever adds to it.
    """
    return lmdb.open(
        str(path), map_size=MAP_SIZE, max_dbs=0, max_readers=MAX_READERS,
        sync=True, metasync=True, readahead=False, lock=True, subdir=True,
    )


def read_applied(txn: lmdb.Transaction) -> int:
    raw = txn.get(APPLIED_KEY)
    return int.from_bytes(raw, "big") if raw else 0


def apply_effects(txn: lmdb.Transaction, effects: list) -> None:
    """Apply one logged batch's effects, in order, in ``txn``.

    ``effects`` is flat (``SET, key, value, DELETE, key, CLEAR, begin, end,
    ...``; see wal.py). Logs written before 2026-11-29 hold one list per
    effect (``[[SET, key, value], ...]``) and are still read: a flat record
    starts with an int, an old one with a list.
    """
    if effects and type(effects[0]) is list:
        effects = [x for e in effects for x in e]
    i, n = 0, len(effects)
    while i < n:
        kind = effects[i]
        if kind == SET:
            put(txn, effects[i + 1], effects[i + 2])
            i += 3
        elif kind == DELETE:
            delete(txn, effects[i + 1])
            i += 2
        elif kind == CLEAR:
            clear(txn, effects[i + 1], effects[i + 2])
            i += 3
        else:
            raise ValueError(f"unknown effect {kind!r} at {i} in a logged batch")


def expand(key: bytes, value: bytes, begin: bytes, end: bytes, reverse: bool) -> Iterator[tuple[bytes, bytes]]:
    if len(key) <= SHORT:
        if begin <= key < end:
            yield key, value
        return
    pairs = cbor2.loads(value)
    for k, v in reversed(pairs) if reverse else pairs:
        if begin <= k < end:
            yield k, v


def iter_range(cur: lmdb.Cursor, begin: bytes, end: bytes, reverse: bool) -> Iterator[tuple[bytes, bytes]]:
    """Pairs in [begin, end) in key order, expanding long-key buckets.

    Only LMDB keys under ``PREFIX`` are data: the walk never steps past the
    prefix in either direction (the engine's ``b"m"`` records sort after it).
    """
    if not reverse:
        start = begin[:BUCKET]  # a bucket below ``begin`` may hold keys >= begin
        if not cur.set_range(PREFIX + start):
            return
        for raw, value in cur:
            if raw[:1] != PREFIX:
                return
            key = raw[1:]
            if key >= end:
                return
            yield from expand(key, value, begin, end, False)
    else:
        start = end[:BUCKET]
        if cur.set_range(PREFIX + start) and cur.key()[:1] == PREFIX:
            key = cur.key()[1:]
            if len(key) == BUCKET and key == start:  # the bucket of ``end`` may hold keys < end
                yield from expand(key, cur.value(), begin, end, True)
            if not cur.prev():
                return
        elif not (cur.set_range(PREFIX_END) and cur.prev()) and not cur.last():
            return
        for raw, value in cur.iterprev():
            if raw[:1] != PREFIX:
                return
            key = raw[1:]
            if len(key) <= SHORT:
                if key < begin:
                    return
            elif key < begin[:BUCKET]:
                return
            yield from expand(key, value, begin, end, True)


def get(txn: lmdb.Transaction, key: bytes) -> bytes | None:
    if len(key) <= SHORT:
        return txn.get(PREFIX + key)
    raw = txn.get(PREFIX + key[:BUCKET])
    if raw is None:
        return None
    for k, v in cbor2.loads(raw):
        if k == key:
            return v
    return None


def put(txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
    if len(key) <= SHORT:
        txn.put(PREFIX + key, value)
        return
    bkey = PREFIX + key[:BUCKET]
    raw = txn.get(bkey)
    pairs = [p for p in cbor2.loads(raw) if p[0] != key] if raw else []
    pairs.append([key, value])
    pairs.sort(key=lambda p: p[0])
    txn.put(bkey, cbor2.dumps(pairs))


def delete(txn: lmdb.Transaction, key: bytes) -> None:
    if len(key) <= SHORT:
        txn.delete(PREFIX + key)
        return
    bkey = PREFIX + key[:BUCKET]
    raw = txn.get(bkey)
    if raw is None:
        return
    pairs = [p for p in cbor2.loads(raw) if p[0] != key]
    if pairs:
        txn.put(bkey, cbor2.dumps(pairs))
    else:
        txn.delete(bkey)


def clear(txn: lmdb.Transaction, begin: bytes, end: bytes) -> None:
    if begin >= end:
        return
    doomed = [k for k, _ in iter_range(txn.cursor(), begin, end, False)]
    for k in doomed:
        delete(txn, k)


def read_range(txn: lmdb.Transaction, begin: bytes, end: bytes, reverse: bool, limit: int) -> list[tuple[bytes, bytes]]:
    """Up to ``limit`` (0 = all) pairs of [begin, end) from the tree, in key order."""
    out: list[tuple[bytes, bytes]] = []
    if begin >= end:
        return out
    cur = txn.cursor()
    if reverse:
        for kv in iter_range(cur, begin, end, True):
            out.append(kv)
            if limit and len(out) >= limit:
                break
        return out
    # Forward, the hot path (journal replay, transcript pages), inlined:
    # raw LMDB keys compare like user keys under the shared prefix, and the
    # engine's b"m" records sort after every b"k" key, so one comparison
    # against b"k" + end stops the walk.
    if not cur.set_range(PREFIX + begin[:BUCKET]):  # a bucket below begin may hold keys >= begin
        return out
    stop = PREFIX + end
    for raw, value in cur:
        if raw >= stop:
            break
        if len(raw) <= SHORT + 1:
            out.append((raw[1:], value))
        else:
            for kv in expand(raw[1:], value, begin, end, False):
                out.append(kv)
        if limit and len(out) >= limit:
            del out[limit:]
            break
    return out
