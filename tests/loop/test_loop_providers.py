"""The HTTP providers against a local server speaking their exact wire formats.

Every classification path (transient, overflow, permanent, broken after
output) through the real httpx client and SSE parser, and retry/backoff on
trio's virtual clock.
"""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest
import trio

from fake_providers import (
    FakeBreak,
    FakeError,
    FakeReply,
    FakeStreamError,
    context_length_exceeded,
    overloaded,
    prompt_too_long,
    rate_limited,
    server_error,
)
from loop import messages as M
from loop.calls import call_model
from loop.errors import (
    ContextOverflowError,
    PermanentProviderError,
    StreamBrokenError,
    TransientProviderError,
)
from loop.providers import (
    AnthropicProvider,
    Finish,
    OpenAIProvider,
    ResponseBuilder,
    TextDelta,
    ToolCallStart,
    ToolSpec,
    stream_model,
)
from loop.retry import RetryPolicy

DIALECTS = ["anthropic", "openai"]
TOOLS = [ToolSpec("lookup", "Look a city up.", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]


def make(dialect: str, server, **kw):
    # timeout=None: no deadlines besides the ones under test (virtual clock safe)
    if dialect == "anthropic":
        return AnthropicProvider("claude-test", base_url=server.base_url, api_key="sk-ant-test", timeout=None, **kw)
    return OpenAIProvider("gpt-test", base_url=server.base_url + "/v1", api_key="sk-test", timeout=None, **kw)


async def collect(provider, messages=None, tools=TOOLS, system="Be brief."):
    events = []
    b = ResponseBuilder()
    async for ev in stream_model(provider, system=system, messages=messages or [M.user("hi")], tools=tools):
        events.append(ev)
        b.add(ev)
    return events, b.message()


async def test_anthropic_text_stream_and_request_shape(fake_server):
    fake_server.enqueue(FakeReply("Hello there, traveller.", input_tokens=21, output_tokens=9))
    p = make("anthropic", fake_server)
    events, msg = await collect(p)
    await p.aclose()
    assert M.text_of(msg) == "Hello there, traveller."
    assert sum(isinstance(e, TextDelta) for e in events) >= 4  # streamed in pieces
    assert msg["stop_reason"] == "end_turn"
    assert msg["usage"] == {"input_tokens": 21, "output_tokens": 9}
    req = fake_server.requests[0]
    assert req.method == "POST" and req.path == "/v1/messages"
    assert req.headers["x-api-key"] == "sk-ant-test"
    assert req.headers["anthropic-version"] == "2023-06-01"
    assert req.body["stream"] is True and req.body["system"] == "Be brief."
    assert req.body["model"] == "claude-test" and req.body["max_tokens"] > 0
    assert req.body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert req.body["tools"][0] == {"name": "lookup", "description": "Look a city up.", "input_schema": TOOLS[0].parameters}


async def test_anthropic_tool_calls_from_input_json_deltas(fake_server):
    fake_server.enqueue(
        FakeReply("Let me check.", tool_calls=[("toolu_01A", "lookup", {"city": "Zürich", "n": [1, 2]}), ("toolu_01B", "lookup", {"city": "Oslo"})])
    )
    p = make("anthropic", fake_server)
    events, msg = await collect(p)
    await p.aclose()
    calls = M.tool_calls_of(msg)
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
        ("toolu_01A", "lookup", {"city": "Zürich", "n": [1, 2]}),
        ("toolu_01B", "lookup", {"city": "Oslo"}),
    ]
    assert msg["stop_reason"] == "tool_use"
    assert isinstance(events[-1], Finish)


