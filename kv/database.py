"""The embedded engine's Database handle: transactions and the retry loop."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

from trio._core import _run as _trio_run

from .engine import Engine, _stamp
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
                # tr.commit()'s steps for the usual case (a transaction without a timeout,
                # watches or a cancelled/used state, whose class keeps Transaction.commit),
                # the engine awaited from here, without commit()'s coroutine frame (~1k
                # instructions a commit): commit()'s own methods (_prepare_commit,
                # _commit_failed), with transaction.cancel_pending's test and _commit_done's
                # body (no watches here) written in, a call less each (~0.9k a commit
                # together, w64). Anything else: commit().
                task = _trio_run.GLOBAL_RUN_CONTEXT.task
                if (tr._slow or not tr._direct_commit or task._cancel_status.effectively_cancelled
                        or (task is task._runner.main_task and task._runner.ki_pending)):
                    await tr.commit()
                    return result
                task._cancel_points += 1  # (commit()'s checkpoint_if_cancelled, passed)
                if tr._prepare_commit():
                    try:
                        await tr._engine.commit(tr)
                    except BaseException as exc:
                        tr._commit_failed(exc)
                        raise
                    version = tr._committed_version = tr._batch_version
                    if tr._versionstamp is not None:
                        # (_finish's one step left here: no watches, which make a transaction
                        # _slow, and the snapshot released by _prepare_commit)
                        tr._versionstamp._set(_stamp(version, tr._batch_order))
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
