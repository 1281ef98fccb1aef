"""The FoundationDB backend: kv's API over the official Python bindings.

Kept deliberately thin: every semantic (conflicts, versionstamps, retry
classification, backoff) is the cluster's own; this module only

* loads the bindings (``fdb.api_version(800)`` by default, 730 for a 7.3
  cluster through an external client; ``SUREFOOT_FDB_API_VERSION`` overrides),
  lazily, so importing ``kv`` never needs libfdb_c;
* bridges FoundationDB futures into trio without blocking the event loop or
  the network thread (the recipe in ``fdb-semantics.md`` section 1): the
  future's ``on_ready`` callback runs on the network thread and only calls
  ``token.run_sync_soon(wake)``; ``wake`` reschedules the parked task; a trio
  cancellation cancels a read's FoundationDB future, but not a watch's or a
  versionstamp's, which the caller still holds (as on the embedded engine);
* shields ``commit`` from cancellation (a cancelled commit "may or may not
  occur") and reports a commit interrupted from outside as
  ``commit_unknown_result`` (1021), which callers already treat as maybe
  committed;
* maps ``fdb.FDBError`` to :class:`kv.KVError` with the same code, and checks
  key/value sizes, the legal key range, inverted ranges, versionstamp
  templates, option values and any use after ``commit()`` started on the
  client, so those errors are raised at once, exactly as the embedded engine
  raises them (libfdb_c defers most of them, and a use during a commit in
  flight would fail that commit; see ``FDBTransaction._usable``);
* presents the rest of the API as the embedded engine does (kv/transaction.py):
  ``on_error`` takes a code, ``get_committed_version`` raises until a commit
  succeeded, ``get_versionstamp`` is one awaitable per attempt, options take
  any number of ms.

It cannot run on machines without libfdb_c; :func:`open_fdb` then raises
:class:`FDBUnavailableError` saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, TypeVar

import trio

from .errors import KVError
from .limits import KEY_SIZE_LIMIT, SYSTEM_KEY_PREFIX, VALUE_SIZE_LIMIT, check_size_limit
from .selectors import KeySelector

__all__ = [
    "open_fdb",
    "FDBDatabase",
    "FDBTransaction",
    "FDBWatch",
    "FDBUnavailableError",
    "DEFAULT_API_VERSION",
    "SUPPORTED_API_VERSIONS",
]

log = logging.getLogger(__name__)

DEFAULT_API_VERSION = 800
# 800: a FoundationDB 8.x client; 730: a 7.3 cluster via an external client library
# (the binding always passes header version 800, see fdb-semantics.md section 1).
SUPPORTED_API_VERSIONS = frozenset({730, 800})
API_VERSION_ENV = "SUREFOOT_FDB_API_VERSION"

# Atomic opcodes (fdb/fdboptions.py MutationType); the binding's generated
# methods are thin wrappers over _atomic_operation(opcode, key, param).
_OPCODES = {
    "add": 2,
    "bit_and": 6,
    "bit_or": 7,
    "bit_xor": 8,
    "append_if_fits": 9,
    "max": 12,
    "min": 13,
    "set_versionstamped_key": 14,
    "set_versionstamped_value": 15,
    "byte_min": 16,
    "byte_max": 17,
    "compare_and_clear": 20,
}

# FoundationDB error codes this module produces itself.
_COMMIT_UNKNOWN_RESULT = 1021
_TRANSACTION_CANCELLED = 1025
_TIMED_OUT = 1031
_OPERATION_CANCELLED = 1101
_CLIENT_INVALID_OPERATION = 2000
_USED_DURING_COMMIT = 2017
_KEY_OUTSIDE_LEGAL_RANGE = 2004
_INVERTED_RANGE = 2005
_KEY_TOO_LARGE = 2102
_VALUE_TOO_LARGE = 2103

T = TypeVar("T")


class FDBUnavailableError(RuntimeError):
    """The FoundationDB client library (libfdb_c) cannot be loaded here."""


_fdb: Any = None  # the `fdb` module once api_version() succeeded
# open_fdb runs _load in a worker thread, so two opens at once would race into
# fdb.api_version(), whose guard (the module global _version) is set only at its
# end: both threads would call fdb_select_api_version_impl, which "is not thread
# safe, and if called from more than one thread simultaneously its behavior is
# undefined" and otherwise fails the second call with api_version_already_set
# (api-c.rst; bindings/c/fdb_c.cpp), which the binding reports as a bare
# "FoundationDB API error" and _select would misreport as FDBUnavailableError.
_load_lock = threading.Lock()


def _load(api_version: int) -> Any:
    """Select the API version (once per process) and return the fdb module."""
    if api_version not in SUPPORTED_API_VERSIONS:
        raise ValueError(f"unsupported FoundationDB API version {api_version}; use one of {sorted(SUPPORTED_API_VERSIONS)}")
    import fdb

    with _load_lock:
        return _select(fdb, api_version)


def _select(fdb: Any, api_version: int) -> Any:
    global _fdb
    if fdb.is_api_version_selected():
        if fdb.get_api_version() != api_version:
            raise RuntimeError(
                f"FoundationDB API version {fdb.get_api_version()} already selected in this process; cannot use {api_version}"
            )
    else:
        try:
            fdb.api_version(api_version)  # imports fdb.impl, which dlopens libfdb_c
        except Exception as e:  # the binding raises a bare Exception when the library is missing
            raise FDBUnavailableError(
                "cannot load the FoundationDB client library (libfdb_c) for API version "
                f"{api_version}: {e}. Install the foundationdb-clients package for your cluster "
                "(https://github.com/apple/foundationdb/releases) or use the embedded engine "
                "(a path, lmdb:PATH or memory:)."
            ) from e
    _fdb = fdb
    return fdb


def _to_kverror(e: BaseException) -> KVError:
    code = getattr(e, "code", 4100)
    try:
        desc = e.description  # type: ignore[attr-defined]  # asks libfdb_c for the text
        if isinstance(desc, bytes):
            desc = desc.decode("utf-8", "replace")
    except Exception:
        desc = None
    return KVError(code, desc)


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    """Re-raise FoundationDB's FDBError as KVError with the same code."""
    try:
        yield
    except KVError:
        raise
    except Exception as e:
        if _fdb is not None and isinstance(e, _fdb.FDBError):
            raise _to_kverror(e) from None
        raise


