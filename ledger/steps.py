"""Durable steps (promise 11): exactly-once-recorded, at-least-once-executed.

``step(lease, name, fn)`` returns the recorded result of (run, name) without
calling ``fn`` if there is one; otherwise it calls ``fn`` (outside any
transaction) and records its result in a transaction that checks the lease.
A crash between the call and the record re-executes ``fn`` on the next
attempt — hence :func:`idempotency_key`, stable per (run, name), to hand to the
far end so *it* can deduplicate. Step names must be deterministic in the run's
code; a name used twice in one execution (one lease) is refused with
:class:`StepNameReused`. An exception from ``fn`` is not recorded: it
propagates and the step runs again next time.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from sessions.codec import dumps, loads, read_chunks, write_chunks

from .errors import StepNameReused

if TYPE_CHECKING:
    from .runs import Lease, Ledger

__all__ = ["Steps", "idempotency_key", "MAX_STEP_NAME", "MAX_STEP_RESULT_BYTES"]

MAX_STEP_NAME = 1_000
#: A step result is written in the recording transaction (chunked), so bound it.
MAX_STEP_RESULT_BYTES = 4_000_000


def idempotency_key(run_id: str, name: str) -> str:
    """Stable across attempts and processes: ``sf-`` + 32 hex of SHA-256(run, name)."""
    h = hashlib.sha256(f"{run_id}\x00{name}".encode()).hexdigest()[:32]
    return f"sf-{h}"


class Steps:
    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger
        self.keys = ledger.keys

    async def get(self, run_id: str, name: str) -> tuple[bool, Any]:
        """``(True, result)`` when (run, name) is recorded, else ``(False, None)``. Read-only."""
        async def fn(tr: Any) -> tuple[bool, Any]:  # read-only
            body = await read_chunks(tr, self.keys.step(run_id, name))
            return (False, None) if body is None else (True, loads(body)["result"])

        return await self.ledger.db.transact(fn)

    async def step(self, lease: "Lease", name: str, fn: Callable[[], Any | Awaitable[Any]]) -> Any:
        if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
            raise ValueError(f"a step name is a non-empty string of at most {MAX_STEP_NAME} characters")
        if name in lease.step_names:
            raise StepNameReused(f"step {name!r} was already used in this execution of run {lease.run_id!r}")
        lease.step_names.add(name)
        sub = self.keys.step(lease.run_id, name)

        async def lookup(tr: Any) -> tuple[bool, Any]:  # read + lease check: no writes
            await self.ledger.check_lease(tr, lease)
            body = await read_chunks(tr, sub)
            return (False, None) if body is None else (True, loads(body)["result"])

        found, result = await self.ledger.db.transact(lookup)
        if found:
            return result
        value = fn()
        if inspect.isawaitable(value):
            value = await value
        body = dumps({"result": value, "at": self.ledger.clock()})
        if len(body) > MAX_STEP_RESULT_BYTES:
            raise ValueError(f"step result of {len(body)} bytes exceeds {MAX_STEP_RESULT_BYTES}")

        async def record(tr: Any) -> Any:  # guarded: reads the step record first
            # Guarded: reads the step record first; a retry after a committed
            # attempt returns what was recorded.
            await self.ledger.check_lease(tr, lease)
            existing = await read_chunks(tr, sub)
            if existing is not None:
                return loads(existing)["result"]
            write_chunks(tr, sub, body)
            return value

        return await self.ledger.db.transact(record)
