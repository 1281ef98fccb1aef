"""The log's sync helper process, seen from the store: ask for a sync, hear it done.

Why a process and not a thread: a group-commit batch is one log append and
one ``fdatasync``. Done on a writer thread, the sync itself releases the GIL,
but the thread needs the GIL back three times per batch (to wake from its
queue, to return from the system call, to hand the outcome to the loop), and
the event loop, busy running the tasks of the previous batch, gives it up
only when it idles or after the 5 ms switch interval. Measured here at 64
concurrent writers: a batch waited ~0.6 ms for its write to *start* and
~0.2 ms more to be heard, about as long as the sync itself, and the loop sat
idle in ``epoll`` a third of the time. A child process has its own GIL: the
loop appends the record (a buffered write, microseconds), sends the segment
number over a socket (and pokes an eventfd, which is what wakes the child:
see ``kv._fsyncd`` for why not the socket), and hears the reply through
``epoll`` like any other I/O, while the child spends its time in ``fdatasync``. The next batch may be
written and its sync requested while one is out (``MAX_IN_FLIGHT``): the
helper answers in order, and its next sync starts as soon as one returns,
not when the busy loop gets round to hearing it.

Durability: the record is written by this process before the request is
sent, and ``fdatasync`` on any descriptor of a file flushes that file's data
and the metadata needed to read it back (its size), so a reply of 0 means
the record is durable. The helper never writes: if this process dies, it
reads end-of-input and exits, and nothing it could still do changes the log.

If the helper dies (or cannot be started), nothing is lost either: the
batch it was asked about is synced right here, on the loop, before it is
answered, and a new helper is started for the next one (after
``MAX_HELPER_STARTS`` starts, every pipelined batch is synced on the loop).
Only a sync that *fails* (the helper's reply is an ``errno``) is a log
failure: the store then refuses commits until reopened (``LmdbStore._broke``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import trio
from trio._core import _run as _trio_run

from . import _fsyncd
from .engine import _park

log = logging.getLogger(__name__)

__all__ = ["MAX_HELPER_STARTS", "MAX_IN_FLIGHT", "SyncHelper"]

MAX_HELPER_STARTS = 5  # after this many starts of the helper, sync on the loop instead
MAX_IN_FLIGHT = 2  # sync requests out at once: the next batch is written while one syncs
_SCRIPT = str(Path(_fsyncd.__file__).resolve())

assert MAX_HELPER_STARTS > 0 and MAX_IN_FLIGHT >= 1


class SyncHelper:
    """One helper process serving one log; up to ``MAX_IN_FLIGHT`` requests out.

    ``request(number, fd)`` is called on the loop after a record was written
    to segment ``number`` through ``fd``; one ``await done()`` per request,
    in request order, returns once that record is durable (raising
    ``OSError`` if the sync failed). The helper answers in order, so answers
    are matched to requests by position. The engine calls ``done()`` from
    one task at a time (it waits for batches in version order).
    """

    def __init__(self, wal_dir: Path, *, script: str = _SCRIPT) -> None:
        self.wal_dir = wal_dir
        self.script = script
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._out = 0  # requests made whose outcome done() has not yet returned
        self._answers: deque[int] = deque()  # outcomes heard, not yet taken (errno, 0: durable)
        self._buf = b""  # a partly read answer
        self._fd = -1  # the descriptor the newest record was written through (for syncing here)
        self._efd = -1  # the eventfd the helper sleeps on (-1: none, it reads the socket)

    # -- the child ---------------------------------------------------------

    def _start(self) -> bool:
        """Start a helper if allowed; False: sync on the loop this time."""
        if self.starts >= MAX_HELPER_STARTS:
            return False
        self.starts += 1
        ours, theirs = socket.socketpair()
        # The helper sleeps on an eventfd, not on the socket: see _fsyncd's docstring (a
        # request on the socket alone made the helper preempt the event loop on its core).
        efd = os.eventfd(0, os.EFD_CLOEXEC) if hasattr(os, "eventfd") else -1
        args = [str(theirs.fileno()), str(self.wal_dir)] + ([str(efd)] if efd >= 0 else [])
        try:
            # -I -S: no environment, no site-packages (the child uses the standard library only,
            # so it is up in milliseconds).
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", self.script, *args],
                pass_fds=(theirs.fileno(),) + ((efd,) if efd >= 0 else ()), stdin=subprocess.DEVNULL,
                close_fds=True)
        except OSError as exc:
            ours.close()
            if efd >= 0:
                os.close(efd)
            log.warning("could not start the log's sync helper for %s (%r); syncing on the event loop",
                        self.wal_dir, exc)
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._efd = efd
        return True

    def _lost(self, why: str) -> None:
        """The helper is gone: every request still unanswered is synced here (one
        ``fdatasync`` of the segment covers every record written to it)."""
        log.warning("the log's sync helper for %s %s; the batch is synced on the event loop%s", self.wal_dir, why,
                    "" if self.starts < MAX_HELPER_STARTS else ", and so is every later one")
        self._drop()
        self._sync_here()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        self._buf = b""
        efd, self._efd = self._efd, -1
        if sock is not None:
            sock.close()  # (before the eventfd: the helper then sees the hang-up, not a request)
        if efd >= 0:
            os.close(efd)
        proc, self._proc = self._proc, None
        if proc is not None:
            # Killed, not waited for until it sees the hang-up: it never writes, every
            # answer wanted was taken (close, _lost), and one started moments ago may still
            # be starting up (measured: such a wait took 0.5-0.9 s on a loaded machine).
            proc.kill()
            proc.wait()

    def _sync_here(self) -> None:
        """Answer every request still unanswered with one sync made here, on the loop."""
        unanswered = self._out - len(self._answers)
        if unanswered <= 0:
            return
        try:
            _datasync(self._fd)
        except OSError as exc:
            status = exc.errno or 5  # EIO when the error carries none
        else:
            status = 0
        self._answers.extend([status] * unanswered)

    # -- the protocol --------------------------------------------------------

    def has_room(self) -> bool:
        """Whether another request may go out before the oldest is answered."""
        return self._out < MAX_IN_FLIGHT

    def request(self, number: int, fd: int) -> None:
        """Ask for segment ``number`` to be synced; a record was just written to it through ``fd``.

        Without a helper (it cannot be started, or kept dying), the sync is
        made here and now, on the loop: slower, never less durable.
        """
        assert self._out < MAX_IN_FLIGHT, "too many sync requests out"
        self._fd = fd
        self._out += 1
        if self._sock is None and not self._start():
            self._sync_here()
            return
        try:
            self._sock.send(_fsyncd.REQUEST.pack(number))  # 8 bytes into a socket holding <= 16: never partial
            if self._efd >= 0:
                os.eventfd_write(self._efd, 1)  # the wake-up (after the request is in the socket)
        except OSError as exc:
            self._lost(f"could not be reached ({exc!r})")

    async def done(self) -> None:
        """Return once the oldest outstanding request is durable; raise ``OSError`` if its sync failed.

        Shielded: an answer must be taken before the next one, whatever
        happens to the waiting task. The engine already waits inside a
        shielded scope, and then this adds none of its own: a nested
        ``CancelScope`` measured ~50k instructions a batch (cachegrind, a
        lone writer on this path: 287.2k -> 237.6k a commit without it).
        """
        assert self._out > 0, "done() without a request"
        if _REFUSING_WAIT or _already_shielded():
            await self._wait_answer()
        else:
            with trio.CancelScope(shield=True):
                await self._wait_answer()
        status = self._answers.popleft()
        self._out -= 1
        if status:
            raise OSError(status, f"fdatasync of the write-ahead log failed: {os.strerror(status)}")

    async def _wait_answer(self) -> None:
        """Until an answer is in ``_answers``: run only where no cancellation can reach (see ``done``)."""
        while not self._answers:
            sock = self._sock
            if sock is None:  # cannot happen: _lost() and close() answer everything out
                raise OSError(5, "the log's sync helper went away without an answer")
            # Wait first: an answer comes after an fdatasync (>= 0.1 ms), so a recv
            # tried at once only fails (a system call and an exception per batch).
            try:
                if _REFUSING_WAIT:
                    await _wait_readable_refusing_cancel(sock)
                else:
                    await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                continue  # close() took the answers over and closed the socket
            if self._sock is not sock:
                continue  # woken, then close() ran before this task did: same as above
            self._receive(sock)

    def _receive(self, sock: socket.socket) -> None:
        """Read what answers have arrived (non-blocking) into ``_answers``; on end of input, fail over."""
        try:
            chunk = sock.recv(_fsyncd.REPLY.size * MAX_IN_FLIGHT)
        except BlockingIOError:  # a spurious wake-up: nothing yet
            return
        except OSError as exc:
            chunk, why = b"", f"failed ({exc!r})"
        else:
            why = "exited"
        if not chunk:
            self._lost(why)
            return
        self._take(chunk)

    def _take(self, chunk: bytes) -> None:
        buf = self._buf + chunk
        size = _fsyncd.REPLY.size
        whole = len(buf) - len(buf) % size
        self._answers.extend(_fsyncd.REPLY.unpack_from(buf, i)[0] for i in range(0, whole, size))
        self._buf = buf[whole:]

    def close(self) -> None:
        """Stop the helper (killed once its answers are in: it never writes).

        Requests still out are seen through first (blocking: one sync
        each), so their batches' waiters hear real outcomes when they next
        run. A waiter parked on the socket is woken before the socket
        closes: trio would never wake a task waiting on a descriptor closed
        under it.
        """
        sock = self._sock
        if sock is not None and len(self._answers) < self._out:
            sock.setblocking(True)
            try:
                while len(self._answers) < self._out:
                    chunk = sock.recv(_fsyncd.REPLY.size * MAX_IN_FLIGHT)
                    if not chunk:
                        break
                    self._take(chunk)
            except OSError:
                pass
        if sock is not None:
            try:
                trio.lowlevel.notify_closing(sock)
            except RuntimeError:
                pass  # not in a trio run: nobody can be waiting on it
        self._drop()
        self._sync_here()  # whatever the helper left unanswered

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


# trio 0.32's epoll I/O manager, whose waiter registry _wait_readable_refusing_cancel fills in
# (private: only on the trio it was copied from and tested with, REFUSING_WAIT_TRIO; on any other
# trio the pin allows, or another I/O manager, the answer is waited for under a shield)
REFUSING_WAIT_TRIO = "0.32."
_REFUSING_WAIT = (trio.__version__.startswith(REFUSING_WAIT_TRIO) and hasattr(trio._core, "_io_epoll")
                  and hasattr(trio._core._io_epoll, "EpollIOManager"))


async def _wait_readable_refusing_cancel(sock: socket.socket) -> None:
    """``trio.lowlevel.wait_readable(sock)`` that a cancellation cannot end: trio's own
    (``EpollIOManager._epoll_wait``) with an abort that refuses (``Abort.FAILED``), so the
    task waits on until the socket is readable (or closed: ``notify_closing``) and meets the
    cancellation at its next checkpoint. Why: an answer must be taken whatever happens to
    the waiting task, and a shielded ``CancelScope`` around the wait costs ~48k instructions
    entered and left, this nothing more than the wait itself."""
    runner = _trio_run.GLOBAL_RUN_CONTEXT.runner
    io = runner.io_manager
    if type(io) is not trio._core._io_epoll.EpollIOManager:
        with trio.CancelScope(shield=True):
            await trio.lowlevel.wait_readable(sock)
        return
    fd = sock.fileno()
    waiters = io._registered[fd]
    if waiters.read_task is not None:
        raise trio.BusyResourceError("another task is already reading this fd")
    waiters.read_task = _trio_run.GLOBAL_RUN_CONTEXT.task
    io._update_registrations(fd)
    await _park()  # (wait_task_rescheduled(_refuse_abort), without a trap and a coroutine a batch)


def _already_shielded() -> bool:
    """Whether the running task's innermost cancel scope is a shield (then nothing outside it can
    cancel the task, and no scope inside it exists to do so). Reads trio's internals (trio is
    pinned; kv.engine reads them too); on a trio it does not recognise, False (shield again)."""
    task = getattr(_trio_run.GLOBAL_RUN_CONTEXT, "task", None)
    scope = getattr(getattr(task, "_cancel_status", None), "_scope", None)
    return getattr(scope, "shield", False) is True


def _datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)

