"""`surefoot serve`: the Runtime, its claim loops and the HTTP app in one trio run.

Start-up: check ``--model`` and the model options (``loop.cli.model_from_args``: one the
model cannot take ends the command, exit 2, before anything is opened), read the pricing file (``--pricing``, else ``$SUREFOOT_PRICING``; a
bad one ends the command here, one line on stderr, before any storage is
opened), open the store (the embedded engine refuses a second process on the
same directory with a clear message), recover what a crash left (Runtime.open
voids stale leases), start N claim loops, then listen.

Shutdown on SIGTERM/SIGINT, in order: /readyz turns 503; SSE streams get a
``stream.closing`` frame and end (clients reconnect elsewhere with
Last-Event-ID); hypercorn stops accepting and lets in-flight requests finish
(bounded by :data:`GRACEFUL_SECONDS`); then the claim loops stop and the store
closes. A second signal skips the grace period.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from typing import Any, Mapping

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

import kv

# The collector's thresholds for a serving process are the runtime's (one value, kept in loop.runtime):
# a server also allocates short-lived containers per request and SSE frame (trio tasks, ASGI dicts,
# Cancelled tracebacks); at CPython's defaults full collections came every ~70k allocations, pauses of
# 26-164 ms measured under many writers, each added to every in-flight acknowledgement and SSE frame.
from loop.runtime import GC_THRESHOLDS

from . import sse
from .api import Api
from .app import create_asgi
from .auth import Authenticator, auth_from_env
from .openapi import build_openapi

log = logging.getLogger(__name__)

__all__ = ["run_server", "serve_store", "serve_main", "default_agent", "tune_gc", "GRACEFUL_SECONDS", "DEFAULT_BACKLOG",
           "GC_THRESHOLDS"]

#: In-flight requests get this long to finish after a shutdown signal.
GRACEFUL_SECONDS = 5.0
#: Listen backlog: hypercorn's default (100) drops bursts such as 1,000 SSE followers connecting at once.
DEFAULT_BACKLOG = 2_048
DEFAULT_INSTRUCTIONS = "You are a helpful assistant."
#: Exit code for a bad model option or pricing file (argparse's code for a bad command line).
EXIT_USAGE = 2
assert DEFAULT_BACKLOG >= 1_024


def tune_gc() -> None:
    """Call once start-up is done: start-up objects leave the collector's view; collections get rarer.

    ``gc.freeze()`` moves everything alive now (modules, the Runtime, the app, the route table)
    to the permanent generation, so a full collection walks only what serving allocated since.
    Nothing is leaked: frozen objects are still freed by reference counting, and only cycles
    among them (start-up garbage, collected just before) would stay.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def default_agent(model: Any = "echo", *, max_tokens: int | None = None) -> Any:
    """The agent ``surefoot serve`` serves: ``model`` a spec string or a provider object (what
    ``loop.cli.model_from_args`` makes of ``--model`` and the model options), ``max_tokens`` its
    output cap per call (``--max-tokens``)."""
    from loop import Agent

    return Agent("default", DEFAULT_INSTRUCTIONS, model, max_tokens=max_tokens)


