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

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

import kv
from kv import fdb_backend
from kvtest_helpers import raises_code


def _libfdb_present() -> bool:
    try:
        import ctypes.util

        return ctypes.util.find_library("fdb_c") is not None or os.path.exists("/usr/lib/libfdb_c.so")
    except Exception:
        return False


needs_no_library = pytest.mark.skipif(_libfdb_present(), reason="libfdb_c is installed here")

REPO = Path(__file__).resolve().parents[2]


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (stdout back).

    The fdb-capi tests load the stand-in as this process's libfdb_c, and loading
    the client library is process-global: what happens *without* a library can
    only be seen in a process that never loaded one.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(fdb_backend.API_VERSION_ENV, None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_kv_does_not_load_the_client_library():
    out = _fresh_python("""
        import sys, importlib.util
        import kv, kv.fdb_backend, fdb
        assert importlib.util.find_spec("fdb") is not None
        print(fdb.is_api_version_selected(), "fdb.impl" in sys.modules)
    """)
    assert out.split() == ["False", "False"]


@needs_no_library
def test_open_fdb_without_library_is_a_clear_error():
    out = _fresh_python("""
        import trio
        from kv import fdb_backend

        async def main():
            try:
                await fdb_backend.open_fdb(None)
            except fdb_backend.FDBUnavailableError as e:
                print("FDBUnavailableError:", e)

        trio.run(main)
    """)
    assert out.startswith("FDBUnavailableError:") and "libfdb_c" in out, out


@needs_no_library
def test_fdb_url_dispatches_to_the_backend():
    out = _fresh_python("""
        import trio, kv
        from kv import fdb_backend

        async def main():
            try:
                await kv.open("fdb:/nonexistent/fdb.cluster")
            except fdb_backend.FDBUnavailableError as e:
                print("FDBUnavailableError:", e)

        trio.run(main)
    """)
    assert out.startswith("FDBUnavailableError:") and "foundationdb-clients" in out, out


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



async def test_a_cancelled_wait_leaves_the_watch_armed(db):
    async def arm(tr):
        await tr.get(b"watched")
        return tr.watch(b"watched")

    w = await db.transact(arm)
    with trio.CancelScope() as scope:
        scope.cancel()
        await w
    assert scope.cancelled_caught and not w.ready

    async def change(tr):
        tr.set(b"watched", b"changed")

    await db.transact(change)
    with trio.fail_after(30):  # a hang guard: the watch must still fire
        await w
    assert w.ready


async def test_committed_version_only_after_a_successful_commit(db):
    # sessions/coalesce.py tells "committed" from "not yet" by this raising; libfdb_c
    # answers -1 before a commit, the same as for a committed read-only transaction.
    tr = db.create_transaction()
    with pytest.raises(kv.KVError) as info:
        tr.get_committed_version()
    assert info.value.code == 2000
    tr.set(b"cv", b"1")
    await tr.commit()
    assert tr.get_committed_version() > 0
    tr.reset()
    with pytest.raises(kv.KVError):
        tr.get_committed_version()
    await tr.get(b"cv")
    await tr.commit()
    assert tr.get_committed_version() == -1  # read-only


async def test_on_error_takes_an_error_code(db):
    tr = db.create_transaction()
    tr.set(b"oe", b"1")
    await tr.on_error(1020)  # retryable: backs off and resets
    assert await tr.get(b"oe") is None
    with pytest.raises(kv.KVError) as info:
        await tr.on_error(2004)  # not retryable: raised
    assert info.value.code == 2004


async def test_watch_argument_errors_raise_at_the_call(db):
    tr = db.create_transaction()
    with pytest.raises(kv.KVError) as info:
        tr.watch(b"\xff\x01")
    assert info.value.code == 2004
    tr.set(b"w", b"1")
    await tr.commit()
    with pytest.raises(kv.KVError) as info:
        tr.watch(b"w")
    assert info.value.code == 2017


async def test_one_versionstamp_per_attempt(db):
    # sessions/journal.py recognises a transaction attempt by its versionstamp object.
    tr = db.create_transaction()
    first = tr.get_versionstamp()
    assert tr.get_versionstamp() is first
    tr.reset()
    second = tr.get_versionstamp()
    assert second is not first
    await tr.on_error(1020)
    third = tr.get_versionstamp()
    assert third is not second
    tr.set_versionstamped_value(b"vs", b"\x00" * 10 + (0).to_bytes(4, "little"))
    await tr.commit()
    assert len(await tr.get_versionstamp()) == 10 and await third == await tr.get_versionstamp()


async def test_options_take_any_number_of_ms_and_raise_kverror_at_once(db):
    tr = db.create_transaction()
    tr.options.set_timeout(60_000.0)  # fdb's int setter alone: struct.error
    tr.options.set_max_retry_delay(500.0)
    tr.options.set_retry_limit(3)
    with pytest.raises(kv.KVError) as info:
        tr.options.set_size_limit(10)  # libfdb_c alone: 2006 only at the next read or commit
    assert info.value.code == 2006
    tr.set(b"opt", b"1")
    await tr.commit()
    assert tr.get_committed_version() > 0


async def test_any_use_after_commit_is_used_during_commit(db):
    # On the fdb backend this is refused before libfdb_c sees it: a read reaching
    # libfdb_c while the commit is in flight fails that commit with 2017 (see _usable).
    tr = db.create_transaction()
    tr.set(b"udc", b"1")
    await tr.commit()
    for use in (
        lambda: tr.get(b"udc"),
        lambda: tr.snapshot.get(b"udc"),
        lambda: tr.get_multi([b"udc"]),
        lambda: _awaited(tr.get_range(b"a", b"z")),
        lambda: _awaited(tr.snapshot.get_range(b"a", b"z")),
    ):
        with pytest.raises(kv.KVError) as info:
            await use()
        assert info.value.code == 2017
    with pytest.raises(kv.KVError) as info:
        tr.set(b"udc", b"2")
    assert info.value.code == 2017
    # RYW getReadVersion checks resetPromise only (it answers straight after a commit:
    # tests/kv/test_lifecycle.py), but the refused uses above set it to used_during_commit
    with pytest.raises(kv.KVError) as info:
        await tr.get_read_version()
    assert info.value.code == 2017
    tr.reset()
    assert await tr.get(b"udc") == b"1"


async def _awaited(range_result):
    return await range_result

# --- the future-to-trio bridge ----------------------------------------------
#
# libfdb_c cannot be loaded here, so these drive the bridge with ContractFuture:
# the few operations the bridge calls on a FoundationDB future (is_ready,
# on_ready, cancel, and reading the result once ready), behaving as api-c.rst
# documents them: fdb_future_set_callback calls back inline when the future is
# already ready, otherwise later on another thread (the network thread);
# fdb_future_cancel makes a pending future fail with operation_cancelled (1101)
# and fires its callbacks. It models no transaction or cluster behaviour; what
# it cannot show is the ctypes trampoline and libfdb_c's real threads.


class _FutureError(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class ContractFuture:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._value: object = None
        self._error: BaseException | None = None
        self._callbacks: list = []
        self.cancel_calls = 0

    def is_ready(self) -> bool:
        with self._lock:
            return self._ready

    def on_ready(self, callback) -> None:
        with self._lock:
            if not self._ready:
                self._callbacks.append(callback)
                return
        callback(self)  # already ready: inline, in the caller's thread

    def resolve(self, value: object = None, error: BaseException | None = None) -> None:
        """Set the future (from whatever thread calls this) and fire its callbacks there."""
        with self._lock:
            if self._ready:
                return
            self._ready, self._value, self._error = True, value, error
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def resolve_from_thread(self, value: object = None) -> None:
        t = threading.Thread(target=self.resolve, args=(value,), name="fake-network-thread")
        t.start()
        t.join()

    def cancel(self) -> None:
        self.cancel_calls += 1
        self.resolve(error=_FutureError(1101))

    def wait(self) -> object:
        assert self._ready, "the bridge read a future that was not ready (that blocks the event loop)"
        if self._error is not None:
            raise self._error
        return self._value

    @property
    def value(self) -> object:
        return self.wait()


async def test_bridge_parks_without_blocking_and_wakes_from_another_thread():
    fut = ContractFuture()
    got: list = []

    async def reader():
        got.append(await fdb_backend._result(fut, lambda f: f.wait()))

    with trio.fail_after(10):  # a hang guard, not a timing assertion
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()  # the loop runs while the reader waits
            assert got == [] and not fut.is_ready()
            await trio.to_thread.run_sync(fut.resolve_from_thread, b"value")
    assert got == [b"value"]


async def test_bridge_survives_a_callback_made_inline_by_on_ready():
    # The future becomes ready between is_ready() and on_ready(): libfdb_c then calls
    # back inline, on the trio thread, before the task has parked.
    class ReadyDuringRegistration(ContractFuture):
        def is_ready(self) -> bool:
            return False

        def on_ready(self, callback) -> None:
            self.resolve(b"late")
            super().on_ready(callback)

    fut = ReadyDuringRegistration()
    with trio.fail_after(10):
        assert await fdb_backend._result(fut, lambda f: f.wait()) == b"late"


async def test_cancelled_read_cancels_its_future():
    fut = ContractFuture()
    with trio.CancelScope() as scope:
        scope.cancel()
        await fdb_backend._result(fut, lambda f: f.wait())
    assert scope.cancelled_caught
    assert fut.cancel_calls == 1
    fut.resolve(b"too late")  # a late answer finds nobody parked: no TrioInternalError
    await trio.testing.wait_all_tasks_blocked()


async def test_cancelled_wait_leaves_a_watch_armed():
    fut = ContractFuture()
    w = fdb_backend.FDBWatch(fut)
    with trio.CancelScope() as scope:
        scope.cancel()
        await w
    assert scope.cancelled_caught
    assert fut.cancel_calls == 0 and not w.ready  # still watching, as the embedded engine's Watch
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.wait)
        await trio.testing.wait_all_tasks_blocked()
        await trio.to_thread.run_sync(fut.resolve_from_thread, None)
    assert w.ready
    w.cancel()  # after it fired: harmless


async def test_cancelled_wait_leaves_a_versionstamp_pending():
    fut = ContractFuture()
    stamp = fdb_backend._Versionstamp(fut)
    with trio.CancelScope() as scope:
        scope.cancel()
        await stamp
    assert scope.cancelled_caught and fut.cancel_calls == 0
    fut.resolve(b"\x00" * 9 + b"\x01")
    assert await stamp == b"\x00" * 9 + b"\x01"


# --- the backend over the real bindings and the stand-in libfdb_c -------------
#
# The conformance suite's fdb-capi cases run everything through kv/fdb_backend.py ->
# fdb/impl.py -> tests/kv/fake_libfdb_c.py (docs/fdb-testing.md). These check paths
# the suite does not pin down: that the real bindings are what runs, paging through
# the C API's batches, FoundationDB's error texts, and the stand-in's own contract.


@pytest.fixture
async def capi(tmp_path):
    from kvtest_helpers import check_stand_in, open_stand_in

    database = await open_stand_in(tmp_path / "capi")
    try:
        yield database
    finally:
        await database.close()
        check_stand_in()


async def test_the_real_bindings_run_over_the_stand_in(capi):
    import fake_libfdb_c
    import fdb
    import fdb.impl

    assert fdb.impl._capi is fake_libfdb_c.LIBRARY and fdb.get_api_version() == fdb_backend.DEFAULT_API_VERSION
    assert isinstance(capi._db, fdb.impl.Database)
    tr = capi.create_transaction()
    assert type(tr._tr) is fdb.impl.Transaction
    tr.set(b"k", b"v")
    assert await tr.get(b"k") == b"v"
    w = tr.watch(b"k")
    await tr.commit()
    before = fake_libfdb_c.calls["fdb_future_set_callback"]
    with trio.fail_after(30):  # a hang guard
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.wait)
            await trio.testing.wait_all_tasks_blocked()  # parked on the watch's future
            assert fake_libfdb_c.calls["fdb_future_set_callback"] == before + 1 and not w.ready

            async def change(t):  # idempotent: a plain set
                t.set(b"k", b"changed")

            await capi.transact(change)
    assert w.ready  # woken by the callback, run through impl's CFUNCTYPE on the network thread


