"""Prefix sharing for exhaustive mode: run a scenario once and ``os.fork()`` at every crash point.

Exhaustive mode crashes a scenario before and after each of its W writes.  Re-running the whole
scenario from the start for each of those 2W runs executes the prefix up to write k again every
time (O(W^2) work).  With the same seed a run is identical up to any write — the fault plan is
consulted at a write only to ask "is this the crash point?" (sim/faults.py) — so the fault-free
run *is* the common prefix of every crash run.  :class:`Forker` runs it once: at write k it forks;
the child swaps in the plan "crash before (or after) write k", takes the crash there, restarts,
recovers, checks, sends its :class:`~sim.harness.RunResult` back over a pipe and exits; the parent
waits for it and carries on fault-free to the next write.  tests/sim/test_sim_fork.py holds the
fork path to results identical (trace, violations, every count) to the re-run path
``run_once(factory, seed, FaultPlan().with_crash(k, when))``, which stays what ``--crash-before K``
replays.

A crash that cannot fire (the write belongs to no process — the checks' own handle — or its process
is already dead) leaves the run fault-free, so its result is the fault-free run's under the crash
plan; the parent records such points instead of forking for them.

The child continues inside the parent's ``trio.run``.  trio's kernel objects (its epoll instance and
its two wake-up socketpairs) are shared with the parent after a fork, and trio changes the epoll
interest list on every wait (EPOLLONESHOT) and writes to the wake-up sockets from
``run_sync_soon``: so the child's first act is to give itself private copies under the same fd
numbers (:func:`_privatize_trio`), leaving the parent's untouched.  Nothing else is shared: no
threads, no real I/O (sim/world.py).  The child runs with the collector off (it is short-lived, and
a collection would write to — copy — every page of the heap); the parent waits for each child
before it continues, so there is never more than one child and the CPU they use is accounted
(``RUSAGE_CHILDREN``, sim/session.py) as one core's.

A child that dies (an exception outside the run's own reporting, a signal) is reported as a failed
run at its crash point — violation ``sim_child_failed`` — never dropped.

Where ``os.fork`` or trio's epoll I/O manager is not available, :func:`fork_available` is false and
exhaustive mode re-runs each crash point from the start.

FORK_COST — why this is not exhaustive mode's default (measured 2026-11-30 on the 2-core dev VM,
CPython 3.11, children's CPU included): a crash run's cost hardly depends on k (crash at the first
write or the last, two-runtimes: 33-43 ms; approval: 28-30 ms against 19.5 ms fault-free), because
what follows the crash — restart, recovery, the clients' retries, quiescence, the checks — is most
of it; the shared prefix saves ~35% of a crash run's user time.  A fork costs about that much:
CPython's reference counting writes to every object the child touches, so a child takes ~1,000
(kv-cycle) to ~2,000 (two-runtimes) copy-on-write page faults at ~5 us each, plus fork and exit
(~3 ms for a ~43 MB process) and the parent's own faults after each fork (~3 ms).  All scenarios
exhaustively, seed 1: 20.8 s of CPU forked against 14.2 s re-run (kv-cycle 20.8 against 5.5 ms a
run; concurrent, the best case, 46 against 49).  It pays for scenarios whose prefix is long and
whose recovery is short; none of the built-in ones is.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Collection

from trio._core import _run as _trio_run  # private: the runner's I/O manager and entry queue

from .faults import FaultPlan

if TYPE_CHECKING:
    from .harness import RunResult
    from .world import World

__all__ = ["Forker", "fork_available", "CHILD_FAILED"]

# The violation a crash run gets when its forked child died without reporting.
CHILD_FAILED = "sim_child_failed"
# What a child may send back (a pickled RunResult is a few KB; a bound keeps a runaway one honest).
MAX_RESULT_BYTES = 64 * 1024 * 1024
# Exit status of a child whose run raised (its traceback is sent instead of a result).
CHILD_ERROR_STATUS = 3

assert MAX_RESULT_BYTES > 0 and 0 < CHILD_ERROR_STATUS < 256

# The real functions, bound at import: a run patches os.getpid (and os.urandom) for its duration.
_fork = getattr(os, "fork", None)
_exit = os._exit
_waitpid = getattr(os, "waitpid", None)


def fork_available() -> bool:
    """Can exhaustive mode share prefixes here?  (os.fork and trio's epoll I/O manager: Linux.)"""
    if _fork is None or not sys.platform.startswith("linux"):
        return False
    try:
        from trio._core._io_epoll import EpollIOManager
    except ImportError:  # pragma: no cover - trio without its epoll backend
        return False
    return issubclass(_trio_run.TheIOManager, EpollIOManager)


class Forker:
    """The fault-free run's fork points: one child per crash point, its result kept by (k, when).

    ``limit`` bounds the writes crashed at (exhaustive's ``limit``); ``stop`` (checked before each
    fork) ends forking early, e.g. when a session's time budget is spent — :attr:`stopped_at` then
    names the first crash point not run; ``only`` (tests) forks at those points alone.
    """

    def __init__(self, *, limit: int | None = None, stop: Callable[[], bool] | None = None,
                 only: Collection[tuple[int, str]] | None = None) -> None:
        self.limit = limit
        self.stop = stop
        self.only = None if only is None else frozenset(only)  # (tests: fork at these points only)
        self.results: dict[tuple[int, str], "RunResult"] = {}
        self.stopped_at: tuple[int, str] | None = None
        self.world: "World | None" = None
        self._child_pipe: int | None = None  # set in a child: where its result goes
        self._child_point: tuple[int, str] | None = None

    @property
    def in_child(self) -> bool:
        return self._child_pipe is not None

    def attach(self, world: "World") -> None:
        """``run_once``'s ``on_world``: the world consults this forker at every write."""
        self.world = world
        world.forker = self

    # -- the fork points (called by SimHooks) ---------------------------

    def at_write(self, k: int, when: str) -> None:
        """Write ``k`` is at crash point ``when`` with a live process: fork a child that crashes here.

        In the child this returns with the world's plan set to crash right here (the caller then
        consults the plan as in a re-run); in the parent it returns once the child has reported.
        """
        if self.in_child or (k, when) in self.results or self.stopped_at is not None:
            return
        if (self.limit is not None and k > self.limit) or (self.only is not None and (k, when) not in self.only):
            return
        if self.stop is not None and self.stop():
            self.stopped_at = (k, when)
            return
        rfd, wfd = os.pipe()
        pid = _fork()  # type: ignore[misc]
        if pid == 0:  # the child: crash here, then run to the end (harness.run_once calls finish)
            try:
                os.close(rfd)
                self._start_child(k, when, wfd)
            except BaseException:  # noqa: BLE001 - nothing may unwind into the parent's frames
                self._child_fail(wfd)
            return
        os.close(wfd)
        self.results[(k, when)] = self._collect(pid, rfd, FaultPlan().with_crash(k, when))

    def _start_child(self, k: int, when: str, wfd: int) -> None:
        """In a fresh child: own trio's kernel objects, then make this run the crash run at (k, when)."""
        gc.disable()
        _privatize_trio()
        self._child_pipe = wfd
        self._child_point = (k, when)
        assert self.world is not None
        self.world.plan = FaultPlan().with_crash(k, when)

    def _collect(self, pid: int, rfd: int, plan: FaultPlan) -> "RunResult":
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                b = os.read(rfd, 1 << 16)
                if not b:
                    break
                size += len(b)
                if size > MAX_RESULT_BYTES:
                    break
                chunks.append(b)
        finally:
            os.close(rfd)
        _, status = _waitpid(pid, 0)  # type: ignore[misc]
        data = b"".join(chunks)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and size <= MAX_RESULT_BYTES:
            try:
                result = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - a truncated or garbled report is a failure too
                return self._failed(plan, f"unreadable result ({type(exc).__name__}: {exc})")
            return result
        if os.WIFSIGNALED(status):
            why = f"killed by signal {os.WTERMSIG(status)}"
        elif os.WIFEXITED(status):
            why = f"exit status {os.WEXITSTATUS(status)}"
        else:  # pragma: no cover - waitpid without WUNTRACED reports only exits and signals
            why = f"wait status {status}"
        if size > MAX_RESULT_BYTES:
            why += f"; result over {MAX_RESULT_BYTES} bytes"
        elif data:
            why += ": " + data.decode("utf-8", "replace")[-2000:]
        return self._failed(plan, why)

    def _failed(self, plan: FaultPlan, why: str) -> "RunResult":
        from .harness import RunResult
        from .world import Violation

        world = self.world
        assert world is not None
        return RunResult(scenario=world.scenario_name, seed=world.seed, plan=plan,
                         violations=[Violation(CHILD_FAILED, None, f"the forked run died: {why}")],
                         trace="", writes=0, commits=0, crashes=0, restarts=0, faults={}, checks=0,
                         virtual_seconds=0.0, wall_seconds=0.0)

    # -- the child's end -------------------------------------------------

    def finish(self, result: "RunResult") -> None:
        """In a child: send the run's result to the parent and exit (never returns)."""
        wfd = self._child_pipe
        assert wfd is not None
        try:
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(wfd, view):]
        except BaseException:  # noqa: BLE001
            self._child_fail(wfd)
        _exit(0)

    def fail(self, exc: BaseException) -> None:
        """In a child: the run raised — send the traceback and exit with an error (never returns)."""
        assert self._child_pipe is not None
        self._child_fail(self._child_pipe, exc)

    @staticmethod
    def _child_fail(wfd: int, exc: BaseException | None = None) -> None:
        try:
            if exc is None:
                text = traceback.format_exc()
            else:
                text = "".join(traceback.format_exception(exc))
            os.write(wfd, text.encode("utf-8", "replace")[-8000:])
        finally:
            _exit(CHILD_ERROR_STATUS)


