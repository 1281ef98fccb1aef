"""The FoundationDB backend where no libfdb_c exists.

The backend's behaviour against a cluster is the whole conformance suite,
run with SUREFOOT_FDB_CLUSTER_FILE set. Here we check what every machine can:
that importing kv never needs the library, that ``fdb:`` URLs reach the
backend, and that a missing library is a clear error rather than a crash.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

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
