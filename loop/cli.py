"""``surefoot run`` and ``surefoot inspect``: the embedded loop from a terminal.

Registered into the ``surefoot`` command by ``server.cli`` through
:func:`add_commands` (which adds both sub-parsers and sets ``func``).

``surefoot run "message"`` opens the embedded runtime in ``./surefoot-data``,
first resumes whatever an earlier ``surefoot run`` left unfinished in the
conversation (killed, Ctrl-C'd, parked for approval), then runs the new
message, streaming the journal readably: text as it arrives, tool calls and
their results, retries with their wait, approvals (asked on the terminal).
With the default ``echo`` model it works offline; ``/now`` or ``/add {"a": 1,
"b": 2}`` make the echo model call the demo tools, ``/approve_action
"deploy"`` one that asks for approval.  ``--pricing FILE`` (or
``$SUREFOOT_PRICING``) prices models (format: :mod:`loop.pricing`), so
``--max-cost-micros N`` can put a cost ceiling on the new run; a bad file is
refused before the data directory is opened.  The model options (``--max-tokens``,
``--thinking off|adaptive|BUDGET``, ``--effort``, ``--thinking-display``,
``--interleaved-thinking``, ``--max-tokens-param``: :func:`add_model_options`, shared with
``surefoot serve``) set what a ``--model`` spec cannot say; one the model cannot take is
refused (exit 2) before the data directory is opened too.

``surefoot inspect [CONVERSATION]`` shows conversations, runs with their
states and attempts, the transcript and the journal.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import trio

import kv
from sessions import events as E
from sessions.errors import NotFound as SessionNotFound

from . import messages as M
from .agents import Agent, tool
from .errors import ModelSpecError
from .pricing import PRICING_ENV, PRICING_OPTION_HELP, Price, PricingFileError, price_for, pricing_from_option
from .providers import DEFAULT_MAX_TOKENS, ModelSpec, Provider, make_provider, parse_model_spec
from .providers.anthropic import EFFORT_LEVELS, MIN_THINKING_BUDGET, THINKING_DISPLAYS
from .providers.openai import MAX_TOKENS_PARAMS
from .runtime import Runtime

__all__ = ["add_commands", "cmd_run", "cmd_inspect", "demo_tools", "render_event", "DEFAULT_DATA_DIR",
           "add_model_options", "model_from_args", "ModelChoice", "ModelOptionError"]

DEFAULT_DATA_DIR = "./surefoot-data"
DEFAULT_CONVERSATION = "main"
UNSETTLED = ("queued", "running", "parked")
EXIT_FAILED, EXIT_LOCKED, EXIT_PARKED, EXIT_INTERRUPTED = 1, 2, 3, 130
# A model option the model cannot take, a bad --pricing file or a ceiling it cannot enforce: a
# usage error, argparse's own exit code.
EXIT_USAGE = 2


def demo_tools() -> list[Any]:
    """Small tools so the offline echo model can show tool calls, results and approvals."""

    @tool(thread=False)
    def now() -> str:
        """The current UTC time (ISO 8601)."""
        return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    @tool(thread=False)
    def add(a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    @tool(requires_approval=True, thread=False)
    def approve_action(action: str) -> str:
        """Perform an action that a person must approve first.

        Args:
            action: What to do.
        """
        return f"done: {action}"

    return [now, add, approve_action]


def _url(args: argparse.Namespace) -> str:
    if getattr(args, "kv", None):
        return args.kv
    return f"lmdb:{args.data or DEFAULT_DATA_DIR}"


def _int_at_least(minimum: int, why: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (``why`` completes "must ..." otherwise)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must {why}, not {n}")
        return n
    return parse


_non_negative_int = _int_at_least(0, "not be negative")
_positive_int = _int_at_least(1, "be a positive integer")


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero (a lease of 0 or less, or NaN,
    would let every worker take over every run at once)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (0 < x < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text}")
    return x


LEASE_OPTION_HELP = "lease length in seconds (default 10): how long a killed process's run waits before another takes it over"


# ---------------------------------------------------------------------- model options
#
# The provider options a spec string cannot carry (loop.providers: a spec names a model and
# where it is served, nothing more), as command-line options of `surefoot run` and `surefoot
# serve`. Both commands call add_model_options() and model_from_args(), so the two cannot
# drift apart. Every combination the chosen provider cannot take is refused here, before
# the command opens (or creates) any storage: a typo must not leave a data directory behind,
# nor a run queued that the next invocation would resume and fail. No environment variables:
# only --pricing has one ($SUREFOOT_PRICING, a file path a deployment sets once); these are
# per-invocation choices.

THINKING_OFF = "off"
THINKING_ADAPTIVE = "adaptive"
#: argparse help of the option group (no bare percent signs).
MODEL_OPTIONS_HELP = ("Options of the --model provider that the spec string cannot carry. A combination the "
                      "provider cannot take is refused (exit 2) before any storage is opened.")


class ModelOptionError(ValueError):
    """A model option the chosen model (or the other options) cannot take. ``str()`` is
    argparse's wording, ``argument --OPTION: why``, which the commands print after
    ``surefoot CMD: error:`` and exit 2, as argparse does for a bad command line."""

    def __init__(self, option: str, why: str) -> None:
        super().__init__(f"argument {option}: {why}")
        self.option = option


def _thinking_value(text: str) -> str | int:
    """``off`` | ``adaptive`` | BUDGET (a positive integer of thinking tokens)."""
    t = text.strip()
    if t in (THINKING_OFF, THINKING_ADAPTIVE):
        return t
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not {THINKING_OFF}, {THINKING_ADAPTIVE} or a budget of thinking tokens: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a thinking budget must be a positive integer, not {n}")
    return n


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Add the model options (``--max-tokens``, ``--thinking``, ``--effort``,
    ``--thinking-display``, ``--interleaved-thinking``, ``--max-tokens-param``) to a command;
    :func:`model_from_args` checks and applies them."""
    g = p.add_argument_group("model options", MODEL_OPTIONS_HELP)
    g.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                   help="the agent's output cap per model call (Agent.max_tokens; any model). Anthropic's "
                        f"default is {DEFAULT_MAX_TOKENS}; an OpenAI-compatible server gets none unless set "
                        "(vLLM refuses one past its context window: set it when using usage ceilings)")
    g.add_argument("--thinking", type=_thinking_value, default=None, metavar="off|adaptive|BUDGET",
                   help="Anthropic only. adaptive: adaptive thinking (Claude 4.6 and later; steer it with "
                        f"--effort); BUDGET: extended thinking with that many budget tokens (>= {MIN_THINKING_BUDGET}, "
                        "below --max-tokens; older models, refused by Opus 4.7+); off: none (the default)")
    g.add_argument("--effort", choices=EFFORT_LEVELS, default=None,
                   help="Anthropic, with --thinking adaptive: output_config.effort (a model refuses a level "
                        "it lacks: the run fails with the API's 400)")
    g.add_argument("--thinking-display", choices=THINKING_DISPLAYS, default=None,
                   help="Anthropic, with --thinking adaptive: readable summaries or signature-only thinking "
                        "blocks (default: the model's; omitted on Opus 4.7+)")
    g.add_argument("--interleaved-thinking", action="store_true", default=False,
                   help="Anthropic, with --thinking BUDGET: send the interleaved-thinking beta header (Claude 4 "
                        "models think between tool calls; with tools the budget may then reach or pass --max-tokens)")
    g.add_argument("--max-tokens-param", choices=MAX_TOKENS_PARAMS, default=None,
                   help="OpenAI-compatible only: the request key the output cap goes under (default max_tokens, "
                        "what vLLM, llama.cpp and Ollama know; max_completion_tokens for OpenAI's reasoning "
                        "models, o-series and gpt-5, which refuse max_tokens)")


