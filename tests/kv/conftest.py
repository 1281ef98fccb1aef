"""Backends for the kv conformance suite.

Every test that takes ``db`` runs once per backend: the memory engine, the
LMDB engine on a fresh ``tmp_path``, and a FoundationDB cluster when
``SUREFOOT_FDB_CLUSTER_FILE`` names its cluster file (otherwise that case is
reported skipped with the reason). The cluster's whole user keyspace
(``b''`` to ``b'\\xff'``) is cleared before each test: point the variable at a
throwaway test cluster only.

``clocked`` gives a database whose commit versions follow a clock the test
moves (the memory engine's injectable clock; the LMDB store under an engine
with the same kind of clock); on FoundationDB ``advance`` really sleeps.
"""

from __future__ import annotations

import os
import time

import pytest


from kvtest_helpers import BACKENDS, EMBEDDED, FDB_ENV, FDB_SKIP_REASON, Clock, open_backend  # noqa: F401


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "fdb" and not os.environ.get(FDB_ENV):
        pytest.skip(FDB_SKIP_REASON)
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