async def test_range_reads_page_through_the_c_api_batches(capi):
    import fake_libfdb_c

    rows = [(b"p%04d" % i, bytes([i % 251]) * 100) for i in range(400)]  # ~52 KB

    async def fill(tr):  # idempotent: plain sets
        for k, v in rows:
            tr.set(k, v)

    await capi.transact(fill)
    tr = capi.create_transaction()
    batches = fake_libfdb_c.calls["fdb_transaction_get_range"]
    assert [(r.key, r.value) async for r in tr.get_range(b"p", b"q")] == rows
    # iterator mode: 4096, 6144, 9216, ... bytes per batch (fdb_c.cpp), so several batches
    assert fake_libfdb_c.calls["fdb_transaction_get_range"] - batches >= 4
    assert [(r.key, r.value) async for r in tr.get_range(b"p", b"q", reverse=True)] == rows[::-1]
    assert [(r.key, r.value) for r in await tr.get_range(b"p", b"q")] == rows  # want_all
    assert [r.key for r in await tr.get_range(b"p", b"q", limit=250)] == [k for k, _ in rows[:250]]  # exact
    assert [r.key for r in await tr.get_range(b"p", b"q", limit=3, reverse=True)] == [k for k, _ in rows[:-4:-1]]
    got = []
    async for r in tr.get_range(b"p", b"q", limit=170):  # iterator with a limit across batches
        got.append(r.key)
    assert got == [k for k, _ in rows[:170]]
    sel = kv.KeySelector.first_greater_than(b"p0009")
    assert [r.key for r in await tr.get_range(sel, b"p0012")] == [b"p0010", b"p0011"]


