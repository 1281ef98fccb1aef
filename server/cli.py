"""The single `surefoot` command.

Subcommands:

* ``serve``    — the HTTP server (server/), see :mod:`server.serve`.
* ``run``, ``inspect`` — the embedded agent loop's commands, registered by ``loop.cli``.
* ``sim``      — the deterministic simulator, registered by ``sim.cli``.
* ``kv-bench`` — commits/s and latency of the storage engine on this machine.

Other packages plug in through one function, ``add_commands(subparsers)``, which adds
their sub-parsers and sets ``func`` (called with the parsed namespace; returns an exit
code or None). A package that is not there yet, or fails to import, simply contributes
no commands: the rest of the CLI keeps working, and ``surefoot --help`` says what is
missing so the gap is visible rather than a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: Packages that contribute subcommands through ``<package>.cli.add_commands(subparsers)``.
PLUGIN_MODULES = ("loop.cli", "sim.cli")

DEFAULT_DATA_DIR = "./surefoot-data"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the HTTP thread API (JSON + SSE) over a durable store",
        description="Serve the /v1 HTTP API. With no flags: the embedded engine in "
        f"{DEFAULT_DATA_DIR}, the offline echo model, on {DEFAULT_HOST}:{DEFAULT_PORT}, "
        "token auth from SUREFOOT_TOKEN (every API route answers 503 until it is set). "
        "A submission's limits.max_cost_micros needs a price for the model: --pricing FILE "
        "(or SUREFOOT_PRICING); without one it is refused 422 missing_price. A bad pricing file stops the "
        "command before the store is opened.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data", default=None, help=f"data directory (default {DEFAULT_DATA_DIR})")
    where.add_argument("--kv", default=None, help="kv url instead of --data: memory:, lmdb:PATH, fdb:[CLUSTER_FILE]")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--workers", type=int, default=4, help="claim loops (concurrent runs) in this process")
    p.add_argument("--model", default="echo", help="echo | anthropic:MODEL | openai:MODEL@BASE_URL")
    p.add_argument("--pricing", default=None, metavar="FILE", help=_pricing_help())
    p.add_argument(
        "--auth",
        choices=("token", "jwt"),
        default="token",
        help="token: SUREFOOT_TOKEN bearer; jwt: SUREFOOT_JWT_KEY/SUREFOOT_JWT_ISSUER (+ SUREFOOT_JWT_AUDIENCE, "
        "SUREFOOT_JWT_ALGORITHMS). Unconfigured -> every /v1 route answers 503 (fails closed)",
    )
    p.add_argument("--backlog", type=int, default=2048, help="listen backlog (bursts of SSE followers)")
    p.add_argument("--log-level", default="info")
    _add_model_options(p)
    p.set_defaults(func=_cmd_serve)


def _optional_module(name: str) -> Any:
    """``importlib.import_module(name)``, or None when that module (or its package) is not in
    this build; a broken import inside it is not hidden."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, name.split(".")[0]):
            raise
        return None


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The model options of ``surefoot run`` (``--max-tokens``, ``--thinking``...), defined and
    checked once, in ``loop.cli``; serve applies them to its default agent. Also ``run``'s
    ``--lease-seconds`` (the runs' lease, checked the same way)."""
    cli = _optional_module("loop.cli")
    if cli is None:
        return
    cli.add_model_options(p)
    p.add_argument("--lease-seconds", type=cli.positive_seconds, default=None, help=cli.LEASE_OPTION_HELP)


def _pricing_help() -> str:
    pricing = _optional_module("loop.pricing")
    return pricing.PRICING_OPTION_HELP if pricing is not None else "JSON file of model prices (see loop.pricing)"


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve import serve_main
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.serve":
            raise
        print("surefoot serve: the HTTP server is not in this build yet", file=sys.stderr)
        return 1
    return serve_main(args)


def _add_kv_bench(subparsers: argparse._SubParsersAction) -> None:
    from .kvbench import MAX_TRANSACTIONS, MAX_WRITERS

    p = subparsers.add_parser(
        "kv-bench",
        help="measure commits/s and commit latency of the storage engine",
        description="Run N small write transactions from M concurrent writers on the embedded "
        "engine (a temporary directory unless --data or --kv) and print one JSON line: "
        "commits/s, p50 and p99 commit latency in ms.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data", default=None, help="data directory to run in (default: a temp dir)")
    where.add_argument("--kv", default=None, help="kv url: memory:, lmdb:PATH, fdb:[CLUSTER_FILE]")
    p.add_argument("-n", "--transactions", type=int, default=5000)
    p.add_argument("-m", "--writers", type=int, default=32, help="concurrent writers")

    def run(args: argparse.Namespace) -> int:
        if not 1 <= args.transactions <= MAX_TRANSACTIONS:
            p.error(f"--transactions must be in 1..{MAX_TRANSACTIONS}")
        if not 1 <= args.writers <= MAX_WRITERS:
            p.error(f"--writers must be in 1..{MAX_WRITERS}")
        from .kvbench import kv_bench_main

        result = kv_bench_main(args.kv, args.data, args.transactions, args.writers)
        print(json.dumps(result))
        return 0

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="surefoot",
        description="surefoot — a durable agent runtime for Python.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(subparsers)
    _add_kv_bench(subparsers)
    missing: list[str] = []
    for name in PLUGIN_MODULES:
        module = _optional_module(name)
        if module is None:
            missing.append(name)
            continue
        add = getattr(module, "add_commands", None)
        if add is None:
            missing.append(f"{name} (no add_commands)")
            continue
        add(subparsers)
    if missing:
        parser.epilog = "not available in this build: " + ", ".join(missing)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "warning")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover - `python -m server.cli`
    sys.exit(main())
