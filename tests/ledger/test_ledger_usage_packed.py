"""Session 17: a run's usage totals of the usual fields are one packed record, one atomic add
a step (ledger.usage.PACKED_FIELDS), other fields one int64 key each as before; totals written
by the older layout (an int64 key per field) are still read, and summed with the packed ones."""

from __future__ import annotations

import pytest

from ledger import Ledger
from ledger.usage import PACKED_FIELD_BYTES, PACKED_FIELDS, PACKED_LAYOUT, decode_total
from sessions import Owner, Sessions
from sessions.codec import pack_i64

OWNER = Owner("test", "u1")


async def _claimed(db):
    s = Sessions(db)
    L = Ledger(db, journal=s.journal)
    await L.submit("k", {}, None, owner=OWNER, conversation="c")
    return L, await L.claim("w", lease_seconds=10)


async def _totals_rows(db, L, run_id):
    r = L.keys.usage_totals_range(run_id)
    rows = await db.transact(lambda tr: tr.get_range(r.start, r.stop))  # read-only
    return [(L.keys.unpack(row.key)[-1], row.value) for row in rows]


async def test_the_usual_fields_are_one_packed_add_and_others_a_key_each(db):
    L, lease = await _claimed(db)
    run = lease.run_id
    await L.usage.record(run, "s1", {"input_tokens": 100, "output_tokens": 20, "cost_micros": 7, "audio_tokens": 3})
    await L.usage.record(run, "s2", {"input_tokens": 1, "cache_read_tokens": 50, "output_tokens": 0})
    await L.usage.record(run, "s3", {"audio_tokens": 4, "input_tokens": 0})  # no packed figure: no packed add
    rows = await _totals_rows(db, L, run)
    assert [name for name, _ in rows] == ["audio_tokens", PACKED_LAYOUT]  # (tuple order: str before int)
    packed = dict(rows)[PACKED_LAYOUT]
    assert len(packed) == PACKED_FIELD_BYTES * len(PACKED_FIELDS)
    assert decode_total(PACKED_LAYOUT, packed) == {"input_tokens": 101, "output_tokens": 20, "cache_read_tokens": 50,
                                                   "cache_write_tokens": 0, "cost_micros": 7}
    assert decode_total("audio_tokens", dict(rows)["audio_tokens"]) == {"audio_tokens": 7}
    assert await L.usage.totals(run) == {"input_tokens": 101, "output_tokens": 20, "cache_read_tokens": 50,
                                         "cost_micros": 7, "audio_tokens": 7, "total_tokens": 121}
    # a figure too large for the int64 the older layout kept is refused before anything is written
    with pytest.raises(ValueError):
        await L.usage.record(run, "s4", {"input_tokens": 1 << 63})
    assert await L.usage.totals(run) == {"input_tokens": 101, "output_tokens": 20, "cache_read_tokens": 50,
                                         "cost_micros": 7, "audio_tokens": 7, "total_tokens": 121}
    with pytest.raises(ValueError):
        decode_total(PACKED_LAYOUT + 1, packed)


async def test_large_figures_do_not_carry_between_fields(db):
    L, lease = await _claimed(db)
    big = (1 << 63) - 1
    for i in range(4):
        await L.usage.record(lease.run_id, f"s{i}", {"input_tokens": big, "output_tokens": 1})
    totals = await L.usage.totals(lease.run_id)
    assert totals["input_tokens"] == 4 * big and totals["output_tokens"] == 4
    assert "cache_read_tokens" not in totals


async def test_totals_of_the_older_layout_are_read_and_summed_with_the_packed_record(db):
    L, lease = await _claimed(db)
    run = lease.run_id

    async def older(tr):  # a test without retries: what the older record_tr added, field by field
        for k, v in {"input_tokens": 40, "output_tokens": 5, "cost_micros": 2, "audio_tokens": 1}.items():
            tr.add(L.keys.usage_total(run, k), pack_i64(v))

    await db.transact(older)
    assert await L.usage.totals(run) == {"input_tokens": 40, "output_tokens": 5, "cost_micros": 2,
                                         "audio_tokens": 1, "total_tokens": 45}
    await L.usage.record(run, "new", {"input_tokens": 60, "output_tokens": 5, "audio_tokens": 1})
    assert await L.usage.totals(run) == {"input_tokens": 100, "output_tokens": 10, "cost_micros": 2,
                                         "audio_tokens": 2, "total_tokens": 110}
    # a ceiling sees the summed figure
    from ledger import UsageLimitExceeded
    s = Sessions(db)
    L2 = Ledger(db, journal=s.journal)
    await L2.submit("k2", {}, None, owner=OWNER, conversation="c2", limits={"max_input_tokens": 150})
    lease2 = await L2.claim("w2", lease_seconds=10)

    async def older2(tr):  # a test without retries
        tr.add(L2.keys.usage_total(lease2.run_id, "input_tokens"), pack_i64(100))

    await db.transact(older2)
    await L2.usage.record(lease2.run_id, "a", {"input_tokens": 40})
    with pytest.raises(UsageLimitExceeded) as info:
        await L2.usage.reserve(lease2.run_id, {"input_tokens": 11})
    assert info.value.used == 140
