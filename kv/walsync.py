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
number over a socket, and hears the reply through ``epoll`` like any other
I/O, while the child spends its time in ``fdatasync``.

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
from pathlib import Path

import trio

from . import _fsyncd

log = logging.getLogger(__name__)

__all__ = ["SyncHelper", "MAX_HELPER_STARTS", "HELPER_EXIT_SECONDS"]

MAX_HELPER_STARTS = 5  # after this many starts of the helper, sync on the loop instead
HELPER_EXIT_SECONDS = 5.0  # close() waits this long for the helper to exit, then kills it
_SCRIPT = str(Path(_fsyncd.__file__).resolve())

assert MAX_HELPER_STARTS > 0 and HELPER_EXIT_SECONDS > 0


class SyncHelper:
    """One helper process serving one log; one request in flight at a time.

    ``request(number, fd)`` is called on the loop after the record was written
    to segment ``number`` through ``fd``; ``await done()`` returns once it is durable
    (raising ``OSError`` if the sync failed). The engine's pipeline never has
    two batches in flight, so replies are matched to requests by order.
    """

    def __init__(self, wal_dir: Path, *, script: str = _SCRIPT) -> None:
        self.wal_dir = wal_dir
        self.script = script
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._asked = False  # a request is out and its outcome not yet taken by done()
        self._reply = b""  # its reply so far (u32 errno, 0: durable)
        self._fd = -1  # the descriptor its record was written through (for syncing here)

    # -- the child ---------------------------------------------------------

    def _start(self) -> bool:
        """Start a helper if allowed; False: sync on the loop this time."""
        if self.starts >= MAX_HELPER_STARTS:
            return False
        self.starts += 1
        ours, theirs = socket.socketpair()
        try:
            # -I -S: no environment, no site-packages (the child uses the standard library only,
            # so it is up in milliseconds).
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", self.script, str(theirs.fileno()), str(self.wal_dir)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            ours.close()
            log.warning("could not start the log's sync helper for %s (%r); syncing on the event loop",
                        self.wal_dir, exc)
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        return True

    def _lost(self, why: str) -> None:
        log.warning("the log's sync helper for %s %s; the batch is synced on the event loop%s", self.wal_dir, why,
                    "" if self.starts < MAX_HELPER_STARTS else ", and so is every later one")
        self._drop()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.wait(HELPER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- the protocol --------------------------------------------------------

    def request(self, number: int, fd: int) -> None:
        """Ask for segment ``number`` to be synced; its record was just written through ``fd``.

        Without a helper (it cannot be started, or kept dying), the sync is
        made here and now, on the loop: slower, never less durable.
        """
        assert not self._asked, "one sync request at a time"
        self._fd = fd
        if self._sock is None and not self._start():
            _datasync(fd)
            return
        try:
            self._sock.send(_fsyncd.REQUEST.pack(number))  # 8 bytes into an empty socket: never partial
        except OSError as exc:
            self._lost(f"could not be reached ({exc!r})")
            _datasync(fd)
            return
        self._asked = True
        self._reply = b""

    async def done(self) -> None:
        """Return once the requested sync is done; raise ``OSError`` if it failed.

        Shielded: the reply must be read before the next request, whatever
        happens to the waiting task (the engine shields commits anyway).
        """
        if not self._asked:
            return  # synced in request()
        with trio.CancelScope(shield=True):
            while len(self._reply) < _fsyncd.REPLY.size:
                sock = self._sock
                if sock is None:
                    break  # close() took the answer over (see there)
                # Wait first: the answer comes after an fdatasync (>= 0.1 ms), so a recv
                # tried at once only fails (a system call and an exception per batch).
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:
                    continue  # close() read the answer and closed the socket
                if self._sock is not sock:
                    continue  # woken, then close() ran before this task did: same as above
                try:
                    chunk = sock.recv(_fsyncd.REPLY.size - len(self._reply))
                except BlockingIOError:  # a spurious wake-up: wait again
                    continue
                except OSError as exc:
                    chunk, why = b"", f"failed ({exc!r})"
                else:
                    why = "exited"
                if not chunk:
                    self._lost(why)
                    self._sync_here()
                    break
                self._reply += chunk
        self._finish()

    def _sync_here(self) -> None:
        """The helper is gone with the request unanswered: sync the record ourselves."""
        try:
            _datasync(self._fd)
        except OSError as exc:
            self._reply = _fsyncd.REPLY.pack(exc.errno or 5)
        else:
            self._reply = _fsyncd.REPLY.pack(0)

    def _finish(self) -> None:
        self._asked = False
        if len(self._reply) < _fsyncd.REPLY.size:  # cannot happen: close() and _lost() always complete it
            raise OSError(5, "the log's sync helper went away without an answer")
        (status,) = _fsyncd.REPLY.unpack(self._reply)
        if status:
            raise OSError(status, f"fdatasync of the write-ahead log failed: {os.strerror(status)}")

    def close(self) -> None:
        """Stop the helper (end of input: it exits at once).

        A request still out is seen through first (blocking: one sync), so
        its batch's waiter hears a real outcome when it next runs. A waiter
        parked on the socket is woken before the socket closes: trio would
        never wake a task waiting on a descriptor closed under it.
        """
        if self._asked and len(self._reply) < _fsyncd.REPLY.size and self._sock is not None:
            self._sock.setblocking(True)
            try:
                while len(self._reply) < _fsyncd.REPLY.size:
                    chunk = self._sock.recv(_fsyncd.REPLY.size - len(self._reply))
                    if not chunk:
                        self._sync_here()
                        break
                    self._reply += chunk
            except OSError:
                self._sync_here()
        if self._sock is not None:
            try:
                trio.lowlevel.notify_closing(self._sock)
            except RuntimeError:
                pass  # not in a trio run: nobody can be waiting on it
        self._drop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


def _datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)