# --- the trio bridge -------------------------------------------------------

async def _wait_ready(fut: Any, *, cancel_on_abort: bool = True) -> None:
    """Park the current task until FoundationDB future ``fut`` is ready.

    on_ready's callback runs on the network thread (or inline if the future
    is already ready); it must not block and its exceptions are dropped, so it
    only hands ``wake`` to trio's thread-safe FIFO entry queue.  ``wake`` must
    not raise either (it would become TrioInternalError), so it checks state.

    A trio cancellation aborts the wait. For a one-shot read the future is
    then cancelled too (nobody else will ask for it). A watch or versionstamp
    future (``cancel_on_abort=False``) is a standing object the caller still
    holds: cancelling it because one wait was cancelled would turn the next
    ``await`` of the same watch into operation_cancelled (1101), where the
    embedded engine's ``Watch``/versionstamp (trio Events) stay live. Its
    callback then fires later and finds nobody parked. (libfdb_c allows any
    number of callbacks per future: ThreadSingleAssignmentVarBase's
    callOrSetAsCallback adds a ThreadMultiCallback; flow/ThreadHelper.actor.h.)
    """
    if fut.is_ready():
        await trio.lowlevel.checkpoint()
        return
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    state = {"parked": True}

    def wake() -> None:
        if state["parked"]:
            state["parked"] = False
            trio.lowlevel.reschedule(task)

    def on_ready(_f: Any) -> None:  # network thread
        try:
            token.run_sync_soon(wake)
        except trio.RunFinishedError:
            pass

    def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
        state["parked"] = False
        if cancel_on_abort:
            fut.cancel()
        return trio.lowlevel.Abort.SUCCEEDED

    fut.on_ready(on_ready)
    await trio.lowlevel.wait_task_rescheduled(abort)


