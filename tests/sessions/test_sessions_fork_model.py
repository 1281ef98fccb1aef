"""Random appends and forks (by reference, chains of them, and copies) against a list model."""

from __future__ import annotations

import random

import pytest

from sessions import Owner, Sessions
from sessions.transcript import MAX_FORK_SEGMENTS

OWNER = Owner("model", "forks")


@pytest.mark.parametrize("seed", [11, 12])
async def test_forks_and_appends_match_a_list_model(db, seed):
    rng = random.Random(seed)
    t = Sessions(db).transcripts
    model: dict[str, list[dict]] = {"root": []}
    await t.create(OWNER, "root")
    for step in range(160):
        sid = rng.choice(sorted(model))
        r = rng.random()
        if r < 0.55:
            msgs = [{"s": sid, "k": step, "j": j, "pad": "x" * rng.choice([0, 10, 120_000])} for j in range(rng.randrange(1, 4))]
            n = await t.append(OWNER, sid, msgs, expected_head=len(model[sid]))
            model[sid].extend(msgs)
            assert n == len(model[sid])
        elif r < 0.9:
            at = rng.randrange(len(model[sid]) + 1)
            new = f"f{step}"
            info = await t.fork(OWNER, sid, at, new_session_id=new, by_reference=rng.random() < 0.8)
            assert info.head == at
            model[new] = list(model[sid][:at])
        else:
            start = rng.randrange(len(model[sid]) + 1)
            limit = rng.randrange(1, 20)
            page = await t.read(OWNER, sid, start, limit)
            assert [m.data for m in page.messages] == model[sid][start:start + limit]
            assert [m.seq for m in page.messages] == list(range(start, min(len(model[sid]), start + limit)))
    for sid, msgs in model.items():
        assert [m.data for m in await t.read_all(OWNER, sid, page=7)] == msgs, sid


async def test_a_chain_deeper_than_the_segment_cap_falls_back_to_copying(db):
    t = Sessions(db).transcripts
    await t.create(OWNER, "s0")
    expect: list[dict] = []
    prev = "s0"
    for i in range(MAX_FORK_SEGMENTS + 3):
        await t.append(OWNER, prev, [{"i": i}])
        expect.append({"i": i})
        nxt = f"s{i + 1}"
        await t.fork(OWNER, prev, len(expect), new_session_id=nxt)
        prev = nxt
    assert [m.data for m in await t.read_all(OWNER, prev)] == expect
