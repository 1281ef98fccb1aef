"""sessions.codec.own_dumps (session 19): one reused cbor2 encoder's encode_to_bytes, for an
object used from one thread (Journal, Transcripts). The same bytes and the same errors as
cbor2.dumps, and nothing carried from one call to the next (after an error, in calls nested in
one another); each thread's own encoder whole while other threads encode with theirs."""

from __future__ import annotations

import datetime
import math
import threading
from collections.abc import Mapping
from typing import Any, Iterator

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv
from sessions import Sessions, codec
from sessions.codec import Encoded, loads, own_dumps

_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text() | st.binary())
_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=6) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=6)),
    max_leaves=40,
)

_DUMPS = own_dumps()


def test_module_dumps_is_still_cbor2s() -> None:
    # (a shared encoder would mix the output of two threads encoding at once: see own_dumps)
    assert codec.dumps is cbor2.dumps


@settings(max_examples=400, deadline=None)
@given(_values)
def test_same_bytes_as_cbor2_dumps(value: Any) -> None:
    assert _DUMPS(value) == cbor2.dumps(value)


@pytest.mark.parametrize("value", [
    0.0, -0.0, 1.5, 1e300, math.inf, -math.inf, 2**64 - 1, 2**64, -(2**64), -(2**64) - 1, 2**200,
    "", "\x00", "é✓\U0001F600", b"", b"\x00\xff", Encoded(b"\xa1aa\x01"), bytearray(b"ab"),
    {"run_id": "r" * 32, "submission_id": "s-1-2"}, {1: "a", "b": [None, True, False]},
    [[[[[]]]]], {"a": {"b": {"c": {}}}}, (1, 2), frozenset(), {1, 2}, cbor2.CBORTag(42, b"x"),
    cbor2.undefined, datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc),
])
def test_same_bytes_for_edge_values(value: Any) -> None:
    assert _DUMPS(value) == cbor2.dumps(value)


def _error_of(fn: Any, value: Any) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn(value)
    return type(info.value), str(info.value)


def _cyclic() -> list[Any]:
    a: list[Any] = [1]
    a.append(a)
    return a


@pytest.mark.parametrize("make", [
    lambda: object(), lambda: {"a": [1, object()]}, _cyclic, lambda: datetime.datetime(2026, 12, 1),
    lambda: {"a": {"b": {object(): 1}}},
])
def test_same_errors_and_nothing_left_behind(make: Any) -> None:
    dumps = own_dumps()
    assert _error_of(dumps, make()) == _error_of(cbor2.dumps, make())
    # the next call is whole: no half-written output carried over
    value = {"after": [1, {"x": "y"}], "n": None}
    assert dumps(value) == cbor2.dumps(value)


def test_a_container_that_failed_is_encodable_after() -> None:
    # A failure inside a container must not leave it marked as being encoded (a later encode
    # of it would then be refused as cyclic).
    dumps = own_dumps()
    inner: dict[str, Any] = {"b": object()}
    outer = {"a": inner}
    with pytest.raises(cbor2.CBOREncodeError):
        dumps(outer)
    inner["b"] = 1
    assert dumps(outer) == cbor2.dumps(outer)


class _Reentrant(Mapping):
    """A mapping whose iteration encodes another value with the same encoder."""

    def __init__(self, dumps: Any, d: dict[str, Any]) -> None:
        self.dumps, self.d = dumps, d
        self.inner: list[bytes] = []

    def __getitem__(self, k: str) -> Any:
        return self.d[k]

    def __len__(self) -> int:
        return len(self.d)

    def __iter__(self) -> Iterator[str]:
        self.inner.append(self.dumps({"inner": [9, 9]}))
        return iter(self.d)

    def items(self) -> Any:
        self.inner.append(self.dumps({"inner": [9, 9]}))
        return self.d.items()


def test_nested_calls_do_not_mix_output() -> None:
    dumps = own_dumps()
    m = _Reentrant(dumps, {"a": 2})
    got = dumps([1, m, "tail", [m]])
    assert m.inner and all(b == cbor2.dumps({"inner": [9, 9]}) for b in m.inner)
    assert got == cbor2.dumps([1, {"a": 2}, "tail", [{"a": 2}]])


def test_each_threads_own_encoder_is_whole() -> None:
    values = [{"t": t, "items": [{"i": i, "s": "x" * (i % 50), "l": list(range(i % 7))} for i in range(200)]}
              for t in range(4)]
    expected = [cbor2.dumps(v) for v in values]
    bad: list[Any] = []
    start = threading.Barrier(len(values))

    def work(t: int) -> None:
        dumps = own_dumps()
        start.wait()
        for _ in range(300):
            if dumps(values[t]) != expected[t]:
                bad.append(t)
                return

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(values))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []


@pytest.mark.parametrize("engine", ["memory", "lmdb"])
async def test_journal_and_transcripts_store_cbor2s_bytes(engine: str, tmp_path: Any) -> None:
    db = await kv.open("memory:" if engine == "memory" else f"lmdb:{tmp_path}/data")
    try:
        s = Sessions(db, retention=0)
        data = {"run_id": "r1", "n": [1, 2.5, None], "nested": {"é": True}}
        message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}

        async def fn(tr: Any) -> None:
            await s.journal.emit(tr, "realm/subj", "conv", "run.queued", data)
            await s.transcripts.append_tr(tr, "realm/subj", "sess", [message], create=True)

        await db.transact(fn)
        page = await s.journal.read("realm/subj", "conv")
        assert [(e.type, e.data) for e in page.events] == [("run.queued", data)]

        async def raw(tr: Any) -> list[bytes]:
            r = s.journal.keys.events("realm/subj", "conv").range()
            return [row.value for row in await tr.get_range(r.start, r.stop)]

        (value,) = await db.transact(raw)
        assert loads(value)[1] == data
        assert value[:1] == b"\x84" and cbor2.dumps(data) in value
        (stored,) = await s.transcripts.read_all("realm/subj", "sess")
        assert stored.data == message

        async def raw_head(tr: Any) -> bytes:
            return await tr.get(s.transcripts.keys.head("realm/subj", "sess"))

        head = await db.transact(raw_head)
        assert head == cbor2.dumps(loads(head)) and loads(head)["n"] == 1
    finally:
        await db.close()