async def test_errors_carry_foundationdb_codes_and_texts(capi):
    tr = capi.create_transaction()
    await tr.get(b"c")
    tr.set(b"c", b"1")

    async def other(t):  # idempotent: a plain set
        t.set(b"c", b"2")

    await capi.transact(other)
    with pytest.raises(kv.KVError) as info:
        await tr.commit()
    assert info.value.code == 1020 and info.value.retryable
    assert info.value.description == "Transaction not committed due to conflict with another transaction"


async def test_libfdb_c_defers_a_void_calls_error_to_the_next_read(capi):
    # Why the backend checks keys, ranges and options itself: through the bindings
    # alone a bad write returns normally and fails the transaction's next read.
    import fdb

    raw = capi._db.create_transaction()
    raw.set(b"\xff\x01", b"v")  # no error here
    with pytest.raises(fdb.FDBError) as info:
        await trio.to_thread.run_sync(lambda: raw.get(b"a").wait())  # impl's blocking wait, in a thread
    assert info.value.code == 2004
    raw.reset()
    assert await trio.to_thread.run_sync(lambda: raw.get(b"a").value) is None  # reset cleared it


async def test_the_stand_in_refuses_what_it_does_not_model(capi):
    import fake_libfdb_c

    raw = capi._db.create_transaction()
    with pytest.raises(fake_libfdb_c.StandInError, match="fdb_transaction_get_estimated_range_size_bytes"):
        raw.get_estimated_range_size_bytes(b"a", b"b")
    with pytest.raises(fake_libfdb_c.StandInError, match="causal_read_risky"):
        raw.options.set_causal_read_risky()


