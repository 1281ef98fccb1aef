"""The checkpointer: a helper process that empties sealed log segments into LMDB.

Run by the store as ``python -m kv.checkpoint DATA_DIR`` with a pipe on its
stdin. Each byte read is a request for a pass (the store sealed a segment);
end of file means the store closed or its process died, and the
checkpointer exits after the pass it is in. It never touches the newest
segment (the store appends to it) and takes ``CHECKPOINT.LOCK`` for each
pass, so a store reopening after a crash waits for a pass left running.

Why a process and not a thread: a checkpoint writes thousands of keys, and
py-lmdb re-takes the GIL around every ``put`` (see ``kv.wal``). In its own
process it runs on the second core without slowing the store's event loop.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from . import lmdb_layout as layout
from .wal import checkpoint_lock, checkpoint_pass

log = logging.getLogger("kv.checkpoint")


def run(path: Path) -> None:
    env = layout.open_env(path)
    wal_dir = path / "wal"
    parent = os.getppid()
    try:
        while True:
            with checkpoint_lock(path):
                done, applied = checkpoint_pass(env, wal_dir, include_newest=False)
            if done:
                log.debug("checkpointed %d segment(s) of %s through version %d", done, path, applied)
            if os.getppid() != parent:
                return  # orphaned: the store's process died (its stdin reaches EOF too)
            if not sys.stdin.buffer.read1(1):
                return  # the store closed (or died)
    finally:
        env.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="surefoot checkpointer: %(levelname)s %(message)s")
    if len(argv) != 2:
        log.error("usage: python -m kv.checkpoint DATA_DIR")
        return 2
    run(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
