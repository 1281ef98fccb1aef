"""Pure pieces of loop/: classification, retry policy, schemas, tools, agents, scripted models, specs, SSE."""

from __future__ import annotations

import dataclasses
import email.utils
import enum
import random
import time
from typing import Annotated, Literal, Optional, TypedDict

import httpx
import pytest
import trio

from loop import messages as M
from loop.agents import Agent, Hooks, Tool, ToolContext, tool
from loop.errors import (
    ContextOverflowError,
    ModelSpecError,
    PermanentProviderError,
    StreamBrokenError,
    ToolSchemaError,
    TransientProviderError,
    classify_exception,
    classify_http,
    parse_retry_after,
)
from loop.providers import (
    EchoModel,
    ModelSpec,
    ResponseBuilder,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
    broken,
    make_provider,
    overflow,
    parse_model_spec,
    permanent,
    reply,
    stream_model,
    tool_call,
    transient,
)
from loop.providers.anthropic import AnthropicProvider
from loop.providers.openai import OpenAIProvider
from loop.providers.sse import SSEParser
from loop.retry import RetryPolicy
from loop.schema import coerce, parse_docstring, schema_for_type, validate

# ---------------------------------------------------------------- classification


def test_parse_retry_after_forms():
    assert parse_retry_after("12") == 12.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("999999") == 600.0  # clamped
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("") is None
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28 <= parse_retry_after(date, now=now) <= 31
    past = email.utils.formatdate(now - 30, usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 529, 599])
def test_transient_statuses(status):
    e = classify_http(status, b'{"error": {"type": "x", "message": "m"}}')
    assert isinstance(e, TransientProviderError) and e.status == status and e.message == "m"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_permanent_statuses(status):
    assert type(classify_http(status, b"{}")) is PermanentProviderError


def test_overflow_detection():
    anth = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 201000 tokens > 200000 maximum"}}
    assert isinstance(classify_http(400, anth), ContextOverflowError)
    oai = {"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}
    assert isinstance(classify_http(400, oai), ContextOverflowError)
    vllm = {"object": "error", "message": "This model's maximum context length is 4096 tokens.", "type": "BadRequestError", "code": 400}
    assert isinstance(classify_http(400, vllm), ContextOverflowError)
    # "too long" in a 500 is a server failure, not an overflow
    assert type(classify_http(500, anth)) is TransientProviderError
    assert type(classify_http(400, {"error": {"message": "max_tokens: too large"}})) is PermanentProviderError


def test_in_stream_error_types():
    assert type(classify_http(None, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})) is TransientProviderError
    assert type(classify_http(None, {"error": {"type": "api_error"}})) is TransientProviderError
    assert type(classify_http(None, {"error": {"type": "invalid_request_error", "message": "x"}})) is PermanentProviderError


def test_classify_headers_and_garbage_body():
    e = classify_http(429, "<html>nginx</html>", {"Retry-After": "9"})
    assert isinstance(e, TransientProviderError) and e.retry_after == 9.0 and "nginx" in e.message
    e = classify_http(503, None, {"retry-after-ms": "250", "retry-after": "9"})
    assert e.retry_after == 0.25
    assert classify_http(502, b"").message == "HTTP 502"


def test_classify_exceptions():
    req = httpx.Request("POST", "http://x")
    for exc in [httpx.ConnectError("refused", request=req), httpx.ReadTimeout("t", request=req),
                httpx.RemoteProtocolError("peer closed", request=req), ConnectionResetError()]:
        assert type(classify_exception(exc)) is TransientProviderError
    assert type(classify_exception(KeyError("x"))) is PermanentProviderError
    te = TransientProviderError("t")
    assert classify_exception(te) is te


def test_error_to_dict_roundtrip_fields():
    cause = TransientProviderError("reset", status=None, error_type="connection_error")
    d = StreamBrokenError("broke", cause=cause).to_dict()
    assert d["type"] == "stream_broken" and d["cause"]["type"] == "transient"


