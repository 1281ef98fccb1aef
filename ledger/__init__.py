"""ledger — what the runtime has promised: submissions and their
acknowledgement, runs, queues, leases, attempts, cancellation, usage and
durable steps.

Built on ``kv`` and on ``sessions`` (the journal and owners: submit journals
``run.queued`` in its own transaction, settle journals ``run.completed`` /
``run.failed`` / ``run.cancelled``). Keys: ledger/keyspace.py. Values: CBOR.
Every transaction is idempotent or guarded, and says which.

Public face::

    from ledger import Ledger, completed, failed, cancelled
    ledger = Ledger(db, root, journal=sessions.journal)     # share the journal instance

    ack = await ledger.submit(submission_id, delivery, result_schema,
                              owner=owner, conversation=conv, policy="queue",   # | "reject" | "interrupt"
                              limits={"max_total_tokens": 100_000, "max_cost_micros": 5_000_000},
                              max_attempts=10)
    ack.submission_id, ack.run_id, ack.cursor, ack.status, ack.outcome, ack.created

    lease = await ledger.claim(worker_id, lease_seconds=30)   # Lease | None
    ack, lease = await ledger.submit_and_claim(submission_id, delivery, schema, owner=owner,
                                               conversation=conv, worker_id=w)  # one commit; lease None
                                               # when the run queued behind another / id reused
    # claim(..., finalize_exhausted=True): the first claim past max_attempts comes back with
    # lease.exhausted=True so the worker tidies the transcript and settles retry_exhausted itself
    # (in on_claimed: one commit with the claim)
    lease.run_id, lease.token, lease.attempt, lease.expires_at, lease.owner, lease.conversation
    delivery, schema = await ledger.get_request(lease.run_id)
    await ledger.renew(lease)                                  # LeaseLost if taken over
    lost = await ledger.renew_many(leases)                     # one commit; run ids whose lease was lost
    ids = await ledger.cancels_requested(run_ids)              # one read: which have a cancel record
    await ledger.release(lease, park=True)                     # parked: awaiting approval
    await ledger.resume(run_id)                                # parked -> runnable
    await ledger.settle(lease, completed(result))              # idempotent
    await ledger.cancel(run_id, owner=owner)                   # durable record
    outcome = await ledger.wait_settled(run_id)
    info = await ledger.get_run(run_id, owner=owner)           # RunInfo
    await ledger.wait_for_work(max_wait)                       # after an empty claim

In-transaction forms for composition (state change + event + lease check in
one commit): ``submit_tr``, ``check_lease(tr, lease)`` (raises LeaseLost),
``is_cancel_requested(tr, run_id)``, ``release_tr``, ``resume_tr``,
``settle_tr``, ``cancel_tr``, ``usage.record_tr``, ``usage.reserve_tr``.

Usage and steps::

    await ledger.usage.record(run_id, step_id, {"input_tokens": 10, "output_tokens": 5,
                                                "cost_micros": 120}, lease=lease)  # once per (run, step)
    await ledger.usage.reserve(run_id, {"input_tokens": 4000})   # UsageLimitExceeded past a ceiling
    await ledger.usage.totals(run_id)
    result = await ledger.steps.step(lease, "charge-card", fn)   # recorded once; StepNameReused
    ledger.idempotency_key(run_id, "charge-card")                # stable, for the far end

Run states: queued, running, parked, completed, failed, cancelled. Attempts
beyond ``max_attempts`` settle failed with error type ``retry_exhausted``.
Clock: wall time by default (lease expiries survive restarts); inject one for
the simulator. Ids and the claim RNG are injectable too.
"""

from __future__ import annotations

from .errors import (ConversationBusy, InvalidState, LeaseLost, LedgerError, NotFound, StepNameReused,
                     SubmissionConflict, UsageConflict, UsageLimitExceeded)
from .keyspace import LedgerKeyspace
from .runs import (CANCELLED, COMPLETED, DEFAULT_LEASE_SECONDS, DEFAULT_MAX_ATTEMPTS, FAILED, MAX_RENEW_BATCH,
                   PARKED, QUEUED, RUNNING, SETTLED_STATES, Acknowledgement, Lease, Ledger, RunInfo, cancelled, completed,
                   encode_request, failed)
from .steps import idempotency_key
from .usage import TOTAL_TOKENS

__all__ = [
    "Ledger", "Lease", "Acknowledgement", "RunInfo", "LedgerKeyspace",
    "completed", "failed", "cancelled", "idempotency_key", "encode_request", "TOTAL_TOKENS",
    "QUEUED", "RUNNING", "PARKED", "COMPLETED", "FAILED", "CANCELLED", "SETTLED_STATES",
    "DEFAULT_MAX_ATTEMPTS", "DEFAULT_LEASE_SECONDS", "MAX_RENEW_BATCH",
    "LedgerError", "NotFound", "SubmissionConflict", "ConversationBusy", "LeaseLost",
    "UsageLimitExceeded", "UsageConflict", "StepNameReused", "InvalidState",
]
