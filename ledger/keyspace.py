"""The ledger keyspace: every key this package reads or writes, in one place.

Tuple-encoded under ``root["l"]`` (``root`` is the deployment's
:class:`kv.Subspace`, default ``(b"surefoot",)``). ``T`` is the owner tag.
Submissions live under their owner (a submission id is an idempotency key *of
that owner*: two owners may use the same one without seeing each other).
Runs are keyed by a random run id, globally (workers claim across owners), and
store the owner tag, checked whenever a caller names an owner.

Key (under root["l"])              Value
---------------------------------  ----------------------------------------------------------
("o", T, "sub", sid)               b"\x01" + 12 bytes + CBOR submission {"owner",
                                   "conversation", "hash", "created", "run_id", "body"?} ("id",
                                   "attempt": 0 and "policy" too when written before session
                                   19; nothing reads them): one versionstamped value holding the
                                   position of its run.queued (the 12 bytes) and, in "body",
                                   the request itself (canonical CBOR {"delivery",
                                   "result_schema"}) when at most INLINE_REQUEST_BYTES.
                                   (Records written before this layout are a bare CBOR map
                                   without "body", and still read: see ledger.runs._SUB_MARK.)
("o", T, "sbd", sid, i)            chunk i of the request when larger than INLINE_REQUEST_BYTES
                                   (and of every request of a record of the older layout)
("o", T, "sbc", sid)               12 bytes (versionstamped value): position of its run.queued,
                                   written only with records of the older layout (read only)
("o", T, "cs", conv)               CBOR conversation state {"active": run id | None, "tail": next
                                   history sequence}; "active" is the one run allowed to be
                                   ready/running/parked; it moves in the transaction that
                                   settles the active run, so it is never stale
("o", T, "q", conv, seq)           run id: read only (cleared by its run's settle): the FIFO
                                   entry older code wrote for a run queued behind an active
                                   run (its run record has no "q"); since session 18 no run
                                   has one (its record says "q": False)
("o", T, "h", conv, seq)           run id: every run of the conversation, in order (history).
                                   The conversation's FIFO is its history after the active
                                   run: the settle of the active run makes the first
                                   unsettled run after it active (runs cancelled while
                                   queued are skipped; every run before the active one is
                                   settled)
("run", run_id)                    CBOR run {"id", "owner", "conversation", "submission_id",
                                   "seq", "state", "attempt", "claims", "max_attempts",
                                   "created", "updated", "limits", "rd"?, "settled_token"?,
                                   "released_token"?, "error"?, "q"?, "out"?}; "rd",
                                   "settled_token", "released_token", "error": None or absent
                                   (a submit stores none of them since session 18; readers
                                   use .get); "q":
                                   False when the run has no FIFO entry (every run since session
                                   18; runs active from their submit since session 17); "out": a
                                   settled run's CBOR outcome {"status", "result", "error"}
                                   when at most runs.INLINE_OUTCOME_BYTES (session 17).
                                   Since session 19 a submit leaves out "attempt" and "claims"
                                   while 0, "limits" while empty and "updated" (= "created");
                                   every reader decodes through runs._complete_run, which puts
                                   them back, and every later write stores them all
("out", run_id, i)                 chunk i of the CBOR outcome of a settled run without "out"
                                   (a larger outcome; every outcome settled before session 17)
("rl", run_id)                     CBOR lease {"token", "worker", "expires_at", "expires_us",
                                   "nonce", "cancel"?}: present iff the run is running; every
                                   worker write reads it (the fencing check). "cancel": True
                                   (absent otherwise) once the run's cancel record exists: a
                                   cancel of a running run rewrites its lease with it (same
                                   token and expiry), a renewal keeps it, a claim or takeover
                                   sets it from the cancel record; so the worker's lease read
                                   is also its read of the cancel request
("cx", run_id)                     CBOR cancel record {"at", "reason"}: durable (never
                                   cleared), watchable; the keeper's poll and waiters read it
("rd", ready_us, run_id)           b"": ready index — runnable runs (only conversation heads),
                                   oldest first; claim reads a small window of it
("lx", expires_us, run_id)         b"": lease-expiry index — running runs by expiry; claim
                                   takes over expired ones first
("sig",)                           int64 LE: bumped when a run becomes ready (workers watch it)
("u", run_id, "s", step_id)        CBOR usage of one step: the idempotency marker of record()
("u", run_id, "t", 1)              the run's totals of ledger.usage.PACKED_FIELDS (input, output,
                                   cache read and write tokens, cost) packed: 12-byte LE unsigned
                                   fields in that order, one atomic add a step (session 17)
("u", run_id, "t", field)          int64 LE total of one usage field (atomic add): fields outside
                                   PACKED_FIELDS, and every field of runs recorded before the
                                   packed record (still read and summed with it)
("st", run_id, name, i)            chunk i of a durable step's CBOR record {"result", "at"}
"""

