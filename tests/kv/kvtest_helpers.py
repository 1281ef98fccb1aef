"""Small helpers shared by the kv tests (not fixtures: see conftest.py)."""

from __future__ import annotations

import os
import struct
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest
import trio

import kv
from kv import KVError
from kv.engine import Engine

MARKER = b"~marker"  # a key no conflict test reads: makes a transaction non-read-only


def le64(n: int) -> bytes:
    return struct.pack("<q", n)


def from_le64(b: bytes | None) -> int | None:
    return None if b is None else struct.unpack("<q", b)[0]


async def write(db, *pairs: tuple[bytes, bytes], clears: tuple[bytes, ...] = ()) -> None:
    async def fn(tr):  # idempotent: plain sets and clears
        for k in clears:
            tr.clear(k)
        for k, v in pairs:
            tr.set(k, v)

    await db.transact(fn)


async def read(db, key: bytes) -> bytes | None:
    async def fn(tr):  # read-only
        return await tr.get(key)

    return await db.transact(fn)


async def dump(db, begin: bytes = b"", end: bytes = b"\xff") -> list[tuple[bytes, bytes]]:
    async def fn(tr):  # read-only
        return [(r.key, r.value) for r in await tr.get_range(begin, end)]

    return await db.transact(fn)


async def commit_code(tr) -> int | None:
    """Commit; the KVError code, or None on success."""
    try:
        await tr.commit()
    except KVError as e:
        return e.code
    return None


def raises_code(code: int):
    """``with raises_code(2004): ...`` — a KVError with exactly this code."""
    return _RaisesCode(code)


class _RaisesCode:
    def __init__(self, code: int) -> None:
        self.code = code
        self._cm = pytest.raises(KVError)

    def __enter__(self):
        self.info = self._cm.__enter__()
        return self.info

    def __exit__(self, *exc):
        suppressed = self._cm.__exit__(*exc)
        if suppressed:
            assert self.info.value.code == self.code, f"expected KVError {self.code}, got {self.info.value!r}"
        return suppressed


async def conflicts(
    db,
    reads: Callable[[object], Awaitable[None]],
    writes: Callable[[object], Awaitable[None]],
) -> bool:
    """Does a transaction doing ``reads`` (then a marker write) fail with
    not_committed after another transaction doing ``writes`` commits in
    between? Asserts the only possible failure is 1020. The database is put
    back as it was afterwards, so one test can probe several writes."""
    before = await dump(db)
    tr = db.create_transaction()
    await tr.get_read_version()
    await reads(tr)
    await db.transact(writes)
    tr.set(MARKER, b"x")
    code = await commit_code(tr)
    assert code in (None, 1020), code

    async def restore(tr):  # idempotent: rewrites a fixed state
        tr.clear_range(b"", b"\xff")
        for k, v in before:
            tr.set(k, v)

    await db.transact(restore)
    return code == 1020


def setter(*pairs: tuple[bytes, bytes]):
    async def fn(tr):
        for k, v in pairs:
            tr.set(k, v)

    return fn


def clearer(*keys: bytes):
    async def fn(tr):
        for k in keys:
            tr.clear(k)

    return fn


FDB_ENV = "SUREFOOT_FDB_CLUSTER_FILE"
# "fdb-capi": the FoundationDB backend and the real bindings over the stand-in libfdb_c
# (tests/kv/fake_libfdb_c.py, docs/fdb-testing.md), on every machine.
BACKENDS = ("memory", "lmdb", "fdb-capi", "fdb")
EMBEDDED = ("memory", "lmdb")
FDB_SKIP_REASON = (f"{FDB_ENV} is not set: FoundationDB backend not under test (set it to a cluster file, with "
                   "libfdb_c from foundationdb-clients installed; the suite wipes that cluster's keyspace)")
STAND_IN_SKIP_REASON = (f"{FDB_ENV} is set: the real libfdb_c is under test, and the stand-in cannot be loaded "
                        "in the same process (loading the client library is process-global)")


class Clock:
    """Seconds, moved by the test (not by time passing)."""

    def __init__(self, start: float) -> None:
        self.now = start
        self.real = False

    def __call__(self) -> float:
        return self.now

    async def advance(self, seconds: float) -> None:
        if self.real:
            await trio.sleep(seconds)
        else:
            self.now += seconds
            await trio.lowlevel.checkpoint()


async def open_backend(name: str, path: Path, *, clock: Clock | None = None) -> kv.Database:
    if name == "memory":
        if clock is None:
            return await kv.open("memory:")
        return kv.MemoryEngine(clock=clock).database()
    if name == "lmdb":
        if clock is None:
            return await kv.open(f"lmdb:{path}")
        from kv.lmdb_engine import LmdbStore

        return kv.Database(Engine(LmdbStore(path), clock=clock), url=f"lmdb:{path}")
    if name == "fdb-capi":
        return await open_stand_in(path, clock=clock)
    if name == "fdb":
        cluster_file = os.environ.get(FDB_ENV)
        if not cluster_file:
            pytest.skip(FDB_SKIP_REASON)
        db = await kv.open(f"fdb:{cluster_file}")

        async def wipe(tr):
            tr.clear_range(b"", b"\xff")

        await db.transact(wipe)
        if clock is not None:
            clock.real = True
        return db
    raise ValueError(name)




async def open_stand_in(path: Path, *, clock: Clock | None = None, factory=None) -> kv.Database:
    """kv.open("fdb:CLUSTER_FILE") -> kv/fdb_backend.py -> the real fdb.impl -> the stand-in
    libfdb_c, whose cluster is a fresh memory engine (on ``clock``, if given: the cluster's
    time is the engine's, so advancing it is honest here and needs no sleep), or what
    ``factory`` makes (called on the stand-in's network thread)."""
    if os.environ.get(FDB_ENV):
        pytest.skip(STAND_IN_SKIP_REASON)
    import fake_libfdb_c

    fake_libfdb_c.install()
    path.mkdir(parents=True, exist_ok=True)
    cluster_file = path / "stand-in.cluster"
    cluster_file.write_text("standin:surefoot@127.0.0.1:4500\n")  # the format of a cluster file; not read
    if factory is None:
        factory = (lambda: kv.MemoryEngine(clock=clock)) if clock else kv.MemoryEngine
    fake_libfdb_c.register_cluster(cluster_file, factory)
    return await kv.open(f"fdb:{cluster_file}")


def check_stand_in() -> None:
    """Fail the test if the stand-in hit a bug of its own on the network thread."""
    import fake_libfdb_c

    errors, fake_libfdb_c.internal_errors[:] = list(fake_libfdb_c.internal_errors), []
    assert not errors, "stand-in libfdb_c internal errors:\n" + "\n".join(errors)


@asynccontextmanager
async def stand_in_database(path: Path, **kw) -> AsyncIterator[kv.Database]:
    """:func:`open_stand_in` (same arguments) as a context: the database is closed on exit,
    then the test fails if the stand-in hit a bug of its own (:func:`check_stand_in`)."""
    db = await open_stand_in(path, **kw)
    try:
        yield db
    finally:
        await db.close()
    check_stand_in()
