"""Session 17's cuts of a turn's CPU in loop/ keep behaviour: each shortcut is compared with the
longer way it replaces.

* ``_message_events`` skips ``_approx_size`` for a message whose CBOR is short enough: the
  bound (``_JSON_PER_CBOR_BYTE``) must never skip a message the estimate would truncate.
* ``Tool.check_arguments`` answers no arguments from a cached validation of ``{}``.
* ``call_model`` reads a stream with ``sync_events`` itself (``_read_sync``), not through
  ``stream_model``'s async generator: the same message, the same errors.
* the clock read without trio's public wrappers (``trio_now``, ``Clock.now``), a run id's
  CBOR by hand (``_cbor_text``), usage figures filtered by a loop (``Store.record_usage``).
"""

from __future__ import annotations

import time
from typing import Any

import cbor2
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loop import messages as M
from loop.agents import tool
from loop.calls import SYSTEM_CLOCK, Clock, call_model, trio_now
from loop.errors import PermanentProviderError, StreamBrokenError, TransientProviderError
from loop.providers import ScriptedModel, reply, tool_call
from loop.providers.base import Finish, TextDelta, ToolCallDelta, ToolCallStart, Usage
from loop.runner import (
    _ESTIMATE_FIXED,
    _ESTIMATE_PER_PART,
    _JSON_PER_CBOR_BYTE,
    MAX_EVENT_TEXT,
    _approx_size,
    _cbor_text,
    _message_events,
)
from sessions.codec import Encoded, dumps

# ---------------------------------------------------------------- the size bound

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=40), st.binary(max_size=20), st.just(cbor2.undefined),
    st.text(alphabet=st.characters(max_codepoint=0x1F), max_size=20),  # control characters
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=8),
    st.dictionaries(st.one_of(st.text(max_size=6), st.booleans(), st.none(), st.integers(-30, 30)), inner,
                    max_size=6)), max_leaves=40)
_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=300)}),
    st.fixed_dictionaries({"type": st.just("tool_call"), "id": st.text(max_size=10), "name": st.text(max_size=10),
                           "arguments": st.dictionaries(st.text(max_size=8), _values, max_size=6)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "call_id": st.text(max_size=10),
                           "content": st.text(max_size=300)}),
    st.fixed_dictionaries({}),
)
_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "error"]), "content": st.lists(_parts, max_size=6)},
    optional={"error": _values, "summary": _values, "usage": st.dictionaries(st.text(max_size=8),
                                                                              st.integers(0, 10**9))},
)


def _bound(m: dict[str, Any], enc: bytes) -> int:
    return _ESTIMATE_FIXED + _ESTIMATE_PER_PART * len(m.get("content") or ()) + _JSON_PER_CBOR_BYTE * len(enc)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_messages)
def test_the_encoded_size_bound_is_never_below_the_estimate(m):
    enc = cbor2.dumps(m)
    assert _approx_size(m) <= _bound(m, enc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_messages, min_size=1, max_size=3), st.integers(0, 1000))
def test_message_events_with_the_bound_are_those_without_it(msgs, seq):
    encoded = {id(m): cbor2.dumps(m) for m in msgs}
    got = _message_events("run-1", seq, msgs, encoded)
    assert len(got) == len(msgs)
    for i, (m, (typ, data)) in enumerate(zip(msgs, got)):
        assert typ == "message.added"
        if _approx_size(m) <= MAX_EVENT_TEXT:  # the estimate's answer: in full
            assert isinstance(data, Encoded)
            assert bytes(data) == cbor2.dumps({"run_id": "run-1", "seq": seq + i, "role": m["role"], "message": m})
        else:
            assert data["truncated"] is True and data["seq"] == seq + i


def test_a_large_message_is_still_truncated_with_its_encoding_known():
    m = M.assistant("x" * (MAX_EVENT_TEXT + 10))
    (typ, data), = _message_events("r", 3, [m], {id(m): cbor2.dumps(m)})
    assert data["truncated"] is True and len(data["text"]) <= MAX_EVENT_TEXT + 1


# ---------------------------------------------------------------- no arguments