async def test_anthropic_sends_history_with_tool_results(fake_server):
    fake_server.enqueue(FakeReply("done"))
    history = [
        M.user("weather?"),
        M.assistant("checking", [{"id": "t1", "name": "lookup", "arguments": {"city": "Oslo"}}]),
        M.tool_results([M.tool_result("t1", "lookup", {"temp": 3}), M.tool_result("t2", "lookup", "boom", is_error=True)]),
        {"role": "error", "error": {"type": "permanent"}},  # the loop's own record: not sent
        M.user("thanks"),
    ]
    p = make("anthropic", fake_server)
    await collect(p, messages=history)
    await p.aclose()
    sent = fake_server.requests[0].body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"][1] == {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"city": "Oslo"}}
    assert sent[2]["content"][0] == {"type": "tool_result", "tool_use_id": "t1", "content": '{"temp":3}'}
    assert sent[2]["content"][1]["is_error"] is True
    assert sent[2]["content"][2] == {"type": "text", "text": "thanks"}


async def test_openai_text_tool_calls_and_usage(fake_server):
    fake_server.enqueue(FakeReply("On it.", tool_calls=[("call_abc", "lookup", {"city": "Lima"})], input_tokens=30, output_tokens=12))
    p = make("openai", fake_server)
    events, msg = await collect(p)
    await p.aclose()
    assert M.text_of(msg) == "On it."
    assert M.tool_calls_of(msg) == [{"type": "tool_call", "id": "call_abc", "name": "lookup", "arguments": {"city": "Lima"}}]
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 30, "output_tokens": 12}
    assert [type(e).__name__ for e in events if isinstance(e, ToolCallStart)] == ["ToolCallStart"]
    req = fake_server.requests[0]
    assert req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-test"
    assert req.body["stream"] is True and req.body["stream_options"] == {"include_usage": True}
    assert req.body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert req.body["tools"][0]["function"]["name"] == "lookup"


