"""Submissions, runs, queues, leases, attempts and cancellation.

Submissions (promise 1)
    :meth:`Ledger.submit` is one transaction: read the submission id; a
    different request hash (SHA-256 over canonical CBOR of delivery + result
    schema) or conversation under the same id is :class:`SubmissionConflict`;
    an existing one returns its run (and the settled outcome if settled);
    otherwise it stores the record and the request, enqueues the run in its
    conversation's FIFO and journals ``run.queued`` — all or nothing. A retry
    after ``commit_unknown_result`` finds the record and returns the same run.

Runs (promises 4, 5, 6)
    States: queued -> running -> completed | failed | cancelled, and
    running -> parked (awaiting approval) -> queued. One run per conversation
    is *active* (held in the conversation state; the FIFO, the runs queued
    behind it in order, is the conversation's history after it); only an
    active queued run is in the ready
    index, so :meth:`Ledger.claim` reads a small window of that index (and of
    the lease-expiry index) whatever the number of idle conversations. A claim
    writes a lease with a fencing token; every worker write calls
    :meth:`Ledger.check_lease` in the same transaction, which reads the lease
    key: a takeover rewrites that key, so the stale worker's transaction
    conflicts and its retry raises :class:`LeaseLost`. A claim beyond
    ``max_attempts`` settles the run failed with ``retry_exhausted``.
    Settling moves the conversation's active marker to the next queued run in
    the same transaction, so no stale marker ever blocks a queue.

Cancellation (promise 7)
    :meth:`Ledger.cancel` writes a durable cancel record. A run that never
    started settles cancelled at once; a parked one is made runnable so a
    worker finalizes it; a running one's lease record is rewritten with
    ``"cancel": True`` in the same transaction (same token and expiry), so its
    worker sees the request at its next boundary in the lease its
    :meth:`Ledger.check_lease` reads anyway (one read a worker write, not two:
    a cancel committed after that read rewrote the key it read, so the write
    conflicts and its retry sees the flag), or wakes on
    :meth:`Ledger.wait_cancel_requested`. Every lease written keeps the flag:
    a renewal rewrites the record it read, a claim or takeover sets it from the
    cancel record (which it reads), and a release, park or settle clears the
    lease (the cancel record stays, for the next claim).

Clock
    Lease expiries are persisted, so they must mean the same thing after a
    restart: the default clock is wall time (``time.time``). The simulator
    injects its virtual clock.
"""

from __future__ import annotations

import hashlib
import logging
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Mapping, Sequence

import trio

import kv
from sessions import events as ev
from sessions.codec import (CHUNK_SIZE, canonical_dumps, dumps, id_source, loads, own_dumps,
                           pack_i64, read_chunks, write_chunks)
from sessions.journal import EventRef, Journal, check_conversation_id, encode_cursor
from sessions.owners import MAX_OWNER_PART, OwnerLike, as_tag

from .errors import ConversationBusy, LeaseLost, NotFound, SubmissionConflict
from .keyspace import LedgerKeyspace
from .usage import check_limits

log = logging.getLogger(__name__)

__all__ = [
    "Ledger", "Lease", "Acknowledgement", "RunInfo", "Policy",
    "QUEUED", "RUNNING", "PARKED", "COMPLETED", "FAILED", "CANCELLED", "SETTLED_STATES",
    "DEFAULT_MAX_ATTEMPTS", "DEFAULT_LEASE_SECONDS", "MAX_RENEW_BATCH", "completed", "failed", "cancelled",
    "encode_request",
]

QUEUED, RUNNING, PARKED = "queued", "running", "parked"
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
SETTLED_STATES = frozenset({COMPLETED, FAILED, CANCELLED})
RUN_STATES = frozenset({QUEUED, RUNNING, PARKED}) | SETTLED_STATES

Policy = Literal["queue", "reject", "interrupt"]
POLICIES = ("queue", "reject", "interrupt")

DEFAULT_MAX_ATTEMPTS = 10
#: With ``claim(finalize_exhausted=True)``, how many claims past ``max_attempts`` are handed to a
#: worker to finalise an exhausted run before the ledger settles it itself (the backstop, for a
#: finaliser that keeps failing; one that finalises in ``on_claimed``, as the loop does, cannot
#: die half way: its claim and its writes are one commit).
FINALIZE_CLAIMS = 3
MAX_MAX_ATTEMPTS = 1_000
DEFAULT_LEASE_SECONDS = 30.0
MAX_LEASE_SECONDS = 3_600.0
#: Claim picks at random among this many oldest candidates, so racing workers rarely pick the same run.
CLAIM_WINDOW = 32
#: Leases :meth:`Ledger.renew_many` extends in one transaction (far under 5 s and 10 MB).
MAX_RENEW_BATCH = 1_000
#: History entries a settle reads at a time looking for the conversation's next unsettled
#: run (see Ledger._next_in_fifo): runs cancelled while queued are the only ones it skips.
FIFO_WINDOW = 8
#: Conversation states a Ledger remembers the last bytes of (see Ledger._cs_seen).
_CS_SEEN_SIZE = 1_024
#: A claim that finds only exhausted/stale entries gives up after this many transactions.
MAX_CLAIM_SKIPS = 64
#: The request (delivery + schema) is stored with the submission; refuse absurd ones up front.
MAX_REQUEST_BYTES = 4_000_000
#: A settled event carries the result only when it is this small (the run record always has it).
MAX_EVENT_RESULT_BYTES = 16_000
#: An outcome whose CBOR is at most this is kept in its run record (``"out"``: those bytes), which
#: the settle writes anyway, so a settle writes one key less; a larger one goes to chunks under
#: ("out", run_id) as before (every outcome did before session 17). With the run record's other
#: fields (ids, limits, the outcome's error again: at most this much too) it stays far under a
#: value's limit.
INLINE_OUTCOME_BYTES = 16_000
MAX_ID = 512
#: A request (canonical CBOR body) up to this size is stored inside its submission record, so a
#: submit writes one key for record, request and position instead of three (each key costs
#: the storage engine a write, a conflict range and an index entry; and the request's
#: chunk keys had to be built). Larger ones go to chunks under ("o", T, "sbd", sid) as before.
INLINE_REQUEST_BYTES = 64_000
#: Bound on the rest of a record: submission id and conversation (MAX_ID characters, at most 4
#: UTF-8 bytes each), owner tag (2 * MAX_OWNER_PART + 1), and under 1,000 bytes of field names,
#: hash, run id, numbers and CBOR heads; plus the 13-byte mark and position.
_SUB_OVERHEAD = 2 * 4 * MAX_ID + 4 * (2 * MAX_OWNER_PART + 1) + 1_000 + 13
assert CLAIM_WINDOW >= 1 and DEFAULT_MAX_ATTEMPTS <= MAX_MAX_ATTEMPTS
assert INLINE_REQUEST_BYTES + _SUB_OVERHEAD <= kv.limits.VALUE_SIZE_LIMIT
assert 2 * INLINE_OUTCOME_BYTES + 4 * 4 * MAX_ID + 20_000 < kv.limits.VALUE_SIZE_LIMIT

#: First byte of a submission record written as one versionstamped value: then the 12-byte
#: position of its run.queued event (10 bytes stamped at commit + the 2-byte order), then the
#: CBOR record. A record from before it (a CBOR map: first byte 0xa0..0xbf, never 0x01) keeps
#: its position under ("o", T, "sbc", sid) and its request in chunks; both are still read.
_SUB_MARK = b"\x01"
_SUB_HEAD = 1 + 12
#: The set_versionstamped_value offset suffix of a record: the stamp goes right after the mark.
_SUB_STAMP_AT = struct.pack("<I", 1)


def _complete_run(run: dict[str, Any]) -> dict[str, Any]:
    """A decoded run record with every field (in place): a submit since session 19 leaves out
    the fields still at their first values ("attempt" 0, "claims" 0, "limits" when empty, and
    "updated", equal to "created"), ~4,000 instructions less to encode at each submit and to
    decode at its claim. Such a record is only ever written by its submit: every later write
    of a run (:meth:`Ledger._put_run`) rewrites a record completed here, with "updated", so a
    record without "updated" is a submit's. Records written before have every field."""
    if "updated" not in run:
        run["updated"] = run["created"]
        if "claims" not in run:
            run["attempt"] = run["claims"] = 0
        if "limits" not in run:
            run["limits"] = {}
    return run


