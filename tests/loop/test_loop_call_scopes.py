"""call_model's ``cancel_scope`` (session 16): a cancel scope only around the parts of a model
call that can wait, made by the caller's factory; a stream that cannot wait (``sync_events``,
the scripted model's unpaced one) gets none, since trio delivers a cancellation only where a
task waits — checked here against a scope around the whole call, as the loop had it."""

from __future__ import annotations

import random

import trio

from loop import messages as M
from loop.calls import SYSTEM_CLOCK, call_model
from loop.providers import ScriptedModel, reply, tool_call, transient
from loop.retry import RetryPolicy


class Scopes:
    """A ``cancel_scope`` factory that counts the scopes it made (cancelled up front when asked)."""

    def __init__(self, cancelled: bool = False) -> None:
        self.made: list[trio.CancelScope] = []
        self.cancelled = cancelled

    def __call__(self) -> trio.CancelScope:
        s = trio.CancelScope()
        if self.cancelled:
            s.cancel()
        self.made.append(s)
        return s


async def _call(model: ScriptedModel, **kw):
    return await call_model(model, system="s", messages=[M.user("hi")], tools=[], **kw)


async def test_an_unpaced_stream_gets_no_scope_and_its_message():
    scopes = Scopes()
    msg = await _call(ScriptedModel([reply("", tool_call("noop"))]), cancel_scope=scopes)
    assert scopes.made == []
    assert M.tool_calls_of(msg)[0]["name"] == "noop"


async def test_a_cancel_cannot_reach_an_unpaced_stream_with_or_without_a_scope():
    # A scope around the whole call, cancelled before it starts, as the loop had it: the
    # stream never waits, so the call still returns its message (nothing is delivered) ...
    with trio.CancelScope() as outer:
        outer.cancel()
        whole = await _call(ScriptedModel(["done"]))
    assert not outer.cancelled_caught and M.text_of(whole) == "done"
    # ... and so does the call given a factory whose scopes start cancelled: it makes none.
    scopes = Scopes(cancelled=True)
    assert M.text_of(await _call(ScriptedModel(["done"]), cancel_scope=scopes)) == "done"
    assert scopes.made == []


async def test_a_paced_stream_is_scoped_and_a_cancel_stops_it():
    scopes = Scopes()
    assert M.text_of(await _call(ScriptedModel(["done"], delay=0.01), cancel_scope=scopes)) == "done"
    assert len(scopes.made) == 1 and not scopes.made[0].cancelled_caught
    stopped = Scopes(cancelled=True)
    assert await _call(ScriptedModel(["done"], delay=0.01), cancel_scope=stopped) is None
    assert len(stopped.made) == 1 and stopped.made[0].cancelled_caught


async def test_a_failing_stream_waits_so_it_is_scoped():
    # The scripted failure streams after a schedule point (as a network call would): it is
    # scoped, and its backoff sleep is too; a cancel in that sleep ends the call (None).
    model = ScriptedModel([transient(), "done"])
    scopes = Scopes()
    notices = []

    async def on_retry(n):
        notices.append(n)
        scopes.cancelled = True  # a cancel noted while the retry notice is committed

    policy = RetryPolicy(max_retries=3, initial_delay=5.0, jitter=0.0, rng=random.Random(0))
    assert await _call(model, cancel_scope=scopes, policy=policy, on_retry=on_retry) is None
    assert len(notices) == 1 and model.n_calls == 1  # the second attempt was never made
    assert len(scopes.made) == 2 and not scopes.made[0].cancelled_caught and scopes.made[1].cancelled_caught


async def test_a_resumed_backoff_is_scoped():
    scopes = Scopes(cancelled=True)
    model = ScriptedModel(["done"])
    assert await _call(model, cancel_scope=scopes, resume_at=SYSTEM_CLOCK.now() + 3600) is None
    assert model.n_calls == 0 and len(scopes.made) == 1 and scopes.made[0].cancelled_caught