def hypercorn_config(host: str, port: int, *, backlog: int = DEFAULT_BACKLOG,
                     graceful: float = GRACEFUL_SECONDS) -> HyperConfig:
    config = HyperConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.backlog = backlog
    config.graceful_timeout = graceful
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def run_server(
    runtime: Any,
    authenticator: Authenticator,
    *,
    agent: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    backlog: int = DEFAULT_BACKLOG,
    shutdown: trio.Event,
    heartbeat: float = sse.HEARTBEAT_SECONDS,
    graceful: float = GRACEFUL_SECONDS,
    expose: dict[str, Any] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``runtime`` over HTTP until ``shutdown`` is set; ``task_status.started(base_url)``.

    ``expose``, if given, receives the transport-free ``Api`` under "api" (for other fronts and tests).
    """
    async with trio.open_nursery() as nursery:
        hubs = sse.Hubs(
            nursery,
            follow=lambda owner, conv, after: runtime.events(conv, after, owner=owner),
            tail=lambda owner, conv: runtime.store.journal.tail_cursor(owner, conv),
            heartbeat=heartbeat,
        )
        api = Api(runtime, authenticator, agent=agent, hubs=hubs, openapi=build_openapi, heartbeat=heartbeat)
        app = create_asgi(api)
        if expose is not None:
            expose["api"] = api
        config = hypercorn_config(host, port, backlog=backlog, graceful=graceful)

        async def shutdown_trigger() -> None:
            await shutdown.wait()
            api.ready = False
            hubs.close_all()
            await trio.sleep(0.05)  # let streams write their closing frame before hypercorn stops them

        binds = await nursery.start(lambda task_status: hypercorn_serve(
            app, config, shutdown_trigger=shutdown_trigger, task_status=task_status))
        url = binds[0] if binds else f"http://{host}:{port}"
        log.info("surefoot serving on %s", url)
        task_status.started(url)
        await shutdown.wait()
        # hypercorn_serve returns after its graceful shutdown; then stop the hubs.
        with trio.move_on_after(graceful + 2):
            while len(hubs):
                await trio.sleep(0.05)
        # When hypercorn has returned, only hub tasks can remain.


async def serve_store(
    url: str,
    *,
    authenticator: Authenticator,
    agent: Any,
    workers: int = 4,
    host: str = "127.0.0.1",
    port: int = 8080,
    backlog: int = DEFAULT_BACKLOG,
    describe: str = "",
    pricing: Mapping[str, Any] | None = None,
    lease_seconds: float | None = None,
) -> int:
    """Open ``url``, recover, run claim loops and serve until SIGTERM/SIGINT; returns the exit code.

    ``pricing`` is the Runtime's table (model key -> ``loop.Price``): what prices a submission's
    ``max_cost_micros`` (a ceiling on a model without a price is refused 422). ``lease_seconds``:
    the runs' lease (None: the runtime's default), i.e. how long after a SIGKILL a restarted
    server waits before it takes the dead process's runs over."""
    from loop.runtime import Runtime

    shutdown = trio.Event()
    try:
        db = await kv.open(url)
    except kv.DataDirectoryLocked as e:
        print(f"surefoot serve: {e}", file=sys.stderr)
        return 1
    try:
        # Recovery is the Runtime's: runs whose leases lapsed (a killed process) are re-claimed, and a
        # clean exit of the block releases in-flight leases (so a restart resumes at once).
        async with Runtime.open(db=db, workers=workers, agents=[agent], pricing=pricing,
                                lease_seconds=lease_seconds) as rt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_signals, shutdown, nursery.cancel_scope)

                async def server_task(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
                    await run_server(rt, authenticator, agent=agent, host=host, port=port,
                                     backlog=backlog, shutdown=shutdown, task_status=task_status)
                    nursery.cancel_scope.cancel()  # served and drained: stop the signal watcher too

                base = await nursery.start(server_task)
                tune_gc()
                print(f"surefoot serving {url} on {base}{describe}", file=sys.stderr, flush=True)
    finally:
        with trio.CancelScope(shield=True):
            await db.close()
    log.info("surefoot serve: stopped cleanly")
    return 0


async def _serve(args: argparse.Namespace, pricing: Mapping[str, Any], choice: Any) -> int:
    url = args.kv or f"lmdb:{args.data or './surefoot-data'}"
    authenticator = Authenticator(auth_from_env(args.auth))
    if not authenticator.configured():
        log.warning("authentication (%s) is not configured: every /v1 route answers 503 until it is "
                    "(set SUREFOOT_TOKEN, or SUREFOOT_JWT_KEY and SUREFOOT_JWT_ISSUER)", args.auth)
    return await serve_store(
        url, authenticator=authenticator, agent=default_agent(choice.model, max_tokens=choice.max_tokens),
        workers=args.workers, host=args.host, port=args.port, backlog=args.backlog, pricing=pricing,
        lease_seconds=getattr(args, "lease_seconds", None),
        describe=f" (auth: {args.auth}, model: {' '.join((args.model, *choice.options))}, "
                 f"workers: {args.workers}, priced models: {len(pricing)})")


async def _signals(shutdown: trio.Event, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not shutdown.is_set():
                log.info("signal %s: shutting down gracefully", signal.Signals(signum).name)
                shutdown.set()
            else:
                log.warning("second signal: stopping now")
                scope.cancel()
                return


def serve_main(args: argparse.Namespace) -> int:
    """``surefoot serve``: exit 0 after a clean shutdown; 1 when the data directory is locked;
    2 for a model option the model cannot take or a bad pricing file (checked first, in that
    order: nothing is opened or created)."""
    from loop.cli import ModelOptionError, model_from_args
    from loop.pricing import PricingFileError, pricing_from_option

    try:
        choice = model_from_args(args)
    except ModelOptionError as e:
        print(f"surefoot serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        pricing = dict(choice.pricing(pricing_from_option(getattr(args, "pricing", None))))
    except PricingFileError as e:
        print(f"surefoot serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    return trio.run(_serve, args, pricing, choice)
