"""Session 18: Transcripts.append_tr builds a one-chunk message's key inline (the tuple codes of
its seq and of chunk 0, not fastpack) and sizes an append without a division per small
message; check_session_id tests a str's class before isinstance. The keys and the refusals
must be what they were."""

from __future__ import annotations

import pytest

from sessions import Owner, Sessions, TooLarge
from sessions.codec import CHUNK_SIZE, fastpack
from sessions.transcript import check_session_id

OWNER = Owner("test", "u1")


async def test_message_keys_across_the_small_int_codes_are_tuple_keys(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    head = 0
    for batch in (250, 5, 3, 60):  # seqs 0..317: one- and two-byte tuple codes, an append crossing 255
        head = await t.append(OWNER, "s", [{"i": head + i} for i in range(batch)], expected_head=head)
    big = {"i": head, "blob": "x" * (CHUNK_SIZE + 10)}  # two chunks, the general path
    head = await t.append(OWNER, "s", [big, {"i": head + 1}], expected_head=head)
    assert head == 320
    prefix = t.keys.messages(OWNER.tag, "s").raw_prefix
    r = t.keys.messages(OWNER.tag, "s").range()
    keys = [row.key for row in await db.transact(lambda tr: tr.get_range(r.start, r.stop))]  # read-only
    expected = [fastpack(prefix, (seq, 0)) for seq in range(318)] + [fastpack(prefix, (318, 0)),
                                                                    fastpack(prefix, (318, 1)), fastpack(prefix, (319, 0))]
    assert keys == expected
    page = await t.read(OWNER, "s", start=0, limit=1000)
    assert [m.data["i"] for m in page.messages] == list(range(320))
    assert page.messages[318].data == big


async def test_an_append_too_large_is_still_refused_before_anything_is_written(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s")
    msg = {"blob": "y" * (CHUNK_SIZE - 100)}
    with pytest.raises(TooLarge):
        await t.append(OWNER, "s", [msg] * 101, expected_head=0)  # ~9.08 MB with the key overhead
    assert await t.append(OWNER, "s", [msg] * 2, expected_head=0) == 2


class _Str(str):
    pass


def test_session_ids_refused_and_accepted_as_before():
    for bad in (None, 3, b"s", "", "s" * 513):
        with pytest.raises(ValueError):
            check_session_id(bad)
    assert check_session_id("s" * 512) == "s" * 512
    sub = _Str("abc")
    assert check_session_id(sub) is sub