async def _result(fut: Any, getter: Callable[[Any], T], *, cancel_on_abort: bool = True) -> T:
    await _wait_ready(fut, cancel_on_abort=cancel_on_abort)
    with _mapped():
        return getter(fut)


# --- results ---------------------------------------------------------------

def _key_value_type() -> Any:
    from . import KeyValue  # the package's own type, resolved late (kv imports us lazily)

    return KeyValue


def _bytes(x: Any, what: str = "keys") -> bytes:
    """``x`` as bytes, refusing anything that is not bytes-like.

    ``bytes(x)`` is not a conversion to rely on: ``bytes(5)`` is five zero
    bytes and ``bytes([1, 2])`` a two-byte key, so a wrong argument would be
    written under a silently different key. The embedded engine raises
    TypeError for such arguments (kv/transaction.py ``_check_write_key``), and
    so do the bindings' own ``keyToBytes``/``valueToBytes`` (fdb/impl.py).
    """
    if type(x) is bytes:
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise TypeError(f"{what} are bytes, not {type(x).__name__}")


def _check_key(key: bytes, *, for_write: bool) -> bytes:
    key = _bytes(key)
    if for_write and len(key) > KEY_SIZE_LIMIT:
        raise KVError(_KEY_TOO_LARGE)
    if key >= SYSTEM_KEY_PREFIX:
        raise KVError(_KEY_OUTSIDE_LEGAL_RANGE)
    return key


def _check_value(value: bytes) -> bytes:
    value = _bytes(value, "values")
    if len(value) > VALUE_SIZE_LIMIT:
        raise KVError(_VALUE_TOO_LARGE)
    return value


def _check_range(begin: bytes, end: bytes) -> tuple[bytes, bytes]:
    begin, end = _bytes(begin), _bytes(end)
    if begin > end:
        raise KVError(_INVERTED_RANGE)
    if end > SYSTEM_KEY_PREFIX:
        raise KVError(_KEY_OUTSIDE_LEGAL_RANGE)
    return begin, end


def _check_stamp_offset(param: bytes, what: str) -> None:
    offset = int.from_bytes(param[-4:], "little")
    if offset + 10 > len(param) - 4:
        raise KVError(_CLIENT_INVALID_OPERATION, f"versionstamp offset {offset} does not fit the {what}")