def _privatize_trio() -> None:
    """In a fresh child: private copies of trio's epoll instance and wake-up sockets, same fd numbers.

    After ``fork`` the child's fds name the parent's kernel objects.  The child would otherwise
    change the parent's epoll interest list (every wait re-arms an EPOLLONESHOT registration; a
    cancelled wait deletes it) and could leave a byte in the parent's wake-up socket — either would
    change what the parent's scheduler sees next.  ``dup2`` onto the same numbers keeps every trio
    object (which holds fd numbers) valid.  A byte waiting in a wake-up socket is copied
    (``MSG_PEEK``: the parent's stays), and every registration trio holds is made again on the new
    epoll, so the child sees what the parent would have seen.
    """
    runner = _trio_run.GLOBAL_RUN_CONTEXT.runner
    io = runner.io_manager
    for pair in (io._force_wakeup, runner.entry_queue.wakeup):
        try:
            pending = pair.wakeup_sock.recv(1 << 16, socket.MSG_PEEK)
        except BlockingIOError:
            pending = b""
        r, w = socket.socketpair()
        for s in (r, w):
            s.setblocking(False)
        r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        os.dup2(r.fileno(), pair.wakeup_sock.fileno())
        os.dup2(w.fileno(), pair.write_sock.fileno())
        r.close()
        w.close()
        if pending:
            pair.write_sock.send(pending)
    ep = select.epoll()
    os.dup2(ep.fileno(), io._epoll.fileno())
    ep.close()
    io._epoll.register(io._force_wakeup.wakeup_sock, select.EPOLLIN)
    for fd in list(io._registered):
        io._registered[fd].current_flags = 0  # (not in the new epoll yet: _update_registrations adds it)
        io._update_registrations(fd)


def child_of(world: "World") -> Forker | None:
    """The forker whose child this process is, if ``world``'s run is a forked child's."""
    f: Any = getattr(world, "forker", None)
    return f if f is not None and f.in_child else None