async def test_openai_sends_tool_history(fake_server):
    fake_server.enqueue(FakeReply("ok"))
    history = [
        M.user("q"),
        M.assistant("", [{"id": "c1", "name": "lookup", "arguments": {"city": "A"}}]),
        M.tool_results([M.tool_result("c1", "lookup", "sunny")]),
    ]
    p = make("openai", fake_server)
    await collect(p, messages=history, system="")
    await p.aclose()
    sent = fake_server.requests[0].body["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "A"}'}}],
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(
    "scripted, cls, status",
    [
        (rate_limited("3"), TransientProviderError, 429),
        (overloaded(), TransientProviderError, 529),
        (server_error(500), TransientProviderError, 500),
        (server_error(503), TransientProviderError, 503),
        (FakeError(408, message="timeout"), TransientProviderError, 408),
        (FakeError(409, message="conflict"), TransientProviderError, 409),
        (FakeError(401, error_type="authentication_error", message="invalid x-api-key"), PermanentProviderError, 401),
        (FakeError(400, error_type="invalid_request_error", message="messages: field required"), PermanentProviderError, 400),
        (FakeError(404, error_type="not_found_error", message="model: claude-nope"), PermanentProviderError, 404),
        (prompt_too_long(), ContextOverflowError, 400),
        (context_length_exceeded(), ContextOverflowError, 400),
    ],
)
async def test_http_error_classification(fake_server, dialect, scripted, cls, status):
    fake_server.enqueue(scripted)
    p = make(dialect, fake_server)
    with pytest.raises(cls) as ei:
        await collect(p)
    await p.aclose()
    assert type(ei.value) is cls
    assert ei.value.status == status
    assert ei.value.provider == p.name


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_retry_after_seconds_and_http_date(fake_server, dialect):
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    fake_server.enqueue(rate_limited("7"), rate_limited(when), FakeError(429, headers={"retry-after-ms": "1500"}))
    p = make(dialect, fake_server)
    got = []
    for _ in range(3):
        with pytest.raises(TransientProviderError) as ei:
            await collect(p)
        got.append(ei.value.retry_after)
    await p.aclose()
    assert got[0] == 7.0
    assert 100 < got[1] <= 121
    assert got[2] == 1.5


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_stream_broken_after_output(fake_server, dialect):
    # 6 events: past the preamble, some text has streamed
    fake_server.enqueue(FakeBreak(FakeReply("a fairly long answer that will break"), after=6))
    p = make(dialect, fake_server)
    seen = []
    with pytest.raises(StreamBrokenError) as ei:
        async for ev in stream_model(p, system="", messages=[M.user("x")], tools=[]):
            seen.append(ev)
    await p.aclose()
    assert any(isinstance(e, TextDelta) and e.text for e in seen)
    assert isinstance(ei.value.cause, TransientProviderError)  # the transport error, kept
    assert ei.value.kind == "stream_broken"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_stream_broken_before_output_is_transient(fake_server, dialect):
    fake_server.enqueue(FakeBreak(FakeReply("never seen"), after=1))  # only the preamble event
    p = make(dialect, fake_server)
    with pytest.raises(TransientProviderError) as ei:
        await collect(p)
    await p.aclose()
    assert type(ei.value) is TransientProviderError


async def test_anthropic_in_stream_error_event(fake_server):
    fake_server.enqueue(
        FakeStreamError(FakeReply("partial"), after=2),  # message_start, ping, then error: no output yet
        FakeStreamError(FakeReply("partial output here"), after=5),
        FakeStreamError(FakeReply("x"), after=2, error_type="invalid_request_error", message="bad thing"),
    )
    p = make("anthropic", fake_server)
    with pytest.raises(TransientProviderError) as ei:
        await collect(p)
    assert type(ei.value) is TransientProviderError and ei.value.error_type == "overloaded_error"
    with pytest.raises(StreamBrokenError) as ei2:
        await collect(p)
    assert ei2.value.cause.error_type == "overloaded_error"
    with pytest.raises(PermanentProviderError):
        await collect(p)
    await p.aclose()


async def test_openai_in_stream_error_chunk(fake_server):
    fake_server.enqueue(FakeStreamError(FakeReply("partial"), after=1, error_type="server_error", message="upstream failed"))
    p = make("openai", fake_server)
    with pytest.raises(TransientProviderError):
        await collect(p)
    await p.aclose()


async def test_connection_refused_is_transient():
    # bind then close a port: nothing listens there
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    p = AnthropicProvider("m", base_url=f"http://127.0.0.1:{port}", api_key="k", timeout=None)
    with pytest.raises(TransientProviderError) as ei:
        await collect(p)
    await p.aclose()
    assert ei.value.error_type == "connection_error"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_call_model_retries_on_virtual_clock(fake_server, dialect, autojump_clock):
    fake_server.enqueue(rate_limited("3"), overloaded(), FakeReply("finally"))
    p = make(dialect, fake_server)
    notices = []

    async def on_retry(n):
        notices.append(n)

    t0 = trio.current_time()
    msg = await call_model(p, system="", messages=[M.user("x")], tools=[], policy=RetryPolicy(jitter=0), on_retry=on_retry)
    await p.aclose()
    assert M.text_of(msg) == "finally"
    assert [(n.attempt, n.max_attempts) for n in notices] == [(1, 4), (2, 4)]
    # retry 1: max(2 s backoff, retry-after 3 s); retry 2: 4 s (no retry-after)
    assert [n.delay for n in notices] == [3.0, 4.0]
    assert trio.current_time() - t0 == pytest.approx(7.0)
    assert [type(n.error).__name__ for n in notices] == ["TransientProviderError"] * 2
    assert len(fake_server.requests) == 3


async def test_call_model_gives_up_after_max_retries(fake_server, autojump_clock):
    fake_server.enqueue(*[server_error(500)] * 5)
    p = make("anthropic", fake_server)
    notices = []

    async def on_retry(n):
        notices.append(n)

    t0 = trio.current_time()
    with pytest.raises(TransientProviderError):
        await call_model(p, system="", messages=[M.user("x")], tools=[], policy=RetryPolicy(jitter=0), on_retry=on_retry)
    await p.aclose()
    assert len(fake_server.requests) == 4  # 1 + 3 retries
    assert [n.delay for n in notices] == [2.0, 4.0, 8.0]
    assert trio.current_time() - t0 == pytest.approx(14.0)


@pytest.mark.parametrize(
    "first, exc",
    [
        (FakeBreak(FakeReply("streamed then broken, long enough"), after=6), StreamBrokenError),
        (prompt_too_long(), ContextOverflowError),
        (FakeError(400, message="bad"), PermanentProviderError),
    ],
)
async def test_call_model_does_not_retry_non_transient(fake_server, autojump_clock, first, exc):
    fake_server.enqueue(first, FakeReply("should not be reached"))
    p = make("anthropic", fake_server)
    with pytest.raises(exc):
        await call_model(p, system="", messages=[M.user("x")], tools=[])
    await p.aclose()
    assert len(fake_server.requests) == 1


async def test_call_model_resumes_retry_count(fake_server, autojump_clock):
    """A retry sequence resumed after a crash does not get a fresh set of retries."""
    fake_server.enqueue(server_error(), server_error(), FakeReply("late"))
    p = make("openai", fake_server)
    with pytest.raises(TransientProviderError):
        await call_model(p, system="", messages=[M.user("x")], tools=[], policy=RetryPolicy(jitter=0), retries_done=2)
    await p.aclose()
    assert len(fake_server.requests) == 2  # attempt 3 and attempt 4, then exhausted


async def test_custom_client_and_extra_headers(fake_server):
    fake_server.enqueue(FakeReply("ok"))
    async with httpx.AsyncClient() as client:
        p = OpenAIProvider("local", base_url=fake_server.base_url, api_key="", client=client, extra_headers={"x-trace": "1"})
        _, msg = await collect(p)
        await p.aclose()  # not ours: must stay open
        assert not client.is_closed
    req = fake_server.requests[0]
    assert "authorization" not in req.headers  # no key: local servers need none
    assert req.headers["x-trace"] == "1"
    assert M.text_of(msg) == "ok"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_runtime_over_the_wire_retries_then_completes(fake_server, dialect, autojump_clock):
    """The whole loop against the fake provider: 529 then 429 (retry-after 3) are journaled as
    run.retry-pending and never reach the transcript; the tool call and final answer stream
    over the real wire format."""
    from loop import Agent, Runtime, tool

    @tool
    def lookup(city: str) -> str:
        """Weather for a city."""
        return f"{city}: sunny"

    fake_server.enqueue(
        overloaded(),
        rate_limited("3"),
        FakeReply("Checking.", tool_calls=[("call_w1", "lookup", {"city": "Oslo"})]),
        FakeReply("It is sunny in Oslo."),
    )
    agent = Agent("w", "Be brief.", make(dialect, fake_server), tools=[lookup], retry=RetryPolicy(jitter=0))
    async with Runtime.open("memory:") as rt:
        t0 = trio.current_time()
        out = await rt.run(agent, "wire", "weather in Oslo?")
        assert out.ok and out.result == "It is sunny in Oslo."
        assert trio.current_time() - t0 >= 5.0  # 2 s backoff, then max(4 s, retry-after 3 s)... at least 2 + 3
        page = await rt.read_events("wire", limit=1000)
        retries = [e.data for e in page.events if e.type == "run.retry-pending"]
        assert [(r["attempt"], r["error"]["status"]) for r in retries] == [(2, 529), (3, 429)]
        assert [r["delay"] for r in retries] == [2.0, 4.0]
        msgs = await rt.transcript("wire")
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert msgs[2]["content"][0]["content"] == "Oslo: sunny"
        assert msgs[1]["usage"] == {"input_tokens": 11, "output_tokens": 7}
    assert len(fake_server.requests) == 4
    last = fake_server.requests[-1].body
    # the tool result went back to the model in the dialect's own shape
    if dialect == "anthropic":
        assert last["messages"][-1]["content"][0] == {"type": "tool_result", "tool_use_id": "call_w1", "content": "Oslo: sunny"}
    else:
        assert last["messages"][-1] == {"role": "tool", "tool_call_id": "call_w1", "content": "Oslo: sunny"}