@dataclass(frozen=True)
class ModelChoice:
    """What a command's model options come to: ``model`` for ``Agent.model`` (the ``--model``
    spec itself, or a provider object built from it when a provider option is set) and
    ``max_tokens`` for ``Agent.max_tokens``."""

    spec: str
    model: str | Provider
    max_tokens: int | None = None
    #: The options set, as a command would write them (for a start-up line); () when none.
    options: tuple[str, ...] = ()

    def agent(self, name: str, instructions: str, **kw: Any) -> Agent:
        return Agent(name, instructions, self.model, max_tokens=self.max_tokens, **kw)

    def pricing(self, table: Mapping[str, Price]) -> Mapping[str, Price]:
        """``table`` as it must be for :attr:`model`. A price is found for a spec string by the
        spec as written, then ``provider:MODEL``, then ``MODEL``; for a provider object only by
        the last two (its ``name`` and ``model``). So that setting a provider option does not
        lose a price keyed by the spec as written (``openai:M@http://host/v1``), that price is
        added under the provider's name, for this command's one agent."""
        if isinstance(self.model, str):
            return table
        want = price_for(table, self.spec)
        if want is None or price_for(table, self.model) == want:
            return table
        return {**table, self.model.name: want}


def model_from_args(args: argparse.Namespace) -> ModelChoice:
    """Check ``args``' ``--model`` and model options against each other and build what they
    ask for; :class:`ModelOptionError` names the first option the model cannot take and why.
    Opens nothing (a provider object's HTTP client is made on its first call)."""
    spec = str(getattr(args, "model", None) or "echo")
    max_tokens: int | None = getattr(args, "max_tokens", None)
    thinking: str | int | None = getattr(args, "thinking", None)
    effort: str | None = getattr(args, "effort", None)
    display: str | None = getattr(args, "thinking_display", None)
    interleaved = bool(getattr(args, "interleaved_thinking", False))
    tokens_param: str | None = getattr(args, "max_tokens_param", None)
    try:
        ms: ModelSpec = parse_model_spec(spec)
    except ModelSpecError as e:
        raise ModelOptionError("--model", str(e)) from None
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ModelOptionError("--max-tokens", f"must be a positive integer, not {max_tokens!r}")
    budget = thinking if isinstance(thinking, int) and not isinstance(thinking, bool) else None
    adaptive = thinking == THINKING_ADAPTIVE
    # Which provider each option belongs to (the first one the model cannot take is named).
    anthropic_only = [(o, v) for o, v in (("--thinking", thinking if thinking != THINKING_OFF else None),
                                          ("--effort", effort), ("--thinking-display", display),
                                          ("--interleaved-thinking", interleaved or None)) if v is not None]
    if ms.kind != "anthropic" and anthropic_only:
        raise ModelOptionError(anthropic_only[0][0], f"only an anthropic:MODEL model takes it, not {spec!r} "
                                                     f"(the {ms.kind} provider has no such option)")
    if tokens_param is not None and ms.kind != "openai":
        raise ModelOptionError("--max-tokens-param", f"only an openai:MODEL model takes it, not {spec!r} "
                                                     f"(the {ms.kind} provider has one name for its cap)")
    if effort is not None and not adaptive:
        raise ModelOptionError("--effort", "needs --thinking adaptive")
    if display is not None and not adaptive:
        raise ModelOptionError("--thinking-display", "needs --thinking adaptive (budgeted thinking has no display)")
    if interleaved and adaptive:
        raise ModelOptionError("--interleaved-thinking", "adaptive thinking interleaves reasoning between tool "
                                                         "calls by itself: drop it, or use --thinking BUDGET")
    if interleaved and budget is None:
        raise ModelOptionError("--interleaved-thinking", "needs extended thinking on: --thinking BUDGET")
    if budget is not None:
        if budget < MIN_THINKING_BUDGET:
            raise ModelOptionError("--thinking", f"a budget of {budget} tokens is below the API's minimum of "
                                                 f"{MIN_THINKING_BUDGET}")
        cap = max_tokens or DEFAULT_MAX_TOKENS
        if budget >= cap and not interleaved:
            said = "--max-tokens" if max_tokens else "the default max_tokens"
            raise ModelOptionError("--thinking", f"a budget of {budget} tokens must be less than {said} {cap} "
                                                 f"(the budget is part of it): raise --max-tokens, or add "
                                                 f"--interleaved-thinking on a Claude 4 model with tools")
    kw: dict[str, Any] = {}
    options: list[str] = []
    if max_tokens is not None:
        options.append(f"--max-tokens {max_tokens}")
    if budget is not None:
        kw["thinking_budget"] = budget
    elif adaptive:
        kw["thinking"] = THINKING_ADAPTIVE
    if thinking is not None and thinking != THINKING_OFF:
        options.append(f"--thinking {thinking}")
    for key, option, value in (("effort", "--effort", effort), ("thinking_display", "--thinking-display", display),
                               ("max_tokens_param", "--max-tokens-param", tokens_param)):
        if value is not None:
            kw[key] = value
            options.append(f"{option} {value}")
    if interleaved:
        kw["interleaved_thinking"] = True
        options.append("--interleaved-thinking")
    if not kw:
        # Nothing the spec cannot say: the agent keeps the spec string (the run's delivery records
        # it, and prices are looked up by it as written).
        return ModelChoice(spec, spec, max_tokens, tuple(options))
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens  # the provider's own checks (budget < max_tokens) see the real cap
    try:
        provider = make_provider(ms, **kw)
    except ValueError as e:  # a rule checked above in the provider's words (kept as a safety net)
        first = next(o for o in options if not o.startswith("--max-tokens "))
        raise ModelOptionError(first.split()[0], str(e)) from None
    return ModelChoice(spec, provider, max_tokens, tuple(options))


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run`` and ``inspect`` to the ``surefoot`` command."""
    p = subparsers.add_parser(
        "run",
        help="run an agent turn in the embedded runtime (resumes interrupted runs first)",
        description="Submit MESSAGE to an agent in the embedded runtime and stream what happens. "
        "Runs an earlier process left unfinished in the conversation are resumed first. "
        "Works offline with the default echo model.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data", default=None, help=f"data directory (default {DEFAULT_DATA_DIR})")
    where.add_argument("--kv", default=None, help="kv url instead of --data: memory:, lmdb:PATH, fdb:[CLUSTER_FILE]")
    p.add_argument("--model", default="echo", help="echo | anthropic:MODEL | openai:MODEL@BASE_URL (default echo)")
    p.add_argument("--conversation", "-c", default=DEFAULT_CONVERSATION, help=f"conversation id (default {DEFAULT_CONVERSATION})")
    p.add_argument("--agent", default="assistant", help="agent name (default assistant)")
    p.add_argument("--instructions", default="You are a helpful assistant.", help="the agent's system prompt")
    p.add_argument("--no-tools", action="store_true", help="no demo tools")
    p.add_argument("--yes", action="store_true", help="approve every approval request without asking")
    p.add_argument("--json", action="store_true", help="print journal events as JSON lines")
    p.add_argument("--lease-seconds", type=positive_seconds, default=None, help=LEASE_OPTION_HELP)
    p.add_argument("--pricing", default=None, metavar="FILE", help=PRICING_OPTION_HELP)
    p.add_argument("--max-cost-micros", type=_non_negative_int, default=None, metavar="N",
                   help="cost ceiling of the new run, in micro-units of the pricing's currency: a model call "
                        "that would pass it is not made and the run fails usage_limit (the model needs a price)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("message", nargs="?", help="the user message (omit to only resume unfinished runs)")
    add_model_options(p)
    p.set_defaults(func=cmd_run)

    q = subparsers.add_parser(
        "inspect",
        help="show conversations, runs, transcripts and the journal of a data directory",
        description="Without CONVERSATION: every conversation with its runs. With it: its runs "
        "(state, attempts), transcript and journal.",
    )
    where = q.add_mutually_exclusive_group()
    where.add_argument("--data", default=None, help=f"data directory (default {DEFAULT_DATA_DIR})")
    where.add_argument("--kv", default=None, help="kv url instead of --data")
    q.add_argument("--events", type=int, default=200, help="journal events to show (latest; 0 = all)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.add_argument("--log-level", default="warning")
    q.add_argument("conversation", nargs="?")
    q.set_defaults(func=cmd_inspect)


# ---------------------------------------------------------------------- rendering


class _Renderer:
    """Turns journal events into terminal output (text streams inline)."""

    def __init__(self, out: Any, *, as_json: bool = False) -> None:
        self.out = out
        self.as_json = as_json
        self.mid_line = False
        self.streamed: set[Any] = set()  # runs whose current answer arrived as part events

    def _line(self, text: str) -> None:
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False
        self.out.write(text + "\n")

    def event(self, ev: Any) -> None:
        if self.as_json:
            self.out.write(json.dumps(ev.as_dict(), default=str) + "\n")
            self.out.flush()
            return
        d = ev.data or {}
        rid = d.get("run_id")
        if ev.type in (E.PART_ADDED, E.PART_UPDATED) and d.get("text"):
            self.streamed.add(rid)
        elif ev.type == E.MESSAGE_ADDED and d.get("role") == "assistant":
            # a fast answer arrives whole, without part events: print its text now
            if rid not in self.streamed:
                text = M.text_of(d.get("message") or {}) or d.get("text", "")
                if text:
                    self._line(text)
            self.streamed.discard(rid)
        r = render_event(ev)
        if r is None:
            return
        inline, text = r
        if inline:
            self.out.write(text)
            self.mid_line = not text.endswith("\n")
        else:
            self._line(text)
        self.out.flush()

    def finish(self) -> None:
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False
        self.out.flush()


def render_event(ev: Any) -> tuple[bool, str] | None:
    """(inline, text) for one journal event, or None to show nothing."""
    d = ev.data or {}
    t = ev.type
    if t in (E.PART_ADDED, E.PART_UPDATED):
        if d.get("kind", "text") == "text" or "text" in d:
            return (True, d.get("text", "")) if d.get("text") else None
        return None
    if t == E.RUN_QUEUED:
        return False, f"· run {d.get('run_id', '')[:8]} queued"
    if t == E.RUN_STARTED:
        extra = " (taking over from a stopped process)" if d.get("takeover") else ""
        return False, f"· run {d.get('run_id', '')[:8]} started, attempt {d.get('attempt')}{extra}"
    if t == E.TOOL_STARTED:
        return False, f"→ {d.get('name')}({json.dumps(d.get('arguments') or {}, ensure_ascii=False)})"
    if t == E.TOOL_COMPLETED:
        mark = "✗" if d.get("is_error") else "←"
        reason = f" [{d['reason']}]" if d.get("reason") else ""
        return False, f"{mark} {d.get('name')}{reason}: {str(d.get('content', ''))[:500]}"
    if t == E.RUN_RETRY_PENDING:
        err = d.get("error") or {}
        at = _dt.datetime.fromtimestamp(d.get("nextAttemptAt", 0), _dt.timezone.utc).strftime("%H:%M:%S")
        return False, (f"… {err.get('message', 'provider error')} — attempt {d.get('attempt')}/{d.get('maxAttempts')} "
                       f"at {at} UTC (in {d.get('delay', 0):.1f}s)")
    if t == E.CONTEXT_COMPACTED:
        return False, f"· context compacted ({d.get('reason')}): messages before #{d.get('upto')} summarised"
    if t == E.APPROVAL_REQUESTED:
        return False, f"? approval needed: {d.get('name')}({json.dumps(d.get('arguments') or {}, ensure_ascii=False)})"
    if t == E.APPROVAL_RESOLVED:
        return False, f"· {'approved' if d.get('allow') else 'denied'}" + (f": {d['reason']}" if d.get("reason") else "")
    if t == E.MESSAGE_ADDED:
        if d.get("role") == "error":
            err = (d.get("message") or {}).get("error") or {}
            return False, f"! {err.get('type', 'error')}: {err.get('message', '')}"
        return None
    if t == E.RUN_COMPLETED:
        return False, f"· run {d.get('run_id', '')[:8]} completed"
    if t == E.RUN_FAILED:
        err = d.get("error") or {}
        return False, f"· run {d.get('run_id', '')[:8]} failed: {err.get('type')}: {err.get('message', '')}"
    if t == E.RUN_CANCELLED:
        return False, f"· run {d.get('run_id', '')[:8]} cancelled"
    return None


# ---------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    """``surefoot run``: exit 0 completed, 1 failed/cancelled, 2 data directory locked, a model
    option the model cannot take, a bad ``--pricing`` file or an unpriced ``--max-cost-micros``,
    3 parked, 130 interrupted."""
    # The model options and the pricing are checked before anything is opened: a typo must not
    # leave a data directory behind, nor a run queued that the next invocation would resume.
    try:
        choice = model_from_args(args)
    except ModelOptionError as e:
        sys.stderr.write(f"surefoot run: error: {e}\n")
        return EXIT_USAGE
    try:
        pricing = dict(choice.pricing(pricing_from_option(getattr(args, "pricing", None))))
    except PricingFileError as e:
        sys.stderr.write(f"surefoot run: {e}\n")
        return EXIT_USAGE
    ceiling = getattr(args, "max_cost_micros", None)
    if ceiling is not None and args.message and price_for(pricing, choice.model) is None:
        # (Runtime.submit would refuse it too, with MissingPrice, but only after opening the store.)
        sys.stderr.write(f"surefoot run: --max-cost-micros needs a price for model {args.model!r}: add it "
                         f"to a pricing file (--pricing FILE or ${PRICING_ENV})\n")
        return EXIT_USAGE
    try:
        return trio.run(_run_main, args, pricing, choice)
    except BaseException as e:  # KeyboardInterrupt, possibly inside trio's exception groups
        locked = _locked(e)
        if locked is not None:
            sys.stderr.write(f"surefoot run: {locked}\n")
            return EXIT_LOCKED
        if not _is_interrupt(e):
            raise
        sys.stderr.write("\ninterrupted — run `surefoot run` again to resume\n")
        return EXIT_INTERRUPTED


def _locked(e: BaseException) -> BaseException | None:
    """The data-directory-locked error inside ``e`` (another process owns the directory)."""
    if isinstance(e, kv.DataDirectoryLocked):
        return e
    if isinstance(e, BaseExceptionGroup):
        for x in e.exceptions:
            found = _locked(x)
            if found is not None:
                return found
    return None


def _is_interrupt(e: BaseException) -> bool:
    if isinstance(e, KeyboardInterrupt):
        return True
    if isinstance(e, BaseExceptionGroup):
        return all(_is_interrupt(x) for x in e.exceptions)
    return False


async def _ask(question: str) -> bool:
    def read() -> str:
        sys.stdout.write(question)
        sys.stdout.flush()
        return sys.stdin.readline()

    answer = await trio.to_thread.run_sync(read, abandon_on_cancel=True)
    return answer.strip().lower() in ("y", "yes")


async def _run_main(args: argparse.Namespace, pricing: dict[str, Price], choice: ModelChoice) -> int:
    agent = choice.agent(args.agent, args.instructions, tools=[] if args.no_tools else demo_tools())
    out = sys.stdout
    renderer = _Renderer(out, as_json=args.json)
    ceiling = getattr(args, "max_cost_micros", None)
    async with Runtime.open(_url(args), workers=1, agents=[agent], lease_seconds=args.lease_seconds,
                            pricing=pricing) as rt:
        conv = args.conversation
        owner = rt.owner
        try:
            start = await rt.store.journal.tail_cursor(owner, conv)
        except SessionNotFound:
            start = None
        pending = [r for r in await rt.runs(conv) if r.status in UNSETTLED]
        for r in pending:
            note = {"parked": "parked awaiting approval", "running": "interrupted earlier; resuming"}.get(r.status, "queued")
            renderer._line(f"· resuming run {r.run_id[:8]} ({note}, attempt {r.attempt})")
            if r.status == "running":
                renderer._line("  (if its process was killed, its lease lapses within "
                               f"{rt.store.lease_seconds:.0f}s and this process takes over)")
        targets = {r.run_id for r in pending}
        # Approvals requested before this process started are not in the live stream: ask now.
        parked = [r for r in pending if r.status == "parked" and r.pending_approvals]
        if parked:
            calls = {p["id"]: p for m in await rt.transcript(conv) for p in M.tool_calls_of(m)}
            for r in parked:
                for cid in r.pending_approvals:
                    c = calls.get(cid, {"name": "?", "arguments": {}})
                    renderer._line(f"? approval needed: {c['name']}({json.dumps(c.get('arguments') or {}, ensure_ascii=False)})")
                    if not args.yes and not sys.stdin.isatty():
                        sys.stderr.write(f"run {r.run_id} is parked awaiting approval of {c['name']}; "
                                         "run `surefoot run --yes` to approve it\n")
                        return EXIT_PARKED
                    allow = True if args.yes else await _ask("  approve? [y/N] ")
                    await rt.approve(r.run_id, cid, allow, None if allow else "denied on the terminal")
        mine = None
        if args.message:
            limits = {"max_cost_micros": ceiling} if ceiling is not None else None
            ack = await rt.submit(agent, conv, args.message, limits=limits)
            mine = ack.run_id
            targets.add(mine)
        if not targets:
            renderer._line(f"nothing to do in conversation {conv!r} (give a message)")
            return 0
        settled: dict[str, Any] = {}
        answers: dict[str, str] = {}
        async for ev in rt.events(conv, after=start):
            renderer.event(ev)
            d = ev.data or {}
            rid = d.get("run_id")
            if ev.type == E.APPROVAL_REQUESTED and rid in targets:
                allow = True if args.yes else (sys.stdin.isatty() and await _ask("  approve? [y/N] "))
                if not args.yes and not sys.stdin.isatty():
                    renderer.finish()
                    sys.stderr.write(f"run {rid} is parked awaiting approval of {d.get('name')}; "
                                     "run `surefoot run --yes` to approve it\n")
                    return EXIT_PARKED
                await rt.approve(rid, d["call_id"], allow, None if allow else "denied on the terminal")
            if ev.type == E.MESSAGE_ADDED and rid in targets and d.get("role") == "assistant":
                answers[rid] = M.text_of(d.get("message") or {})
            if ev.type in (E.RUN_COMPLETED, E.RUN_FAILED, E.RUN_CANCELLED) and rid in targets:
                settled[rid] = d
                if len(settled) == len(targets):
                    break
        renderer.finish()
        final = settled.get(mine) if mine else None
        if final is None and settled:
            final = list(settled.values())[-1]
        if final and final.get("status") == "completed":
            if args.json:
                out.write(json.dumps({"result": final.get("result")}, default=str) + "\n")
            return 0
        return EXIT_FAILED


# ---------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        return trio.run(_inspect_main, args)
    except BaseException as e:
        locked = _locked(e)
        if locked is None:
            raise
        sys.stderr.write(f"surefoot inspect: {locked}\n")
        return EXIT_LOCKED


def _short_message(m: dict[str, Any]) -> str:
    role = m.get("role")
    if role == "compaction":
        return f"[compaction up to #{m.get('upto')} ({m.get('reason')})] {str(m.get('summary', ''))[:200]}"
    if role == "error":
        e = m.get("error") or {}
        return f"[error] {e.get('type')}: {e.get('message', '')}"
    parts = []
    t = M.text_of(m)
    if t:
        parts.append(t if len(t) <= 300 else t[:300] + "…")
    for p in m.get("content") or ():
        if p.get("type") == "tool_call":
            parts.append(f"→ {p['name']}({json.dumps(p.get('arguments') or {}, ensure_ascii=False)}) [{p['id']}]")
        elif p.get("type") == "tool_result":
            mark = "✗" if p.get("is_error") else "←"
            reason = f" [{p['reason']}]" if p.get("reason") else ""
            parts.append(f"{mark} {p.get('name')}{reason}: {str(p.get('content', ''))[:300]} [{p['call_id']}]")
    return " ".join(parts)


def _usage_text(u: dict[str, int]) -> str:
    """A run's tokens, and its cost beside them when its model was priced (``cost_micros``:
    micro-units of the currency the runtime's prices are in)."""
    if not u.get("total_tokens") and not u.get("cost_micros"):
        return ""
    text = f"  tokens {u.get('input_tokens', 0)} in / {u.get('output_tokens', 0)} out"
    cache = u.get("cache_read_tokens", 0) + u.get("cache_write_tokens", 0)
    if cache:
        text += f" / {cache} cache"
    if "cost_micros" in u:
        text += f"  cost {u['cost_micros']} micros ({u['cost_micros'] / 1_000_000:.6f})"
    return text