def _strinc(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (fdb.impl.strinc)."""
    p = _bytes(prefix).rstrip(b"\xff")
    if not p:
        raise ValueError("key must contain at least one byte not equal to 0xFF")
    return p[:-1] + bytes([p[-1] + 1])


def _selector(x: Any) -> Any:
    """kv.KeySelector or bytes -> fdb.KeySelector."""
    if isinstance(x, KeySelector) or hasattr(x, "or_equal"):
        return _fdb.KeySelector(_bytes(x.key), bool(x.or_equal), int(x.offset))
    return _fdb.KeySelector.first_greater_or_equal(_bytes(x))


class FDBRangeResult:
    """``get_range``'s result: ``await`` it for a list, or ``async for`` over it.

    Paging re-implements ``fdb.impl.FDBRange.__iter__`` over the private
    ``tr._get_range`` so each page is a future we can await.
    """

    def __init__(self, tr: "FDBTransaction", begin: Any, end: Any, limit: int, reverse: bool) -> None:
        self._tr = tr
        self._begin = begin
        self._end = end
        self._limit = limit
        self._reverse = reverse

    def __await__(self):
        return self._to_list().__await__()

    async def _to_list(self) -> list:
        mode = _fdb.StreamingMode.exact if self._limit > 0 else _fdb.StreamingMode.want_all
        return [kv_ async for kv_ in self._iterate(mode)]

    def __aiter__(self) -> AsyncIterator:
        return self._iterate(_fdb.StreamingMode.iterator)

    async def _iterate(self, mode: int) -> AsyncIterator:
        KeyValue = _key_value_type()
        bsel, esel = _selector(self._begin), _selector(self._end)
        limit, iteration = self._limit, 1
        while True:
            self._tr._usable()
            with _mapped():
                fut = self._tr._read._get_range(bsel, esel, limit, mode, iteration, self._reverse)
            kvs, count, more = await _result(fut, lambda f: f.wait())
            for item in kvs:
                yield KeyValue(item.key, item.value)
            if not count or not more or (limit > 0 and count >= limit):
                return
            if limit > 0:
                limit -= count
            iteration += 1
            if self._reverse:
                esel = _fdb.KeySelector.first_greater_or_equal(kvs[-1].key)
            else:
                bsel = _fdb.KeySelector.first_greater_than(kvs[-1].key)


class FDBWatch:
    """A watch: ``await w`` (or ``await w.wait()``) returns once the key changed
    after the creating transaction committed; ``cancel()`` frees it."""

    def __init__(self, fut: Any) -> None:
        self._fut = fut
        self._done = False

    @property
    def ready(self) -> bool:
        return self._done or bool(self._fut.is_ready())

    async def wait(self) -> None:
        # A cancelled wait leaves the watch armed (see _wait_ready); cancel() frees it.
        await _result(self._fut, lambda f: f.wait(), cancel_on_abort=False)
        self._done = True

    def __await__(self):
        return self.wait().__await__()

    def cancel(self) -> None:
        self._fut.cancel()


class _Versionstamp:
    """``tr.get_versionstamp()``: awaitable to the 10-byte stamp after commit."""

    def __init__(self, fut: Any) -> None:
        self._fut = fut

    def __await__(self):
        return _result(self._fut, lambda f: bytes(f.value), cancel_on_abort=False).__await__()


class _Options:
    """``tr.options``: FoundationDB's transaction options, called as on the embedded engine.

    The bindings' setters are not a drop-in: an int option is
    ``struct.pack("<q", param)`` (fdb/impl.py option_wrap_int), so
    ``set_timeout(1500.0)`` raised struct.error where the embedded engine takes
    any number of ms; ``fdb_transaction_set_option`` errors come back as
    ``fdb.FDBError``, not KVError; and libfdb_c defers a bad value
    (ThreadSafeTransaction::setOption runs it on the network thread), so a size
    limit out of range failed only at the next read or commit, where the
    embedded engine raises invalid_option_value (2006) at once. Any other
    FoundationDB option is passed through with its errors mapped.
    """

    __slots__ = ("_opts",)

    def __init__(self, opts: Any) -> None:
        self._opts = opts

    def _set(self, name: str, *args: Any) -> None:
        with _mapped():
            getattr(self._opts, name)(*args)

    def set_timeout(self, ms: float) -> None:
        self._set("set_timeout", int(ms))

    def set_retry_limit(self, n: int) -> None:
        self._set("set_retry_limit", int(n))

    def set_max_retry_delay(self, ms: float) -> None:
        self._set("set_max_retry_delay", int(ms))

    def set_size_limit(self, nbytes: int) -> None:
        self._set("set_size_limit", check_size_limit(nbytes))

    def set_next_write_no_write_conflict_range(self) -> None:
        self._set("set_next_write_no_write_conflict_range")

    def __getattr__(self, name: str) -> Callable[..., None]:
        setter = getattr(self._opts, name)

        def set_option(*args: Any) -> None:
            with _mapped():
                setter(*args)

        return set_option


class FDBTransaction:
    """kv's Transaction over ``fdb.impl.Transaction`` (or its snapshot view)."""

    def __init__(self, db: "FDBDatabase", tr: Any, *, snapshot_of: "FDBTransaction | None" = None) -> None:
        self.db = db
        self._tr = tr if snapshot_of is None else snapshot_of._tr
        self._read = tr if snapshot_of is None else snapshot_of._tr.snapshot
        self._is_snapshot = snapshot_of is not None
        self._owner: FDBTransaction = self if snapshot_of is None else snapshot_of  # holds the state below
        self._snapshot_view: FDBTransaction | None = None
        # FoundationDB: every use after commit() started (until reset/on_error) is
        # used_during_commit. It is checked here, before libfdb_c sees the call, for
        # every read and write (see _usable).
        self._commit_started = False
        # libfdb_c's RYW resetPromise as we know it, as the code it fails with (0: not
        # set): cancel() and a failed on_error set 1025, a call refused as used during
        # commit 2017 (checkUsedDuringCommit sets it then); until reset or an on_error
        # that retries. Raised at the call, as on the embedded engine (see _usable), and
        # by on_error, which RYW fails with it before anything else.
        self._cancelled = 0
        # Set once commit() succeeded, until reset/on_error: get_committed_version
        # is only defined then (api-c.rst: "fdb_transaction_commit() must have been
        # called ... and the resulting future must be ready and not an error ... or
        # the behavior is undefined"; in practice it returns -1, the read-only answer).
        self._committed = False
        # One versionstamp future per attempt, as the embedded engine hands out one
        # _Deferred until reset: sessions/journal.py recognises an attempt by it (a
        # new object per call cost every journal emit an extra snapshot read).
        self._stamp: _Versionstamp | None = None

    def _usable(self) -> None:
        """used_during_commit (2017) once commit() started, before libfdb_c sees the call.

        libfdb_c must not see it: ReadYourWritesTransaction::checkUsedDuringCommit
        sends used_during_commit into the transaction's resetPromise, and
        RYWImpl::commit waits on ``resetPromise || tr.commit()`` (fdbclient/
        ReadYourWrites.actor.cpp), so one read, watch or get_versionstamp from
        another task while a commit is in flight made that commit fail with 2017
        although the commit underneath carried on and may have landed. libfdb_c
        also reports a write's 2017 only at the next read or commit. The embedded
        engine refuses all of these at the call (kv/transaction.py _check_usable).

        Likewise transaction_cancelled (1025) after cancel(): libfdb_c defers a
        write's error (ThreadSafeTransaction::set runs it on the network thread
        into the transaction's deferredError), so ``tr.set`` after ``tr.cancel()``
        returned normally, and a commit's 1025 came from its future, where
        :meth:`commit` would report it as commit_unknown_result (1021) although
        nothing was sent.
        """
        owner = self._owner
        # In RYW's order: checkUsedDuringCommit() before resetPromise, in every call.
        if owner._commit_started:
            if not owner._cancelled:  # as libfdb_c would have (we keep the call from it)
                owner._cancelled = _USED_DURING_COMMIT
            raise KVError(_USED_DURING_COMMIT)
        if owner._cancelled:
            raise KVError(owner._cancelled)

    # -- reads --
    @property
    def snapshot(self) -> "FDBTransaction":
        if self._is_snapshot:
            return self
        if self._snapshot_view is None:
            self._snapshot_view = FDBTransaction(self.db, None, snapshot_of=self)
        return self._snapshot_view

    @property
    def options(self) -> _Options:
        """FoundationDB's transaction options (set_timeout(ms), set_retry_limit(n),
        set_max_retry_delay(ms), set_size_limit(n), set_next_write_no_write_conflict_range(),
        ...), errors as KVError (see :class:`_Options`)."""
        return _Options(self._tr.options)

    async def get(self, key: bytes) -> bytes | None:
        self._usable()
        with _mapped():
            fut = self._read.get(_bytes(key))
        return await _result(fut, lambda f: f.value)

    async def get_multi(self, keys: Iterable[bytes]) -> list[bytes | None]:
        self._usable()
        with _mapped():
            futs = [self._read.get(_bytes(k)) for k in keys]  # all in flight at once
        return [await _result(f, lambda f: f.value) for f in futs]

    async def get_key(self, selector: KeySelector) -> bytes:
        self._usable()
        with _mapped():
            fut = self._read.get_key(_selector(selector))
        return await _result(fut, lambda f: bytes(f.value))

    def get_range(self, begin: Any, end: Any, *, limit: int = 0, reverse: bool = False) -> FDBRangeResult:
        begin = b"" if begin is None else begin  # None means the whole legal keyspace, as in fdb
        end = SYSTEM_KEY_PREFIX if end is None else end
        if isinstance(begin, (bytes, bytearray)) and isinstance(end, (bytes, bytearray)) and begin > end:
            begin = end  # FoundationDB returns empty for begin >= end
        return FDBRangeResult(self, begin, end, int(limit), bool(reverse))

    def get_range_startswith(self, prefix: bytes, *, limit: int = 0, reverse: bool = False) -> FDBRangeResult:
        return self.get_range(prefix, _strinc(prefix), limit=limit, reverse=reverse)

    async def get_read_version(self) -> int:
        # RYW getReadVersion checks resetPromise only, not checkUsedDuringCommit: safe to hand
        # to libfdb_c during a commit in flight (it neither fails nor poisons it), and answered
        # after the commit too.
        if self._owner._cancelled:
            raise KVError(self._owner._cancelled)
        with _mapped():
            fut = self._tr.get_read_version()
        return await _result(fut, lambda f: f.wait())

    # -- writes --
    def set(self, key: bytes, value: bytes) -> None:
        self._usable()
        key, value = _check_key(key, for_write=True), _check_value(value)
        with _mapped():
            self._tr.set(key, value)

    def clear(self, key: bytes) -> None:
        self._usable()
        key = _check_key(key, for_write=False)  # an oversize key cannot exist: FoundationDB's own rule applies
        with _mapped():
            self._tr.clear(key)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self._usable()
        begin, end = _check_range(begin, end)
        with _mapped():
            self._tr.clear_range(begin, end)

    def clear_range_startswith(self, prefix: bytes) -> None:
        self.clear_range(prefix, _strinc(prefix))

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.set(key, value)

    def _atomic(self, name: str, key: bytes, param: bytes) -> None:
        self._usable()
        key, param = _check_key(key, for_write=True), _check_value(param)
        with _mapped():
            self._tr._atomic_operation(_OPCODES[name], key, param)

    def add(self, key: bytes, param: bytes) -> None:
        self._atomic("add", key, param)

    def bit_and(self, key: bytes, param: bytes) -> None:
        self._atomic("bit_and", key, param)

    def bit_or(self, key: bytes, param: bytes) -> None:
        self._atomic("bit_or", key, param)

    def bit_xor(self, key: bytes, param: bytes) -> None:
        self._atomic("bit_xor", key, param)

    def max(self, key: bytes, param: bytes) -> None:
        self._atomic("max", key, param)

    def min(self, key: bytes, param: bytes) -> None:
        self._atomic("min", key, param)

    def byte_min(self, key: bytes, param: bytes) -> None:
        self._atomic("byte_min", key, param)

    def byte_max(self, key: bytes, param: bytes) -> None:
        self._atomic("byte_max", key, param)

    def append_if_fits(self, key: bytes, param: bytes) -> None:
        self._atomic("append_if_fits", key, param)

    def compare_and_clear(self, key: bytes, param: bytes) -> None:
        self._atomic("compare_and_clear", key, param)

    def set_versionstamped_key(self, key: bytes, value: bytes) -> None:
        self._usable()
        key, value = _bytes(key), _check_value(value)
        # libfdb_c reports a malformed stamp template only at the next read or
        # commit (the C call is void); check it here so it raises at once, as on
        # the embedded engine. The 4-byte offset suffix is not part of the key.
        if len(key) < 14:
            raise KVError(_CLIENT_INVALID_OPERATION, "a versionstamped key needs at least 14 bytes")
        _check_stamp_offset(key, "key")
        _check_key(key[:-4], for_write=True)
        with _mapped():
            self._tr._atomic_operation(_OPCODES["set_versionstamped_key"], key, value)

    def set_versionstamped_value(self, key: bytes, value: bytes) -> None:
        self._usable()
        key = _check_key(key, for_write=True)
        value = _bytes(value, "values")
        if len(value) < 4:
            raise KVError(_CLIENT_INVALID_OPERATION, "a versionstamped value needs a 4-byte offset suffix")
        _check_stamp_offset(value, "value")
        if len(value) - 4 > VALUE_SIZE_LIMIT:
            raise KVError(_VALUE_TOO_LARGE)
        with _mapped():
            self._tr._atomic_operation(_OPCODES["set_versionstamped_value"], key, value)

    # -- conflict ranges --
    def add_read_conflict_range(self, begin: bytes, end: bytes) -> None:
        self._usable()
        begin, end = _check_range(begin, end)
        with _mapped():
            self._tr.add_read_conflict_range(begin, end)

    def add_read_conflict_key(self, key: bytes) -> None:
        key = _bytes(key)
        self.add_read_conflict_range(key, key + b"\x00")

    def add_write_conflict_range(self, begin: bytes, end: bytes) -> None:
        self._usable()
        begin, end = _check_range(begin, end)
        with _mapped():
            self._tr.add_write_conflict_range(begin, end)

    def add_write_conflict_key(self, key: bytes) -> None:
        key = _bytes(key)
        self.add_write_conflict_range(key, key + b"\x00")

    # -- lifecycle --
    def watch(self, key: bytes) -> FDBWatch:
        # ReadYourWritesTransaction::watch returns used_during_commit,
        # key_outside_legal_range and key_too_large as the watch future's error, so
        # they surfaced only at ``await w``; the embedded engine raises them here.
        self._usable()
        key = _check_key(key, for_write=True)
        with _mapped():
            return FDBWatch(self._tr.watch(key))

    def get_versionstamp(self) -> _Versionstamp:
        """Awaitable 10-byte versionstamp, ready after commit; the same object
        until reset()/on_error() starts a new attempt."""
        owner = self._owner
        if owner._stamp is None:
            self._usable()
            with _mapped():
                owner._stamp = _Versionstamp(self._tr.get_versionstamp())
        return owner._stamp

    def get_committed_version(self) -> int:
        """The commit's version (-1 for a read-only commit); KVError 2000 before a
        successful commit, as on the embedded engine (kv/transaction.py), which
        callers rely on to tell "committed" from "not yet" (sessions/coalesce.py
        ``_settle_inflight``). libfdb_c would answer -1 there, indistinguishable
        from a committed read-only transaction."""
        if not self._owner._committed:
            raise KVError(_CLIENT_INVALID_OPERATION, "transaction has not committed")
        with _mapped():
            return int(self._tr.get_committed_version())

    async def commit(self) -> None:
        """Commit; never abandoned half-way.

        The wait is shielded: cancelling a commit's future would leave its
        outcome unknown anyway, so we let it finish and report the real result.
        If the commit is nevertheless interrupted (the transaction cancelled
        from elsewhere, or the run shutting down), the caller gets 1021. So does
        a used_during_commit (2017) from the commit's future: RYWImpl::commit
        reports it when something used the transaction while the commit was in
        flight, whatever the commit underneath did (see :meth:`_usable`, which
        keeps this module from causing it).
        """
        self._usable()
        owner = self._owner
        # Cancellable until handed over, as on the embedded engine: Cancelled, nothing sent.
        await trio.lowlevel.checkpoint_if_cancelled()
        with _mapped():
            fut = self._tr.commit()
        owner._commit_started = True
        with trio.CancelScope(shield=True):
            try:
                await _wait_ready(fut)
                with _mapped():
                    fut.wait()
                owner._committed = True
            except KVError as e:
                if e.code in (_TRANSACTION_CANCELLED, _OPERATION_CANCELLED, _USED_DURING_COMMIT):
                    raise KVError(_COMMIT_UNKNOWN_RESULT, "commit interrupted; it may have committed") from e
                raise
            except (trio.Cancelled, KeyboardInterrupt, trio.RunFinishedError) as e:  # pragma: no cover - defensive
                raise KVError(_COMMIT_UNKNOWN_RESULT, "commit interrupted; it may have committed") from e

    async def on_error(self, error: BaseException | int) -> None:
        """FoundationDB's on_error: sleeps the backoff and resets for retryable
        errors, re-raises the others (as KVError). ``error`` may be an error code,
        as for the embedded engine and fdb's own ``Transaction.on_error``."""
        if isinstance(error, int) and not isinstance(error, bool):
            error = KVError(error)
        if not isinstance(error, KVError):
            raise error
        owner = self._owner
        if owner._cancelled:  # RYWImpl::onError throws a set resetPromise before anything else
            raise KVError(owner._cancelled)
        with _mapped():
            fut = self._tr.on_error(error.code)
        try:
            await _result(fut, lambda f: f.wait())
        except KVError as err:
            # A failed on_error leaves libfdb_c's transaction cancelled (RYWImpl::onError, API
            # >= 610: resetPromise.sendError(transaction_cancelled)) until reset(): raised at
            # the call from now on, as after cancel() (see _usable).
            if not owner._cancelled:
                # (1031: the timeout had run out, so libfdb_c's resetPromise holds
                # transaction_timed_out, which onError threw and left set)
                owner._cancelled = _TIMED_OUT if err.code == _TIMED_OUT else _TRANSACTION_CANCELLED
            raise
        self._owner._forget_attempt()  # on_error reset the transaction

    def reset(self) -> None:
        with _mapped():
            self._tr.reset()
        self._owner._forget_attempt()

    def _forget_attempt(self) -> None:
        self._commit_started = self._committed = False
        self._cancelled = 0
        self._stamp = None

    def cancel(self) -> None:
        with _mapped():
            self._tr.cancel()
        if not self._owner._cancelled:
            self._owner._cancelled = _TRANSACTION_CANCELLED


class FDBDatabase:
    """kv's Database over ``fdb.impl.Database``."""

    def __init__(self, db: Any, cluster_file: str | None, api_version: int) -> None:
        self._db = db
        self.cluster_file = cluster_file
        self.api_version = api_version
        self._closed = False

    def __repr__(self) -> str:
        return f"FDBDatabase(cluster_file={self.cluster_file!r}, api_version={self.api_version})"

    def create_transaction(self) -> FDBTransaction:
        if self._closed:
            raise KVError(_CLIENT_INVALID_OPERATION, "database is closed")
        with _mapped():
            return FDBTransaction(self, self._db.create_transaction())

    async def transact(
        self,
        fn: Callable[[FDBTransaction], Awaitable[T]],
        *,
        retry_limit: int | None = None,
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(tr)`` and commit, retrying through ``on_error`` (which
        retries 1020/1007/1009 *and* 1021: ``fn`` must be idempotent or guarded)."""
        tr = self.create_transaction()
        with _mapped():
            if retry_limit is not None:
                tr.options.set_retry_limit(int(retry_limit))
            if timeout is not None:
                tr.options.set_timeout(max(1, int(timeout * 1000)))
        while True:
            try:
                result = await fn(tr)
                await tr.commit()
                return result
            except KVError as e:
                await tr.on_error(e)

    async def close(self) -> None:
        # fdb.open caches one Database per cluster file for the process and the
        # network thread stops at exit; we only stop handing out transactions.
        self._closed = True
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> "FDBDatabase":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _api_version_from_env() -> int:
    raw = os.environ.get(API_VERSION_ENV)
    return int(raw) if raw else DEFAULT_API_VERSION


async def open_fdb(cluster_file: str | None = None, *, api_version: int | None = None) -> FDBDatabase:
    """Open a FoundationDB database (``None``: the default cluster file).

    Raises :class:`FDBUnavailableError` when libfdb_c cannot be loaded.
    """
    version = api_version if api_version is not None else _api_version_from_env()
    fdb = await trio.to_thread.run_sync(_load, version)  # dlopen and network setup off the event loop
    with _mapped():
        db = await trio.to_thread.run_sync(fdb.open, cluster_file or None)
    log.info("opened FoundationDB database %s at API version %d", cluster_file or "(default cluster file)", version)
    return FDBDatabase(db, cluster_file or None, version)
