"""Usage: never lost, never double counted (promise 10).

``record(run, step_id, usage)`` is idempotent on (run, step): the step's
marker key is read (a read conflict) and written with the totals' atomic adds
in one transaction, so a duplicate or a 1021 retry finds the marker and adds
nothing. Totals are per run, per field, by atomic ``add`` (no read conflict
between steps). Usage figures are non-negative integers; money is an integer
of micro-units (``cost_micros``).

``reserve(run, estimate)`` is the pre-flight check before a model call: it
refuses, with :class:`UsageLimitExceeded`, when the current totals plus the
estimate would pass one of the run's ceilings. Ceilings come from the
submission's ``limits``: ``{"max_total_tokens": n}`` (input + output tokens),
``{"max_cost_micros": n}``, or ``{"max_<field>": n}`` for any usage field. A
reservation holds nothing: one run makes one model call at a time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from sessions.codec import dumps, loads, pack_i64, unpack_i64

from .errors import UsageConflict, UsageLimitExceeded

if TYPE_CHECKING:
    from .runs import Lease, Ledger

__all__ = ["UsageBook", "TOTAL_TOKENS", "MAX_USAGE_FIELDS", "PACKED_FIELDS", "check_limits", "decode_total"]

#: Derived field: input_tokens + output_tokens.
TOTAL_TOKENS = "total_tokens"
MAX_USAGE_FIELDS = 32
MAX_STEP_ID = 512

#: The usage fields a run's totals keep in one packed record, ``("u", run, "t", PACKED_LAYOUT)``:
#: each a little-endian unsigned field of PACKED_FIELD_BYTES, in this order, so one atomic
#: ``add`` of the step's figures packed alike adds them all, field by field (as FoundationDB
#: layers pack several counters in one value). A carry crosses into the next field only past
#: 2**96 - 1: a figure is below 2**63 (an int64 before this layout; asserted by record_tr), so
#: that needs 2**33 steps of the largest figure. Every add to the record has the same length
#: (an add's operand length is the value's: a shorter one would drop the fields past it), so
#: the layout never changes in place: another field list is another layout number. Fields
#: not listed keep one int64 key each, as every field did before (records of that older
#: layout are read and summed with the packed one: see decode_total).
PACKED_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "cost_micros")
PACKED_FIELD_BYTES = 12
PACKED_LAYOUT = 1
MAX_FIGURE = (1 << 63) - 1
assert len(PACKED_FIELDS) * PACKED_FIELD_BYTES <= 100 and PACKED_FIELD_BYTES * 8 >= 64 + 32


#: Each packed field's bit position in the record read as one little-endian int (its index x 96).
_PACKED_SHIFT = {f: i * PACKED_FIELD_BYTES * 8 for i, f in enumerate(PACKED_FIELDS)}
_PACKED_BYTES = PACKED_FIELD_BYTES * len(PACKED_FIELDS)


def _checked_and_packed(usage: Mapping[str, int]) -> "tuple[dict[str, int], bytes | None, dict[str, int]]":
    """``(figures, operand, rest)`` for record_tr, in one pass over ``usage`` (two model steps a
    turn): ``figures`` the checked figures (non-negative ints below 2**63 under str names, not
    the derived TOTAL_TOKENS); ``operand`` the packed record's add operand (None when no packed
    field is non-zero), the record read as one little-endian int of _PACKED_BYTES with each
    field at ``v << shift`` (a figure is at most MAX_FIGURE < 2**96, so fields never overlap:
    the same bytes as each field's 12 bytes joined, with one ``to_bytes`` instead of one per
    field); ``rest`` the non-zero figures of other fields (an int64 key each)."""
    if len(usage) > MAX_USAGE_FIELDS:
        raise ValueError(f"at most {MAX_USAGE_FIELDS} usage fields")
    out: dict[str, int] = {}
    rest: dict[str, int] = {}
    total = 0
    for k, v in usage.items():
        shift = _PACKED_SHIFT.get(k)
        if shift is None and (not isinstance(k, str) or not k or k == TOTAL_TOKENS):
            raise ValueError(f"bad usage field {k!r}")
        # (an int's class is int: the isinstance checks only for anything else, bool included)
        if ((v.__class__ is not int and (isinstance(v, bool) or not isinstance(v, int)))
                or v < 0 or v > MAX_FIGURE):
            raise ValueError(f"usage field {k!r} must be a non-negative int below 2**63")
        out[k] = v
        if shift is None:
            if v:
                rest[k] = v
        else:
            total |= v << shift
    return out, (total.to_bytes(_PACKED_BYTES, "little") if total else None), rest


def decode_total(name: "str | int", value: bytes) -> dict[str, int]:
    """The totals one row of a run's totals range holds: ``name`` is the key's last part (a
    field name: an int64 total of that field, the older layout and fields outside
    PACKED_FIELDS; PACKED_LAYOUT: the packed record). For readers of the raw keys (the
    simulator's checks); :meth:`UsageBook.totals_tr` sums them."""
    if name.__class__ is int:
        if name != PACKED_LAYOUT:
            raise ValueError(f"unknown usage totals layout {name!r}")
        n = PACKED_FIELD_BYTES
        return {f: int.from_bytes(value[i * n:(i + 1) * n], "little") for i, f in enumerate(PACKED_FIELDS)}
    return {name: unpack_i64(value)}


_LIMIT_NAME = re.compile(r"^max_[a-z][a-z0-9_]{0,62}$")


def check_limits(limits: Mapping[str, Any] | None) -> dict[str, int]:
    """A submission's usage ceilings, checked: ``{"max_<field>": n}`` with ``n`` a
    non-negative int (``None``: no ceiling, dropped), at most ``MAX_USAGE_FIELDS`` of them.

    Checked in the submitting transaction before it writes anything (``submit_tr``),
    so a bad ceiling is a clear ``ValueError`` naming it and nothing is committed (a
    ceiling that is not an int would otherwise be stored and only fail the run's first
    reserve).
    """
    if limits is None:
        return {}
    if not isinstance(limits, Mapping):
        raise ValueError(f"limits must be a mapping of max_<field> to an int, got {type(limits).__name__}")
    if len(limits) > MAX_USAGE_FIELDS:
        raise ValueError(f"at most {MAX_USAGE_FIELDS} usage limits")
    out: dict[str, int] = {}
    for name, ceiling in limits.items():
        if not isinstance(name, str) or not _LIMIT_NAME.match(name):
            raise ValueError(f"bad usage limit name {name!r}: max_ and a usage field, e.g. max_total_tokens")
        if ceiling is None:
            continue
        if isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 0:
            raise ValueError(f"usage limit {name!r} must be a non-negative int, got {ceiling!r}")
        out[name] = ceiling
    return out


class UsageBook:
    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger
        self.keys = ledger.keys

    async def record_tr(self, tr: Any, run_id: str, step_id: str, usage: Mapping[str, int], *,
                        run_exists: bool = False, new: bool = False) -> bool:
        """Count ``usage`` for (run, step) once; returns False when it was already counted.
        Guarded by the step marker. Raises :class:`UsageConflict` for a different figure.

        ``run_exists=True``: the caller already proved the run exists in ``tr``
        (e.g. its lease check read the run's lease, which only exists with the
        run), so the run record is not read and decoded again.

        ``new=True``: the caller's own guard proves the step's marker cannot exist, so it is
        not read either (returns True; writes what a first record writes). The loop's runner
        is such a caller: it names a step by the position its loop state moves past in the
        very transaction that records it (``model-N`` with ``model_calls = N``,
        ``compact@H`` with the transcript's head past H), and that transaction checks the
        run's lease (a real read: no other worker writes for the run) and is guarded by the
        loop state's version, so a marker that existed would mean the state had already
        moved, and the commit would not be made."""
        if not isinstance(step_id, str) or not step_id or len(step_id) > MAX_STEP_ID:
            raise ValueError("a step id is a non-empty string")
        figures, packed, rest = _checked_and_packed(usage)
        if not run_exists:
            await self.ledger._run(tr, run_id, snapshot=True)  # exists; no conflict with run-record writes
        marker = self.keys.usage_step(run_id, step_id)
        if not new:
            raw = await tr.get(marker)
            if raw is not None:
                if loads(raw) != figures:
                    raise UsageConflict(f"usage for step {step_id!r} of run {run_id!r} was recorded with other figures")
                return False
        tr.set(marker, dumps(figures))
        if packed is not None:  # (the usual fields, whatever their number: one add)
            tr.add(self.keys.usage_packed_total(run_id), packed)
        for k, v in rest.items():
            tr.add(self.keys.usage_total(run_id, k), pack_i64(v))
        return True

    async def record(self, run_id: str, step_id: str, usage: Mapping[str, int], *,
                     lease: "Lease | None" = None) -> bool:
        async def fn(tr: Any) -> bool:  # guarded: lease check + step marker
            if lease is not None:
                await self.ledger.check_lease(tr, lease)
            return await self.record_tr(tr, run_id, step_id, usage)

        return await self.ledger.db.transact(fn)

    async def totals_tr(self, tr: Any, run_id: str) -> dict[str, int]:
        r = self.keys.usage_totals_range(run_id)
        out: dict[str, int] = {}
        for row in await tr.get_range(r.start, r.stop):
            # (a packed record and the older layout's int64 key of a field may both hold a
            # part of one field's total: a run recorded across the layout change)
            for k, v in decode_total(self.keys.unpack(row.key)[-1], row.value).items():
                if v or k not in PACKED_FIELDS:
                    out[k] = out.get(k, 0) + v
        out[TOTAL_TOKENS] = out.get("input_tokens", 0) + out.get("output_tokens", 0)
        return out

    async def totals(self, run_id: str) -> dict[str, int]:
        return await self.ledger.db.transact(lambda tr: self.totals_tr(tr, run_id))  # read-only

    async def reserve_tr(self, tr: Any, run_id: str, estimate: Mapping[str, int]) -> dict[str, int]:
        """Refuse (UsageLimitExceeded) if totals + estimate pass a ceiling; returns the
        remaining headroom per ceiling. Read-only."""
        run = await self.ledger._run(tr, run_id)
        limits = run.get("limits") or {}
        totals = await self.totals_tr(tr, run_id)
        est = dict(estimate)
        est.setdefault(TOTAL_TOKENS, est.get("input_tokens", 0) + est.get("output_tokens", 0))
        headroom: dict[str, int] = {}
        for name, ceiling in limits.items():
            if not name.startswith("max_") or ceiling is None:
                continue
            fld = name[4:]
            used, want = totals.get(fld, 0), int(est.get(fld, 0))
            if used + want > ceiling:
                raise UsageLimitExceeded(
                    f"run {run_id!r}: {fld} would reach {used + want}, past its ceiling of {ceiling}",
                    field=fld, used=used, estimate=want, ceiling=int(ceiling))
            headroom[fld] = int(ceiling) - used
        return headroom

    async def reserve(self, run_id: str, estimate: Mapping[str, int]) -> dict[str, int]:
        return await self.ledger.db.transact(lambda tr: self.reserve_tr(tr, run_id, estimate))
