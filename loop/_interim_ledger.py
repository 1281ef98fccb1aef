"""INTERIM: a minimal ledger so the loop can be built and tested before ``ledger/`` lands.

Everything here is the ``ledger`` package's job (issue 3); this module exists
only until that package exposes submissions, runs, leases, cancellation,
usage and steps, and :mod:`loop.store` is switched over to it.  It keeps
the same promises in the simplest way (one record per run, a FIFO per
conversation, a ready index), without the performance work.

Keys under ``root["lpx"]``:

("sub", owner, submission_id)        CBOR {"hash", "run_id"}
("run", run_id)                      CBOR run record (see ``_new_run``)
("q", owner, conv, created_ns, run)  b"": the conversation's FIFO of unsettled runs
("ready", run_id)                    b"": runs that may be claimed now (head of their FIFO, not parked)
("wake",)                            int64: bumped whenever a run becomes ready (watched)
("u", run_id, step)                  CBOR usage of one step (idempotent on (run, step))
("st", run_id, name)                 CBOR {"value": ...}: a durable step's recorded result
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio

import kv
from sessions import events as E
from sessions.codec import canonical_hash, dumps, loads, pack_i64

__all__ = ["InterimLedger", "LeaseLost", "SubmissionConflict", "Lease"]

DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_MAX_ATTEMPTS = 10


class LedgerError(Exception):
    pass


class LeaseLost(LedgerError):
    pass


class SubmissionConflict(LedgerError):
    pass


class RunNotFound(LedgerError):
    pass


@dataclass
class Lease:
    run_id: str
    worker: str
    token: str
    expires: float
    attempt: int


class InterimLedger:
    def __init__(self, db: Any, root: kv.Subspace, *, journal: Any, clock: Callable[[], float] = time.time,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        self.db = db
        self.sub = root["lpx"]
        self.journal = journal
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts

    def _k(self, *t: Any) -> bytes:
        return self.sub.pack(t)

    async def _get_run(self, tr: Any, run_id: str) -> dict[str, Any]:
        raw = await tr.get(self._k("run", run_id))
        if raw is None:
            raise RunNotFound(run_id)
        return loads(raw)

    def _put_run(self, tr: Any, run: dict[str, Any]) -> None:
        tr.set(self._k("run", run["id"]), dumps(run))

    def _mark_ready(self, tr: Any, run_id: str) -> None:
        tr.set(self._k("ready", run_id), b"")
        tr.add(self._k("wake"), pack_i64(1))

    async def _promote_head(self, tr: Any, owner: str, conv: str) -> None:
        """Make the head of the conversation's FIFO ready (if it is queued)."""
        r = self.sub.range(("q", owner, conv))
        rows = await tr.get_range(r.start, r.stop, limit=1)
        if not rows:
            return
        run_id = self.sub.unpack(rows[0].key)[-1]
        run = await self._get_run(tr, run_id)
        if run["status"] == "queued":
            self._mark_ready(tr, run_id)

    # -- submit -------------------------------------------------------------

    async def submit(self, owner: str, conv: str, submission_id: str, delivery: Any, schema: Any) -> dict[str, Any]:
        """Guarded by the submission record: a retry finds it and returns the same run."""
        h = canonical_hash({"delivery": delivery, "schema": schema})
        new_run_id = uuid.uuid4().hex

        async def fn(tr: Any) -> dict[str, Any]:
            raw = await tr.get(self._k("sub", owner, submission_id))
            if raw is not None:
                rec = loads(raw)
                if rec["hash"] != h:
                    raise SubmissionConflict(f"submission {submission_id!r} exists with a different request")
                run = await self._get_run(tr, rec["run_id"])
                return {"run": run, "duplicate": True, "ref": None}
            now = self.clock()
            run = {"id": new_run_id, "owner": owner, "conversation": conv, "submission_id": submission_id,
                   "delivery": delivery, "result_schema": schema, "status": "queued", "attempt": 0,
                   "lease": None, "outcome": None, "created": now, "cancel": False, "parked": False}
            tr.set(self._k("sub", owner, submission_id), dumps({"hash": h, "run_id": new_run_id}))
            self._put_run(tr, run)
            created_ns = int(now * 1e9)
            r = self.sub.range(("q", owner, conv))
            first = await tr.get_range(r.start, r.stop, limit=1)
            tr.set(self._k("q", owner, conv, created_ns, new_run_id), b"")
            if not first:
                self._mark_ready(tr, new_run_id)
            ref = await self.journal.emit(tr, owner, conv, E.RUN_QUEUED, {"run_id": new_run_id, "submission_id": submission_id})
            return {"run": run, "duplicate": False, "ref": ref}

        res = await self.db.transact(fn)
        res["cursor"] = await res["ref"].cursor() if res["ref"] is not None else None
        return res

    # -- claims -------------------------------------------------------------

    async def claim(self, worker: str) -> tuple[dict[str, Any], Lease] | None:
        """Guarded by the run record's lease field (read in the transaction)."""
        token = uuid.uuid4().hex

        async def fn(tr: Any) -> tuple[dict[str, Any], Lease] | None | str:
            now = self.clock()
            r = self.sub.range(("ready",))
            rows = await tr.snapshot.get_range(r.start, r.stop, limit=64)
            for row in rows:
                run_id = self.sub.unpack(row.key)[-1]
                tr.add_read_conflict_key(row.key)
                run = await self._get_run(tr, run_id)
                lease = run.get("lease")
                if lease and lease["token"] == token:
                    return run, Lease(run_id, worker, token, lease["expires"], run["attempt"])
                if run["status"] in ("completed", "failed", "cancelled") or run.get("parked"):
                    tr.clear(row.key)
                    continue
                if lease and lease["expires"] > now:
                    continue
                if run["attempt"] >= self.max_attempts:
                    await self._settle(tr, run, {"status": "failed", "error": {"kind": "retry_exhausted",
                                       "message": f"run failed after {run['attempt']} attempts"}})
                    continue
                run["attempt"] += 1
                run["status"] = "running"
                run["lease"] = {"worker": worker, "token": token, "expires": now + self.lease_seconds}
                self._put_run(tr, run)
                return run, Lease(run_id, worker, token, now + self.lease_seconds, run["attempt"])
            return None

        return await self.db.transact(fn)

    async def check_lease(self, tr: Any, lease: Lease) -> dict[str, Any]:
        run = await self._get_run(tr, lease.run_id)
        cur = run.get("lease")
        if not cur or cur["token"] != lease.token or run["status"] != "running":
            raise LeaseLost(f"run {lease.run_id}: lease is no longer held")
        return run

    async def renew(self, lease: Lease) -> None:
        async def fn(tr: Any) -> None:  # guarded by the lease check; idempotent
            run = await self.check_lease(tr, lease)
            run["lease"]["expires"] = self.clock() + self.lease_seconds
            self._put_run(tr, run)

        await self.db.transact(fn)

    async def release(self, lease: Lease) -> None:
        async def fn(tr: Any) -> None:  # guarded by the lease check
            try:
                run = await self.check_lease(tr, lease)
            except LeaseLost:
                return
            run["lease"] = None
            run["status"] = "queued"
            self._put_run(tr, run)
            self._mark_ready(tr, lease.run_id)

        await self.db.transact(fn)

    async def void_all_leases(self) -> int:
        """Embedded restart: every lease belongs to a dead process."""
        async def fn(tr: Any) -> int:
            n = 0
            r = self.sub.range(("ready",))
            for row in await tr.get_range(r.start, r.stop):
                run_id = self.sub.unpack(row.key)[-1]
                run = await self._get_run(tr, run_id)
                if run.get("lease") and run["status"] == "running":
                    run["lease"]["expires"] = 0.0
                    self._put_run(tr, run)
                    n += 1
            return n

        return await self.db.transact(fn)

    async def _settle(self, tr: Any, run: dict[str, Any], outcome: dict[str, Any]) -> None:
        run["status"] = outcome["status"]
        run["outcome"] = outcome
        run["lease"] = None
        self._put_run(tr, run)
        tr.clear(self._k("ready", run["id"]))
        tr.clear(self._k("q", run["owner"], run["conversation"], int(run["created"] * 1e9), run["id"]))
        data = {"run_id": run["id"], "status": outcome["status"]}
        for k in ("result", "error"):
            if k in outcome:
                data[k] = outcome[k]
        await self.journal.emit(tr, run["owner"], run["conversation"], E.RUN_SETTLED_EVENTS[outcome["status"]], data)
        await self._promote_head(tr, run["owner"], run["conversation"])

    async def settle(self, tr: Any, lease: Lease, outcome: dict[str, Any]) -> None:
        run = await self.check_lease(tr, lease)
        await self._settle(tr, run, outcome)

    # -- park / cancel ------------------------------------------------------

    async def park(self, tr: Any, lease: Lease) -> None:
        run = await self.check_lease(tr, lease)
        run["parked"] = True
        run["status"] = "parked"
        run["lease"] = None
        self._put_run(tr, run)
        tr.clear(self._k("ready", run["id"]))

    async def unpark(self, tr: Any, run_id: str) -> None:
        run = await self._get_run(tr, run_id)
        if run["status"] != "parked":
            return
        run["parked"] = False
        run["status"] = "queued"
        run["attempt"] = max(0, run["attempt"] - 1)  # a park is not a failed attempt
        self._put_run(tr, run)
        self._mark_ready(tr, run_id)

    async def cancel(self, owner: str, run_id: str) -> dict[str, Any]:
        async def fn(tr: Any) -> dict[str, Any]:  # idempotent: sets a flag
            run = await self._get_run(tr, run_id)
            if run["owner"] != owner:
                raise RunNotFound(run_id)
            if run["status"] in ("completed", "failed", "cancelled"):
                return run
            run["cancel"] = True
            self._put_run(tr, run)
            tr.add(self._k("cancel-n", run_id), pack_i64(1))
            if run["status"] == "queued" and run["attempt"] == 0:
                await self._settle(tr, run, {"status": "cancelled"})  # never started: settle at once
            elif run["status"] == "parked":
                await self.unpark(tr, run_id)  # a worker finalises it
            return run

        return await self.db.transact(fn)

    async def cancel_requested(self, tr: Any, run_id: str) -> bool:
        return bool((await self._get_run(tr, run_id)).get("cancel"))

    async def wait_cancel(self, run_id: str) -> None:
        while True:
            async def fn(tr: Any) -> tuple[bool, Any]:
                run = await self._get_run(tr, run_id)
                if run.get("cancel"):
                    return True, None
                return False, tr.watch(self._k("cancel-n", run_id))

            done, w = await self.db.transact(fn)
            if done:
                return
            try:
                await w
            finally:
                if not w.ready:
                    w.cancel()

    async def wait_ready(self) -> None:
        w = await self.db.transact(lambda tr: _watch(tr, self._k("wake")))
        try:
            await w
        finally:
            if not w.ready:
                w.cancel()

    # -- usage / steps ------------------------------------------------------

    async def record_usage(self, tr: Any, run_id: str, step: str, usage: dict[str, Any]) -> None:
        key = self._k("u", run_id, step)
        if await tr.get(key) is None:
            tr.set(key, dumps(usage))
            for f in ("input_tokens", "output_tokens"):
                tr.add(self._k("ut", run_id, f), pack_i64(int(usage.get(f, 0))))

    async def usage_totals(self, tr: Any, run_id: str) -> dict[str, int]:
        from sessions.codec import unpack_i64
        return {f: unpack_i64(await tr.get(self._k("ut", run_id, f))) for f in ("input_tokens", "output_tokens")}

    async def step(self, lease: Lease, name: str, fn: Callable[[], Any]) -> Any:
        key = self._k("st", lease.run_id, name)
        raw = await self.db.transact(lambda tr: tr.get(key))
        if raw is not None:
            return loads(raw)["value"]
        value = fn()
        if hasattr(value, "__await__"):
            value = await value

        async def put(tr: Any) -> Any:  # guarded: first record wins
            await self.check_lease(tr, lease)
            cur = await tr.get(key)
            if cur is not None:
                return loads(cur)["value"]
            tr.set(key, dumps({"value": value}))
            return value

        return await self.db.transact(put)

    async def get(self, owner: str, run_id: str) -> dict[str, Any]:
        run = await self.db.transact(lambda tr: self._get_run(tr, run_id))
        if run["owner"] != owner:
            raise RunNotFound(run_id)
        return run

    async def list_runs(self, owner: str, conv: str | None) -> list[dict[str, Any]]:
        async def fn(tr: Any) -> list[dict[str, Any]]:
            r = self.sub.range(("run",))
            out = []
            for row in await tr.get_range(r.start, r.stop):
                run = loads(row.value)
                if run["owner"] == owner and (conv is None or run["conversation"] == conv):
                    out.append(run)
            return out

        return await self.db.transact(fn)


async def _watch(tr: Any, key: bytes) -> Any:
    return tr.watch(key)
