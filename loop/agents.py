"""Agents, tools, hooks and the tool context.

An :class:`Agent` is configuration only (name, instructions, model, tools,
hooks): it holds no conversation state, so one agent object serves every run,
and everything a run needs to resume after a crash is in storage, never here.

A tool is a typed Python function, sync or async.  Its JSON schema comes
from the signature and docstring (:mod:`loop.schema`) unless given; the
parameter annotated :class:`ToolContext` (or named ``ctx``) receives the
tool context instead of a model argument.  ``@tool(requires_approval=True)``
makes the run park durably until someone approves the call.

Hooks run at the turn's boundaries: ``before_model_call`` may rewrite the
request for that one call (it is not persisted, and runs again after a
restart, so it must be deterministic); ``after_tool`` may rewrite a tool's
result *before* it is persisted (and never runs twice for one persisted
result).  Both may be sync or async.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import trio

from .compaction import tools_schema_chars
from .errors import ToolSchemaError
from .providers.base import Provider, ToolSpec
from .retry import DEFAULT_RETRY_POLICY, RetryPolicy
from .schema import coerce, schema_for_function, validate

__all__ = [
    "Agent",
    "Tool",
    "tool",
    "Hooks",
    "ModelCallInfo",
    "ToolCallInfo",
    "ToolContext",
    "MAX_TOOLS",
    "MAX_MODEL_CALLS_PER_RUN",
]

# Providers accept tool names matching this (Anthropic's rule, the strictest).
TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Tools per agent (providers degrade well before this; it catches mistakes).
MAX_TOOLS = 128
# A run stops (failed, "max_model_calls") after this many model calls by default:
# a model that loops on tool calls forever must not run forever.
MAX_MODEL_CALLS_PER_RUN = 50

assert MAX_TOOLS > 0 and MAX_MODEL_CALLS_PER_RUN > 0


class ToolContext:
    """What a running tool may know and do (``ctx`` argument).

    * ``idempotency_key`` — stable for this tool call across restarts; hand it
      to the far end (a payment API's Idempotency-Key) so a retried effect is
      deduplicated there.
    * ``cancelled`` — true once the run was cancelled; long tools should poll it.
    * ``await ctx.step(name, fn)`` — a durable step: recorded once per run and
      name, returned from the record without calling ``fn`` again.

    The loop builds contexts backed by the ledger; constructing one directly
    (tests, calling a tool by hand) gives an in-memory step record.
    """

    def __init__(
        self,
        *,
        run_id: str = "local",
        conversation: str = "local",
        call_id: str = "call",
        tool_name: str = "",
        attempt: int = 1,
        step_impl: Callable[[str, Callable[[], Any]], Awaitable[Any]] | None = None,
        cancel_event: trio.Event | None = None,
        idempotency_key: str | Callable[[], str] | None = None,
    ) -> None:
        self.run_id = run_id
        self.conversation = conversation
        self.call_id = call_id
        self.tool_name = tool_name
        self.attempt = attempt
        self._step_impl = step_impl
        self._cancel_event = cancel_event
        self._idempotency_key = idempotency_key
        self._local_steps: dict[str, Any] = {}
        self._names_used: set[str] = set()

    @property
    def idempotency_key(self) -> str:
        key = self._idempotency_key
        if callable(key):  # computed on first use (most tools never ask for it)
            key = self._idempotency_key = key()
        return key or f"{self.run_id}:{self.call_id}"

    @property
    def cancelled(self) -> bool:
        return self._cancel_event is not None and self._cancel_event.is_set()

    async def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (sync or async) once per (run, tool call, name); later calls get the record."""
        if not name or "/" in name:
            raise ValueError(f"bad step name {name!r}")
        if name in self._names_used:
            raise ValueError(f"step name {name!r} used twice in one tool call")
        self._names_used.add(name)
        if self._step_impl is not None:
            return await self._step_impl(f"{self.call_id}/{name}", fn)
        if name not in self._local_steps:
            r = fn()
            if inspect.isawaitable(r):
                r = await r
            self._local_steps[name] = r
        return self._local_steps[name]


def _is_ctx_param(p: inspect.Parameter, ann: Any) -> bool:
    if ann is ToolContext or (isinstance(ann, type) and issubclass(ann, ToolContext)):
        return True
    if isinstance(ann, str) and ann.split(".")[-1] == "ToolContext":
        return True
    return p.name == "ctx" and ann is inspect.Parameter.empty


@dataclass
class Tool:
    """A function the model may call.  Calling the Tool calls the function."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: Mapping[str, Any]
    requires_approval: bool = False
    thread: bool = True  # run a sync function in a worker thread (it may block)
    context_param: str | None = None
    _hints: dict[str, Any] = field(default_factory=dict, repr=False)
    # is_async of ``_async_of`` (the function it was computed for): inspect walks the function's
    # wrappers on every call, and every tool call asks.
    _async: bool = field(default=False, init=False, repr=False, compare=False)
    _async_of: Any = field(default=None, init=False, repr=False, compare=False)
    # The errors of no arguments ({}) against ``_empty_of`` (the ``parameters`` they were found
    # for): validation is a function of the value and the schema, and a call of a tool without
    # parameters (the common case) sends none.
    _empty_errors: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _empty_of: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not TOOL_NAME_RE.match(self.name):
            raise ToolSchemaError(f"tool name {self.name!r} must match {TOOL_NAME_RE.pattern}")
        if self.parameters.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {self.name}: parameters schema must be an object")
        functools.update_wrapper(self, self.fn, updated=())  # type: ignore[arg-type]

    @property
    def is_async(self) -> bool:
        fn = self.fn
        if self._async_of is not fn:  # (recomputed if ``fn`` was replaced)
            self._async, self._async_of = inspect.iscoroutinefunction(fn), fn
        return self._async

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def check_arguments(self, arguments: Any) -> list[str]:
        if not isinstance(arguments, dict):
            return [f"$: arguments must be an object, got {type(arguments).__name__}"]
        if not arguments:
            params = self.parameters
            if self._empty_of is not params:  # (found again if ``parameters`` was replaced)
                self._empty_errors, self._empty_of = tuple(validate({}, params)), params
            return list(self._empty_errors)
        return validate(arguments, self.parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    async def invoke(self, arguments: Mapping[str, Any], ctx: ToolContext | None = None) -> Any:
        """Call the function with validated model arguments (converted to the declared types)."""
        kwargs = {k: coerce(v, self._hints.get(k, Any)) for k, v in arguments.items()}
        if self.context_param is not None:
            kwargs[self.context_param] = ctx if ctx is not None else ToolContext(tool_name=self.name)
        if self.is_async:
            return await self.fn(**kwargs)
        if self.thread:
            return await trio.to_thread.run_sync(functools.partial(self.fn, **kwargs))
        r = self.fn(**kwargs)
        if inspect.isawaitable(r):
            r = await r
        return r


def _make_tool(
    fn: Callable[..., Any],
    *,
    name: str | None,
    description: str | None,
    schema: Mapping[str, Any] | None,
    requires_approval: bool,
    thread: bool,
) -> Tool:
    if isinstance(fn, Tool):
        return fn
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    ctx_param = None
    for pname, p in sig.parameters.items():
        if _is_ctx_param(p, hints.get(pname, p.annotation)):
            ctx_param = pname
            break
    skip = (lambda p, ann: p.name == ctx_param) if ctx_param else None
    if schema is None:
        desc, params = schema_for_function(fn, skip=skip)
    else:
        desc, params = (inspect.getdoc(fn) or "").split("\n\n")[0], dict(schema)
    return Tool(
        fn=fn,
        name=name or fn.__name__,
        description=description if description is not None else desc,
        parameters=params,
        requires_approval=requires_approval,
        thread=thread,
        context_param=ctx_param,
        _hints={k: v for k, v in hints.items() if k != "return"},
    )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    schema: Mapping[str, Any] | None = None,
    requires_approval: bool = False,
    thread: bool = True,
) -> Any:
    """Make a function a :class:`Tool`: ``@tool`` or ``@tool(requires_approval=True, ...)``.

    ``schema`` replaces the derived parameters schema; ``thread=False`` runs a
    sync function on the event loop (only for functions that never block).
    """
    kw = dict(name=name, description=description, schema=schema, requires_approval=requires_approval, thread=thread)
    if fn is not None:
        return _make_tool(fn, **kw)  # type: ignore[arg-type]
    return lambda f: _make_tool(f, **kw)  # type: ignore[arg-type]


@dataclass
class ModelCallInfo:
    """What a ``before_model_call`` hook sees (and may change for this one call)."""

    agent: "Agent"
    run_id: str
    conversation: str
    call_number: int
    system: str
    messages: list[dict[str, Any]]
    tools: list[ToolSpec]


@dataclass
class ToolCallInfo:
    """What an ``after_tool`` hook sees; ``content``/``is_error`` may be changed before persisting."""

    agent: "Agent"
    run_id: str
    conversation: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    content: str
    is_error: bool
    reason: str | None = None


HookFn = Callable[[Any], Any]


@dataclass
class Hooks:
    before_model_call: HookFn | None = None
    after_tool: HookFn | None = None

    @staticmethod
    async def call(fn: HookFn | None, info: Any) -> None:
        if fn is None:
            return
        r = fn(info)
        if inspect.isawaitable(r):
            await r


@dataclass
class Agent:
    """An agent's configuration: ``Agent(name, instructions, model, tools, hooks)``.

    ``model`` is a spec string (``echo``, ``anthropic:MODEL``,
    ``openai:MODEL@BASE_URL``) or a provider object (``ScriptedModel``).
    """

    name: str
    instructions: str = ""
    model: str | Provider = "echo"
    tools: Sequence[Tool | Callable[..., Any]] = ()
    hooks: Hooks | None = None
    max_tokens: int | None = None
    max_model_calls: int = MAX_MODEL_CALLS_PER_RUN
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    # Estimated context tokens past which older messages are compacted (None: only on overflow).
    compact_at_tokens: int | None = None
    # Messages kept verbatim after a compaction (the recent tail the model sees).
    keep_recent: int = 6

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an agent needs a name")
        self.tools = tuple(t if isinstance(t, Tool) else tool(t) for t in self.tools)
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"agent {self.name}: more than {MAX_TOOLS} tools")
        names = [t.name for t in self.tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"agent {self.name}: duplicate tool names {sorted(dup)}")
        assert self.max_model_calls > 0 and self.keep_recent >= 1
        self._by_name = {t.name: t for t in self.tools}
        # The specs every model call sends, built once (like ``_by_name``, from the tools as
        # they were at construction), and the size of their JSON, measured on first use: the
        # input estimate behind usage ceilings counts it on every reserved call.
        self._specs = tuple(t.spec() for t in self.tools)  # type: ignore[union-attr]
        self._schema_chars: int | None = None
        if self.hooks is None:
            self.hooks = Hooks()

    def get_tool(self, name: str) -> Tool | None:
        return self._by_name.get(name)

    def tool_specs(self) -> list[ToolSpec]:
        """The tool definitions a model call sends (a new list; the specs are shared)."""
        return list(self._specs)

    def tool_schema_chars(self, specs: Sequence[ToolSpec] | None = None) -> int:
        """Characters of the JSON of the tool definitions a call sends
        (:func:`loop.compaction.tools_schema_chars`): of this agent's own, computed once; of
        ``specs`` when a ``before_model_call`` hook changed them for one call (the same
        spec objects in the same order are this agent's own: the cached figure)."""
        own = self._specs
        if specs is not None and not (len(specs) == len(own) and all(a is b for a, b in zip(specs, own))):
            return tools_schema_chars(specs)
        if self._schema_chars is None:
            self._schema_chars = tools_schema_chars(own)
        return self._schema_chars
