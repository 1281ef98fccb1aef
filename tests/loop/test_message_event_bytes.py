"""message.added's data is built from the bytes the transcript encoded (not encoded again):
what is stored must be exactly what encoding the event's dict would store."""

from __future__ import annotations

import cbor2

from loop import Runtime
from loop.runner import _message_events
from sessions.codec import Encoded
from turn_helpers import noop_tool_agent


async def test_stored_message_events_are_the_encoding_of_their_dicts(tmp_path):
    agent = noop_tool_agent("bytes")
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}", agents=[agent]) as rt:
        out = await rt.run(agent, "c1", "go")
        assert out.ok
        transcript = await rt.transcript("c1")
        j = rt.store.journal
        sub = j.keys.events(rt.owner, "c1")
        rows = await rt.db.transact(lambda tr: tr.get_range(sub.range().start, sub.range().stop))
        added = [cbor2.loads(r.value) + [r.value] for r in rows if cbor2.loads(r.value)[0] == "message.added"]
        assert [a[1]["seq"] for a in added] == [0, 1, 2, 3]
        for (typ, data, ts, eid, raw), msg in zip(added, transcript):
            assert data == {"run_id": out.run_id, "seq": data["seq"], "role": msg["role"], "message": msg}
            assert list(data) == ["run_id", "seq", "role", "message"]
            assert raw == cbor2.dumps([typ, data, ts, eid])


def test_prebuilt_data_equals_the_dicts_encoding():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [], "usage": {"input_tokens": 3}},
            {"role": "custom-role", "content": []}, {"role": None, "content": []}, {"content": []},
            {"role": "tool", "content": [{"type": "tool_result", "content": "x" * 9_000}]}]  # too long: truncated
    for first_seq in (0, 23, 24, 255, 256, 70_000, 2**40):
        plain = _message_events("run-1", first_seq, msgs)
        fast = _message_events("run-1", first_seq, msgs, {id(m): cbor2.dumps(m) for m in msgs})
        assert [t for t, _ in fast] == [t for t, _ in plain]
        for (_, f), (_, p) in zip(fast, plain):
            if "truncated" in p:
                assert f == p  # not built from the message's bytes
            else:
                assert type(f) is Encoded and bytes(f) == cbor2.dumps(p)
