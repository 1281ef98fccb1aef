"""The embedded engine's Database handle: transactions and the retry loop."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

from .engine import Engine
from .errors import KVError
from .transaction import Transaction

log = logging.getLogger(__name__)

__all__ = ["Database"]

T = TypeVar("T")


class Database:
    """A handle on one engine. ``async with`` closes it (and the engine, if it owns it)."""

    def __init__(self, engine: Engine, *, url: str, owns_engine: bool = True) -> None:
        self._engine = engine
        self.url = url
        self._owns_engine = owns_engine

    @property
    def engine(self) -> Engine:
        return self._engine

    def create_transaction(self) -> Transaction:
        if self._engine.closed:
            raise KVError(2000, "database is closed")
        return Transaction(self)

    async def transact(
        self,
        fn: Callable[[Transaction], Awaitable[T]],
        *,
        retry_limit: int | None = None,
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(tr)`` and commit, retrying retryable errors with FoundationDB's backoff.

        ``commit_unknown_result`` (1021) is retried too, exactly as
        ``@fdb.transactional`` does: ``fn`` must be idempotent or guarded.
        ``timeout`` is in seconds and covers all attempts.
        """
        tr = self.create_transaction()
        if retry_limit is not None:
            tr.options.set_retry_limit(retry_limit)
        if timeout is not None:
            tr.options.set_timeout(int(timeout * 1000))
        while True:
            try:
                result = await fn(tr)
                await tr.commit()
                return result
            except KVError as e:
                if e.code == 1021:
                    log.debug("commit_unknown_result: retrying a maybe-committed transaction")
                await tr.on_error(e)

    async def close(self) -> None:
        if self._owns_engine:
            self._engine.close()

    async def __aenter__(self) -> "Database":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<kv.Database {self.url}>"
