"""The FoundationDB backend where no libfdb_c exists.

The backend's behaviour against a cluster is the whole conformance suite,
run with SUREFOOT_FDB_CLUSTER_FILE set. Here we check what every machine can:
that importing kv never needs the library, that ``fdb:`` URLs reach the
backend, that a missing library is a clear error rather than a crash, and the
backend's pure-Python parts (argument checks, the future-to-trio bridge).

The ``db``-fixture tests at the end are parity checks: they pin down how the
embedded engine presents an API detail that the FoundationDB backend had to
adapt (kv/fdb_backend.py), run on memory and LMDB everywhere, and on a cluster
when SUREFOOT_FDB_CLUSTER_FILE names its cluster file and libfdb_c (the
foundationdb-clients package) is installed; otherwise that case is skipped
with that reason.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import trio

import kv
from kv import fdb_backend


def _libfdb_present() -> bool:
    try:
        import ctypes.util

        return ctypes.util.find_library("fdb_c") is not None or os.path.exists("/usr/lib/libfdb_c.so")
    except Exception:
        return False


needs_no_library = pytest.mark.skipif(_libfdb_present(), reason="libfdb_c is installed here")


def test_importing_kv_does_not_load_the_client_library():
    import fdb

    assert importlib.util.find_spec("fdb") is not None
    assert not fdb.is_api_version_selected() or _libfdb_present()


@needs_no_library
async def test_open_fdb_without_library_is_a_clear_error():
    with pytest.raises(fdb_backend.FDBUnavailableError, match="libfdb_c"):
        await fdb_backend.open_fdb(None)


@needs_no_library
async def test_fdb_url_dispatches_to_the_backend():
    with pytest.raises(fdb_backend.FDBUnavailableError, match="foundationdb-clients"):
        await kv.open("fdb:/nonexistent/fdb.cluster")


async def test_unsupported_api_version_is_refused():
    with pytest.raises(ValueError, match="730"):
        await fdb_backend.open_fdb(None, api_version=610)


def test_api_version_from_environment(monkeypatch):
    monkeypatch.setenv(fdb_backend.API_VERSION_ENV, "730")
    assert fdb_backend._api_version_from_env() == 730
    monkeypatch.delenv(fdb_backend.API_VERSION_ENV)
    assert fdb_backend._api_version_from_env() == fdb_backend.DEFAULT_API_VERSION == 800


def test_client_side_checks_match_the_embedded_engine():
    # Raised before the bindings are touched, so they hold without a cluster.
    from kv.limits import KEY_SIZE_LIMIT, VALUE_SIZE_LIMIT

    for fn, code in [
        (lambda: fdb_backend._check_key(b"\xff", for_write=True), 2004),
        (lambda: fdb_backend._check_key(b"k" * (KEY_SIZE_LIMIT + 1), for_write=True), 2102),
        (lambda: fdb_backend._check_value(b"v" * (VALUE_SIZE_LIMIT + 1)), 2103),
        (lambda: fdb_backend._check_range(b"b", b"a"), 2005),
        (lambda: fdb_backend._check_range(b"a", b"\xff\x00"), 2004),
        (lambda: fdb_backend._check_stamp_offset(b"x" * 12 + (5).to_bytes(4, "little"), "key"), 2000),
    ]:
        with pytest.raises(kv.KVError) as info:
            fn()
        assert info.value.code == code
    assert fdb_backend._check_key(b"k" * KEY_SIZE_LIMIT, for_write=True) == b"k" * KEY_SIZE_LIMIT
    assert fdb_backend._check_range(b"a", b"\xff") == (b"a", b"\xff")
    fdb_backend._check_stamp_offset(b"x" * 12 + (2).to_bytes(4, "little"), "key")  # fits: no error


def test_arguments_must_be_bytes_not_anything_bytes_accepts():
    # bytes(5) is five zero bytes and bytes([1, 2]) a two-byte key: a wrong argument
    # must be a TypeError (as on the embedded engine), never a silently different key.
    for bad in (5, [1, 2], "k", None):
        with pytest.raises(TypeError):
            fdb_backend._check_key(bad, for_write=True)
        with pytest.raises(TypeError):
            fdb_backend._check_value(bad)
        with pytest.raises(TypeError):
            fdb_backend._check_range(b"a", bad)
    assert fdb_backend._check_key(bytearray(b"k"), for_write=True) == b"k"
    assert fdb_backend._check_value(memoryview(b"v")) == b"v"


# --- parity: the embedded engine's behaviour the fdb backend must match ------

async def test_non_bytes_arguments_are_type_errors(db):
    tr = db.create_transaction()
    with pytest.raises(TypeError):
        tr.set(b"k", 5)
    with pytest.raises(TypeError):
        tr.set(7, b"v")
    with pytest.raises(TypeError):
        await tr.get(5)
