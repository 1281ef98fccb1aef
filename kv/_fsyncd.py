"""The write-ahead log's sync helper: a child process that only calls ``fdatasync``.

Run by :class:`kv.walsync.SyncHelper` as ``python -I -S _fsyncd.py SOCKET_FD WAL_DIR [EVENT_FD]``
(standard library only, so it starts in milliseconds and never imports the
package). Why a process: see ``kv.walsync``.

Wake-ups: with ``EVENT_FD`` (an eventfd), the parent sends each request on
the socket and then adds 1 to the eventfd, and the helper sleeps on the
eventfd, not on the socket. Why: a write to a Unix socket wakes its reader
as a *synchronous* wake-up (the kernel assumes the writer is about to sleep
and puts the reader on the writer's CPU), so every request made the helper
preempt the parent's event loop on its own core, even with the other core
idle (measured: the loop was switched out in 84% of requests on a fast disk,
~0.1 ms each, and 29% on a slower one, ~0.7 ms each). An eventfd wakes its
reader normally: on an idle core if there is one. The socket is still
watched for the parent's end (hang-up only: data arriving does not wake a
poller that asked for no events). Without ``EVENT_FD`` the helper reads the
socket directly (the protocol is the same).

Protocol on the inherited stream socket, requests answered in order (the
parent may send the next before the previous is answered):

* request: the segment number to sync, u64 little-endian;
* reply: u32 little-endian, 0 when ``fdatasync`` of that segment returned, else
  the ``errno`` of the failure (opening or syncing).

End of input (the parent closed the socket or died) ends the helper. It
never writes to the log: the parent writes each record, then asks for it to
be synced, so nothing the helper does can outlive its parent's say.
"""

import os
import select
import socket
import struct
import sys

REQUEST = struct.Struct("<Q")
REPLY = struct.Struct("<I")
SEGMENT_NAME = "%016x.wal"  # kv.wal.segment_path's layout


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def _requests(sock: socket.socket, efd: int):
    """Yield each request's segment number as it comes; return at the parent's end."""
    if efd < 0:
        while True:
            raw = _read_exactly(sock, REQUEST.size)
            if not raw:
                return
            yield REQUEST.unpack(raw)[0]
    poller = select.poll()
    poller.register(efd, select.POLLIN)
    poller.register(sock, 0)  # hang-up and errors only (always reported)
    while True:
        ready = dict(poller.poll())
        if ready.get(efd, 0) & select.POLLIN:
            count = os.eventfd_read(efd)  # requests sent since the last read (each sent before its +1)
            raw = _read_exactly(sock, REQUEST.size * count)
            if not raw:
                return
            for i in range(count):
                yield REQUEST.unpack_from(raw, i * REQUEST.size)[0]
        elif sock.fileno() in ready:
            return  # the parent closed its end (or died) with nothing more asked


def main(argv: list) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    wal_dir = argv[2]
    efd = int(argv[3]) if len(argv) > 3 else -1
    sync = getattr(os, "fdatasync", os.fsync)
    number, fd = -1, -1
    requests = _requests(sock, efd)
    while True:
        try:
            wanted = next(requests, None)
        except OSError:
            return 0
        if wanted is None:
            return 0
        status = 0
        try:
            if wanted != number:
                if fd >= 0:
                    os.close(fd)
                    number, fd = -1, -1
                fd = os.open(os.path.join(wal_dir, SEGMENT_NAME % wanted), os.O_WRONLY | os.O_CLOEXEC)
                number = wanted
            sync(fd)
        except OSError as exc:
            status = exc.errno or 5  # EIO when the error carries none
        try:
            sock.sendall(REPLY.pack(status))
        except OSError:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