async def _inspect_main(args: argparse.Namespace) -> int:
    out = sys.stdout
    async with Runtime.open(_url(args), workers=0) as rt:
        if not args.conversation:
            convs = await rt.conversations()
            rows = []
            for c in convs:
                runs = await rt.runs(c)
                msgs = await rt.transcript(c)
                rows.append({"conversation": c, "messages": len(msgs), "runs": len(runs),
                             "states": {s: sum(1 for r in runs if r.status == s) for s in sorted({r.status for r in runs})}})
            if args.json:
                out.write(json.dumps(rows) + "\n")
            elif not rows:
                out.write("no conversations\n")
            else:
                for r in rows:
                    states = ", ".join(f"{k} {v}" for k, v in r["states"].items())
                    out.write(f"{r['conversation']}: {r['messages']} messages, {r['runs']} runs ({states})\n")
            return 0
        conv = args.conversation
        runs = await rt.runs(conv)
        msgs = await rt.transcript(conv)
        try:
            events = []
            after = None
            while True:
                page = await rt.read_events(conv, after=after, limit=1000)
                events.extend(page.events)
                if not page.more:
                    break
                after = page.next_cursor
        except SessionNotFound:
            events = []
        if args.events:
            events = events[-args.events:]
        usage = {r.run_id: await rt.usage(r.run_id) for r in runs}
        if args.json:
            out.write(json.dumps({
                "conversation": conv,
                "runs": [{"run_id": r.run_id, "status": r.status, "attempt": r.attempt, "agent": r.agent,
                          "outcome": r.outcome, "pending_approvals": list(r.pending_approvals),
                          "usage": usage[r.run_id]} for r in runs],
                "transcript": msgs,
                "journal": [e.as_dict() for e in events],
            }, default=str) + "\n")
            return 0
        out.write(f"conversation {conv}\n\nruns:\n")
        for r in runs:
            extra = ""
            if r.outcome and r.outcome.get("error"):
                extra = f" — {r.outcome['error'].get('type')}: {r.outcome['error'].get('message', '')}"
            if r.pending_approvals:
                extra += f" — awaiting approval of {', '.join(r.pending_approvals)}"
            out.write(f"  {r.run_id}  {r.status:<9} attempt {r.attempt}  agent {r.agent}"
                      f"{_usage_text(usage[r.run_id])}{extra}\n")
        out.write("\ntranscript:\n")
        for i, m in enumerate(msgs):
            out.write(f"  #{i:<3} {m.get('role'):<10} {_short_message(m)}\n")
        out.write(f"\njournal ({len(events)} events shown):\n")
        for e in events:
            ts = _dt.datetime.fromtimestamp(e.ts, _dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
            data = json.dumps(e.data, default=str, ensure_ascii=False)
            out.write(f"  {ts} {e.cursor[:16]}… {e.type:<18} {data[:160]}\n")
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loop.cli run|inspect ...`` (the same commands without the server)."""
    parser = argparse.ArgumentParser(prog="surefoot")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
