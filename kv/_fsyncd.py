"""The write-ahead log's sync helper: a child process that only calls ``fdatasync``.

Run by :class:`kv.walsync.SyncHelper` as ``python -I -S _fsyncd.py SOCKET_FD WAL_DIR``
(standard library only, so it starts in milliseconds and never imports the
package). Why a process: see ``kv.walsync``.

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


def main(argv: list) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    wal_dir = argv[2]
    sync = getattr(os, "fdatasync", os.fsync)
    number, fd = -1, -1
    while True:
        try:
            raw = _read_exactly(sock, REQUEST.size)
        except OSError:
            return 0
        if not raw:
            return 0
        (wanted,) = REQUEST.unpack(raw)
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
