"""The direct SSE write path: live frames written to a follower's socket without hypercorn's send path.

Why
    At a thousand followers of one conversation every event costs a thousand writes, and a
    profile of the fan-out (tests/bench/bench_server.py with ``BENCH_SERVER_PROFILE``) put
    about 175 µs of CPU on each (1,000 followers: ~175 ms per event, 1.75 cores at 10 events/s
    on a 2-core machine) — a task wakeup per connection, then hypercorn's ASGI ``send``:
    ``HTTPStream.app_send`` -> ``H11Protocol.stream_send`` -> h11's chunked writer ->
    ``TCPServer.protocol_send`` (a lock, a shielded cancel scope) -> trio's ``send_all`` (a
    checkpoint, the socket wrapper), with the socket ``send`` itself a quarter of it. The
    hub already encodes each frame once; with this path it also *writes* it: one loop over the
    live followers' sockets, one non-blocking ``send`` of the same pre-framed bytes each, no
    task switched to. Everything else (headers, the opening comment, the replay, the closing
    frame, the end of the response) still goes through ASGI.

How (and why it is safe)
    :func:`open_direct_writer` is called by :class:`server.app.FastRoutes` after the response
    start has been sent through ASGI. It recognises hypercorn's HTTP/1.1 trio stack behind the
    ASGI ``send`` callable (``HTTPStream.app_send`` bound to a stream whose protocol is an
    ``H11Protocol`` whose ``send`` is ``TCPServer.protocol_send``) and checks that h11 is
    sending this response body with the chunked coding (an HTTP/1.1 peer, state SEND_BODY) on
    a plain (not TLS) socket. Anything else — HTTP/2, TLS, HTTP/1.0, another server, a
    hypercorn whose internals moved — returns ``None`` and the stream keeps the ASGI path, so
    the fast path can only ever be an optimisation. ``tests/server`` asserts it is taken with
    the installed hypercorn, so an upgrade that loses it fails a test rather than the benchmark.

    Byte-stream consistency: every direct write is one or more *whole* chunks of the chunked
    coding (``<hex length>\\r\\n<data>\\r\\n``), and a write that the kernel takes only in part
    keeps its remainder in :attr:`DirectWriter.pending`, which the stream's own task flushes
    before anything else is written (directly or through ASGI). h11 does not count chunked
    body bytes, so its final ``0\\r\\n\\r\\n`` (sent through ASGI at the end) stays valid.

    Interleaving with hypercorn: writes happen only while hypercorn's per-connection send lock
    is free (a synchronous write cannot interleave with a suspended ``send_all``), and the
    task-side flush holds that lock.

    File descriptor lifetime: the writer owns a ``dup`` of the socket's descriptor, closed by
    :meth:`DirectWriter.close` when the stream ends. If hypercorn closes its descriptor first
    (the client went away), ours still names the same socket, never a descriptor number that
    a new connection has reused — a write can never reach another client.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import h11
import trio
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.tcp_server import TCPServer

__all__ = ["DirectWriter", "open_direct_writer", "chunk"]

#: Largest pending (accepted, not yet written) bytes before a writer refuses more: a follower this far
#: behind is treated like one whose queue overflowed (cut off; it reconnects with Last-Event-ID).
MAX_PENDING_BYTES = 8 * 1024 * 1024
assert MAX_PENDING_BYTES > 0


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of HTTP/1.1's chunked transfer coding."""
    assert data, "an empty chunk would end the response"
    return b"%x\r\n%b\r\n" % (len(data), data)


class DirectWriter:
    """Non-blocking writes of whole chunks to one connection's socket (see the module docstring)."""

    __slots__ = ("_sock", "_lock", "pending", "broken")

    def __init__(self, sock: socket.socket, lock: trio.Lock) -> None:
        self._sock: socket.socket | None = sock
        self._lock = lock
        #: Bytes accepted but not yet written (the tail of a partial write, or writes made while
        #: hypercorn held the connection), in order. The owning task flushes them.
        self.pending = bytearray()
        #: The peer is gone (a write failed) or the writer is closed: accept and drop everything.
        self.broken = False

    def try_write(self, data: bytes) -> bool:
        """Write ``data`` (whole chunks) now, without blocking. False: some or all of it is
        pending (or the writer is broken) and the owning task must :meth:`flush`."""
        if self.broken:
            return False
        if self.pending or self._lock.locked():
            self._hold(data)
            return False
        assert self._sock is not None
        try:
            n = self._sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.broken = True
            return False
        if n == len(data):
            return True
        self._hold(memoryview(data)[n:])
        return False

    def _hold(self, data: bytes | memoryview) -> None:
        if len(self.pending) + len(data) > MAX_PENDING_BYTES:
            self.broken = True  # too far behind: cut off (the client resumes with Last-Event-ID)
            self.pending.clear()
            return
        self.pending += data

    async def write(self, data: bytes) -> None:
        """Queue ``data`` (whole chunks) behind anything pending and write it all; may block."""
        if data:
            if self.broken:
                raise trio.BrokenResourceError("the SSE client is gone")
            self._hold(data)
        await self.flush()

    async def flush(self) -> None:
        """Write everything pending, waiting for the socket as needed (holding hypercorn's send lock)."""
        if self.broken:
            raise trio.BrokenResourceError("the SSE client is gone")
        if not self.pending:
            return
        async with self._lock:
            while self.pending:
                assert self._sock is not None
                try:
                    n = self._sock.send(self.pending)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self._sock)
                    continue
                except OSError as e:
                    self.broken = True
                    self.pending.clear()
                    raise trio.BrokenResourceError("the SSE client is gone") from e
                del self.pending[:n]

    def fileno(self) -> int:
        """The writer's own descriptor for the connection (-1 once closed)."""
        return self._sock.fileno() if self._sock is not None else -1

    def close(self) -> None:
        self.broken = True
        self.pending.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def open_direct_writer(send: Any) -> DirectWriter | None:
    """A :class:`DirectWriter` for the connection behind hypercorn's ASGI ``send``, or None.

    Call after the response start has gone out through ``send`` (so h11 is in SEND_BODY).
    """
    stream = getattr(send, "__self__", None)
    if not isinstance(stream, HTTPStream) or getattr(send, "__func__", None) is not HTTPStream.app_send:
        return None
    protocol = getattr(stream.send, "__self__", None)
    if not isinstance(protocol, H11Protocol):
        return None  # HTTP/2 or HTTP/3: frames, not chunks
    conn = protocol.connection
    if not isinstance(conn, h11.Connection) or conn.our_state is not h11.SEND_BODY:
        return None
    if conn.their_http_version is None or conn.their_http_version < b"1.1":
        return None  # an HTTP/1.0 peer: no chunked coding
    server = getattr(protocol.send, "__self__", None)
    if not isinstance(server, TCPServer):
        return None
    tstream = getattr(server, "stream", None)
    lock = getattr(server, "send_lock", None)
    if not isinstance(tstream, trio.SocketStream) or not isinstance(lock, trio.Lock):
        return None  # TLS (an SSLStream) or something unknown
    try:
        fd = os.dup(tstream.socket.fileno())
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
    except OSError:
        os.close(fd)
        return None
    return DirectWriter(sock, lock)