def _parse_submission(raw: bytes) -> tuple[dict[str, Any], bytes | None]:
    """A stored submission record and the position of its run.queued (None: a record from
    before positions were kept in it; see ``_SUB_MARK``)."""
    if raw[:1] == _SUB_MARK:
        return loads(memoryview(raw)[_SUB_HEAD:]), raw[1:_SUB_HEAD]
    return loads(raw), None


# The request's outer map, in canonical key order ("delivery" is the shorter key): a map head
# of 2 and each key's CBOR. Built by hand because cbor2's canonical mode costs ~10,000
# instructions per map over its ordinary one (it sorts every map); the values inside are
# encoded canonically by _canonical_dumps.
_REQUEST_HEAD, _REQUEST_SCHEMA_KEY = b"\xa2" + dumps("delivery"), dumps("result_schema")
_CBOR_NULL = dumps(None)

#: Types cbor2 encodes byte for byte the same in its ordinary and its canonical mode (floats
#: are not: canonical mode picks the shortest exact width; nor are sets, which it sorts).
_SAME_IN_BOTH_MODES = frozenset((str, int, bool, bytes, type(None)))


class _NotPlain(Exception):
    """A value _in_canonical_order leaves to cbor2's canonical mode (a float, a set, a
    non-str map key, a dict subclass...)."""


def _canonical_key(key: str) -> tuple[int, str]:
    # Canonical CBOR orders map keys by their encoding, shorter first (RFC 7049 3.9, as
    # cbor2 does): for str keys, by UTF-8 length, then by UTF-8 bytes, whose order is the
    # code point order Python compares str in.
    return (len(key), key) if key.isascii() else (len(key.encode()), key)


#: Canonical key order by map shape (see _in_canonical_order); cleared when full. Shapes of
#: at most _KEY_ORDER_KEYS keys are remembered (a bigger map is sorted each time).
_KEY_ORDER: dict[tuple, tuple] = {}
_KEY_ORDER_SIZE = 1_024
_KEY_ORDER_KEYS = 16
assert _KEY_ORDER_SIZE > 0


def _canonical_key_order(shape: tuple) -> tuple:
    """The keys of ``shape`` (a dict's, in insertion order) in canonical order. Two C-level
    sorts where one sort by _canonical_key makes a Python call per key: for ASCII keys (the
    usual), code point order then a stable sort by length is (length, bytes) order. sorted()
    and join() raise TypeError for keys that are not all str (a str subclass passes them,
    and is refused by _in_canonical_order's loop)."""
    try:
        keys = sorted(shape)
        ascii_keys = "".join(keys).isascii()
    except TypeError:
        raise _NotPlain from None
    keys.sort(key=len if ascii_keys else _canonical_key)
    return tuple(keys)


def _in_canonical_order(value: Any) -> Any:
    """``value`` rebuilt with every map's keys in canonical order, so that cbor2's ordinary
    encoding of it is its canonical encoding; raises _NotPlain for anything else than dicts
    with str keys, lists, tuples and the _SAME_IN_BOTH_MODES leaves."""
    t = type(value)
    if t is dict:
        n = len(value)
        if 1 < n <= _KEY_ORDER_KEYS:
            # A request's maps come in few shapes (a message's, a content part's...): their
            # canonical key order is remembered per shape (the keys in insertion order). A
            # shape is remembered only when its keys are all of class str, so a map found
            # here needs no check per key: its keys equal those (a str subclass equal to one
            # is encoded by cbor2 as that str, in either mode).
            shape = tuple(value)
            keys = _KEY_ORDER.get(shape)
            if keys is None:
                keys = _canonical_key_order(shape)
                for k in keys:
                    if type(k) is not str:
                        raise _NotPlain
                if len(_KEY_ORDER) >= _KEY_ORDER_SIZE:
                    _KEY_ORDER.clear()
                _KEY_ORDER[shape] = keys
        else:
            keys = _canonical_key_order(tuple(value)) if n > 1 else value
            for k in keys:
                if type(k) is not str:
                    raise _NotPlain
        out = {}
        for k in keys:
            v = value[k]
            out[k] = v if type(v) in _SAME_IN_BOTH_MODES else _in_canonical_order(v)
        return out
    if t is list or t is tuple:
        return [v if type(v) in _SAME_IN_BOTH_MODES else _in_canonical_order(v) for v in value]
    if t in _SAME_IN_BOTH_MODES:
        return value
    raise _NotPlain


def _canonical_dumps(value: Any) -> bytes:
    """``canonical_dumps(value)``, byte for byte, at about half its cost for the usual
    request (JSON-like: dicts with str keys, lists, strings, ints): cbor2's canonical mode
    costs ~3x its ordinary one (it encodes and sorts every map's keys natively, per map),
    while putting the keys in order in Python and encoding ordinarily costs ~1.5x
    (delivery of the ledger bench: 6.5 -> 5.0 us; a tool result message: 14.1 -> 9.6 us,
    thread time). Anything else (floats, sets, non-str keys, nesting past the recursion
    limit) is left to cbor2's canonical mode whole.

    Measured and not kept (session 12), for whoever looks at CBOR costs next: encoding a run
    record by hand in Python (pre-encoded keys, b"".join) takes 7.7 us where cbor2 6.3's
    ``dumps`` takes 4.8 us; and cbor2 5.6.5 is slower than 6.3 here (13.8 vs 4.6 us for
    the same record, 15.0 vs 10.2 us for a canonical delivery; thread time)."""
    try:
        return dumps(_in_canonical_order(value))
    except (_NotPlain, RecursionError, UnicodeEncodeError):
        return canonical_dumps(value)


def encode_request(delivery: Any, result_schema: Any) -> tuple[bytes, str]:
    """A submission's request as stored (its body) and its hash: the body is the canonical
    CBOR of ``{"delivery", "result_schema"}`` and the hash SHA-256 of that very body, so
    one encoding serves both (the hash is the same ``canonical_hash`` as ever: tests compare
    the body with cbor2's canonical encoding of the whole map)."""
    body = b"".join((_REQUEST_HEAD, _canonical_dumps(delivery), _REQUEST_SCHEMA_KEY,
                     _CBOR_NULL if result_schema is None else _canonical_dumps(result_schema)))
    return body, hashlib.sha256(body).hexdigest()


def _checked_submission(submission_id: str, delivery: Any, result_schema: Any, owner: OwnerLike,
                        conversation: str, policy: str, limits: Mapping[str, int] | None,
                        max_attempts: int, encoded: tuple[bytes, str] | None,
                        ) -> tuple[str, dict[str, int], bytes, str]:
    """A submission's arguments checked (a bad one raises ValueError before anything is
    written) and normalised: its owner tag, its limits, its request body and hash (``encoded``,
    or :func:`encode_request` of ``delivery`` and ``result_schema``). Pure: made once per
    submit, not in each attempt of its transaction."""
    tag = as_tag(owner)
    _check_id("submission id", submission_id)
    check_conversation_id(conversation)
    limits = check_limits(limits)
    if policy not in POLICIES:
        raise ValueError(f"policy is one of {POLICIES}")
    if not 1 <= max_attempts <= MAX_MAX_ATTEMPTS:
        raise ValueError(f"max_attempts must be in 1..{MAX_MAX_ATTEMPTS}")
    body, digest = encoded if encoded is not None else encode_request(delivery, result_schema)
    if len(body) > MAX_REQUEST_BYTES:
        raise ValueError(f"a submission of {len(body)} bytes exceeds {MAX_REQUEST_BYTES}")
    return tag, limits, body, digest


def _check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise ValueError(f"{kind} is a non-empty string of at most {MAX_ID} characters")
    return value


def completed(result: Any = None) -> dict[str, Any]:
    """An outcome: the run finished with ``result``."""
    return {"status": COMPLETED, "result": result, "error": None}


