"""kv — strictly serializable, FoundationDB-shaped transactions.

The one storage contract under surefoot: FoundationDB's transaction model,
met by three backends so the code above is written once:

* ``memory:`` — in-process MVCC (tests, the simulator; see :mod:`kv.memory`),
* a path or ``lmdb:PATH`` — the embedded engine, durable on local disk,
* ``fdb:`` / ``fdb:CLUSTER_FILE`` — a FoundationDB cluster via the official bindings.

    async with await kv.open("./data") as db:
        await db.transact(fn)            # fn(tr): reads, writes; retried on conflict

See docs/kv-api.md for the whole surface and kv.limits for the numbers.
"""

from __future__ import annotations

import os

from . import limits, tuple
from .database import Database
from .engine import FaultHooks, Watch
from .errors import KVError
from .lmdb_engine import DataDirectoryLocked
from .memory import MemoryEngine
from .selectors import KeySelector
from .transaction import KeyValue, Transaction
from .tuple import Subspace

__all__ = [
    "open", "Database", "Transaction", "KeyValue", "KeySelector", "Watch", "KVError",
    "DataDirectoryLocked", "MemoryEngine", "FaultHooks", "Subspace", "tuple", "limits",
    "DEFAULT_URL",
]

DEFAULT_URL = "lmdb:./surefoot-data"
FDB_CLUSTER_FILE_ENV = "SUREFOOT_FDB_CLUSTER_FILE"


async def open(url: str | os.PathLike = DEFAULT_URL) -> Database:  # noqa: A001 - the issue names it kv.open
    """Open a database by URL: ``memory:``, ``lmdb:PATH`` or a bare path, ``fdb:[CLUSTER_FILE]``."""
    url = os.fspath(url)
    if not url:
        raise ValueError("empty kv url: use memory:, lmdb:PATH, a path, or fdb:[CLUSTER_FILE]")
    if url == "memory:" or url == "memory":
        return Database(MemoryEngine().engine, url="memory:", owns_engine=True)
    if url.startswith("fdb:") or url == "fdb":
        from .fdb_backend import open_fdb

        cluster_file = url[4:] or os.environ.get(FDB_CLUSTER_FILE_ENV) or None
        return await open_fdb(cluster_file)
    if url.startswith("lmdb:"):
        path = url[5:]
    elif ":" in url.split("/", 1)[0] and not url.startswith((".", "/")):
        raise ValueError(f"unknown kv url scheme in {url!r}: use memory:, lmdb:PATH, a path, or fdb:")
    else:
        path = url
    if not path:
        raise ValueError("lmdb: needs a directory path, e.g. lmdb:./surefoot-data")
    from .lmdb_engine import open_lmdb_engine

    engine = open_lmdb_engine(path)
    return Database(engine, url=f"lmdb:{path}")