def test_no_arguments_are_checked_against_the_schema_as_it_is_now():
    @tool
    def lookup(city: str) -> str:
        """Look up."""
        return city

    first = lookup.check_arguments({})
    assert first and "city" in first[0]
    first.append("a caller's own list")  # (a copy: the cached errors are not the caller's)
    assert lookup.check_arguments({}) == first[:1]
    lookup.parameters = {"type": "object", "properties": {}}  # replaced: validated again
    assert lookup.check_arguments({}) == []
    assert lookup.check_arguments({"x": 1}) == []
    assert lookup.check_arguments([]) == ["$: arguments must be an object, got list"]

    @tool
    async def noop() -> str:
        """Nothing."""
        return "ok"

    assert noop.check_arguments({}) == [] and noop.check_arguments({}) == []


# ---------------------------------------------------------------- sync streams


class _SyncStream:
    """A stream whose events are a plain iterator (as the scripted model's unpaced one)."""

    def __init__(self, events: Any) -> None:
        self._events = events
        self.closed = False

    @property
    def sync_events(self) -> Any:
        return self._events

    def __aiter__(self) -> "_SyncStream":
        return self

    async def __anext__(self) -> Any:
        for ev in self._events:
            return ev
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


class _Provider:
    name = "sync-test"

    def __init__(self, make: Any) -> None:
        self.make = make
        self.opened: list[_SyncStream] = []

    def stream(self, **kw: Any) -> _SyncStream:
        s = _SyncStream(self.make())
        self.opened.append(s)
        return s


def _events_then(error: BaseException | None, *, output: bool, finish: bool = True):
    def gen():
        if output:
            yield TextDelta("hel", 0)
            yield TextDelta("lo", 0)
        if error is not None:
            raise error
        if finish:
            yield Finish("end_turn", Usage(3, 2))
    return gen


def _no_scope() -> trio.CancelScope:  # a sync stream gets none: never called
    raise AssertionError("a stream that cannot wait got a cancel scope")


async def _call(provider: Any, on_event: Any = None):
    return await call_model(provider, system="s", messages=[M.user("hi")], tools=[], on_event=on_event,
                            cancel_scope=_no_scope)


async def test_a_sync_stream_makes_the_message_and_hands_on_every_event():
    seen: list[Any] = []
    p = _Provider(_events_then(None, output=True))
    msg = await _call(p, seen.append)
    assert msg["content"] == [{"type": "text", "text": "hello"}] and msg["stop_reason"] == "end_turn"
    assert [type(e).__name__ for e in seen] == ["TextDelta", "TextDelta", "Finish"]
    assert p.opened[0].closed  # closed as stream_model closes it


async def test_a_sync_stream_failing_after_output_is_broken_not_retried():
    p = _Provider(_events_then(ConnectionError("reset"), output=True))
    with pytest.raises(StreamBrokenError):
        await _call(p)
    assert len(p.opened) == 1


async def test_a_sync_stream_failing_before_output_is_classified_and_retried():
    calls = []

    def make():
        calls.append(1)
        if len(calls) == 1:
            return _events_then(ConnectionError("refused"), output=False)()
        return _events_then(None, output=True)()

    p = _Provider(make)
    msg = await call_model(p, system="s", messages=[M.user("hi")], tools=[], cancel_scope=trio.CancelScope,
                           clock=Clock(time.time))
    assert M.text_of(msg) == "hello" and len(calls) == 2


async def test_a_sync_stream_with_a_provider_error_or_no_finish():
    p = _Provider(_events_then(PermanentProviderError("bad request"), output=False))
    with pytest.raises(PermanentProviderError):
        await _call(p)
    p = _Provider(_events_then(TransientProviderError("overloaded"), output=True))
    with pytest.raises(StreamBrokenError):
        await _call(p)
    p = _Provider(_events_then(None, output=True, finish=False))
    with pytest.raises(StreamBrokenError):
        await _call(p)
    p = _Provider(_events_then(None, output=False, finish=False))
    with pytest.raises(TransientProviderError):  # nothing shown yet: a transient connection error
        await call_model(p, system="s", messages=[M.user("hi")], tools=[], cancel_scope=_no_scope,
                         policy=__import__("loop.retry", fromlist=["RetryPolicy"]).RetryPolicy(max_retries=0))


async def test_an_error_of_the_caller_is_not_classified():
    class Stop(Exception):
        pass

    def on_event(ev: Any) -> None:
        raise Stop()

    p = _Provider(_events_then(None, output=True))
    with pytest.raises(Stop):
        await _call(p, on_event)
    assert p.opened[0].closed