class _GatedStore:
    """A memory store whose commits wait at a gate the test opens (from the stand-in's
    network thread's point of view: a commit in flight as long as the test likes)."""

    def __new__(cls):
        from kv.memory import MemoryStore

        class Gated(MemoryStore):
            def __init__(self) -> None:
                super().__init__()
                self.entered = threading.Event()
                self.gate = threading.Event()

            def can_apply_inline(self, mutations: int) -> bool:
                return False

            async def apply(self, version, mutations) -> None:
                self.entered.set()
                await trio.to_thread.run_sync(self.gate.wait)
                await super().apply(version, mutations)

        return Gated()


@pytest.mark.stand_in
async def test_a_read_during_a_commit_in_flight_is_refused_before_libfdb_c(tmp_path):
    # libfdb_c fails a commit in flight with used_during_commit (2017) when anything else
    # uses its transaction (RYW checkUsedDuringCommit -> resetPromise), whatever the commit
    # underneath does; the backend reports that as 1021. So the backend refuses the use
    # itself (_usable), and the commit's real outcome is reported.
    from kv.engine import Engine
    from kvtest_helpers import check_stand_in, open_stand_in

    store = _GatedStore()
    db = await open_stand_in(tmp_path / "gated", factory=lambda: kv.Database(Engine(store), url="gated"))
    try:
        tr = db.create_transaction()
        tr.set(b"k", b"v")
        outcome: list = []

        async def commit():
            try:
                await tr.commit()
                outcome.append("committed")
            except kv.KVError as e:
                outcome.append(e.code)

        with trio.fail_after(30):  # a hang guard
            async with trio.open_nursery() as nursery:
                nursery.start_soon(commit)
                await trio.to_thread.run_sync(store.entered.wait)  # the commit is in flight
                # (not get_read_version: RYW answers it during a commit, and the stand-in would
                # queue it behind this gated one)
                for use in (lambda: tr.get(b"k"), lambda: tr.snapshot.get(b"x")):
                    with raises_code(2017):
                        await use()
                with raises_code(2017):
                    tr.set(b"k2", b"v")
                store.gate.set()
        assert outcome == ["committed"]
        assert tr.get_committed_version() > 0

        # ... which is what libfdb_c does to the bindings on their own:
        import fdb

        store.gate.clear()
        store.entered.clear()
        raw = db._db.create_transaction()
        raw.set(b"r", b"1")
        commit_future = raw.commit()
        await trio.to_thread.run_sync(store.entered.wait)
        with pytest.raises(fdb.FDBError) as info:
            await trio.to_thread.run_sync(lambda: raw.get(b"r").value)
        assert info.value.code == 2017
        store.gate.set()
        with pytest.raises(fdb.FDBError) as info:
            await trio.to_thread.run_sync(commit_future.wait)
        assert info.value.code == 2017  # although the commit underneath carries on and lands:
        with trio.fail_after(30):
            while await db.transact(lambda t: t.get(b"r")) != b"1":
                await trio.sleep(0.01)
    finally:
        store.gate.set()
        await db.close()
        check_stand_in()


async def test_a_watch_outlives_its_destroyed_transaction(capi):
    # FoundationDB: a committed transaction's watch belongs to the database. The backend
    # drops its transaction once transact() returns; impl destroys it when collected.
    import gc

    import fake_libfdb_c

    async def arm(tr):
        await tr.get(b"w")
        return tr.watch(b"w")

    w = await capi.transact(arm)
    destroyed = fake_libfdb_c.calls["fdb_transaction_destroy"]
    gc.collect()
    assert fake_libfdb_c.calls["fdb_transaction_destroy"] > destroyed  # the transaction is gone

    async def change(tr):  # idempotent: a plain set
        tr.set(b"w", b"1")

    await capi.transact(change)
    with trio.fail_after(30):  # a hang guard: the watch must still fire
        await w
    assert w.ready