def failed(type: str, message: str = "", **detail: Any) -> dict[str, Any]:
    """An outcome: the run failed (``type`` is machine-readable, e.g. ``retry_exhausted``)."""
    return {"status": FAILED, "result": None, "error": {"type": type, "message": message, **detail}}


def cancelled(reason: str = "") -> dict[str, Any]:
    return {"status": CANCELLED, "result": None, "error": {"type": "cancelled", "message": reason}}


def _check_outcome(outcome: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(outcome)
    if out.get("status") not in SETTLED_STATES:
        raise ValueError(f"an outcome's status is one of {sorted(SETTLED_STATES)}")
    out.setdefault("result", None)
    out.setdefault("error", None)
    return out


@dataclass(slots=True)
class Lease:
    """A worker's claim on a run. ``token`` is the fencing token (increases per claim)."""

    run_id: str
    token: int
    attempt: int
    max_attempts: int
    worker_id: str
    expires_at: float
    owner: str
    conversation: str
    submission_id: str
    #: True when this claim took over an expired lease (the previous execution may have died mid-way).
    takeover: bool = False
    #: True when the run's attempts are used up and this claim (``finalize_exhausted=True``) exists
    #: only to finalise it: tidy up and settle ``failed("retry_exhausted")``.
    exhausted: bool = False
    #: Step names used in this execution (durable steps refuse reuse).
    step_names: set[str] = field(default_factory=set)
    #: What ``claim(on_claimed=...)`` returned inside the claiming transaction (None when
    #: the hook did not run: no hook, or a retry that found its own committed claim).
    prepared: Any = None
    #: Other claimable entries the claiming transaction saw (up to CLAIM_WINDOW - 1): a hint
    #: that more work is waiting (a worker pool may then look for it with more workers).
    backlog: int = 0
    #: True when the run was created by the very transaction that claimed it
    #: (:meth:`Ledger.submit_and_claim`): nothing else can exist for it yet (no loop
    #: state, no cancel record), so ``on_claimed`` may skip reading them.
    new_run: bool = False
    #: While ``on_claimed`` runs inside :meth:`Ledger.submit_and_claim` (else None): a list
    #: the hook may put ``(type, data)`` journal events of the run's conversation in, instead
    #: of emitting them; they are journaled right after the run's run.queued and run.started,
    #: in the same emit (the same keys, values and order as the hook emitting them then).
    journal_after_start: "list[tuple[str, Any]] | None" = None
    #: The lease record's stored bytes as this lease last saw them, and their decoding
    #: (:meth:`Ledger.check_lease`): a check that reads the same bytes again (every commit
    #: of a run between renewals) does not decode them again. A memo of a pure function of
    #: the bytes read, so never stale: changed bytes are decoded.
    seen: "tuple[bytes, dict[str, Any]] | None" = field(default=None, repr=False, compare=False)
    #: The run record's stored bytes as the claim wrote them, and the record: a settle whose
    #: transaction's lease check found this lease settles from a copy of it without reading
    #: the run (see :meth:`Ledger.settle_tr`); one that reads the same bytes back copies the
    #: record instead of decoding it again.
    run_seen: "tuple[bytes, dict[str, Any]] | None" = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Acknowledgement:
    """What a submitter hears once the submission is durable."""

    submission_id: str
    run_id: str
    cursor: str | None        # position of the run's run.queued event
    status: str               # the run's state now
    outcome: dict[str, Any] | None = None  # when settled
    created: bool = True      # False: an earlier submit with this id already made the run


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: str
    owner: str
    conversation: str
    submission_id: str
    state: str
    #: Attempts made at the work, at most ``max_attempts`` (a claim that only finalises an
    #: exhausted run, see ``claim(finalize_exhausted=True)``, is not an attempt).
    attempt: int
    max_attempts: int
    created: float
    updated: float
    limits: dict[str, Any]
    cancel_requested: bool
    outcome: dict[str, Any] | None
    worker: str | None = None
    lease_expires_at: float | None = None


class _PendingAck:
    """A submit's acknowledgement once its transaction commits: ``ack`` as is (``ref`` None),
    or a new run's, made once its run.queued position is known (``ack`` None: the
    Acknowledgement, a frozen dataclass, is built once, not once before and again after)."""

    __slots__ = ("ack", "ref", "lease", "submission_id", "run_id", "status")

    def __init__(self, ack: Acknowledgement | None, ref: EventRef | None, lease: "Lease | None" = None,
                 submission_id: str = "", run_id: str = "", status: str = "") -> None:
        self.ack, self.ref, self.lease = ack, ref, lease
        self.submission_id, self.run_id, self.status = submission_id, run_id, status

    async def result(self) -> Acknowledgement:
        if self.ref is None:
            assert self.ack is not None
            return self.ack
        return Acknowledgement(self.submission_id, self.run_id, await self.ref.cursor(), self.status)


_SKIP = object()


@dataclass(frozen=True, slots=True)
class _ClaimOnSubmit:
    """What :meth:`Ledger.submit_and_claim` asks of :meth:`Ledger.submit_tr`."""

    worker_id: str
    lease_seconds: float
    nonce: str
    on_claimed: Callable[[Any, Lease], Awaitable[Any]] | None


class Ledger:
    """What the runtime has promised, in one deployment root."""

    def __init__(
        self,
        db: Any,
        root: "kv.Subspace | None" = None,
        *,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.keys = LedgerKeyspace(root)
        self.journal = journal if journal is not None else Journal(db, root, clock=clock)
        self.clock = clock
        self.new_id = new_id or id_source()  # run ids, claim nonces (no syscall per id)
        self.rng = rng or random.Random()
        self._claiming: set[bytes] = set()  # index keys claims of this process are trying
        #: conversation-state key -> (the bytes a queued submit of this process wrote there, their
        #: decoding): the next submit to the conversation that reads those same bytes copies the
        #: dict instead of decoding them (a memo of a pure function of the bytes read: never
        #: stale; bytes written by anyone else, or by a transaction that did not commit, are
        #: decoded). Bounded: cleared when full.
        self._cs_seen: dict[bytes, tuple[bytes, dict[str, Any]]] = {}
        #: The records this Ledger writes are encoded by a cbor2 encoder of its own (made
        #: once: cbor2.dumps builds an encoder and its output file every call, ~1,200
        #: instructions of a small record's encoding); the same bytes. One thread only: a
        #: Ledger is used from its database's trio thread (see sessions.codec.own_dumps).
        self._dumps = own_dumps()
        from .usage import UsageBook
        from .steps import Steps
        self.usage = UsageBook(self)
        self.steps = Steps(self)

    def idempotency_key(self, run_id: str, name: str) -> str:
        """The stable key of durable step ``name`` of ``run_id`` (for the far end)."""
        from .steps import idempotency_key
        return idempotency_key(run_id, name)

    async def step(self, lease: Lease, name: str, fn: Callable[[], Any]) -> Any:
        """Shortcut for ``self.steps.step``."""
        return await self.steps.step(lease, name, fn)

    # -- records ------------------------------------------------------------

    async def _run(self, tr: Any, run_id: str, owner: str | None = None, *, snapshot: bool = False) -> dict[str, Any]:
        raw = await (tr.snapshot if snapshot else tr).get(self.keys.run(run_id))
        if raw is None:
            raise NotFound(f"run {run_id!r} not found")
        run = _complete_run(loads(raw))
        if owner is not None and run.get("owner") != owner:
            raise NotFound(f"run {run_id!r} not found")
        return run

    def _put_run(self, tr: Any, run: dict[str, Any]) -> bytes:
        run["updated"] = self.clock()
        raw = self._dumps(run)
        tr.set(self.keys.run(run["id"]), raw)
        return raw

    def _make_ready(self, tr: Any, run: dict[str, Any]) -> None:
        us = int(self.clock() * 1e6)
        if run.get("rd") is not None:
            tr.clear(self.keys.ready(run["rd"], run["id"]))
        run["rd"] = us
        tr.set(self.keys.ready(us, run["id"]), b"")
        tr.add(self.keys.signal(), pack_i64(1))

    # -- submit -------------------------------------------------------------

    async def submit_tr(self, tr: Any, submission_id: str, delivery: Any, result_schema: Any = None, *,
                        owner: OwnerLike, conversation: str, policy: Policy = "queue",
                        limits: Mapping[str, int] | None = None,
                        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                        claim: "_ClaimOnSubmit | None" = None,
                        encoded: tuple[bytes, str] | None = None) -> _PendingAck:
        """Submit in ``tr``. Guarded by the submission record (read first).
        ``await (await ledger.submit_tr(...)).result()`` after commit gives the acknowledgement.

        With ``claim`` (see :meth:`submit_and_claim`) a new run that is its
        conversation's active run at once is leased to ``claim.worker_id`` in
        this same transaction instead of entering the ready index; the
        pending acknowledgement's ``lease`` is then set. ``encoded``:
        :func:`encode_request` of this delivery and schema, made once before
        the transaction (not again in each attempt)."""
        tag, limits, body, digest = _checked_submission(
            submission_id, delivery, result_schema, owner, conversation, policy, limits, max_attempts, encoded)
        ack, ref, lease, run_id, status = await self._submit_tr(
            tr, tag, submission_id, body, digest, conversation, policy, limits, max_attempts, claim)
        return _PendingAck(ack, ref, lease, submission_id, run_id, status)

    async def _submit_tr(self, tr: Any, tag: str, submission_id: str, body: bytes, digest: str,
                         conversation: str, policy: Policy, limits: dict[str, int], max_attempts: int,
                         claim: _ClaimOnSubmit | None,
                         ) -> tuple[Acknowledgement | None, EventRef | None, Lease | None, str, str]:
        """:meth:`submit_tr` with its arguments checked by :func:`_checked_submission`
        (:meth:`submit` and :meth:`submit_and_claim` check them once, before the
        transaction, and call this positionally in each attempt). Guarded by the
        submission record (read first). Returns what a :class:`_PendingAck` holds, as a
        tuple ``(ack, ref, lease, run_id, status)``: ``submit`` makes its acknowledgement from
        it directly (calling a class runs its ``__init__`` from C, a fresh interpreter entry a
        submit; a tuple is built inline)."""
        sub_key = self.keys.submission(tag, submission_id)
        raw = await tr.get(sub_key)
        if raw is not None:
            rec, pos = _parse_submission(raw)
            if rec["hash"] != digest or rec["conversation"] != conversation or rec.get("owner") != tag:
                raise SubmissionConflict(f"submission {submission_id!r} was already used for a different request")
            run = await self._run(tr, rec["run_id"])
            if pos is None:  # a record from before positions were kept in it
                pos = await tr.get(self.keys.submission_cursor(tag, submission_id))
            outcome = await self._outcome(tr, run) if run["state"] in SETTLED_STATES else None
            lease = None
            if claim is not None and run["state"] == RUNNING:
                # A retry (after commit_unknown_result) of a submit_and_claim that committed: the
                # lease carries its nonce, so the run is ours to drive (hook result not at hand).
                lraw = await tr.get(self.keys.lease(run["id"]))
                lrec = loads(lraw) if lraw is not None else None
                if lrec is not None and lrec.get("nonce") == claim.nonce:
                    lease = self._lease_from(run, lrec)
            return (Acknowledgement(submission_id, run["id"], encode_cursor(pos) if pos else None,
                                    run["state"], outcome, created=False), None, lease, "", "")
        cs_key = self.keys.conversation_state(tag, conversation)
        cs_raw = await tr.get(cs_key)
        if cs_raw:
            seen = self._cs_seen.get(cs_key)
            cs = dict(seen[1]) if seen is not None and seen[0] == cs_raw else loads(cs_raw)
        else:
            cs = {"active": None, "tail": 0}
        queued = cs["active"] is not None
        if queued:
            if policy == "reject":
                raise ConversationBusy(f"conversation {conversation!r} already has an active run",
                                       active_run=cs["active"])
            if policy == "interrupt":
                await self._cancel_tr(tr, cs["active"], reason="interrupted by a newer submission")
                cs = loads(await tr.get(cs_key))  # the cancel may have advanced the FIFO
        now = self.clock()
        run_id = self.new_id()
        seq = cs["tail"]
        cs["tail"] = seq + 1
        # "rd", "settled_token", "released_token" and "error" are not stored while None (every
        # reader uses .get; records written before session 18 have them as None): four fields
        # less to encode here and to decode at each read of the record. Nor (session 19) are
        # "attempt" and "claims" while 0, "limits" while empty and "updated" (= "created"):
        # every reader decodes a run record through _complete_run, which puts them back.
        run = {"id": run_id, "owner": tag, "conversation": conversation, "submission_id": submission_id,
               "seq": seq, "state": QUEUED, "max_attempts": max_attempts, "created": now, "q": False}
        if limits:
            run["limits"] = dict(limits)
        # The history entry is the run's only queue entry: the conversation's FIFO is its
        # history after the active run (see _finish_tr), so no ("q", ...) key is written
        # (one mutation a queued submit, and its clear at the run's settle, less than the
        # separate FIFO entry written before session 18). The run's "q": False tells the settle
        # there is no FIFO entry to clear (records without the field, written before this, have one).
        tr.set(self.keys.history(tag, conversation, seq), run_id.encode())
        lease_rec: dict[str, Any] | None = None
        if cs["active"] is None:
            cs["active"] = run_id
            if claim is None:
                self._make_ready(tr, run)
            else:
                # Claimed in this transaction: never in the ready index, no ready signal (idle
                # workers elsewhere are not woken for a run that is already taken).
                expires_at = now + claim.lease_seconds
                expires_us = int(expires_at * 1e6)
                lease_rec = {"token": 1, "worker": claim.worker_id, "expires_at": expires_at,
                             "expires_us": expires_us, "nonce": claim.nonce}
                lease_raw = self._dumps(lease_rec)
                tr.set(self.keys.lease(run_id), lease_raw)
                tr.set(self.keys.expiry(expires_us, run_id), b"")
                run.update(state=RUNNING, attempt=1, claims=1)
        cs_raw = self._dumps(cs)
        tr.set(cs_key, cs_raw)
        if queued:  # (the conversation is busy: its next submit is likely queued too)
            if len(self._cs_seen) >= _CS_SEEN_SIZE:
                self._cs_seen.clear()
            self._cs_seen[cs_key] = (cs_raw, cs)
        run_raw = self._dumps(run)
        tr.set(self.keys.run(run_id), run_raw)  # (_put_run, "updated" being now)
        # (Since session 19 without "id", "attempt" and "policy", which nothing reads: the id is
        # the key's, "attempt" was always 0, the policy acted on here. Older records have them.)
        rec = {"owner": tag, "conversation": conversation, "hash": digest, "created": now, "run_id": run_id}
        if len(body) <= INLINE_REQUEST_BYTES:
            rec["body"] = body
        else:
            write_chunks(tr, self.keys.submission_body(tag, submission_id), body)
        # run.queued, and run.started when claimed here: one emit (the same keys and values as two)
        items: list[tuple[str, Any]] = [(ev.RUN_QUEUED, {"run_id": run_id, "submission_id": submission_id})]
        lease = None
        if lease_rec is not None:
            assert claim is not None
            items.append((ev.RUN_STARTED, {"run_id": run_id, "attempt": 1, "max_attempts": max_attempts,
                                           "takeover": False}))
            _complete_run(run)  # (the record a settle rewrites from lease.run_seen: whole)
            lease = self._lease_from(run, lease_rec)
            lease.new_run = True
            lease.seen = (lease_raw, lease_rec)
            lease.run_seen = (run_raw, run)
            if claim.on_claimed is not None:
                # Before the emit, so that the events the hook leaves in journal_after_start are
                # journaled by it, after run.started (one emit and one count update less).
                lease.journal_after_start = items
                try:
                    lease.prepared = await claim.on_claimed(tr, lease)
                finally:
                    lease.journal_after_start = None
        ref = (await self.journal.emit_many_tr(tr, tag, conversation, items, first_ref_only=True))[0]
        # The record, its request and the position of its run.queued: one versionstamped value
        # (see _SUB_MARK). Unreadable in this transaction, which never reads it back.
        tr.set_versionstamped_value(sub_key, b"".join((
            _SUB_MARK, b"\x00" * 10, ref.order.to_bytes(2, "big"), self._dumps(rec), _SUB_STAMP_AT)))
        return None, ref, lease, run_id, run["state"]

    async def submit(self, submission_id: str | None, delivery: Any, result_schema: Any = None, *,
                     owner: OwnerLike, conversation: str, policy: Policy = "queue",
                     limits: Mapping[str, int] | None = None,
                     max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> Acknowledgement:
        """Durably accept a request; see the module docstring. Guarded (see :meth:`submit_tr`)."""
        sid = submission_id or self.new_id()
        tag, limits, body, digest = _checked_submission(
            sid, delivery, result_schema, owner, conversation, policy, limits, max_attempts, None)
        ack, ref, _, run_id, status = await self.db.transact(lambda tr: self._submit_tr(
            tr, tag, sid, body, digest, conversation, policy, limits, max_attempts, None))
        self.journal.note_committed(tag, conversation)  # it journaled run.queued
        # _PendingAck.result(), inline (one coroutine less an acknowledged submit)
        if ref is None:
            assert ack is not None
            return ack
        return Acknowledgement(sid, run_id, await ref.cursor(), status)

    async def submit_and_claim(self, submission_id: str | None, delivery: Any, result_schema: Any = None, *,
                               owner: OwnerLike, conversation: str, worker_id: str,
                               lease_seconds: float = DEFAULT_LEASE_SECONDS, policy: Policy = "queue",
                               limits: Mapping[str, int] | None = None,
                               max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                               on_claimed: Callable[[Any, Lease], Awaitable[Any]] | None = None,
                               encoded: tuple[bytes, str] | None = None,
                               ) -> tuple[Acknowledgement, Lease | None]:
        """Submit and, when the new run can start at once (its conversation has no active
        run), claim it for ``worker_id`` in the same transaction: one commit where
        :meth:`submit` + :meth:`claim` make two, and no idle worker is woken for it.

        For a submitter that will drive the run itself (the embedded ``Runtime.run``).
        Returns the acknowledgement and the lease (None: the run queued behind another,
        or the submission id was already used: workers run it, wait for it as usual).
        The lease is attempt 1 with ``new_run`` set; ``on_claimed(tr, lease)`` runs in
        the transaction as for :meth:`claim` (its result is ``lease.prepared``).

        Guarded by the submission record, as :meth:`submit`; the lease carries a nonce
        chosen before the first attempt, so a retry after ``commit_unknown_result``
        whose first attempt committed finds its own lease and returns it (without
        ``prepared``: the hook did not run again). ``encoded``: as for :meth:`submit_tr`
        (a caller that needs the request as stored decodes its body: ``loads(encoded[0])``).
        """
        _check_id("worker id", worker_id)
        if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")
        sid = submission_id or self.new_id()
        claim = _ClaimOnSubmit(worker_id, lease_seconds, self.new_id(), on_claimed)
        tag, limits, body, digest = _checked_submission(
            sid, delivery, result_schema, owner, conversation, policy, limits, max_attempts, encoded)
        ack, ref, lease, run_id, status = await self.db.transact(lambda tr: self._submit_tr(
            tr, tag, sid, body, digest, conversation, policy, limits, max_attempts, claim))
        self.journal.note_committed(tag, conversation)  # it journaled run.queued
        if ref is None:
            assert ack is not None
            return ack, lease
        return Acknowledgement(sid, run_id, await ref.cursor(), status), lease

    async def request_tr(self, tr: Any, lease: Lease) -> tuple[Any, Any]:
        """``(delivery, result_schema)`` of a leased run's submission, in ``tr`` (read-only):
        the lease already names the owner and submission, so the run record is not re-read.
        Not in the transaction that submitted it (its record is a versionstamped value there)."""
        req = await self._request(tr, lease.owner, lease.submission_id)
        if req is None:
            raise NotFound(f"run {lease.run_id!r} not found")
        return req["delivery"], req["result_schema"]

    async def _request(self, tr: Any, tag: str, submission_id: str) -> dict[str, Any] | None:
        """A submission's stored request ``{"delivery", "result_schema"}`` (None: no such
        submission): inside its record, or in chunks when large (or written before requests
        were kept in the record)."""
        raw = await tr.get(self.keys.submission(tag, submission_id))
        if raw is None:
            return None
        rec, _ = _parse_submission(raw)
        body = rec.get("body")
        if body is None:
            body = await read_chunks(tr, self.keys.submission_body(tag, submission_id))
            if body is None:
                return None
        return loads(body)

    async def get_request(self, run_id: str, *, owner: OwnerLike | None = None) -> tuple[Any, Any]:
        """``(delivery, result_schema)`` of a run's submission. Read-only."""
        async def fn(tr: Any) -> tuple[Any, Any]:  # read-only
            run = await self._run(tr, run_id, as_tag(owner) if owner is not None else None)
            req = await self._request(tr, run["owner"], run["submission_id"])
            if req is None:
                raise NotFound(f"run {run_id!r} not found")
            return req["delivery"], req["result_schema"]

        return await self.db.transact(fn)

    # -- claim / lease ------------------------------------------------------

    async def claim(self, worker_id: str, lease_seconds: float = DEFAULT_LEASE_SECONDS, *,
                    finalize_exhausted: bool = False,
                    on_claimed: Callable[[Any, Lease], Awaitable[Any]] | None = None) -> Lease | None:
        """Take the next runnable run (an expired lease first), or None when there is none.

        A run whose attempts are used up is settled failed (``retry_exhausted``)
        inside the claim. With ``finalize_exhausted=True`` up to
        ``FINALIZE_CLAIMS`` claims past the bound are instead handed to the worker
        with ``lease.exhausted`` set (no run.started), so it can tidy the
        transcript (e.g. finalise a dangling tool call) and settle
        ``failed("retry_exhausted")`` itself — best in ``on_claimed``, so that the
        claim and the finalisation are one commit; only if all of those fail does
        a later claim settle the run in the ledger as a backstop.

        Guarded: the lease carries a nonce chosen before the first attempt; a
        retry (possibly after a 1021 whose commit happened) first checks
        whether the run it last tried now holds that nonce and returns it.

        ``on_claimed(tr, lease)`` runs inside the claiming transaction once the
        lease is written, so a worker can make the run's first writes in the
        same commit (one commit less per run); its result is ``lease.prepared``.
        It is not called for a retry that finds its own committed claim (that
        claim's ``prepared`` is None: the caller then reads what it needs).
        """
        _check_id("worker id", worker_id)
        if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")
        nonce = self.new_id()
        tried: list[str] = []
        tried_keys: set[bytes] = set()
        mine: set[bytes] = set()

        async def fn(tr: Any) -> Any:  # guarded: nonce check of the last tried run
            if tried:
                raw = await tr.get(self.keys.lease(tried[-1]))
                if raw is not None and loads(raw).get("nonce") == nonce:
                    run = await self._run(tr, tried[-1])
                    return self._lease_from(run, loads(raw))
            now = self.clock()
            now_us = int(now * 1e6)
            xr = self.keys.expiry_range()
            # A lease is over from its expiry microsecond on: the scan includes
            # now_us itself (wait_for_work wakes exactly then, so excluding it made
            # a worker claim and wait in a loop with time standing still).
            rows = await tr.snapshot.get_range(xr.start, self.keys.expiry(now_us + 1, ""), limit=CLAIM_WINDOW)
            kind = "lx"
            if not rows:
                rr = self.keys.ready_range()
                rows = await tr.snapshot.get_range(rr.start, rr.stop, limit=CLAIM_WINDOW)
                kind = "rd"
            if not rows:
                return None
            # Prefer an entry no other claim of this process is trying right now
            # (workers of one runtime then never conflict with each other) and,
            # after a conflict, one this claim has not tried yet.
            busy = self._claiming
            fresh = [r for r in rows if r.key not in busy and r.key not in tried_keys] or rows
            row = fresh[self.rng.randrange(len(fresh))]
            tr.add_read_conflict_key(row.key)
            _k, us, run_id = self.keys.unpack(row.key)
            tried.append(run_id)
            tried_keys.add(row.key)
            mine.add(row.key)
            busy.add(row.key)
            try:
                run = await self._run(tr, run_id)
            except NotFound:
                tr.clear(row.key)
                return _SKIP
            old_lease = None
            if kind == "lx":
                raw = await tr.get(self.keys.lease(run_id))
                old_lease = loads(raw) if raw else None
                if run["state"] != RUNNING or old_lease is None or old_lease["expires_us"] != us:
                    tr.clear(row.key)  # stale index entry
                    return _SKIP
            elif run["state"] != QUEUED or run.get("rd") != us:
                tr.clear(row.key)
                return _SKIP
            attempt = run["attempt"] + 1
            exhausted = attempt > run["max_attempts"]
            if exhausted and not (finalize_exhausted and attempt <= run["max_attempts"] + FINALIZE_CLAIMS):
                run["attempt"] = run["max_attempts"]
                # An acknowledged cancel ends the run cancelled, however it ends (promise 7).
                await self._finish_tr(tr, run, cancelled("cancel requested") if await self.is_cancel_requested(
                    tr, run_id) else failed("retry_exhausted", f"run gave up after {run['max_attempts']} attempts",
                                            attempts=run["max_attempts"]))
                return _SKIP
            token = run["claims"] + 1
            expires_at = now + lease_seconds
            expires_us = int(expires_at * 1e6)
            tr.clear(row.key)
            lease_rec = {"token": token, "worker": worker_id, "expires_at": expires_at,
                         "expires_us": expires_us, "nonce": nonce}
            # The lease carries the cancel request (see _cancel_tr): from the lease taken over
            # when it says so (the cancel record is never cleared), else from the cancel record,
            # read here (a real read: a cancel committing meanwhile, which writes it, makes this
            # claim conflict). A queued run never claimed has none (its cancel settled it), but
            # the read is kept for it too: a claim is once a run, and the flag must not hang on
            # that reasoning.
            if (old_lease is not None and old_lease.get("cancel")) or await self.is_cancel_requested(tr, run_id):
                lease_rec["cancel"] = True
            lease_raw = self._dumps(lease_rec)
            tr.set(self.keys.lease(run_id), lease_raw)
            tr.set(self.keys.expiry(expires_us, run_id), b"")
            run.update(state=RUNNING, attempt=attempt, claims=token, rd=None)
            run_raw = self._put_run(tr, run)
            if not exhausted:  # the finalizing claim of an exhausted run starts no attempt
                await self.journal.emit(tr, run["owner"], run["conversation"], ev.RUN_STARTED, {
                    "run_id": run_id, "attempt": attempt, "max_attempts": run["max_attempts"],
                    "takeover": kind == "lx"})
            lease = self._lease_from(run, lease_rec)
            lease.seen = (lease_raw, lease_rec)
            lease.run_seen = (run_raw, run)
            lease.takeover = kind == "lx"
            lease.exhausted = exhausted
            lease.backlog = len(rows) - 1
            if on_claimed is not None:
                lease.prepared = await on_claimed(tr, lease)
            return lease

        try:
            for _ in range(MAX_CLAIM_SKIPS):
                result = await self.db.transact(fn)
                if result is not _SKIP:
                    return result
                tried.clear()
            return None
        finally:
            self._claiming.difference_update(mine)

    @staticmethod
    def _lease_from(run: dict[str, Any], rec: dict[str, Any]) -> Lease:
        # exhausted: a claim past max_attempts only finalises (also when a retry finds its
        # own committed claim, which did not pass through the claiming code's flag)
        return Lease(run["id"], rec["token"], run["attempt"], run["max_attempts"], rec["worker"],
                     rec["expires_at"], run["owner"], run["conversation"], run["submission_id"],
                     exhausted=run["attempt"] > run["max_attempts"])

    async def check_lease(self, tr: Any, lease: Lease) -> dict[str, Any]:
        """Raise :class:`LeaseLost` unless ``lease`` still holds its run, *as of this
        transaction*: the read makes a concurrent takeover abort this transaction.
        Returns the lease record read (read-only: decoded once per stored value and kept
        in ``lease.seen``, so the same dict may be returned again). Its ``"cancel"`` is True
        once a cancel of the run was requested (see :meth:`_cancel_tr`): the caller's
        transaction learns of a cancel from this read, and one committed after it rewrote
        the lease, so the transaction conflicts and its retry sees it."""
        raw = await tr.get(self.keys.lease(lease.run_id))
        if raw is None:
            raise LeaseLost(f"lease {lease.token} on run {lease.run_id!r} was lost")
        seen = lease.seen
        if seen is not None and seen[0] == raw:
            rec = seen[1]
        else:
            rec = loads(raw)
            lease.seen = (raw, rec)
        if rec["token"] != lease.token:
            raise LeaseLost(f"lease {lease.token} on run {lease.run_id!r} was lost")
        return rec

    async def renew(self, lease: Lease, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> Lease:
        """Extend the lease; raises :class:`LeaseLost` if it is gone. Guarded by the token
        (a retry just extends again)."""
        if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")

        async def fn(tr: Any) -> float:  # guarded: token check; a retry extends again
            raw = await tr.get(self.keys.lease(lease.run_id))
            rec = loads(raw) if raw else None
            if rec is None or rec["token"] != lease.token:
                raise LeaseLost(f"lease {lease.token} on run {lease.run_id!r} was lost")
            expires_at = self.clock() + lease_seconds
            expires_us = int(expires_at * 1e6)
            tr.clear(self.keys.expiry(rec["expires_us"], lease.run_id))
            tr.set(self.keys.expiry(expires_us, lease.run_id), b"")
            # The record read, updated: its other fields ("cancel" too) are kept.
            rec.update(expires_at=expires_at, expires_us=expires_us)
            tr.set(self.keys.lease(lease.run_id), self._dumps(rec))
            return expires_at

        lease.expires_at = await self.db.transact(fn)
        return lease

    async def renew_many(self, leases: "list[Lease]", lease_seconds: float = DEFAULT_LEASE_SECONDS) -> set[str]:
        """:meth:`renew` for each of ``leases`` in one transaction (one commit, not one per
        run: a worker renews all its leases at once); returns the run ids whose lease was
        lost (those are left as they are). Guarded by each lease's token, as :meth:`renew`
        (a retry re-reads every lease and extends again)."""
        if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
            raise ValueError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")
        assert len(leases) <= MAX_RENEW_BATCH

        async def fn(tr: Any) -> tuple[set[str], dict[str, float]]:  # guarded: token check per lease
            lost: set[str] = set()
            extended: dict[str, float] = {}
            expires_at = self.clock() + lease_seconds
            expires_us = int(expires_at * 1e6)
            for lease in leases:
                key = self.keys.lease(lease.run_id)
                raw = await tr.get(key)
                rec = loads(raw) if raw else None
                if rec is None or rec["token"] != lease.token:
                    lost.add(lease.run_id)
                    continue
                tr.clear(self.keys.expiry(rec["expires_us"], lease.run_id))
                tr.set(self.keys.expiry(expires_us, lease.run_id), b"")
                rec.update(expires_at=expires_at, expires_us=expires_us)  # ("cancel" kept)
                tr.set(key, self._dumps(rec))
                extended[lease.run_id] = expires_at
            return lost, extended

        lost, extended = await self.db.transact(fn)
        for lease in leases:
            if lease.run_id in extended:
                lease.expires_at = extended[lease.run_id]
        return lost

    async def release_tr(self, tr: Any, lease: Lease, *, park: bool = False, refund_attempt: bool = True) -> str:
        """Give the run back without settling it: runnable again (``park=False``) or
        parked awaiting :meth:`resume` (``park=True``, e.g. for an approval). A clean
        release does not count as an attempt unless ``refund_attempt=False``.
        Guarded: a retry whose release already committed returns the same state."""
        run = await self._run(tr, lease.run_id)
        if run.get("released_token") == lease.token and run["state"] in (QUEUED, PARKED):
            return run["state"]
        raw = await tr.get(self.keys.lease(lease.run_id))
        rec = loads(raw) if raw else None
        if rec is None or rec["token"] != lease.token:
            raise LeaseLost(f"lease {lease.token} on run {lease.run_id!r} was lost")
        tr.clear(self.keys.lease(lease.run_id))
        tr.clear(self.keys.expiry(rec["expires_us"], lease.run_id))
        run["released_token"] = lease.token
        if refund_attempt:
            run["attempt"] = max(0, run["attempt"] - 1)
        if park:
            run["state"] = PARKED
        else:
            run["state"] = QUEUED
            self._make_ready(tr, run)
        self._put_run(tr, run)
        return run["state"]

    async def release(self, lease: Lease, *, park: bool = False, refund_attempt: bool = True) -> str:
        return await self.db.transact(
            lambda tr: self.release_tr(tr, lease, park=park, refund_attempt=refund_attempt))

    async def resume_tr(self, tr: Any, run_id: str, *, owner: OwnerLike | None = None) -> str:
        """Make a parked run runnable again. Idempotent (a non-parked run is left as is)."""
        run = await self._run(tr, run_id, as_tag(owner) if owner is not None else None)
        if run["state"] == PARKED:
            run["state"] = QUEUED
            self._make_ready(tr, run)
            self._put_run(tr, run)
        return run["state"]

    async def resume(self, run_id: str, *, owner: OwnerLike | None = None) -> str:
        return await self.db.transact(lambda tr: self.resume_tr(tr, run_id, owner=owner))

    # -- settle -------------------------------------------------------------

    async def settle_tr(self, tr: Any, lease: Lease, outcome: Mapping[str, Any], *,
                        lease_rec: dict[str, Any] | None = None,
                        events_before: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
        """Settle the run with ``outcome`` (see :func:`completed`, :func:`failed`,
        :func:`cancelled`). Idempotent: settling again with the same lease returns the
        stored outcome; a lost lease raises :class:`LeaseLost`.

        ``lease_rec``: what :meth:`check_lease` returned for ``lease`` earlier in this
        same transaction (the check is not repeated). ``events_before``: ``(type, data)``
        journal events of the run's conversation the caller would emit in this transaction
        just before the settle: journaled here, in order, ahead of run.completed / failed /
        cancelled, in the same emit (the same keys and values as emitting them first; one
        emitted-count update and one emit's fixed cost less per settled run)."""
        out = _check_outcome(outcome)
        seen = lease.run_seen
        if seen is not None and lease_rec is not None and lease_rec.get("token") == lease.token:
            # Not read: while the lease check of this very transaction (a real read, with its
            # conflict) finds this claim's lease, the run record is the one the claim wrote.
            # Every other writer of a run record either takes the lease first (a claim, a
            # takeover, the exhausted backstop), or is the holder itself (release, park,
            # settle: each ends the holder's lease), or touches only a queued or parked run
            # (resume, cancel, a FIFO promotion), which a leased run is not. (A shallow copy:
            # settling assigns top-level fields only, and the memo must stay the claim's.)
            run = dict(seen[1])
        else:
            raw = await tr.get(self.keys.run(lease.run_id))
            if raw is None:
                raise NotFound(f"run {lease.run_id!r} not found")
            # A shallow copy of the claim's record when the bytes are the claim's (see above).
            run = dict(seen[1]) if seen is not None and seen[0] == raw else _complete_run(loads(raw))
        if run["state"] in SETTLED_STATES:
            if run.get("settled_token") == lease.token:
                if events_before:  # (as if the caller had emitted them itself)
                    await self.journal.emit_many_tr(tr, run["owner"], run["conversation"], events_before, refs=False)
                return await self._outcome(tr, run) or out
            raise LeaseLost(f"run {lease.run_id!r} was settled by someone else")
        if lease_rec is not None and lease_rec.get("token") == lease.token:
            rec = lease_rec
        else:
            rec = await self.check_lease(tr, lease)
        # the lease record the check read is the one _finish_tr clears (not read twice)
        await self._finish_tr(tr, run, out, token=lease.token, lease_rec=_SKIP if rec is None else rec,
                              events_before=events_before)
        return out

    async def settle(self, lease: Lease, outcome: Mapping[str, Any]) -> dict[str, Any]:
        return await self.db.transact(lambda tr: self.settle_tr(tr, lease, outcome))

    async def _outcome(self, tr: Any, run: dict[str, Any]) -> dict[str, Any] | None:
        """A settled run's outcome: in its record (``"out"``, its CBOR) when small, else in
        chunks under ("out", run_id) (so is every outcome settled before session 17)."""
        inline = run.get("out")
        if inline is not None:
            return loads(inline)
        body = await read_chunks(tr, self.keys.outcome(run["id"]))
        return loads(body) if body is not None else None

    async def _finish_tr(self, tr: Any, run: dict[str, Any], outcome: dict[str, Any], *,
                         token: int | None = None, lease_rec: Any = _SKIP,
                         events_before: Sequence[tuple[str, Any]] = ()) -> None:
        """Settle ``run`` (not yet settled) in ``tr`` and advance its conversation's FIFO.
        ``lease_rec``: the run's lease record as already read in ``tr`` (None: none).
        ``events_before``: journaled just before the settled event (see :meth:`settle_tr`)."""
        run_id, tag, conv = run["id"], run["owner"], run["conversation"]
        if lease_rec is _SKIP:
            raw = await tr.get(self.keys.lease(run_id))
            lease_rec = loads(raw) if raw is not None else None
        if lease_rec is not None:
            tr.clear(self.keys.expiry(lease_rec["expires_us"], run_id))
            tr.clear(self.keys.lease(run_id))
        if run.get("rd") is not None:
            tr.clear(self.keys.ready(run["rd"], run_id))
            run["rd"] = None
        if run.get("q", True):  # (see submit_tr: a run active since its submit has no FIFO entry)
            tr.clear(self.keys.fifo(tag, conv, run["seq"]))
        status = outcome["status"]
        run["state"] = status
        run["settled_token"] = token
        run["error"] = outcome.get("error")
        encoded = self._dumps(outcome)
        if len(encoded) <= INLINE_OUTCOME_BYTES:  # (the usual case: in the run record, see _outcome)
            run["out"] = encoded
            self._put_run(tr, run)
        else:
            self._put_run(tr, run)
            if len(encoded) <= CHUNK_SIZE:  # one chunk, at the key write_chunks would give it
                tr.set(self.keys.outcome_chunk(run_id, 0), encoded)
            else:
                write_chunks(tr, self.keys.outcome(run_id), encoded)
        cs_key = self.keys.conversation_state(tag, conv)
        cs = loads(await tr.get(cs_key))
        if cs["active"] == run_id:
            # The FIFO is the conversation's history after the active run (higher seqs: a
            # submit takes seq ``tail``; see _next_in_fifo), so when the active run is the last
            # one submitted (its seq is ``tail - 1``, the usual case) nothing waits and the
            # range read is skipped: it was ~4% of a turn's CPU. A submit racing with this
            # settle writes ``cs``, which this transaction read: it conflicts either way.
            cs["active"] = None
            if run["seq"] + 1 != cs["tail"]:
                nrun = await self._next_in_fifo(tr, tag, conv, run["seq"])
                if nrun is not None:
                    cs["active"] = nrun["id"]
                    if nrun["state"] == QUEUED:
                        self._make_ready(tr, nrun)
                        self._put_run(tr, nrun)
            tr.set(cs_key, self._dumps(cs))
        data: dict[str, Any] = {"run_id": run_id, "status": status, "error": outcome.get("error")}
        result = outcome.get("result")
        if result is not None:
            # The result is part of the outcome just encoded: when that fits, so does the result
            # (no second encoding of it in the common case).
            if len(encoded) <= MAX_EVENT_RESULT_BYTES or len(self._dumps(result)) <= MAX_EVENT_RESULT_BYTES:
                data["result"] = result
            else:
                data["result_truncated"] = True
        await self.journal.emit(tr, tag, conv, ev.RUN_SETTLED_EVENTS[status], data, before=events_before)

    async def _next_in_fifo(self, tr: Any, tag: str, conv: str, seq: int) -> dict[str, Any] | None:
        """The run to make active after the settling active run ``seq``: the first unsettled
        run of the conversation's history after it (None: none). The conversation's FIFO is
        its history after the active run: every run before the active one is settled (runs
        become active in history order, one at a time), and a run after it is queued, or
        settled when it was cancelled while queued (skipped here, each once: the next active
        run is after it). The history holds every run, so this also finds the runs queued
        by older code (which wrote a FIFO entry too, cleared by their settle)."""
        start = self.keys.history(tag, conv, seq + 1)
        stop = self.keys.history_range(tag, conv).stop
        limit = 1  # the usual case: the next run is the next entry (then a window at a time)
        while True:
            rows = await tr.get_range(start, stop, limit=limit)
            for row in rows:
                nrun = await self._run(tr, row.value.decode())
                if nrun["state"] not in SETTLED_STATES:
                    return nrun
            if len(rows) < limit:
                return None
            start, limit = rows[-1].key + b"\x00", FIFO_WINDOW

    # -- cancel -------------------------------------------------------------

    async def _cancel_tr(self, tr: Any, run_id: str, *, reason: str = "", owner: str | None = None) -> str:
        run = await self._run(tr, run_id, owner)
        if run["state"] in SETTLED_STATES:
            return run["state"]
        ck = self.keys.cancel(run_id)
        if await tr.get(ck) is None:
            tr.set(ck, self._dumps({"at": self.clock(), "reason": reason}))
        if run["state"] == RUNNING:
            # The running run's lease says so too ("cancel": True, same token and expiry): its
            # worker's every write reads the lease (check_lease) and learns of the request
            # there, instead of reading the cancel record as well. Rewriting the lease makes a
            # worker transaction that read it before this commit conflict, as the cancel
            # record's read did (promise 7: its retry settles cancelled). A renewal keeps the
            # field; a claim (a takeover too) sets it from the cancel record or the old lease.
            lk = self.keys.lease(run_id)
            raw = await tr.get(lk)
            if raw is not None:
                rec = loads(raw)
                if not rec.get("cancel"):
                    rec["cancel"] = True
                    tr.set(lk, self._dumps(rec))
        if run["state"] == QUEUED and run["claims"] == 0:
            await self._finish_tr(tr, run, cancelled(reason))
        elif run["state"] == PARKED:
            run["state"] = QUEUED  # a worker claims it, sees the cancel and finalizes cleanly
            self._make_ready(tr, run)
            self._put_run(tr, run)
        return run["state"]

    async def cancel_tr(self, tr: Any, run_id: str, *, owner: OwnerLike | None = None, reason: str = "") -> str:
        """Request cancellation; returns the run's state after. Idempotent (state-checked)."""
        return await self._cancel_tr(tr, run_id, reason=reason, owner=as_tag(owner) if owner is not None else None)

    async def cancel(self, run_id: str, *, owner: OwnerLike | None = None, reason: str = "") -> str:
        return await self.db.transact(lambda tr: self.cancel_tr(tr, run_id, owner=owner, reason=reason))

    async def is_cancel_requested(self, tr: Any, run_id: str) -> bool:
        """In the worker's transaction: a cancel committed after its read version aborts it
        (read conflict), so the retry sees the request."""
        return await tr.get(self.keys.cancel(run_id)) is not None

    async def cancel_requested(self, run_id: str) -> bool:
        return await self.db.transact(lambda tr: self.is_cancel_requested(tr, run_id))  # read-only

    async def cancels_requested(self, run_ids: "list[str]") -> set[str]:
        """Which of ``run_ids`` have a cancel record: one read-only transaction for all (a
        worker polls the runs it drives together)."""
        async def fn(tr: Any) -> set[str]:  # read-only
            return {r for r in run_ids if await tr.snapshot.get(self.keys.cancel(r)) is not None}

        return await self.db.transact(fn)

    async def wait_cancel_requested(self, run_id: str) -> None:
        """Return once a cancel for ``run_id`` is recorded (watch on the cancel key)."""
        while True:
            async def fn(tr: Any) -> Any:  # read-only
                if await tr.get(self.keys.cancel(run_id)) is not None:
                    return None
                return tr.watch(self.keys.cancel(run_id))

            w = await self.db.transact(fn)
            if w is None:
                return
            try:
                await w
            finally:
                if not w.ready:
                    w.cancel()

    # -- queries ------------------------------------------------------------

    async def get_run_tr(self, tr: Any, run_id: str, *, owner: OwnerLike | None = None) -> RunInfo:
        run = await self._run(tr, run_id, as_tag(owner) if owner is not None else None)
        outcome = await self._outcome(tr, run) if run["state"] in SETTLED_STATES else None
        cx = await tr.get(self.keys.cancel(run_id)) is not None
        worker = expires = None
        if run["state"] == RUNNING:
            raw = await tr.get(self.keys.lease(run_id))
            if raw:
                rec = loads(raw)
                worker, expires = rec["worker"], rec["expires_at"]
        return RunInfo(run["id"], run["owner"], run["conversation"], run["submission_id"], run["state"],
                       min(run["attempt"], run["max_attempts"]), run["max_attempts"], run["created"], run["updated"], run["limits"], cx,
                       outcome, worker, expires)

    async def get_run(self, run_id: str, *, owner: OwnerLike | None = None) -> RunInfo:
        return await self.db.transact(lambda tr: self.get_run_tr(tr, run_id, owner=owner))  # read-only

    async def wait_settled(self, run_id: str, *, owner: OwnerLike | None = None) -> dict[str, Any]:
        """The run's outcome once settled (a watch on the run record).

        The watch is on the run record, which the settling transaction writes whether the
        outcome goes in it (small ones, since session 17) or in chunks of its own (large
        ones, and every one settled by an older version). The record also changes on a claim,
        a park or a resume, each waking the waiter for a re-read and a new watch: a few per
        run, for one key less per settle."""
        tag = as_tag(owner) if owner is not None else None
        while True:
            async def fn(tr: Any) -> Any:  # read-only
                run = await self._run(tr, run_id, tag)
                if run["state"] in SETTLED_STATES:
                    return ("done", await self._outcome(tr, run))
                return ("wait", tr.watch(self.keys.run(run_id)))

            kind, v = await self.db.transact(fn)
            if kind == "done":
                return v
            try:
                await v
            finally:
                if not v.ready:
                    v.cancel()

    async def list_runs_tr(self, tr: Any, owner: OwnerLike, conversation: str, *, limit: int = 1_000) -> list[RunInfo]:
        """The conversation's runs, oldest first, in ``tr`` (read-only)."""
        tag = as_tag(owner)
        r = self.keys.history_range(tag, conversation)
        rows = await tr.get_range(r.start, r.stop, limit=limit)
        return [await self.get_run_tr(tr, row.value.decode(), owner=tag) for row in rows]

    async def list_runs(self, owner: OwnerLike, conversation: str, *, limit: int = 1_000) -> list[RunInfo]:
        """The conversation's runs, oldest first. Read-only."""
        return await self.db.transact(lambda tr: self.list_runs_tr(tr, owner, conversation, limit=limit))  # read-only

    async def active_run(self, owner: OwnerLike, conversation: str) -> str | None:
        tag = as_tag(owner)

        async def fn(tr: Any) -> str | None:  # read-only
            raw = await tr.get(self.keys.conversation_state(tag, conversation))
            return loads(raw)["active"] if raw else None

        return await self.db.transact(fn)

    async def wait_for_work(self, max_wait: float = 1.0) -> None:
        """Sleep until a run may be claimable: something became ready, the earliest
        lease expires, or ``max_wait`` seconds pass. Workers call it after an empty claim."""
        async def fn(tr: Any) -> tuple[Any, float | None]:  # read-only
            xr = self.keys.expiry_range()
            first = await tr.get_range(xr.start, xr.stop, limit=1)
            rr = self.keys.ready_range()
            ready = await tr.get_range(rr.start, rr.stop, limit=1)
            if ready:
                return None, 0.0
            w = tr.watch(self.keys.signal())
            expiry = self.keys.unpack(first[0].key)[1] / 1e6 if first else None
            return w, expiry

        w, expiry = await self.db.transact(fn)
        if w is None:
            return
        wait = max_wait
        if expiry is not None:
            wait = max(0.0, min(wait, expiry - self.clock()))
        try:
            with trio.move_on_after(wait):
                await w
        finally:
            if not w.ready:
                w.cancel()