async def test_the_scripted_model_through_the_sync_path_gives_what_stream_model_gives():
    model = ScriptedModel([reply("", tool_call("noop")), reply("done")])
    a = await call_model(model, system="s", messages=[M.user("hi")], tools=[], cancel_scope=_no_scope)
    b = await call_model(model, system="s", messages=[M.user("hi")], tools=[])  # (no factory: stream_model)
    model2 = ScriptedModel([reply("", tool_call("noop")), reply("done")])
    c = await call_model(model2, system="s", messages=[M.user("hi")], tools=[])
    d = await call_model(model2, system="s", messages=[M.user("hi")], tools=[], cancel_scope=_no_scope)
    assert a == c and b == d
    assert [p["type"] for p in a["content"]] == ["tool_call"]
    assert isinstance(ToolCallStart, type) and isinstance(ToolCallDelta, type)


# ---------------------------------------------------------------- clocks, a run id, usage


async def test_trio_now_is_trios_clock():
    for _ in range(2):
        a = trio.current_time()
        b = trio_now()
        assert a <= b <= trio.current_time()
        await trio.sleep(0.01)
    assert trio.lowlevel.current_clock().current_time() >= b + 0.01


def test_trio_now_with_a_mock_clock_and_clock_now_outside_trio():
    async def main() -> tuple[float, float, float]:
        a = trio_now()
        await trio.sleep(5)
        return a, trio_now(), SYSTEM_CLOCK.now()

    clock = trio.testing.MockClock(autojump_threshold=0)
    a, b, wall_in_run = trio.run(main, clock=clock)
    assert b - a == 5
    assert abs(wall_in_run - time.time()) < 60  # mapped onto wall time
    with pytest.raises(RuntimeError):
        trio_now()
    c = Clock(lambda: 123.0)
    assert c.now() == 123.0  # outside trio: the wall clock


def test_clock_now_moves_with_trios_clock():
    c = Clock(lambda: 1_000.0)

    async def main() -> tuple[float, float]:
        a = c.now()
        await trio.sleep(2.5)
        return a, c.now()

    a, b = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert a == 1_000.0 and b == 1_002.5


def test_a_run_ids_cbor_by_hand_is_cbor2s():
    for s in ["", "r", "run-0001", "x" * 23, "x" * 24, "é" * 100, "y" * 300, "z" * 70_000, "\U0001f600" * 7]:
        assert _cbor_text(s) == dumps(s) == cbor2.dumps(s)


async def test_usage_figures_recorded_are_the_plain_non_negative_ints(tmp_path):
    from loop import Runtime

    class Sub(int):
        pass

    recorded: dict[str, Any] = {}
    async with Runtime.open(f"lmdb:{tmp_path / 'data'}") as rt:
        store = rt.store

        class Usage_:
            async def record_tr(self, tr, run_id, step, figures, **kw):
                recorded.update(figures)
                return True

        class Ledger_:
            usage = Usage_()

        fake = type("S", (), {"ledger": Ledger_()})()
        claim = type("C", (), {"run_id": "r1"})()
        await type(store).record_usage(fake, None, claim, "model-1",
                                       {"input_tokens": 3, "output_tokens": 0, "neg": -1, "flag": True,
                                        "sub": Sub(4), "f": 1.5, "s": "x"})
    assert recorded == {"input_tokens": 3, "output_tokens": 0, "sub": 4}
    assert type(recorded["sub"]) is int


# ---------------------------------------------------------------- the scripted model's common reply


def test_a_plain_scripted_reply_streams_as_the_general_path_streams_it():
    from loop.providers.scripted import _reply_events

    ctx = [M.user("hello there"), M.assistant("", [{"type": "tool_call", "id": "c0", "name": "t", "arguments": {"a": 1}}])]
    replies = [reply("done"), reply("", tool_call("noop")), reply("x" * 50, tool_call("a", {"k": "v"}), tool_call("b")),
               reply("", tool_call("a", id="fixed")), reply(""), reply("hi", stop_reason="max_tokens"),
               reply("u", usage=Usage(7, 3))]
    for r in replies:
        fast = list(_reply_events(r, system="sys", messages=ctx, chunk=16))
        general = list(_reply_events(r, system="sys", messages=ctx, chunk=16, max_tokens=10**9))  # (never cut)
        assert fast == general, r
        assert isinstance(fast[-1], Finish)
