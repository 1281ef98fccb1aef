"""A stand-in for libfdb_c, the FoundationDB C client, that the real bindings load.

No FoundationDB server or client library can be installed on these machines,
so the FoundationDB backend (kv/fdb_backend.py) and the official Python
bindings under it (fdb/impl.py) would otherwise never run. This module is an
object with the C library's functions, by name, that ``fdb.impl`` takes for
the shared library (:func:`install` makes its ``ctypes.CDLL(capi_name)``
return it). Everything above it is real: impl's ctypes plumbing (argtypes,
restype, errcheck -> FDBError, out-parameters through ``byref``, KeyValue
arrays read back with ``string_at``, callbacks through a ``CFUNCTYPE``
trampoline pinned with ``Py_IncRef``), its futures and network thread, and
our glue. Below it, the "cluster" is surefoot's own memory engine
(``kv.MemoryEngine``), which passes the whole conformance suite with
FoundationDB's semantics.

What it models, after bindings/c/fdb_c.cpp and the client (cited inline):

* futures: a handle table; ``fdb_future_set_callback`` calls back inline when
  the future is ready, otherwise once, on the network thread, when it becomes
  ready (CAPICallback); cancel/destroy set operation_cancelled (1101) if not
  ready; ``release_memory`` makes later getters future_released (1102);
  getters on a pending future are future_not_set (2015);
* the network: ``fdb_run_network`` runs a trio loop on impl's network thread
  until ``fdb_stop_network``; every operation is posted there (trio's
  thread-safe ``run_sync_soon``) and a transaction's operations run in the
  order they were issued, as ThreadSafeTransaction's ``onMainThread`` does;
* transactions: memory-engine transactions; the void calls (set, clear,
  atomic ops, conflict ranges, option values) report their errors as the
  transaction's deferred error, raised by its next read, watch or commit
  (RYW ``deferredError``/``checkDeferredError``), not at the call; a call
  while a commit is queued or in flight fails with used_during_commit (2017)
  and so does that commit, which carries on underneath (RYW
  ``checkUsedDuringCommit``), and every call after it until reset/on_error;
  ``get_range`` honours limit, target_bytes, the streaming mode and iteration
  byte budgets of ``validate_and_update_parameters`` (fdb_c.cpp), returning
  partial batches with ``more`` set; ``on_error`` backs off and resets for
  retryable codes and fails with the code otherwise (the memory transaction's
  rules, which are RYW's: transaction_cancelled after cancel, and a failed
  on_error leaves the transaction cancelled); ``get_committed_version``
  answers -1 until a commit succeeded;
* errors: FoundationDB's codes, texts from flow/error_definitions.h, and
  ``fdb_error_predicate`` as kv.errors classifies them.

What it cannot model (see docs/fdb-testing.md): libfdb_c's and a cluster's own
behaviour — real latency and batching, 1007/1009/1021 arising from a real
cluster, a timeout firing while an operation is pending, multiple clients and
processes, the multi-version client. Whatever impl asks that it cannot honestly
answer (tenants, split points, network options, most transaction options...)
raises :class:`StandInError` naming the C function, so a gap shows up as a
failing test, never as a silently wrong answer. Bugs of the stand-in itself on
the network thread are recorded in :data:`internal_errors` (the kv tests fail
on any) and the affected future fails with internal_error (4100).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import os
import struct
import threading
import traceback
from typing import Any, Callable

import trio

import kv
from kv import KVError, KeySelector
from kv.errors import MAYBE_COMMITTED, RETRYABLE_NOT_COMMITTED

log = logging.getLogger(__name__)

__all__ = ["StandInError", "install", "installed", "register_cluster", "internal_errors", "calls", "LIBRARY"]

MAX_API_VERSION = 800  # an 8.0 client library: fdb_get_max_api_version
_ROW_OVERHEAD = 32  # bytes a row counts beyond its key and value against a byte limit (sizeof(KeyValueRef))

# FoundationDB's texts for the codes the stand-in can produce (flow/include/flow/error_definitions.h).
ERROR_TEXT = {
    0: "Success",
    1007: "Transaction is too old to perform reads or be committed",
    1009: "Request for future version",
    1020: "Transaction not committed due to conflict with another transaction",
    1021: "Transaction may or may not have committed",
    1025: "Operation aborted because the transaction was cancelled",
    1031: "Operation aborted because the transaction timed out",
    1032: "Too many watches currently set",
    1036: "Read or wrote an unreadable key",
    1101: "Asynchronous operation cancelled",
    1102: "Future has been released",
    1515: "No cluster file found in current directory or default location",
    2000: "Invalid API call",
    2004: "Key outside legal range",
    2005: "Range begin key larger than end key",
    2006: "Option set with an invalid value",
    2007: "Option not valid in this context",
    2008: "Action not possible before the network is configured",
    2009: "Network can be configured only once",
    2015: "Future not ready",
    2017: "Operation issued while a commit was outstanding",
    2018: "Unrecognized atomic mutation type",
    2021: "Transaction is read-only and therefore does not have a commit version",
    2025: "Network can only be started once",
    2101: "Transaction exceeds byte limit",
    2102: "Key length exceeds limit",
    2103: "Value length exceeds limit",
    2201: "API version may be set only once",
    2202: "API version not valid",
    2203: "API version not supported",
    2210: "EXACT streaming mode requires limits, but none were given",
    4000: "An unknown error occurred",
    4100: "An internal error occurred",
}

# fdboptions.py ErrorPredicate
_RETRYABLE, _MAYBE_COMMITTED, _RETRYABLE_NOT_COMMITTED = 50000, 50001, 50002
# fdboptions.py StreamingMode
_WANT_ALL, _ITERATOR, _EXACT, _SERIAL = -2, -1, 0, 4
# fdb_c.cpp validate_and_update_parameters
_MODE_BYTES = (None, 256, 1000, 4096, 80000)  # exact, small, medium, large, serial (None: unlimited)
_ITERATION_BYTES = (4096, 6144, 9216, 13824, 20736, 31104, 46656, 69984, 80000, 120000)
# fdboptions.py ConflictRangeType
_CONFLICT_READ, _CONFLICT_WRITE = 0, 1
# fdboptions.py MutationType -> the memory transaction's method
_MUTATIONS = {2: "add", 6: "bit_and", 7: "bit_or", 8: "bit_xor", 9: "append_if_fits", 12: "max", 13: "min",
              14: "set_versionstamped_key", 15: "set_versionstamped_value", 16: "byte_min", 17: "byte_max",
              20: "compare_and_clear"}
# fdboptions.py TransactionOption codes the memory engine has (name, int range or None for no parameter)
_INT_MAX = 2**31 - 1
_TR_OPTIONS: dict[int, tuple[str, tuple[int, int] | None]] = {
    30: ("set_next_write_no_write_conflict_range", None),
    500: ("set_timeout", (0, _INT_MAX)),
    501: ("set_retry_limit", (-1, _INT_MAX)),
    502: ("set_max_retry_delay", (0, _INT_MAX)),
    503: ("set_size_limit", None),  # range checked by the memory engine (kv.limits.check_size_limit)
}


class StandInError(RuntimeError):
    """The bindings asked for something the stand-in cannot honestly give (or misused the C API)."""


#: Tracebacks of unexpected exceptions on the network thread (stand-in bugs).
internal_errors: list[str] = []
#: How often impl called each C function (tests check that a path really ran).
calls: collections.Counter[str] = collections.Counter()


class KeyValueC(ctypes.Structure):
    """``FDBKeyValue`` as foundationdb/fdb_c.h declares it (``#pragma pack(4)``)."""

    _pack_ = 4
    _fields_ = [("key", ctypes.c_void_p), ("key_length", ctypes.c_int),
                ("value", ctypes.c_void_p), ("value_length", ctypes.c_int)]


_MAX_READ_KEY = b"\xff"  # RYW getMaxReadKey() without the read_system_keys option


def _bound(sel: KeySelector) -> KeySelector | bytes:
    """A range bound as the memory engine takes it.

    first_greater_or_equal(k) and first_greater_than(k) (= first_greater_or_equal(k + \\x00))
    are plain key bounds: a range read between them reads, and conflicts on, exactly
    [begin, end) (less at a limit), as a cluster's does; any other selector is resolved
    by the memory engine, reading (and conflicting on) what it resolves through.
    """
    if sel.offset == 1:
        return sel.key + b"\x00" if sel.or_equal else sel.key
    return sel


# --- futures -----------------------------------------------------------------

_VOID, _INT64, _KEY, _VALUE, _KV_ARRAY = "void", "int64", "key", "value", "keyvalue_array"


class _Future:
    __slots__ = ("handle", "kind", "lock", "ready", "error", "result", "callbacks", "released", "buffers",
                 "on_cancel", "__weakref__")

    def __init__(self, handle: int, kind: str) -> None:
        self.handle = handle
        self.kind = kind
        self.lock = threading.RLock()  # (re-entrant: see StandInLibrary._lock)
        self.ready = False
        self.error = 0
        self.result: Any = None
        self.callbacks: list[tuple[Any, Any]] = []
        self.released = False
        self.buffers: list[Any] = []  # C memory handed out by getters, alive until release/destroy
        self.on_cancel: Callable[[], None] | None = None  # stops the operation (network thread)

    def complete(self, result: Any = None, error: int = 0) -> bool:
        """Set once (later calls are ignored); fires the callbacks on this thread."""
        with self.lock:
            if self.ready:
                return False
            self.ready, self.result, self.error = True, result, error
            callbacks, self.callbacks = self.callbacks, []
        for cb, param in callbacks:
            if cb is None:
                param.set()  # fdb_future_block_until_ready's waiter
            else:
                _call_back(cb, self.handle, param)
        return True


_CALLBACK_C = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # void (*)(FDBFuture*, void*)


def _call_back(cb: Any, handle: int, param: Any) -> None:
    # As libfdb_c does: a C call of the function pointer with (future, userdata), through
    # the binding's ctypes trampoline (its _CBFUNC declares only the first parameter).
    fn = ctypes.cast(cb, _CALLBACK_C) if not isinstance(cb, int) else _CALLBACK_C(cb)
    fn(handle, param)


# --- the library -------------------------------------------------------------

class _CFunction:
    """One exported C function: impl sets argtypes/restype/errcheck on it as on ctypes'
    foreign functions, and they are applied as ctypes applies them."""

    def __init__(self, name: str, impl: Callable[..., Any]) -> None:
        self.__name__ = name
        self._impl = impl
        self.argtypes: list | None = None
        self.restype: Any = ctypes.c_int
        self.errcheck: Callable | None = None

    def __repr__(self) -> str:
        return f"<stand-in libfdb_c {self.__name__}>"

    def __call__(self, *args: Any) -> Any:
        calls[self.__name__] += 1
        if self.argtypes is not None:
            if len(args) != len(self.argtypes):
                raise TypeError(f"{self.__name__}: this function takes {len(self.argtypes)} arguments ({len(args)} given)")
            args = tuple(_convert(self.__name__, i, t, a) for i, (t, a) in enumerate(zip(self.argtypes, args)))
        result = _restype(self.restype, self._impl(*args))
        if self.errcheck is not None:
            return self.errcheck(result, self, args)
        return result


def _convert(fname: str, i: int, argtype: Any, arg: Any) -> Any:
    """Check and convert one argument as ctypes would (ArgumentError where ctypes raises one)."""
    if argtype in (ctypes.c_int, ctypes.c_int64, ctypes.c_uint64):
        if not isinstance(arg, int):
            raise ctypes.ArgumentError(f"{fname} argument {i + 1}: wrong type {type(arg).__name__}")
        return argtype(arg).value  # wraps as C does
    if argtype is ctypes.c_void_p:
        if isinstance(arg, ctypes.c_void_p):  # an instance of the argtype itself passes as its value
            return arg.value
        if arg is None or isinstance(arg, (int, bytes)) or isinstance(arg, ctypes._CFuncPtr):
            return arg
        raise ctypes.ArgumentError(f"{fname} argument {i + 1}: wrong type {type(arg).__name__}")
    if argtype is ctypes.c_char_p:
        if arg is None or isinstance(arg, bytes):
            return arg
        raise ctypes.ArgumentError(f"{fname} argument {i + 1}: wrong type {type(arg).__name__}")
    if hasattr(argtype, "_type_") and isinstance(argtype, type(ctypes.POINTER(ctypes.c_int))):
        target = getattr(arg, "_obj", arg)  # byref(x) or a pointer instance
        if type(arg).__name__ == "CArgObject":
            if not isinstance(target, argtype._type_):
                raise ctypes.ArgumentError(
                    f"{fname} argument {i + 1}: byref of {type(target).__name__}, expected {argtype._type_.__name__}")
            return target
        if isinstance(arg, argtype):
            return arg.contents
        raise ctypes.ArgumentError(f"{fname} argument {i + 1}: wrong type {type(arg).__name__}")
    raise StandInError(f"{fname}: argument type {argtype!r} not supported by the stand-in")


def _restype(restype: Any, value: Any) -> Any:
    if restype is None:
        return None
    if restype is ctypes.c_void_p:
        return value or None  # NULL comes back as None
    if restype is ctypes.c_char_p:
        return value
    if restype is int or restype in (ctypes.c_int, ctypes.c_uint):
        return restype(value).value if restype is not int else int(value)
    raise StandInError(f"restype {restype!r} not supported by the stand-in")


def _set_pointer(ptr: Any, address: int) -> None:
    """*out = address, for an out-parameter of pointer type."""
    ctypes.c_void_p.from_buffer(ptr).value = address


class _Database:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory  # -> a kv.MemoryEngine, or a kv.Database over any embedded engine
        self.kvdb: kv.Database | None = None  # made on the network thread

    def database(self) -> kv.Database:
        if self.kvdb is None:
            made = self.factory()
            self.kvdb = made if isinstance(made, kv.Database) else made.database()
        return self.kvdb


_LATER = object()  # an operation's result when a task of its own completes its future later


class _Op:
    __slots__ = ("future", "run", "scope", "done", "ignores_deferred", "is_option", "no_commit_check")

    def __init__(self, future: _Future | None, run: Callable, *, ignores_deferred: bool = False,
                 is_option: bool = False, no_commit_check: bool = False) -> None:
        self.future = future
        self.run = run  # (mtr) -> result, or an async function of mtr
        self.scope: trio.CancelScope | None = None
        self.done = False
        # on_error and reset clear the deferred error (RYW onError/reset) instead of failing with it
        self.ignores_deferred = ignores_deferred
        self.is_option = is_option  # setOption: no used-during-commit check
        # getReadVersion: RYW checks resetPromise only (no checkUsedDuringCommit), so it neither
        # fails nor poisons a commit in flight, and answers after the commit
        self.no_commit_check = no_commit_check

    @property
    def checks_commit(self) -> bool:
        """RYW checkUsedDuringCommit applies (not to reset, on_error or options)."""
        return not self.ignores_deferred and not self.is_option and not self.no_commit_check


class _Transaction:
    """A FDBTransaction: a memory-engine transaction plus libfdb_c's own per-transaction state."""

    def __init__(self, db: _Database) -> None:
        self.db = db
        self.mtr: Any = None  # the memory transaction, made on the network thread
        self.queue: collections.deque[_Op] = collections.deque()
        self.running: _Op | None = None
        self.worker = False
        self.deferred = 0  # RYW deferredError
        self.lock = threading.RLock()
        self.committed_version = -1  # NativeAPI's committedVersion (invalidVersion until a commit)
        self.destroyed = False
        # RYW commitStarted: the commit, from fdb_transaction_commit until reset/on_error
        # (it stays set after a failed commit: API >= 410).
        self.commit_op: _Op | None = None

    def transaction(self) -> Any:
        if self.mtr is None:
            self.mtr = self.db.database().create_transaction()
        return self.mtr


class StandInLibrary:
    """The object impl gets as ``_capi``: attribute access by C function name."""

    def __init__(self) -> None:
        # Re-entrant: impl destroys futures and transactions from __del__, and the garbage
        # collector may run one on this very thread inside a critical section below.
        self._lock = threading.RLock()
        self._handles = itertools.count(0x7F5E_0000_1000, 0x40)
        self._futures: dict[int, _Future] = {}
        self._transactions: dict[int, _Transaction] = {}
        self._databases: dict[int, _Database] = {}
        self._clusters: dict[str, Callable[[], Any]] = {}
        self._api_version = 0
        self._setup = False
        self._ran = False
        self._stopped = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._early: list[Callable[[], None]] = []  # posted before the network ran
        self._functions: dict[str, _CFunction] = {}
        for name in dir(type(self)):
            if name.startswith("fdb_"):
                self._functions[name] = _CFunction(name, object.__getattribute__(self, name))

    # impl looks functions up as attributes of the CDLL; unknown names are missing symbols.
    def __getattribute__(self, name: str) -> Any:
        if name.startswith("fdb_"):
            functions = object.__getattribute__(self, "_functions")
            try:
                return functions[name]
            except KeyError:
                raise AttributeError(f"stand-in libfdb_c: undefined symbol: {name}") from None
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return "<stand-in libfdb_c (tests/kv/fake_libfdb_c.py) over kv.MemoryEngine>"

    # -- the cluster registry (test side) --

    def register_cluster(self, cluster_file: str | os.PathLike, factory: Callable[[], Any]) -> None:
        """``fdb_create_database(cluster_file)`` opens what ``factory`` makes (on the network
        thread): a ``kv.MemoryEngine``, or a ``kv.Database`` over an embedded engine."""
        with self._lock:
            self._clusters[os.path.abspath(os.fspath(cluster_file))] = factory

    # -- plumbing --

    def _handle(self) -> int:
        with self._lock:
            return next(self._handles)

    def _new_future(self, kind: str) -> _Future:
        fut = _Future(self._handle(), kind)
        with self._lock:
            self._futures[fut.handle] = fut
        return fut

    def _future(self, fname: str, handle: int) -> _Future:
        with self._lock:
            fut = self._futures.get(handle)
        if fut is None:
            raise StandInError(f"{fname}: 0x{handle or 0:x} is not a live FDBFuture (destroyed or never made)")
        return fut

    def _transaction_of(self, fname: str, handle: int) -> _Transaction:
        with self._lock:
            txn = self._transactions.get(handle)
        if txn is None:
            raise StandInError(f"{fname}: 0x{handle or 0:x} is not a live FDBTransaction")
        return txn

    def _post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the network thread (in posting order)."""
        with self._lock:
            if self._stopped:
                return
            if self._token is None:
                self._early.append(fn)
                return
            token = self._token
        try:
            token.run_sync_soon(self._guarded, fn)
        except trio.RunFinishedError:
            pass

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self._internal(f"posted {getattr(fn, '__name__', fn)!r}")

    def _internal(self, what: str) -> None:
        tb = traceback.format_exc()
        internal_errors.append(f"{what}:\n{tb}")
        log.error("stand-in libfdb_c internal error in %s:\n%s", what, tb)

    def _enqueue(self, txn: _Transaction, op: _Op) -> None:
        """Queue ``op`` on ``txn`` (network thread): a transaction's operations run in order."""
        if txn.destroyed:
            if op.future is not None:
                op.future.complete(error=1025)
            return
        commit = txn.commit_op
        if commit is not None and not commit.done and op.checks_commit:
            # RYW checkUsedDuringCommit while the commit is queued or in flight: the call fails
            # with used_during_commit, and so does the commit (resetPromise.sendError;
            # RYWImpl::commit waits on resetPromise || tr.commit()), although the commit
            # underneath carries on. (After the commit, _run_op checks in turn.)
            if commit.future is not None:
                commit.future.complete(error=2017)
            self._fail_used_during_commit(txn, op)
            return
        txn.queue.append(op)
        if not txn.worker:
            txn.worker = True
            assert self._nursery is not None
            self._nursery.start_soon(self._drain, txn)

    async def _drain(self, txn: _Transaction) -> None:
        try:
            while txn.queue:
                op = txn.queue.popleft()
                if op.done:
                    continue
                txn.running = op
                try:
                    await self._run_op(txn, op)
                finally:
                    txn.running = None
        finally:
            txn.worker = False

    async def _run_op(self, txn: _Transaction, op: _Op) -> None:
        fut = op.future
        with trio.CancelScope() as scope:
            op.scope = scope
            try:
                if txn.commit_op is not None and txn.commit_op.done and op.checks_commit:
                    # after the commit (queued behind it; what was queued before it runs first)
                    self._fail_used_during_commit(txn, op)
                    return
                if txn.deferred and not op.ignores_deferred:
                    # RYW checkDeferredError: every later call fails with it (a void one's is kept)
                    if fut is not None:
                        fut.complete(error=txn.deferred)
                    return
                mtr = txn.transaction()
                result = op.run(mtr)
                if hasattr(result, "__await__"):
                    result = await result
                if fut is not None and result is not _LATER:
                    fut.complete(result)
            except KVError as e:
                if fut is None:
                    if not txn.deferred:
                        txn.deferred = e.code  # a void call: reported by the next read or commit
                else:
                    fut.complete(error=e.code)
            except Exception:
                self._internal(f"operation on transaction (future {fut.handle if fut else None})")
                if fut is not None:
                    fut.complete(error=4100)
        op.done = True
        if scope.cancelled_caught and fut is not None:
            fut.complete(error=1101)

    @staticmethod
    def _fail_used_during_commit(txn: _Transaction, op: _Op) -> None:
        op.done = True
        if op.future is not None:
            op.future.complete(error=2017)
        elif not txn.deferred:
            txn.deferred = 2017

    def _future_op(self, txn: _Transaction, kind: str, run: Callable, *, ignores_deferred: bool = False,
                   no_commit_check: bool = False) -> int:
        fut = self._new_future(kind)
        op = _Op(fut, run, ignores_deferred=ignores_deferred, no_commit_check=no_commit_check)

        def cancel() -> None:  # network thread
            op.done = True
            if op.scope is not None:
                op.scope.cancel()
            fut.complete(error=1101)

        fut.on_cancel = cancel
        self._post(lambda: self._enqueue(txn, op))
        return fut.handle

    def _void_op(self, txn: _Transaction, run: Callable, *, is_option: bool = False) -> None:
        op = _Op(None, run, is_option=is_option)
        self._post(lambda: self._enqueue(txn, op))

    def _ready_future(self, kind: str, result: Any = None, error: int = 0) -> int:
        fut = self._new_future(kind)
        fut.complete(result, error)
        return fut.handle

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            with self._lock:
                self._token = trio.lowlevel.current_trio_token()
                early, self._early = self._early, []
            for fn in early:
                self._guarded(fn)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    # ======================= the C API ========================================

    # -- api version, errors --

    def fdb_select_api_version_impl(self, runtime_version: int, header_version: int) -> int:
        if self._api_version:
            return 2201  # api_version_already_set
        if runtime_version > header_version or runtime_version < 13:
            return 2202  # api_version_invalid
        if runtime_version > MAX_API_VERSION or header_version > MAX_API_VERSION:
            return 2203  # api_version_not_supported
        self._api_version = runtime_version
        return 0

    def fdb_get_max_api_version(self) -> int:
        return MAX_API_VERSION

    def fdb_get_error(self, code: int) -> bytes:
        # Error::fromUnvalidatedCode(code).what(): unknown codes read as unknown_error.
        return ERROR_TEXT.get(code, ERROR_TEXT[4000]).encode()

    def fdb_error_predicate(self, predicate: int, code: int) -> int:
        if predicate == _RETRYABLE:
            return int(code in MAYBE_COMMITTED or code in RETRYABLE_NOT_COMMITTED)
        if predicate == _MAYBE_COMMITTED:
            return int(code in MAYBE_COMMITTED)
        if predicate == _RETRYABLE_NOT_COMMITTED:
            return int(code in RETRYABLE_NOT_COMMITTED)
        return 0

    # -- the network --

    def fdb_network_set_option(self, option: int, value: Any, length: int) -> int:
        raise StandInError(f"fdb_network_set_option({option}): network options are not modelled by the stand-in")

    def fdb_setup_network(self) -> int:
        if not self._api_version:
            return 2200  # api_version_unset
        if self._setup:
            return 2009  # network_already_setup
        self._setup = True
        return 0

    def fdb_run_network(self) -> int:
        if not self._setup:
            return 2008  # network_not_setup
        if self._ran:
            return 2025  # network_cannot_be_restarted
        self._ran = True
        trio.run(self._main)
        return 0

    def fdb_stop_network(self) -> int:
        if not self._setup:
            return 2008
        with self._lock:
            token, self._stopped = self._token, True
        if token is not None:
            try:
                token.run_sync_soon(lambda: self._stop.set())
            except trio.RunFinishedError:
                pass
        return 0

    # -- futures --

    def fdb_future_destroy(self, handle: int) -> None:
        with self._lock:
            fut = self._futures.pop(handle, None)
        if fut is None:
            raise StandInError(f"fdb_future_destroy: 0x{handle or 0:x} is not a live FDBFuture (destroyed twice?)")
        if not fut.ready:
            self._cancel_future(fut)  # fdb_future_destroy is TSAVB(f)->cancel()
        fut.buffers = []

    def fdb_future_release_memory(self, handle: int) -> None:
        fut = self._future("fdb_future_release_memory", handle)
        if fut.ready and not fut.error:
            fut.released = True
            fut.result = None
            fut.buffers = []

    def _cancel_future(self, fut: _Future) -> None:
        def cancel() -> None:
            if fut.on_cancel is not None:
                fut.on_cancel()
            else:
                fut.complete(error=1101)

        self._post(cancel)

    def fdb_future_cancel(self, handle: int) -> None:
        fut = self._future("fdb_future_cancel", handle)
        if not fut.ready:
            self._cancel_future(fut)

    def fdb_future_block_until_ready(self, handle: int) -> int:
        fut = self._future("fdb_future_block_until_ready", handle)
        if threading.current_thread().name == "fdb-network-thread" and not fut.ready:
            return 2026  # blocked_from_network_thread
        done = threading.Event()
        with fut.lock:
            ready = fut.ready
            if not ready:
                fut.callbacks.append((None, done))
        if not ready:
            done.wait()
        return 0

    def fdb_future_is_ready(self, handle: int) -> int:
        return int(self._future("fdb_future_is_ready", handle).ready)

    def fdb_future_set_callback(self, handle: int, callback: Any, param: Any) -> int:
        fut = self._future("fdb_future_set_callback", handle)
        with fut.lock:
            if not fut.ready:
                fut.callbacks.append((callback, param))
                return 0
        _call_back(callback, handle, param)  # already ready: inline (callOrSetAsCallback)
        return 0

    def fdb_future_get_error(self, handle: int) -> int:
        fut = self._future("fdb_future_get_error", handle)
        if not fut.ready:
            return 2015  # future_not_set
        return fut.error

    def _readable(self, fname: str, handle: int, kind: str) -> _Future | int:
        fut = self._future(fname, handle)
        if fut.kind != kind:
            raise StandInError(f"{fname} on a future of {fut.kind} (undefined behaviour in libfdb_c)")
        if not fut.ready:
            return 2015  # future_not_set
        if fut.error:
            return fut.error
        if fut.released:
            return 1102  # future_released
        return fut

    def fdb_future_get_int64(self, handle: int, out: Any) -> int:
        fut = self._readable("fdb_future_get_int64", handle, _INT64)
        if isinstance(fut, int):
            return fut
        out.value = fut.result
        return 0

    def fdb_future_get_uint64(self, handle: int, out: Any) -> int:
        raise StandInError("fdb_future_get_uint64: no stand-in operation returns a uint64")

    def _bytes_out(self, fut: _Future, data: bytes, ptr: Any) -> None:
        buf = ctypes.create_string_buffer(data, len(data) + 1)
        fut.buffers.append(buf)
        _set_pointer(ptr, ctypes.addressof(buf))

    def fdb_future_get_key(self, handle: int, out_key: Any, out_length: Any) -> int:
        fut = self._readable("fdb_future_get_key", handle, _KEY)
        if isinstance(fut, int):
            return fut
        self._bytes_out(fut, fut.result, out_key)
        out_length.value = len(fut.result)
        return 0

    def fdb_future_get_value(self, handle: int, out_present: Any, out_value: Any, out_length: Any) -> int:
        fut = self._readable("fdb_future_get_value", handle, _VALUE)
        if isinstance(fut, int):
            return fut
        value = fut.result
        out_present.value = int(value is not None)
        if value is not None:
            self._bytes_out(fut, value, out_value)
            out_length.value = len(value)
        return 0

    def fdb_future_get_keyvalue_array(self, handle: int, out_kvs: Any, out_count: Any, out_more: Any) -> int:
        fut = self._readable("fdb_future_get_keyvalue_array", handle, _KV_ARRAY)
        if isinstance(fut, int):
            return fut
        rows, more = fut.result
        array = (KeyValueC * max(1, len(rows)))()
        for slot, (k, v) in zip(array, rows):
            kb, vb = ctypes.create_string_buffer(k, len(k) + 1), ctypes.create_string_buffer(v, len(v) + 1)
            fut.buffers += (kb, vb)
            slot.key, slot.key_length = ctypes.addressof(kb), len(k)
            slot.value, slot.value_length = ctypes.addressof(vb), len(v)
        fut.buffers.append(array)
        _set_pointer(out_kvs, ctypes.addressof(array))
        out_count.value = len(rows)
        out_more.value = int(bool(more))
        return 0

    def fdb_future_get_key_array(self, handle: int, out_keys: Any, out_count: Any) -> int:
        raise StandInError("fdb_future_get_key_array: range split points are not modelled by the stand-in")

    def fdb_future_get_string_array(self, handle: int, out_strings: Any, out_count: Any) -> int:
        raise StandInError("fdb_future_get_string_array: addresses for keys are not modelled by the stand-in")

    # -- databases --

    def fdb_create_database(self, cluster_file: bytes | None, out_database: Any) -> int:
        path = os.path.abspath(cluster_file.decode()) if cluster_file else None
        if path is None:
            raise StandInError("fdb_create_database: the default cluster file is not modelled; "
                               "pass a cluster file registered with register_cluster()")
        if not os.path.exists(path):
            return 1515  # no_cluster_file_found
        with self._lock:
            factory = self._clusters.get(path)
        if factory is None:
            raise StandInError(f"fdb_create_database: {path} is not a stand-in cluster (register_cluster it)")
        handle = self._handle()
        with self._lock:
            self._databases[handle] = _Database(factory)
        out_database.value = handle
        return 0

    def fdb_database_destroy(self, handle: int) -> None:
        with self._lock:
            self._databases.pop(handle, None)

    def fdb_database_open_tenant(self, *args: Any) -> int:
        raise StandInError("fdb_database_open_tenant: tenants are not modelled by the stand-in")

    def fdb_database_create_transaction(self, handle: int, out_transaction: Any) -> int:
        with self._lock:
            db = self._databases.get(handle)
        if db is None:
            raise StandInError(f"fdb_database_create_transaction: 0x{handle or 0:x} is not a live FDBDatabase")
        th = self._handle()
        with self._lock:
            self._transactions[th] = _Transaction(db)
        out_transaction.value = th
        return 0

    def fdb_database_set_option(self, handle: int, option: int, value: Any, length: int) -> int:
        raise StandInError(f"fdb_database_set_option({option}): database options are not modelled by the stand-in")

    def fdb_database_get_client_status(self, handle: int) -> int:
        raise StandInError("fdb_database_get_client_status: not modelled by the stand-in")

    def fdb_tenant_destroy(self, handle: int) -> None:
        raise StandInError("fdb_tenant_destroy: tenants are not modelled by the stand-in")

    def fdb_tenant_get_id(self, handle: int) -> int:
        raise StandInError("fdb_tenant_get_id: tenants are not modelled by the stand-in")

    def fdb_tenant_create_transaction(self, handle: int, out: Any) -> int:
        raise StandInError("fdb_tenant_create_transaction: tenants are not modelled by the stand-in")

    # -- transactions --

    def fdb_transaction_destroy(self, handle: int) -> None:
        with self._lock:
            txn = self._transactions.pop(handle, None)
        if txn is None:
            raise StandInError(f"fdb_transaction_destroy: 0x{handle or 0:x} is not a live FDBTransaction")

        def destroy() -> None:
            # The RYW transaction goes away: what is still queued or running for it fails
            # with transaction_cancelled; watches it armed by committing live on (a
            # committed watch belongs to the database), unarmed ones cannot fire.
            txn.destroyed = True
            self._fail_pending(txn, 1025)
            if txn.mtr is not None:
                for w in list(txn.mtr._watches):
                    if not w.armed:
                        w._fire(KVError(1025))

        self._post(destroy)

    def _fail_pending(self, txn: _Transaction, code: int) -> None:
        queued, txn.queue = list(txn.queue), collections.deque()
        for op in queued:
            op.done = True
            if op.future is not None:
                op.future.complete(error=code)
        running = txn.running
        if running is not None and running.scope is not None:
            running.scope.cancel()
            if running.future is not None:
                running.future.complete(error=code)

    def fdb_transaction_cancel(self, handle: int) -> None:
        txn = self._transaction_of("fdb_transaction_cancel", handle)

        def cancel() -> None:  # at once, not behind the queue: RYW resetPromise.sendError(transaction_cancelled)
            self._fail_pending(txn, 1025)
            txn.transaction().cancel()

        self._post(cancel)

    def fdb_transaction_set_read_version(self, handle: int, version: int) -> None:
        raise StandInError("fdb_transaction_set_read_version: the memory engine cannot read at a chosen version")

    def fdb_transaction_get_read_version(self, handle: int) -> int:
        txn = self._transaction_of("fdb_transaction_get_read_version", handle)
        return self._future_op(txn, _INT64, lambda mtr: mtr.get_read_version(), no_commit_check=True)

    @staticmethod
    def _arg_bytes(fname: str, data: Any, length: int) -> bytes:
        if data is None:
            data = b""
        if not isinstance(data, bytes) or length < 0 or length > len(data):
            raise StandInError(f"{fname}: {length} bytes asked of a buffer of {len(data) if isinstance(data, bytes) else data!r}")
        return data[:length]

    def fdb_transaction_get(self, handle: int, key: bytes, key_length: int, snapshot: int) -> int:
        txn = self._transaction_of("fdb_transaction_get", handle)
        key = self._arg_bytes("fdb_transaction_get", key, key_length)
        return self._future_op(txn, _VALUE, lambda mtr: (mtr.snapshot if snapshot else mtr).get(key))

    def fdb_transaction_get_key(self, handle: int, key: bytes, key_length: int, or_equal: int, offset: int,
                                snapshot: int) -> int:
        txn = self._transaction_of("fdb_transaction_get_key", handle)
        sel = KeySelector(self._arg_bytes("fdb_transaction_get_key", key, key_length), bool(or_equal), offset)
        if sel.key > _MAX_READ_KEY:
            return self._ready_future(_KEY, error=2004)
        return self._future_op(txn, _KEY, lambda mtr: (mtr.snapshot if snapshot else mtr).get_key(sel))

    def fdb_transaction_get_range(self, handle: int, begin: bytes, begin_length: int, begin_or_equal: int,
                                  begin_offset: int, end: bytes, end_length: int, end_or_equal: int, end_offset: int,
                                  limit: int, target_bytes: int, mode: int, iteration: int, snapshot: int,
                                  reverse: int) -> int:
        fname = "fdb_transaction_get_range"
        txn = self._transaction_of(fname, handle)
        bkey, ekey = self._arg_bytes(fname, begin, begin_length), self._arg_bytes(fname, end, end_length)
        if bkey > _MAX_READ_KEY or ekey > _MAX_READ_KEY:
            # RYW getRange: "if (begin.getKey() > maxKey || end.getKey() > maxKey) return key_outside_legal_range()"
            return self._ready_future(_KV_ARRAY, error=2004)
        bsel = _bound(KeySelector(bkey, bool(begin_or_equal), begin_offset))
        esel = _bound(KeySelector(ekey, bool(end_or_equal), end_offset))
        # validate_and_update_parameters (fdb_c.cpp): 0 means unlimited.
        if limit == 0 and target_bytes == 0 and mode == _EXACT:
            return self._ready_future(_KV_ARRAY, error=2210)  # exact_mode_without_limits
        if mode == _WANT_ALL:
            mode = _SERIAL
        if mode == _ITERATOR:
            if iteration <= 0:
                return self._ready_future(_KV_ARRAY, error=2000)
            mode_bytes: int | None = _ITERATION_BYTES[min(iteration, len(_ITERATION_BYTES)) - 1]
        elif 0 <= mode <= _SERIAL:
            mode_bytes = _MODE_BYTES[mode]
        else:
            return self._ready_future(_KV_ARRAY, error=2000)
        if target_bytes == 0:
            byte_limit = mode_bytes
        else:
            byte_limit = target_bytes if mode_bytes is None else min(target_bytes, mode_bytes)
        if limit < 0:
            return self._ready_future(_KV_ARRAY, error=2012)  # range_limits_invalid
        snap, rev = bool(snapshot), bool(reverse)

        async def run(mtr: Any) -> tuple[list, bool]:
            view = mtr.snapshot if snap else mtr
            rows = await view.get_range(bsel, esel, limit=limit, reverse=rev)
            n = len(rows)
            if byte_limit is not None:
                used, n = 0, 0
                for k, v in rows:  # at least one row, then while under the byte limit
                    if n and used >= byte_limit:
                        break
                    used += len(k) + len(v) + _ROW_OVERHEAD
                    n += 1
            if n < len(rows):
                # Cut by bytes: the read (and its read conflict range) ends at the last row
                # returned, as a storage server's reply stopped by its byte limit does. The
                # snapshot read above recorded no conflicts; redo it as the real read.
                if snap:
                    rows = rows[:n]
                else:
                    rows = await mtr.get_range(bsel, esel, limit=n, reverse=rev)
                return [(r[0], r[1]) for r in rows], True
            return [(r[0], r[1]) for r in rows], bool(limit) and len(rows) >= limit

        if not snap and byte_limit is not None:
            inner = run

            async def run(mtr: Any) -> tuple[list, bool]:  # noqa: F811 - a snapshot probe first
                probe = await mtr.snapshot.get_range(bsel, esel, limit=limit, reverse=rev)
                used, n = 0, 0
                for k, v in probe:
                    if n and used >= byte_limit:
                        break
                    used += len(k) + len(v) + _ROW_OVERHEAD
                    n += 1
                if n < len(probe):
                    rows = await mtr.get_range(bsel, esel, limit=n, reverse=rev)
                    return [(r[0], r[1]) for r in rows], True
                return await inner(mtr)

        return self._future_op(txn, _KV_ARRAY, run)

    def fdb_transaction_get_estimated_range_size_bytes(self, *args: Any) -> int:
        raise StandInError("fdb_transaction_get_estimated_range_size_bytes: not modelled by the stand-in")

    def fdb_transaction_get_range_split_points(self, *args: Any) -> int:
        raise StandInError("fdb_transaction_get_range_split_points: not modelled by the stand-in")

    def fdb_transaction_get_range_split_points_with_limit(self, *args: Any) -> int:
        raise StandInError("fdb_transaction_get_range_split_points_with_limit: not modelled by the stand-in")

    def fdb_transaction_get_addresses_for_key(self, *args: Any) -> int:
        raise StandInError("fdb_transaction_get_addresses_for_key: not modelled by the stand-in")

    def fdb_transaction_get_approximate_size(self, handle: int) -> int:
        raise StandInError("fdb_transaction_get_approximate_size: not modelled by the stand-in")

    def fdb_transaction_add_conflict_range(self, handle: int, begin: bytes, begin_length: int, end: bytes,
                                           end_length: int, kind: int) -> int:
        fname = "fdb_transaction_add_conflict_range"
        txn = self._transaction_of(fname, handle)
        b, e = self._arg_bytes(fname, begin, begin_length), self._arg_bytes(fname, end, end_length)
        if kind == _CONFLICT_READ:
            self._void_op(txn, lambda mtr: mtr.add_read_conflict_range(b, e))
        elif kind == _CONFLICT_WRITE:
            self._void_op(txn, lambda mtr: mtr.add_write_conflict_range(b, e))
        else:
            return 2006  # invalid_option_value (ThreadSafeTransaction: an unknown conflict range type)
        return 0

    def fdb_transaction_set_option(self, handle: int, option: int, value: Any, length: int) -> int:
        fname = "fdb_transaction_set_option"
        txn = self._transaction_of(fname, handle)
        from fdb import fdboptions

        known = {v[0]: k for k, v in fdboptions.TransactionOption.items()}
        if option not in known:
            return 2007  # invalid_option (ThreadSafeTransaction::setOption, synchronously)
        if option not in _TR_OPTIONS:
            raise StandInError(f"{fname}: option {known[option]} ({option}) is not modelled by the stand-in")
        method, int_range = _TR_OPTIONS[option]
        if method == "set_next_write_no_write_conflict_range":
            self._void_op(txn, lambda mtr: mtr.options.set_next_write_no_write_conflict_range(), is_option=True)
            return 0
        param = self._arg_bytes(fname, value, length) if value is not None else None

        def apply(mtr: Any) -> None:  # on the network thread; errors become the deferred error
            if param is None or len(param) != 8:
                raise KVError(2006, "an int option takes 8 bytes")  # extractIntOption
            n = struct.unpack("<q", param)[0]
            if int_range is not None and not int_range[0] <= n <= int_range[1]:
                raise KVError(2006)
            getattr(mtr.options, method)(n)

        self._void_op(txn, apply, is_option=True)
        return 0

    def fdb_transaction_atomic_op(self, handle: int, key: bytes, key_length: int, param: bytes, param_length: int,
                                  opcode: int) -> None:
        fname = "fdb_transaction_atomic_op"
        txn = self._transaction_of(fname, handle)
        k, p = self._arg_bytes(fname, key, key_length), self._arg_bytes(fname, param, param_length)
        method = _MUTATIONS.get(opcode)
        if method is None:
            def bad(mtr: Any) -> None:
                raise KVError(2018)  # invalid_mutation_type, deferred
            self._void_op(txn, bad)
            return
        self._void_op(txn, lambda mtr: getattr(mtr, method)(k, p))

    def fdb_transaction_set(self, handle: int, key: bytes, key_length: int, value: bytes, value_length: int) -> None:
        fname = "fdb_transaction_set"
        txn = self._transaction_of(fname, handle)
        k, v = self._arg_bytes(fname, key, key_length), self._arg_bytes(fname, value, value_length)
        self._void_op(txn, lambda mtr: mtr.set(k, v))

    def fdb_transaction_clear(self, handle: int, key: bytes, key_length: int) -> None:
        txn = self._transaction_of("fdb_transaction_clear", handle)
        k = self._arg_bytes("fdb_transaction_clear", key, key_length)
        self._void_op(txn, lambda mtr: mtr.clear(k))

    def fdb_transaction_clear_range(self, handle: int, begin: bytes, begin_length: int, end: bytes,
                                    end_length: int) -> None:
        fname = "fdb_transaction_clear_range"
        txn = self._transaction_of(fname, handle)
        b, e = self._arg_bytes(fname, begin, begin_length), self._arg_bytes(fname, end, end_length)
        self._void_op(txn, lambda mtr: mtr.clear_range(b, e))

    def fdb_transaction_watch(self, handle: int, key: bytes, key_length: int) -> int:
        txn = self._transaction_of("fdb_transaction_watch", handle)
        k = self._arg_bytes("fdb_transaction_watch", key, key_length)

        def arm(mtr: Any, state: dict[str, Any]) -> Callable:
            # Registered in order with the transaction; waited for by a task of its own
            # (a watch outlives the operations queued after it, and its transaction).
            w = state["watch"] = mtr.watch(k)
            return w.wait

        return self._later(txn, self._new_future(_VOID), arm)

    def _later(self, txn: Any, fut: _Future, begin: Callable[[Any, dict[str, Any]], Callable],
               convert: Callable = lambda r: None) -> int:
        """Queue an operation answered later (a watch, a versionstamp): at its turn in the
        transaction, ``begin(mtr, state)`` returns what to await, and a task of its own awaits
        it into ``fut`` (see _await_into); cancelling or destroying ``fut`` cancels what
        ``state`` holds (the watch, the task's scope) and completes it with 1101."""
        state: dict[str, Any] = {}

        def start(mtr: Any) -> object:
            self._nursery.start_soon(self._await_into, fut, begin(mtr, state), state, convert)
            return _LATER

        op = _Op(fut, start)

        def cancel() -> None:
            op.done = True
            for held in ("watch", "scope"):
                if state.get(held) is not None:
                    state[held].cancel()
            fut.complete(error=1101)

        fut.on_cancel = cancel
        self._post(lambda: self._enqueue(txn, op))
        return fut.handle

    async def _await_into(self, fut: _Future, wait: Callable, state: dict, convert: Callable = lambda r: None) -> None:
        with trio.CancelScope() as scope:
            state["scope"] = scope
            try:
                result = await wait()
                fut.complete(convert(result))
            except KVError as e:
                fut.complete(error=e.code)
            except Exception:
                self._internal(f"waiting for future {fut.handle}")
                fut.complete(error=4100)
        if scope.cancelled_caught:
            fut.complete(error=1101)

    def fdb_transaction_commit(self, handle: int) -> int:
        txn = self._transaction_of("fdb_transaction_commit", handle)

        async def commit(mtr: Any) -> None:
            await mtr.commit()
            with txn.lock:
                txn.committed_version = mtr.get_committed_version()

        fut = self._new_future(_VOID)
        op = _Op(fut, commit)

        def cancel() -> None:
            op.done = True
            if op.scope is not None:
                op.scope.cancel()
            fut.complete(error=1101)

        fut.on_cancel = cancel

        def enqueue() -> None:
            self._enqueue(txn, op)
            if txn.commit_op is None and not txn.destroyed:
                txn.commit_op = op

        self._post(enqueue)
        return fut.handle

    def fdb_transaction_get_committed_version(self, handle: int, out_version: Any) -> int:
        txn = self._transaction_of("fdb_transaction_get_committed_version", handle)
        with txn.lock:
            out_version.value = txn.committed_version
        return 0

    def fdb_transaction_get_versionstamp(self, handle: int) -> int:
        txn = self._transaction_of("fdb_transaction_get_versionstamp", handle)

        def ask(mtr: Any, state: dict[str, Any]) -> Callable:
            stamp = mtr.get_versionstamp()

            async def wait() -> bytes:
                return await stamp  # the memory transaction's awaitable versionstamp

            return wait

        return self._later(txn, self._new_future(_KEY), ask, bytes)

    def fdb_transaction_on_error(self, handle: int, code: int) -> int:
        txn = self._transaction_of("fdb_transaction_on_error", handle)

        async def on_error(mtr: Any) -> None:
            await mtr.on_error(KVError(code))  # backs off and resets, or raises the error itself
            txn.deferred, txn.commit_op = 0, None
            with txn.lock:
                txn.committed_version = -1

        # on_error runs even with a deferred error pending: it is how a transaction recovers.
        return self._future_op(txn, _VOID, on_error, ignores_deferred=True)

    def fdb_transaction_reset(self, handle: int) -> None:
        txn = self._transaction_of("fdb_transaction_reset", handle)

        def reset(mtr: Any) -> None:
            mtr.reset()
            txn.deferred, txn.commit_op = 0, None
            with txn.lock:
                txn.committed_version = -1

        self._post(lambda: self._enqueue(txn, _Op(None, reset, ignores_deferred=True)))


LIBRARY = StandInLibrary()


def register_cluster(cluster_file: str | os.PathLike, factory: Callable[[], Any]) -> None:
    LIBRARY.register_cluster(cluster_file, factory)


def installed() -> bool:
    """Is the stand-in the library fdb.impl loaded in this process?"""
    import sys

    impl = sys.modules.get("fdb.impl")
    return impl is not None and getattr(impl, "_capi", None) is LIBRARY


def install(api_version: int = 800) -> None:
    """Make ``fdb.impl`` load the stand-in, and select ``api_version``, in this process.

    Process-global and once only, as loading libfdb_c is: afterwards no real
    cluster can be used in this process. ``ctypes.CDLL`` is patched only while
    the first ``fdb.api_version`` call imports impl, and only for libfdb_c's name.
    """
    import fdb

    from kv import fdb_backend

    if installed():
        return
    if fdb.is_api_version_selected():
        raise RuntimeError("an FDB API version was already selected in this process over another library")
    real_cdll = ctypes.CDLL

    def cdll(name: Any, *args: Any, **kwargs: Any) -> Any:
        base = os.path.basename(os.fspath(name)) if name is not None else ""
        if base in ("libfdb_c.so", "libfdb_c.dylib", "fdb_c.dll") or base.startswith("libfdb_c.so"):
            return LIBRARY
        return real_cdll(name, *args, **kwargs)

    ctypes.CDLL = cdll  # type: ignore[misc]
    try:
        fdb_backend._load(api_version)  # the backend's own loader: fdb.api_version -> import fdb.impl
    finally:
        ctypes.CDLL = real_cdll  # type: ignore[misc]
    if not installed():
        raise RuntimeError("fdb.impl did not load the stand-in (a real libfdb_c beside the bindings?)")
