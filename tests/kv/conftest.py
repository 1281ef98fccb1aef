"""Backends for the kv conformance suite.

Every test that takes ``db`` runs once per backend: the memory engine, the
LMDB engine on a fresh ``tmp_path``, and a FoundationDB cluster when
``SUREFOOT_FDB_CLUSTER_FILE`` names its cluster file (otherwise that case is
reported skipped with the reason). The cluster's whole user keyspace
(``b''`` to ``b'\\xff'``) is cleared before each test: point the variable at a
throwaway test cluster only.

``fdb-capi`` runs the FoundationDB backend and the real bindings (fdb/impl.py)
over the stand-in libfdb_c (fake_libfdb_c.py, docs/fdb-testing.md), whose
cluster is a fresh memory engine per test. It runs everywhere, except when
``SUREFOOT_FDB_CLUSTER_FILE`` is set: loading the client library is
process-global, so the stand-in and a real cluster cannot share a process.

``clocked`` gives a database whose commit versions follow a clock the test
moves (the memory engine's injectable clock; the LMDB store under an engine
with the same kind of clock); on FoundationDB ``advance`` really sleeps; on the
stand-in the memory engine behind it runs on the same moved clock.
"""

from __future__ import annotations

import os
import time

import pytest


from kvtest_helpers import (  # noqa: F401
    BACKENDS, EMBEDDED, FDB_ENV, FDB_SKIP_REASON, STAND_IN_SKIP_REASON, Clock, check_stand_in, open_backend,
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "stand_in: the test loads the stand-in libfdb_c (run last: see below)")


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the fdb-capi cases (and tests taking test_fdb_backend's ``capi`` or marked
    ``stand_in``) last.

    The first of them loads the stand-in as the process's libfdb_c and selects API
    version 800 (process-global, for good: see kvtest_helpers.open_stand_in). Tests
    that need the bindings unloaded (tests/kv/test_tuple.py's fdb.tuple reference
    fixture, anything importing fdb.impl its own way) must run before that, wherever
    they are in the session; the fdb-capi cases keep their relative order.
    """
    def loads_stand_in(item) -> bool:
        return ("fdb-capi" in item.nodeid or "capi" in getattr(item, "fixturenames", ())
                or item.get_closest_marker("stand_in") is not None)

    first = [item for item in items if not loads_stand_in(item)]
    if len(first) != len(items):
        items[:] = first + [item for item in items if loads_stand_in(item)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "fdb" and not os.environ.get(FDB_ENV):
        pytest.skip(FDB_SKIP_REASON)
    if request.param == "fdb-capi" and os.environ.get(FDB_ENV):
        pytest.skip(STAND_IN_SKIP_REASON)
    return request.param


@pytest.fixture(params=EMBEDDED)
def embedded(request) -> str:
    return request.param


@pytest.fixture
async def db(backend, tmp_path):
    database = await open_backend(backend, tmp_path / "data")
    try:
        yield database
    finally:
        await database.close()
        if backend == "fdb-capi":
            check_stand_in()


@pytest.fixture
async def edb(embedded, tmp_path):
    """The embedded engines only (memory and LMDB)."""
    database = await open_backend(embedded, tmp_path / "data")
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
async def clocked(backend, tmp_path):
    clock = Clock(time.time())
    database = await open_backend(backend, tmp_path / "data", clock=clock)
    try:
        yield database, clock
    finally:
        await database.close()
        if backend == "fdb-capi":
            check_stand_in()