from __future__ import annotations

from functools import lru_cache

import kv
from sessions.codec import fastpack, pack_str, pack_uint

#: Packed keys are pure functions of their parts; tuple packing costs tens of
#: microseconds, so hot keys (a conversation's journal, a run's lease) are cached.
#: Small: the hot keys are those of runs in flight, and every entry is objects the
#: cycle collector scans on each full collection (8,192 entries per cache, ~20
#: caches, made those collections ~1.7x as long in the turns benchmark).
_CACHE = 1_024

__all__ = ["LedgerKeyspace"]

# Packed constant parts: a key is a cached packed prefix + its variable parts (tuple encoding
# concatenates), so building one encodes only what varies.
_O, _SUB, _SBD, _SBC, _CS, _Q, _H = (pack_str(p) for p in ("o", "sub", "sbd", "sbc", "cs", "q", "h"))
_RUN, _OUT, _RL, _CX, _U, _S, _T = (pack_str(p) for p in ("run", "out", "rl", "cx", "u", "s", "t"))
_RD, _LX = pack_str("rd"), pack_str("lx")
_PACKED1 = pack_uint(1)  # (ledger.usage.PACKED_LAYOUT)

class LedgerKeyspace:
    """Key constructors for the table above. Pure; no I/O."""

    __slots__ = ("root", "base", "_blen", "_b", "_rd", "_lx", "_signal", "_ready_range", "_expiry_range")

    def __init__(self, root: "kv.Subspace | None" = None) -> None:
        self.root = root if root is not None else kv.Subspace((b"surefoot",))
        self.base = self.root["l"]
        self._b = self.base.key()
        self._blen = len(self.base.key())
        # Keys and ranges with no variable part, or only a trailing one, packed once (each
        # claim reads both index ranges; every run made ready bumps the signal).
        self._rd, self._lx = self._b + _RD, self._b + _LX
        self._signal = fastpack(self._b, ("sig",))
        self._ready_range = self.base.range(("rd",))
        self._expiry_range = self.base.range(("lx",))

    def unpack(self, key: bytes) -> tuple:
        return kv.tuple.unpack(key[self._blen:])

    def _sub(self, t: tuple) -> "kv.Subspace":
        return kv.Subspace(raw_prefix=fastpack(self._b, t))

    @lru_cache(maxsize=_CACHE)
    def _owned(self, tag: str) -> bytes:
        """The packed ``("o", T)`` prefix of an owner's keys."""
        return self._b + _O + pack_str(tag)

    # submissions
    def submission(self, tag: str, sid: str) -> bytes:
        # Not cached: a submission id is looked up about once (its submit, a claim's request
        # read), and a cache miss (insert, evict) costs more than the two concatenations.
        return self._owned(tag) + _SUB + pack_str(sid)

    @lru_cache(maxsize=_CACHE)
    def submission_body(self, tag: str, sid: str) -> "kv.Subspace":
        return kv.Subspace(raw_prefix=self._owned(tag) + _SBD + pack_str(sid))

    @lru_cache(maxsize=_CACHE)
    def submission_cursor(self, tag: str, sid: str) -> bytes:
        return self._owned(tag) + _SBC + pack_str(sid)

    # conversations
    @lru_cache(maxsize=_CACHE)
    def conversation_state(self, tag: str, conv: str) -> bytes:
        return self._owned(tag) + _CS + pack_str(conv)

    def fifo(self, tag: str, conv: str, seq: int) -> bytes:
        return self._queue_prefixes(tag, conv)[0] + pack_uint(seq)

    @lru_cache(maxsize=_CACHE)
    def _queue_prefixes(self, tag: str, conv: str) -> tuple[bytes, bytes]:
        owned, c = self._owned(tag), pack_str(conv)
        return owned + _Q + c, owned + _H + c

    def fifo_and_history(self, tag: str, conv: str, seq: int) -> tuple[bytes, bytes]:
        """``(fifo(tag, conv, seq), history(tag, conv, seq))``, the keys a submit writes (the FIFO
        entry only for a run queued behind the active one): the
        conversation's prefixes cached, ``seq`` packed once for both (and not cached: each
        sequence number is written once)."""
        q, h = self._queue_prefixes(tag, conv)
        s = pack_uint(seq)
        return q + s, h + s

    @lru_cache(maxsize=_CACHE)
    def fifo_range(self, tag: str, conv: str) -> slice:
        return self.base.range(("o", tag, "q", conv))

    def history(self, tag: str, conv: str, seq: int) -> bytes:
        return self._queue_prefixes(tag, conv)[1] + pack_uint(seq)

    @lru_cache(maxsize=_CACHE)
    def history_range(self, tag: str, conv: str) -> slice:
        return self.base.range(("o", tag, "h", conv))

    # runs
    @lru_cache(maxsize=_CACHE)
    def _run_part(self, run_id: str) -> bytes:
        """``pack_str(run_id)``, packed once per run: a turn builds ~10 keys of its run (record,
        lease, cancel, expiry, usage step and totals), most not cached themselves."""
        return pack_str(run_id)

    def run(self, run_id: str) -> bytes:
        # Not cached itself: two concatenations onto the run's cached part (a cache of its
        # own was a second entry, and a second miss at the submit, for every run).
        return self._b + _RUN + self._run_part(run_id)

    @lru_cache(maxsize=_CACHE)
    def outcome(self, run_id: str) -> "kv.Subspace":
        return kv.Subspace(raw_prefix=self._b + _OUT + self._run_part(run_id))

    def outcome_chunk(self, run_id: str, i: int) -> bytes:
        """``outcome(run_id).pack((i,))``, without making (and caching) the Subspace: a run's
        outcome is written once, by its settle, as one chunk when it fits, and waited on
        at chunk 0."""
        return self._b + _OUT + self._run_part(run_id) + pack_uint(i)

    @lru_cache(maxsize=_CACHE)
    def lease(self, run_id: str) -> bytes:
        return self._b + _RL + self._run_part(run_id)

    @lru_cache(maxsize=_CACHE)
    def cancel(self, run_id: str) -> bytes:
        return self._b + _CX + self._run_part(run_id)

    def ready(self, ready_us: int, run_id: str) -> bytes:
        return self._rd + pack_uint(ready_us) + self._run_part(run_id)

    def ready_range(self) -> slice:
        return self._ready_range

    def lease_range(self) -> slice:
        """Every run's lease key (``("rl", run_id)``): for tools that watch leases (the sim's faults)."""
        return self.base.range(("rl",))

    def expiry(self, expires_us: int, run_id: str) -> bytes:
        return self._lx + pack_uint(expires_us) + self._run_part(run_id)

    def expiry_range(self) -> slice:
        return self._expiry_range

    def signal(self) -> bytes:
        return self._signal

    # usage
    def usage_step(self, run_id: str, step_id: str) -> bytes:
        # (Not cached: a step's marker is written once, by the step's own commit, and read
        # only by a retry or a repeated record; a cache miss costs more than packing.)
        return self._b + _U + self._run_part(run_id) + _S + pack_str(step_id)

    @lru_cache(maxsize=_CACHE)
    def usage_total(self, run_id: str, field: str) -> bytes:
        return self._b + _U + self._run_part(run_id) + _T + pack_str(field)

    def usage_packed_total(self, run_id: str) -> bytes:
        """``("u", run_id, "t", 1)``: the packed totals record (ledger.usage.PACKED_LAYOUT).
        Not cached: built once per model step, from the step marker's cached prefix parts."""
        return self._b + _U + self._run_part(run_id) + _T + _PACKED1

    @lru_cache(maxsize=_CACHE)
    def usage_totals_range(self, run_id: str) -> slice:
        return self.base.range(("u", run_id, "t"))

    # durable steps
    @lru_cache(maxsize=_CACHE)
    def step(self, run_id: str, name: str) -> "kv.Subspace":
        return self._sub(("st", run_id, name))
