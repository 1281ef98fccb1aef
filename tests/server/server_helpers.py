"""Helpers: a real Runtime + real hypercorn on a loopback port, driven with httpx."""

from __future__ import annotations

import itertools
import re
import signal
import socket
import subprocess
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import trio

from loop.runtime import Runtime
from server.auth import AuthConfig, Authenticator
from server.serve import default_agent, run_server

TOKEN = "test-token-0123456789"
FDB_CAPI = "fdb-capi"  # serving()'s url for the FoundationDB backend over the stand-in libfdb_c


#: The line `surefoot serve` writes to stderr once it listens: it names the bound address.
SERVING_LINE = re.compile(r"^surefoot serving \S+ on (http://\S+)", re.M)
_starts = itertools.count()


class ServeProcess:
    """A server child process (``surefoot serve`` or tests/server/serve_child.py) on a port the
    kernel picks: the command gets ``--port 0`` (or ``0``) and the test reads the bound address
    from the serving line. A port picked by ``free_port()`` and bound later by the child can be
    taken in between by any other process on the machine; on a busy host that made restarts fail.

    stderr goes to a file of its own, so a chatty child never blocks on a full pipe and a child
    that exits early is reported with what it said."""

    def __init__(self, argv: list[str], *, tmp: Path, env: dict[str, str], cwd: Path | None = None) -> None:
        self.err_path = tmp / f"serve-{next(_starts)}.err"
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._err)
        self.url: str | None = None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.stderr()}")

    async def healthy(self, timeout: float = 30) -> str:
        """Wait until the child listens and answers /readyz 200; its base url."""
        with trio.fail_after(timeout):
            while self.url is None:
                self._check_alive()
                m = SERVING_LINE.search(self.stderr())
                if m:
                    self.url = m.group(1)
                else:
                    await trio.sleep(0.05)
            async with httpx.AsyncClient(base_url=self.url, timeout=2) as c:
                while True:
                    self._check_alive()
                    try:
                        if (await c.get("/readyz")).status_code == 200:
                            return self.url
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)

    def client(self, token: str | None = TOKEN, **kw: Any) -> httpx.AsyncClient:
        assert self.url, "healthy() first"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 10), **kw)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Kill it if it still runs (a failed test), and close the stderr file."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()

    async def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then its exit code (killed if it does not exit in ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await trio.to_thread.run_sync(lambda: self.proc.wait(timeout))
        finally:
            self.close()


@dataclass
class Served:
    url: str
    rt: Any
    auth: Authenticator
    shutdown: trio.Event
    api: Any = None

    def client(self, token: str | None = TOKEN, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        headers.update(kw.pop("headers", {}))
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 20), **kw)


@asynccontextmanager
async def serving(url: str = "memory:", *, auth: AuthConfig | None = None, agent: Any = None,
                  workers: int = 2, heartbeat: float = 15.0, clock: Any = None,
                  **rt_kw: Any) -> AsyncIterator[Served]:
    auth = auth if auth is not None else AuthConfig(mode="token", token=TOKEN)
    authenticator = Authenticator(auth, **({"clock": clock} if clock else {}))
    agent = agent if agent is not None else default_agent("echo")
    async with _storage(url) as db, Runtime.open(url, db=db, workers=workers, agents=[agent], **rt_kw) as rt:
        async with trio.open_nursery() as nursery:
            shutdown = trio.Event()
            exposed: dict = {}
            base = await nursery.start(lambda task_status: run_server(
                rt, authenticator, agent=agent, host="127.0.0.1", port=0, shutdown=shutdown,
                heartbeat=heartbeat, graceful=1.0, expose=exposed, task_status=task_status))
            try:
                yield Served(base, rt, authenticator, shutdown, exposed["api"])
            finally:
                shutdown.set()


@asynccontextmanager
async def _storage(url: str) -> AsyncIterator[Any]:
    """``url`` itself for the embedded engines (the Runtime opens it); for ``"fdb-capi"``, the
    FoundationDB backend over the real ``fdb`` bindings and the stand-in libfdb_c
    (docs/fdb-testing.md), on a fresh stand-in cluster."""
    if url != FDB_CAPI:
        yield None
        return
    from kvtest_helpers import stand_in_database

    with tempfile.TemporaryDirectory(prefix="surefoot-standin-") as tmp:
        async with stand_in_database(Path(tmp)) as db:
            yield db


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_settled(client: httpx.AsyncClient, run_id: str, timeout: float = 20) -> dict:
    with trio.fail_after(timeout):
        while True:
            r = await client.get(f"/v1/runs/{run_id}")
            assert r.status_code == 200, r.text
            body = r.json()
            if body["status"] in ("completed", "failed", "cancelled"):
                return body
            await trio.sleep(0.02)


def parse_sse(buf: str) -> tuple[list[dict], str]:
    """Complete SSE frames in ``buf`` -> (frames as {id, event, data, comment}, the incomplete rest)."""
    frames = []
    while "\n\n" in buf:
        raw, buf = buf.split("\n\n", 1)
        f: dict = {}
        for line in raw.split("\n"):
            if line.startswith(":"):
                f["comment"] = line[1:].strip()
            elif ":" in line:
                k, _, v = line.partition(":")
                f[k] = v[1:] if v.startswith(" ") else v
        frames.append(f)
    return frames, buf


def ticking_agent(n: int = 8, delay: float = 0.05, effects: list | None = None, name: str = "default") -> Any:
    """An agent whose scripted model calls the ``tick`` tool ``n`` times, then answers: a turn with many events."""
    from loop import Agent, ScriptedModel
    from loop.providers.scripted import reply, tool_call

    def script(messages, tools):
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        done = sum(1 for m in messages[last_user:] if m.get("role") == "tool")  # this turn's ticks
        if done >= n:
            return "done"
        return reply(f"tick {done}", tool_call("tick", {"i": done}))

    async def tick(i: int) -> str:
        """Wait a little and report."""
        if effects is not None:
            effects.append(i)
        await trio.sleep(delay)
        return f"ok {i}"

    return Agent(name, "tick", ScriptedModel(script), tools=[tick])


class SSEReader:
    """Reads an SSE response incrementally into frames."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._it = response.aiter_text()
        self._buf = ""
        self._pending: list[dict] = []

    async def next(self) -> dict:
        while not self._pending:
            chunk = await self._it.__anext__()
            frames, self._buf = parse_sse(self._buf + chunk)
            self._pending.extend(frames)
        return self._pending.pop(0)

    async def events_until(self, pred, timeout: float = 20) -> list[dict]:
        out = []
        with trio.fail_after(timeout):
            while True:
                f = await self.next()
                if "id" in f or "event" in f:
                    out.append(f)
                    if pred(f):
                        return out