# ---------------------------------------------------------------- retry policy


def test_retry_policy_defaults_and_decisions():
    p = RetryPolicy(jitter=0)
    t = TransientProviderError("x")
    assert [p.should_retry(t, n) for n in range(5)] == [True, True, True, False, False]
    assert not p.should_retry(t, 0, output_started=True)
    assert not p.should_retry(StreamBrokenError("b", cause=t), 0)
    assert not p.should_retry(PermanentProviderError("p"), 0)
    assert not p.should_retry(ContextOverflowError("o"), 0)
    assert p.should_compact(ContextOverflowError("o"), 0) and not p.should_compact(ContextOverflowError("o"), 1)
    assert [p.delay(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert p.delay(1, TransientProviderError("x", retry_after=30)) == 30.0
    assert p.delay(3, TransientProviderError("x", retry_after=1)) == 8.0  # never shorter than our own schedule
    assert RetryPolicy(jitter=0, max_delay=5).delay(10) == 5.0


def test_retry_policy_jitter_bounded_and_seedable():
    a = RetryPolicy(jitter=0.25, rng=random.Random(7))
    b = RetryPolicy(jitter=0.25, rng=random.Random(7))
    da = [a.delay(n) for n in (1, 2, 3)]
    assert da == [b.delay(n) for n in (1, 2, 3)]
    for d, base in zip(da, (2, 4, 8)):
        assert base * 0.75 <= d <= base * 1.25
    assert len(set(da)) == 3


# ---------------------------------------------------------------- schemas


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Point:
    """A point on the plane."""

    x: float
    y: float = 0.0


class Filter(TypedDict):
    field: str
    value: int


def test_schema_for_types():
    assert schema_for_type(Optional[int]) == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert schema_for_type(list[str]) == {"type": "array", "items": {"type": "string"}}
    assert schema_for_type(dict[str, int]) == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert schema_for_type(Literal[1, 2]) == {"enum": [1, 2], "type": "integer"}
    assert schema_for_type(Color) == {"enum": ["red", "blue"], "type": "string"}
    assert schema_for_type(Annotated[str, "a name"]) == {"type": "string", "description": "a name"}
    pt = schema_for_type(Point)
    assert pt["required"] == ["x"] and pt["description"] == "A point on the plane."
    assert schema_for_type(Filter)["required"] == ["field", "value"]
    assert schema_for_type(tuple[int, str])["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    with pytest.raises(ToolSchemaError):
        schema_for_type(dict[int, str])
    with pytest.raises(ToolSchemaError):
        schema_for_type(object)


def test_docstring_parsing():
    desc, params = parse_docstring(
        """Search the catalogue.

        Longer text.

        Args:
            query: What to look for,
                across lines.
            limit (int): At most this many.

        Returns:
            matches.
        """
    )
    assert desc == "Search the catalogue.\n\nLonger text."
    assert params == {"query": "What to look for, across lines.", "limit": "At most this many."}


def test_validate_reports_paths():
    s = schema_for_type(list[Point])
    assert validate([{"x": 1}, {"x": 2.5, "y": 3}], s) == []
    errs = validate([{"y": 1}, {"x": "no"}, {"x": 1, "z": 0}], s)
    assert "$[0]: missing required property 'x'" in errs
    assert "$[1].x: expected number, got str" in errs
    assert "$[2]: unexpected property 'z'" in errs
    assert validate(True, {"type": "integer"}) == ["$: expected integer, got bool"]
    assert validate("abc", {"type": "string", "maxLength": 2, "pattern": "^a"}) == ["$: longer than 2"]
    assert validate(3, {"oneOf": [{"type": "integer"}, {"type": "number"}]})  # matches both
    assert validate(None, {"anyOf": [{"type": "string"}, {"type": "null"}]}) == []


def test_coerce_to_declared_types():
    assert coerce({"x": 1}, Point) == Point(1.0)
    assert isinstance(coerce({"x": 1}, Point).x, float)
    assert coerce("red", Color) is Color.RED
    assert coerce([{"x": 1, "y": 2}], list[Point]) == [Point(1, 2)]
    assert coerce([1, "a"], tuple[int, str]) == (1, "a")
    assert coerce({"x": 1}, Optional[Point]) == Point(1)


# ---------------------------------------------------------------- tools and agents


def test_tool_decorator_schema_and_context_param():
    @tool(requires_approval=True)
    def transfer(amount: float, to: str, memo: Optional[str] = None, ctx: ToolContext = None) -> str:
        """Move money.

        Args:
            amount: How much.
            to: Account id.
        """
        return f"{amount}->{to} {ctx.idempotency_key}"

    assert isinstance(transfer, Tool) and transfer.requires_approval and transfer.context_param == "ctx"
    assert transfer.description == "Move money."
    assert transfer.parameters["required"] == ["amount", "to"]
    assert "ctx" not in transfer.parameters["properties"]
    assert transfer.parameters["properties"]["amount"] == {"type": "number", "description": "How much."}
    assert transfer(1.0, "a", ctx=ToolContext(run_id="r", call_id="c")) == "1.0->a r:c"  # still a function
    assert transfer.check_arguments({"amount": "x"}) == [
        "$: missing required property 'to'",
        "$.amount: expected number, got str",
    ]
    assert transfer.check_arguments([1]) != []


def test_explicit_schema_and_bad_tools():
    t = tool(lambda **kw: kw, name="raw", schema={"type": "object", "properties": {"a": {"type": "string"}}})
    assert t.parameters["properties"] == {"a": {"type": "string"}}
    with pytest.raises(ToolSchemaError):
        tool(lambda *a: a, name="star")
    with pytest.raises(ToolSchemaError):
        tool(lambda: 1, name="bad name!")


async def test_tool_invoke_sync_async_and_coercion():
    calls = []

    def sync_tool(p: Point, colors: list[Color]) -> dict:
        calls.append(trio.lowlevel.current_trio_token if False else "thread")
        return {"x": p.x, "colors": [c.value for c in colors]}

    async def async_tool(n: int, ctx: ToolContext) -> int:
        return n + len(ctx.call_id)

    t1, t2 = tool(sync_tool), tool(async_tool)
    assert await t1.invoke({"p": {"x": 2}, "colors": ["red"]}) == {"x": 2.0, "colors": ["red"]}
    assert await t2.invoke({"n": 1}, ToolContext(call_id="abc")) == 4
    assert not t1.is_async and t2.is_async


async def test_tool_context_local_steps():
    ctx = ToolContext(run_id="r1", call_id="c1")
    n = []

    async def effect():
        n.append(1)
        return len(n)

    assert await ctx.step("charge", effect) == 1
    with pytest.raises(ValueError):
        await ctx.step("charge", effect)  # a name used twice in one call is refused
    assert ctx.idempotency_key == "r1:c1" and not ctx.cancelled
    ev = trio.Event()
    ctx2 = ToolContext(cancel_event=ev)
    ev.set()
    assert ctx2.cancelled


def test_agent_validation():
    def a(x: int) -> int:
        return x

    ag = Agent("helper", "Be helpful.", tools=[a])
    assert ag.get_tool("a").parameters["required"] == ["x"]
    assert [s.name for s in ag.tool_specs()] == ["a"]
    assert isinstance(ag.hooks, Hooks)
    with pytest.raises(ValueError):
        Agent("dup", tools=[a, tool(a)])
    with pytest.raises(ValueError):
        Agent("")


# ---------------------------------------------------------------- scripted / echo models


async def run_model(model, messages, tools=()):
    b = ResponseBuilder()
    events = []
    async for ev in stream_model(model, system="", messages=messages, tools=list(tools)):
        b.add(ev)
        events.append(ev)
    return b.message(), events


async def test_scripted_model_items_in_order():
    m = ScriptedModel(
        [
            transient(retry_after=2),
            overflow(),
            permanent("nope"),
            reply("checking", tool_call("lookup", {"city": "Oslo"})),
            "plain answer",
            broken("half an answer", after=1),
        ]
    )
    msgs = [M.user("x")]
    with pytest.raises(TransientProviderError) as ei:
        await run_model(m, msgs)
    assert ei.value.retry_after == 2
    with pytest.raises(ContextOverflowError):
        await run_model(m, msgs)
    with pytest.raises(PermanentProviderError):
        await run_model(m, msgs)
    msg, events = await run_model(m, msgs)
    assert M.tool_calls_of(msg) == [{"type": "tool_call", "id": "call_1_0", "name": "lookup", "arguments": {"city": "Oslo"}}]
    assert msg["stop_reason"] == "tool_use" and msg["usage"]["input_tokens"] > 0
    msg, _ = await run_model(m, msgs)
    assert M.text_of(msg) == "plain answer" and msg["stop_reason"] == "end_turn"
    with pytest.raises(StreamBrokenError):
        await run_model(m, msgs)
    with pytest.raises(PermanentProviderError, match="exhausted"):
        await run_model(m, msgs)
    assert len(m.calls) == 7


async def test_scripted_model_function_script_is_replayable():
    def script(messages, tools):
        return "done" if messages[-1]["role"] == "tool" else reply("", tool_call("t"))

    m = ScriptedModel(script)
    msg, _ = await run_model(m, [M.user("go")])
    assert M.tool_calls_of(msg)[0]["id"] == "call_1_0"
    msg2, _ = await run_model(ScriptedModel(script), [M.user("go")])  # a "restarted" model
    assert msg2 == msg


async def test_echo_model():
    e = EchoModel()
    msg, events = await run_model(e, [M.user("hello world, how are you")])
    assert M.text_of(msg) == "You said: hello world, how are you"
    assert sum(isinstance(x, TextDelta) for x in events) > 1

    def lookup(city: str) -> str:
        return city

    specs = Agent("a", tools=[lookup]).tool_specs()
    msg, _ = await run_model(e, [M.user("/lookup Paris")], specs)
    assert M.tool_calls_of(msg)[0]["arguments"] == {"city": "Paris"}
    msg, _ = await run_model(e, [M.user('/lookup {"city": "Rome"}')], specs)
    assert M.tool_calls_of(msg)[0]["arguments"] == {"city": "Rome"}
    msg, _ = await run_model(e, [M.user("/nosuch x")], specs)
    assert M.text_of(msg) == "You said: /nosuch x"
    after = [M.user("/lookup Paris"), msg, M.tool_results([M.tool_result("c", "lookup", "sunny")])]
    msg, _ = await run_model(e, after, specs)
    assert M.text_of(msg) == "Tool results:\nlookup: sunny"


def test_response_builder_orders_parts_and_keeps_bad_json():
    b = ResponseBuilder()
    for ev in [TextDelta("a"), TextDelta("b"), ToolCallStart(1, "c1", "t"), ToolCallDelta(1, '{"x":'), ToolCallDelta(1, "1}"),
               ToolCallStart(2, "c2", "u"), ToolCallDelta(2, "{oops"), TextDelta("after", 3)]:
        b.add(ev)
    msg = b.message()
    assert [p["type"] for p in msg["content"]] == ["text", "tool_call", "tool_call", "text"]
    assert msg["content"][0]["text"] == "ab"
    assert msg["content"][1]["arguments"] == {"x": 1}
    assert msg["content"][2]["arguments"] == {"_raw": "{oops"}
    assert "stop_reason" not in msg


# ---------------------------------------------------------------- specs and SSE


def test_model_specs():
    assert parse_model_spec("echo") == ModelSpec("echo")
    assert parse_model_spec("anthropic:claude-sonnet-4-5") == ModelSpec("anthropic", "claude-sonnet-4-5")
    assert parse_model_spec("openai:gpt-4o-mini") == ModelSpec("openai", "gpt-4o-mini")
    assert parse_model_spec("openai:llama3:8b@http://localhost:11434/v1") == ModelSpec("openai", "llama3:8b", "http://localhost:11434/v1")
    assert parse_model_spec("anthropic:m@2025@https://proxy.example/x") == ModelSpec("anthropic", "m@2025", "https://proxy.example/x")
    assert str(parse_model_spec("openai:q@http://h:1/v1")) == "openai:q@http://h:1/v1"
    for bad in ["", "gpt-4", "openai:", "other:m", "anthropic:@http://x"]:
        with pytest.raises(ModelSpecError):
            parse_model_spec(bad)
    assert isinstance(make_provider("echo"), EchoModel)
    p = make_provider("openai:m@http://127.0.0.1:9/v1", api_key="k")
    assert isinstance(p, OpenAIProvider) and p.base_url == "http://127.0.0.1:9/v1" and p.model == "m"
    assert isinstance(make_provider("anthropic:m", api_key="k"), AnthropicProvider)
    s = ScriptedModel([])
    assert make_provider(s) is s


def test_api_keys_from_environment(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-env-a")
    monkeypatch.setenv("OPENAI_API_KEY", "from-env-o")
    assert AnthropicProvider("m")._headers()["x-api-key"] == "from-env-a"
    assert OpenAIProvider("m")._headers()["authorization"] == "Bearer from-env-o"
    monkeypatch.delenv("OPENAI_API_KEY")
    assert "authorization" not in OpenAIProvider("m")._headers()


def test_sse_parser():
    lines = [": keep-alive", "event: message_start", 'data: {"a":', "data: 1}", "", "data: x", "id: 7", "", "event: ping", "data:{}"]
    evs = list(SSEParser().parse_all(lines))
    assert [(e.event, e.data, e.id) for e in evs] == [("message_start", '{"a":\n1}', None), ("message", "x", "7"), ("ping", "{}", "7")]  # the last id persists (WHATWG)


def test_loop_keys_are_the_tuple_encoding():
    import kv as _kv
    from loop.keyspace import LoopKeyspace

    k = LoopKeyspace(_kv.Subspace((b"root",)))
    for run_id in ("abc", "x\x00y", "é" * 40):
        assert k.state(run_id) == k.base.pack(("r", run_id))
        assert k.parked(run_id) == k.base.pack(("p", run_id))


async def test_scripted_model_without_recording_still_plays_its_script_in_order():
    from loop import ScriptedModel
    from loop import messages as M
    from loop.providers.base import TextDelta

    m = ScriptedModel(["one", "two"], record=False)
    texts = []
    for _ in range(2):
        parts = [ev.text async for ev in m.stream(system="s", messages=[M.user("hi")], tools=[])
                 if isinstance(ev, TextDelta)]
        texts.append("".join(parts))
    assert texts == ["one", "two"]
    assert m.n_calls == 2 and m.calls == []


async def test_a_scripted_stream_fails_inside_the_stream_classified_as_before():
    """ScriptedModel.stream returns the stream that plays its item (one generator layer): a
    script that raises, an exhausted script and a Fail item all fail from inside the stream,
    where stream_model classifies them (nothing escapes the call to provider.stream)."""
    def bad_script(messages, tools):
        raise KeyError("bug in a script")

    cases = [
        (ScriptedModel(bad_script), PermanentProviderError),
        (ScriptedModel([]), PermanentProviderError),
        (ScriptedModel([transient("busy")]), TransientProviderError),
        (ScriptedModel([permanent("no")]), PermanentProviderError),
    ]
    for model, exc in cases:
        with pytest.raises(exc):
            async for _ in stream_model(model, system="", messages=[M.user("x")], tools=[]):
                pass
        assert model.n_calls == 1
    evs = [ev async for ev in stream_model(ScriptedModel(["ok"]), system="", messages=[M.user("x")], tools=[])]
    assert [type(e).__name__ for e in evs] == ["TextDelta", "Finish"]
