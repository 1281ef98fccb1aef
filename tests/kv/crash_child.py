"""Child process for test_crash.py: commit in a loop, report each acknowledged commit.

Usage: python crash_child.py DATA_DIR ROUND [SEGMENT_BYTES]

With SEGMENT_BYTES the store seals a log segment that often, so its
checkpointer process is busy while the kills land.

Prints ``ready`` once the database is open, then ``ack TXID`` on stdout
(flushed) after each ``commit()`` returns. Eight concurrent writers make the
engine form multi-transaction batches. Each transaction writes four data keys
and a versionstamped value, so the parent can check all-or-nothing per
transaction and per batch. Runs until it is SIGKILLed.
"""

from __future__ import annotations

import struct
import sys

import trio

import kv

WRITERS = 8
KEYS_PER_TX = 4


async def main(path: str, round_no: int, segment_bytes: int | None) -> None:
    if segment_bytes is None:
        db = await kv.open(f"lmdb:{path}")
    else:
        import time

        from kv.engine import Engine
        from kv.lmdb_engine import LmdbStore

        db = kv.Database(Engine(LmdbStore(path, segment_bytes=segment_bytes), clock=time.time), url=f"lmdb:{path}")
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    async def writer(w: int) -> None:
        n = 0
        while True:
            txid = b"%03d.%d.%06d" % (round_no, w, n)
            tr = db.create_transaction()
            # blind writes to unique keys: never conflicts, committed at most once
            for j in range(KEYS_PER_TX):
                tr.set(b"data/%s/%d" % (txid, j), txid * 8)
            tr.set_versionstamped_value(b"stamp/" + txid, b"\x00" * 10 + struct.pack("<I", 0))
            await tr.commit()
            sys.stdout.write(f"ack {txid.decode()}\n")
            sys.stdout.flush()
            n += 1

    async with trio.open_nursery() as nursery:
        for w in range(WRITERS):
            nursery.start_soon(writer, w)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
