"""loop — the agent loop: agents, model providers, tools, retry, compaction, approvals, recovery.

The embedded Runtime (what the server builds HTTP on)::

    async with Runtime.open("./surefoot-data", workers=4) as rt:
        ack = await rt.submit(agent, conversation, "hello", submission_id=key)
        #   -> Acknowledgement(submission_id, run_id, cursor, status, conversation, duplicate, outcome)
        outcome = await rt.wait(ack)            # or: outcome = await rt.run(agent, conversation, "hello")
        async for ev in rt.events(conversation, after=ack.cursor, owner=tag): ...   # replay, then live
        page = await rt.read_events(conversation, after=cursor)                   # one page, no waiting
        await rt.cancel(run_id)                 # durable, cooperative
        await rt.approve(run_id, call_id, allow=True, reason="ok")
        info = await rt.get_run(run_id)         # RunInfo(status, attempt, outcome, pending_approvals, ...)
        messages = await rt.transcript(conversation)
        new_id = await rt.fork(conversation, at=4)
        await rt.serve(workers=8)               # more claim loops, until cancelled

Every method takes ``owner=`` (an owner tag ``"realm/subject"``; default
``local/default``); a foreign run or conversation is the same NotFound as a
missing one.

Records: ``Outcome(run_id, status, result, text, error)`` (status completed |
failed | cancelled; ``error`` is ``{"type", "message", ...}`` — types include
transient, overflow, permanent, stream_broken, usage_limit, result_schema,
max_model_calls, retry_exhausted, missing_price, cancelled); ``RunInfo(run_id, conversation,
status, attempt, agent, submission_id, created, outcome, pending_approvals,
cancel_requested)`` (status queued | running | parked | completed | failed |
cancelled).

Errors a front end maps: :class:`NotFound` (404), :class:`SubmissionConflict`
and :class:`ConversationBusy` (409, from ``submit``), :class:`ApprovalError`
(409: nothing pending for that call), :class:`CursorBehind` (from ``events``:
the cursor fell behind retention; ``first_retained`` says where to resume),
``sessions.errors.InvalidCursor`` (400).

Building blocks:

* :class:`Agent`, :func:`tool`, :class:`Tool`, :class:`Hooks`, :class:`ToolContext`
* providers: :func:`make_provider` / :func:`parse_model_spec` (``echo``,
  ``anthropic:MODEL``, ``openai:MODEL@BASE_URL``), :class:`ScriptedModel`,
  :class:`EchoModel`
* :class:`RetryPolicy` and the provider error classes of :mod:`loop.errors`
* :class:`Price` / :func:`cost_micros` (:mod:`loop.pricing`): ``Runtime(pricing={model: Price(...)})``
  prices model calls, so ``limits={"max_cost_micros": n}`` is enforced (``MissingPrice`` for an
  unpriced model); :func:`load_pricing` reads the same table from a JSON file (``--pricing``)
* :func:`call_model` — one model call with retries applied
"""

from .agents import Agent, Hooks, ModelCallInfo, Tool, ToolCallInfo, ToolContext, tool
from .calls import Clock, RetryNotice, call_model
from .errors import (
    ContextOverflowError,
    LoopError,
    MissingPrice,
    ModelSpecError,
    PermanentProviderError,
    ProviderError,
    StreamBrokenError,
    ToolSchemaError,
    TransientProviderError,
)
from .providers import EchoModel, ScriptedModel, make_provider, parse_model_spec
from ledger import ConversationBusy, SubmissionConflict
from ledger.usage import check_limits
from sessions.errors import CursorBehind

from .pricing import FREE, Price, PricingFileError, cost_micros, load_pricing
from .retry import RetryPolicy
from .runtime import Acknowledgement, NotFound, Outcome, RunInfo, Runtime
from .store import ApprovalError

__all__ = [
    "Runtime",
    "Acknowledgement",
    "Outcome",
    "RunInfo",
    "NotFound",
    "ApprovalError",
    "SubmissionConflict",
    "ConversationBusy",
    "CursorBehind",
    "Agent",
    "Tool",
    "tool",
    "Hooks",
    "ModelCallInfo",
    "ToolCallInfo",
    "ToolContext",
    "call_model",
    "Clock",
    "RetryNotice",
    "RetryPolicy",
    "make_provider",
    "parse_model_spec",
    "ScriptedModel",
    "EchoModel",
    "LoopError",
    "ProviderError",
    "TransientProviderError",
    "ContextOverflowError",
    "PermanentProviderError",
    "StreamBrokenError",
    "ToolSchemaError",
    "ModelSpecError",
    "MissingPrice",
    "Price",
    "FREE",
    "cost_micros",
    "load_pricing",
    "PricingFileError",
    "check_limits",
]
