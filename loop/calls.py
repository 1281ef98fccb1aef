"""One model call with the retry policy applied: the piece between the loop and a provider.

:func:`call_model` streams a call, feeding each event to ``on_event`` (the
durable loop journals them as part.added / part.updated), and retries
transient failures that happened before any output.  Before each backoff
wait it awaits ``on_retry`` — the durable loop persists ``run.retry-pending``
there, with the wall-clock time of the next attempt, *before* sleeping, so a
crash during the wait is resumed at the right moment and the error itself
never reaches the transcript (promise 8).

Context overflow and permanent errors are raised to the caller (the loop
compacts, or records the failure); so is :class:`StreamBrokenError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

import trio

from .errors import ProviderError, TransientProviderError
from .messages import Message
from .providers.base import (Finish, Provider, ResponseBuilder, StreamEvent, ToolSpec, _is_output, stream_failure,
                             stream_model, stream_unfinished)
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy

__all__ = ["RetryNotice", "call_model", "Clock", "SYSTEM_CLOCK", "trio_now"]

log = logging.getLogger(__name__)

try:
    # trio's per-thread run context (an internal of trio's, there through 0.32): its ``runner``
    # attribute exists only inside a run. Read directly, the run's clock costs no frames of
    # trio's public wrappers (``current_clock``/``current_time``: two Python calls each, and a
    # turn reads the clock ~16 times); without it, the public functions are used.
    from trio._core._run import GLOBAL_RUN_CONTEXT as _RUN_CONTEXT
except ImportError:  # pragma: no cover — another trio: the public path
    _RUN_CONTEXT = None


def trio_now() -> float:
    """``trio.current_time()``: the current run's clock, read without trio's wrappers."""
    runner = getattr(_RUN_CONTEXT, "runner", None)
    return runner.clock.current_time() if runner is not None else trio.current_time()


class Clock:
    """Wall time for records (``now``) and waiting (``sleep_until``), swappable in tests.

    The default maps trio's clock onto wall time once per trio run (at the run's first
    ``now``), so a trio ``MockClock`` makes every wait and every recorded time virtual
    together, and within a run ``now`` moves exactly as trio's clock does.

    Once per *run*, not once per Clock: trio starts each run's ``SystemClock`` at a random
    offset (10,000 to 200,000 s), so an offset kept from an earlier ``trio.run`` of the same
    process (``SYSTEM_CLOCK`` is shared by every runtime) put every later run's times off by
    up to ~190,000 s: lease expiries another process compares with its own wall clock (a
    live run taken over at once, or a dead one's runs held for days), journal timestamps,
    retry times.
    """

    def __init__(self, wall: Callable[[], float] | None = None) -> None:
        import time

        self._wall = wall or time.time
        self._clock: trio.abc.Clock | None = None  # the trio clock ``_offset`` maps (its run's)
        self._offset = 0.0

    def now(self) -> float:
        """Seconds since the epoch (virtual when trio's clock is)."""
        runner = getattr(_RUN_CONTEXT, "runner", None)
        if runner is not None:
            clock = runner.clock
        else:
            try:
                clock = trio.lowlevel.current_clock()
            except RuntimeError:  # outside trio
                return self._wall()
        if clock is not self._clock:  # this run's first call (see the class docstring)
            self._clock = clock
            self._offset = self._wall() - clock.current_time()
        return self._offset + clock.current_time()

    async def sleep_until(self, wall_time: float) -> None:
        await trio.sleep(max(0.0, wall_time - self.now()))


SYSTEM_CLOCK = Clock()


@dataclass(frozen=True)
class RetryNotice:
    """Handed to ``on_retry``: what failed and when the next attempt is."""

    error: ProviderError
    attempt: int  # the attempt that failed (1-based)
    max_attempts: int  # 1 + policy.max_retries
    delay: float
    next_attempt_at: float  # wall-clock seconds


async def call_model(
    provider: Provider,
    *,
    system: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    max_tokens: int | None = None,
    stream_options: Mapping[str, Any] | None = None,
    policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    on_event: Callable[[StreamEvent], Awaitable[None] | None] | None = None,
    on_retry: Callable[[RetryNotice], Awaitable[None]] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    retries_done: int = 0,
    resume_at: float | None = None,
    cancel_scope: Callable[[], trio.CancelScope] | None = None,
) -> Message | None:
    """The assistant message of one model call, after transient retries.

    ``retries_done`` resumes a retry sequence interrupted by a crash (the
    durable loop knows it from the journal), so a restart does not grant a
    fresh set of retries, and ``resume_at`` (the persisted ``nextAttemptAt``)
    makes it wait out the backoff that was running when the process died.

    ``stream_options``: the provider's extra keywords for a call clamped under a usage
    ceiling (``capped_call_options``); every retry is sent with the same ones.

    ``cancel_scope``: makes the cancel scope the call may be cancelled through, entered
    around each part of the call that can wait (a backoff sleep; a provider stream, unless
    it has ``sync_events``, as the scripted model's unpaced one does) instead of one scope
    the caller enters around the whole call. The same cancellation (trio delivers one only
    where a task waits), without a scope (~48k instructions entered and left) around a
    stream that cannot wait. None is returned when one of them caught a cancellation. The
    caller makes each new scope cancelled if a cancel came meanwhile (the durable loop:
    ``Runner._new_call_scope``). Without it, nothing here makes a cancel scope.
    """
    if resume_at is not None and not await _sleep_until(clock, resume_at, cancel_scope):
        return None
    attempt = retries_done + 1
    max_attempts = 1 + policy.max_retries
    while True:
        builder = ResponseBuilder()
        try:
            if cancel_scope is None:
                await _read(provider, builder, system, messages, tools, max_tokens, stream_options, on_event)
            else:
                # (an error of this call itself propagates unclassified, as from stream_model)
                opened = provider.stream(system=system, messages=messages, tools=tools, max_tokens=max_tokens,
                                         **(stream_options or {}))
                events = getattr(opened, "sync_events", None)
                if events is not None:  # cannot wait: nothing to cancel
                    await _read_sync(provider, builder, opened, events, on_event)
                else:
                    with cancel_scope() as cs:
                        await _read(provider, builder, system, messages, tools, max_tokens, stream_options,
                                    on_event, opened)
                    if cs.cancelled_caught:
                        return None
            return builder.message()
        except TransientProviderError as e:
            # After output, stream_model raised StreamBrokenError instead: never here.
            if not policy.should_retry(e, attempt - 1):
                raise
            delay = policy.delay(attempt, e)
            notice = RetryNotice(e, attempt, max_attempts, delay, clock.now() + delay)
            log.info("%s: %s; retry %d/%d in %.2fs", getattr(provider, "name", "?"), e.message, attempt, policy.max_retries, delay)
            if on_retry is not None:
                await on_retry(notice)
            if not await _sleep_until(clock, notice.next_attempt_at, cancel_scope):
                return None
            attempt += 1


async def _sleep_until(clock: Clock, at: float, cancel_scope: Callable[[], trio.CancelScope] | None) -> bool:
    """A backoff wait, inside a scope made by ``cancel_scope`` if given; False when that scope
    caught a cancellation (the call is then abandoned: ``call_model`` returns None)."""
    if cancel_scope is None:
        await clock.sleep_until(at)
        return True
    with cancel_scope() as cs:
        await clock.sleep_until(at)
    return not cs.cancelled_caught


async def _read_sync(
    provider: Provider,
    builder: ResponseBuilder,
    opened: Any,
    events: Any,
    on_event: Callable[[StreamEvent], Awaitable[None] | None] | None,
) -> None:
    """:func:`_read` of a stream whose events need no waiting (``opened.sync_events``, the
    scripted model's unpaced one): the same events, errors and checks as ``stream_model``
    reading it, without an async generator between (trio registers each one it sees start,
    and every event passes through its ``asend``). Only the iterator's own errors are
    classified, as ``stream_model``'s are: what ``builder`` or ``on_event`` raise (a failed
    flush) propagates as it would from the body of an ``async for`` over ``stream_model``."""
    output = False
    finished = False
    it = iter(events)
    try:
        while True:
            try:
                ev = next(it)
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 — classified as stream_model classifies it
                err = stream_failure(provider, e, output)
                if err is e:
                    raise
                raise err from e
            if isinstance(ev, Finish):
                finished = True
            elif not output and _is_output(ev):  # (once output, always: no need to ask again)
                output = True
            builder.add(ev)
            if on_event is not None:
                r = on_event(ev)
                if r is not None:
                    await r
    finally:
        aclose = getattr(opened, "aclose", None)
        if aclose is not None:
            await aclose()
    if not finished:
        raise stream_unfinished(provider, output)


async def _read(
    provider: Provider,
    builder: ResponseBuilder,
    system: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    max_tokens: int | None,
    stream_options: Mapping[str, Any] | None,
    on_event: Callable[[StreamEvent], Awaitable[None] | None] | None,
    opened: Any = None,
) -> None:
    """One attempt's stream, folded into ``builder``, each event handed to ``on_event``."""
    async for ev in stream_model(provider, system=system, messages=messages, tools=tools, max_tokens=max_tokens,
                                  options=stream_options, opened=opened):
        builder.add(ev)
        if on_event is not None:
            r = on_event(ev)
            if r is not None:
                await r
