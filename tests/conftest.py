"""Fixtures shared by the sessions and ledger tests: every ``db`` test runs on the memory engine,
on the LMDB engine in a temp dir (the real engines, nothing faked), and as ``fdb-capi``: through
the FoundationDB backend and the real ``fdb`` bindings over the stand-in libfdb_c
(tests/kv/fake_libfdb_c.py, docs/fdb-testing.md), so sessions/ and ledger/ are held to the same
behaviour on the backend that has no cluster here."""

from __future__ import annotations

import logging

import pytest

import kv
from kv.engine import FaultHooks
from kv.errors import KVError


class FakeClock:
    """A wall clock the test moves (lease expiry, staging age)."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Inject1021(FaultHooks):
    """Deliver ``commit_unknown_result`` after a commit that *did* apply, for the
    next ``n`` commits whose mutations touch a key containing ``needle``."""

    def __init__(self, needle: bytes, n: int = 1) -> None:
        self.needle = needle
        self.n = n
        self.injected = 0

    def after_apply(self, version, batch):
        out = {}
        for req in batch:
            if self.injected < self.n and any(self.needle in bytes(m[1]) if m[0] != "atomic" else self.needle in bytes(m[2])
                                              for m in req.mutations):
                out[req] = KVError(1021)
                self.injected += 1
        return out


@pytest.fixture(params=["memory", "lmdb", "fdb-capi"])
async def db(request, tmp_path):
    if request.param == "fdb-capi":
        # (tests/kv is on the path: pyproject's pythonpath)
        from kvtest_helpers import stand_in_database

        async with stand_in_database(tmp_path / "cluster") as database:
            yield database
        return
    url = "memory:" if request.param == "memory" else f"lmdb:{tmp_path / 'data'}"
    database = await kv.open(url)
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def inject_1021(request):
    """``inject_1021(db, needle, n=1)``: the next n commits writing a key that contains
    ``needle`` apply and then report 1021 to their caller."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("db") == "fdb-capi":
        pytest.skip("injects 1021 through the embedded engine's fault hooks; a FoundationDB "
                    "cluster (or the stand-in libfdb_c) has none")

    def install(database, needle: bytes, n: int = 1) -> Inject1021:
        hooks = Inject1021(needle, n)
        database.engine.hooks = hooks
        return hooks

    return install


@pytest.fixture
def quiet_runtime_logs():
    """Silence logging: the runtime logs every injected fault at WARNING/ERROR, and the
    assertions tell the story (used by the simulator's tests)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(previous)
