"""A chaos soak of the real server process: `surefoot serve` SIGKILLed at random moments, restarted.

    python tests/server/chaos.py --seconds 600 --seed 7        # a long soak; exit 1 on any violation
    python tests/server/chaos.py --seconds 30 --kills 3 --seed 1 --record /tmp/chaos.json

The simulator (sim/) checks the promises of ../shared/DESIGN.md on the in-memory engine with a
virtual clock. This checks them on the real stack: hypercorn + quart-trio in a child process
(serve_child.py: an agent whose scripted model calls a ``tick`` tool that fsyncs its effect to a
file before sleeping), the LMDB engine with its write-ahead log on a real directory, and real
httpx clients over loopback:

* clients submit messages to a few conversations with Idempotency-Keys, retry a submission whose
  acknowledgement was lost (same key, same body) until it is acknowledged, re-send acknowledged
  keys (the same run must come back) and reuse keys with another body (409), sometimes cancel;
* followers read conversations' SSE streams, resuming with ``Last-Event-ID`` after every drop
  (a kill, or a disconnect of their own);
* a killer SIGKILLs the server at chosen moments — mid-tool (an effect recorded, its result not),
  mid-stream (a follower just got a frame), right after a submit left a client, or anywhere — and
  restarts it on the same data directory.

Then, after the last restart and quiescence, :func:`check` names every promise the record breaks
(see VIOLATIONS). Choices are seeded; timing is not (it is a real process on a real clock), so a
seed reproduces the plan, not the exact interleaving — a failure prints the seed and the command.

The record is plain JSON (``--record``), so the checker can be run, and bitten, on its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _p in (str(HERE), str(ROOT)):  # run as a script: the helpers beside it, the packages they import
    if _p not in sys.path:
        sys.path.insert(0, _p)

from server_helpers import free_port, parse_sse

TOKEN = "chaos-token-0123456789"
SSE = {"Accept": "text/event-stream"}
TERMINAL_EVENTS = ("run.completed", "run.failed", "run.cancelled")
SETTLED = ("completed", "failed", "cancelled")
#: How a kill is timed. Every soak with two kills or more has the first two. ``at_ready``: as soon
#: as a restarted server answers /readyz, while it re-claims and recovers the runs the last kill cut.
#: ``mid_start``: the server is killed, restarted, and killed again before it answers (in its log
#: replay, its checkpoint at open, its first claims...); it counts as one kill. ``mid_term``: SIGTERM,
#: then SIGKILL within a second, in the graceful shutdown (streams closing, leases being released).
KILL_MODES = ("mid_tool", "after_submit", "mid_stream", "anywhere", "at_ready", "mid_start", "mid_term")
#: Longest wait for a kill's moment before killing anyway (mode recorded as ``<mode>:timeout``).
TRIGGER_TIMEOUT = 6.0
#: Seconds of work (range) a restarted server gets before the next kill, however late the plan runs.
MIN_WORK = (1.0, 3.0)
#: Longest a (re)started server may take to answer /readyz (imports on a loaded 2-core box are slow).
START_TIMEOUT = 60.0
MAX_PAGE = 1_000  # server.limits.MAX_PAGE
#: Seconds of soak per conversation (ChaosConfig.conversations), to stay clear of journal retention.
CONVERSATION_SECONDS = 150.0

#: The violations :func:`check` reports, by name, with the promise each one breaks.
VIOLATIONS = {
    "server_start": "the server failed to (re)start on the data directory it left, or died on its own",
    "server_error": "a 5xx answer (never a stack trace, never a partial write)",
    "submit_unacknowledged": "a submission never got an acknowledgement however often it was retried",
    "ack_settled": "promise 1/4: an acknowledged submission did not settle as it should (completed; "
                   "cancelled only if the driver cancelled it)",
    "ack_in_transcript": "promise 1/2: a completed run's user message is not in its transcript exactly once",
    "one_run_per_key": "promise 1: one Idempotency-Key gave two runs, or its settled re-send another answer",
    "key_conflict_409": "promise 1: a key reused with a different body was not refused 409",
    "tool_at_most_once": "promise 3: a tool call's effect was recorded more than once",
    "interrupted_result": "promise 3: a call whose effect is recorded lacks its result or an `interrupted` one, "
                          "or a call has the tool's own result with no effect recorded",
    "transcript_well_formed": "promise 2: a tool call without exactly one result after it, or a result without a call",
    "journal_order": "promise 9: journal positions not strictly increasing, or one used twice",
    "settled_once": "promise 9: a run's terminal event missing, repeated, or contradicting its status",
    "stream_exact": "promise 9: a follower's ids are not a contiguous slice of the final journal",
    "stream_caught_up": "promise 9: a follower never reached the end of the final journal",
}


@dataclass
class ChaosConfig:
    seed: int = 1
    seconds: float = 20.0          # the chaos phase (kills spread over it); quiescence comes after
    kills: int | None = None       # how many kills; None: one per ~`kill_every` seconds (restarts included)
    kill_every: float = 30.0
    conversations: int = 0         # 0: one per CONVERSATION_SECONDS of soak, at least 4 (see below)
    clients: int = 3
    followers: int = 0             # 0: one per conversation from its start, two more from an ack's cursor
    ticks: int = 3
    tick_seconds: float = 0.12
    lease_seconds: float = 3.0
    segment_bytes: int = 128 << 10  # the log's segments: small, so the checkpointer runs during the soak
    max_outstanding: int = 3       # unsettled runs per client before it waits
    settle_timeout: float = 120.0
    progress: bool = False

    def __post_init__(self) -> None:
        # A conversation's journal keeps its last 20,000 events (promise 9's retention); a follower
        # from the start of a trimmed journal is rightly told it fell behind, which this checker
        # does not model. At this soak's rate (40-90 events/s in all) a conversation per 150 s keeps
        # each one well under that.
        if not self.conversations:
            self.conversations = max(4, math.ceil(self.seconds / CONVERSATION_SECONDS))
        if not self.followers:
            self.followers = self.conversations + 2

    def planned_kills(self) -> int:
        return self.kills if self.kills is not None else max(1, round(self.seconds / self.kill_every))


# ----------------------------------------------------------------------------- the server child


class Server:
    """The serve_child process on one data directory, killed and restarted in place."""

    def __init__(self, workdir: Path, cfg: ChaosConfig) -> None:
        self.data = workdir / "data"
        self.effects = workdir / "effects.txt"
        self.effects.touch()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = cfg
        self.proc: trio.Process | None = None
        self.starts = 0
        self.log = workdir / "server.log"
        self.up = trio.Event()  # set while the server answers; replaced at each kill
        self.start_seconds = 3.0  # how long the last start took to answer /readyz

    async def start(self) -> None:
        """Spawn the child and wait until it answers /readyz."""
        await self.spawn()
        t = time.monotonic()
        await self.wait_ready()
        self.start_seconds = time.monotonic() - t

    async def spawn(self) -> None:
        env = {**os.environ, "SUREFOOT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT),
               "SUREFOOT_TEST_TICKS": str(self.cfg.ticks), "SUREFOOT_TEST_TICK_SECONDS": str(self.cfg.tick_seconds),
               "SUREFOOT_TEST_LEASE_SECONDS": str(self.cfg.lease_seconds), "SUREFOOT_TEST_EFFECTS_DETAIL": "1",
               "SUREFOOT_TEST_SEGMENT_BYTES": str(self.cfg.segment_bytes)}
        with open(self.log, "ab") as log:  # noqa: ASYNC230 — a local file, written once per start
            log.write(f"--- start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "serve_child.py"), str(self.data), str(self.port), str(self.effects)],
                env=env, stdout=log, stderr=log)
        self.starts += 1

    async def wait_ready(self) -> None:
        assert self.proc is not None
        with trio.fail_after(START_TIMEOUT):
            async with httpx.AsyncClient(base_url=self.url, timeout=2) as c:
                while True:
                    if self.proc.poll() is not None:
                        raise ServerFailed(f"exited {self.proc.returncode} at start {self.starts}: {self.log_tail()}")
                    try:
                        if (await c.get("/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)
        self.up.set()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        if self.up.is_set():  # a server killed while starting was never up: keep the event its waiters hold
            self.up = trio.Event()
        self.proc.send_signal(sig)

    async def wait_dead(self) -> None:
        assert self.proc is not None
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(20):
                await self.wait_dead()
            if self.proc.poll() is None:
                self.proc.kill()
                with trio.CancelScope(shield=True):
                    await self.wait_dead()

    def effects_size(self) -> int:
        """Bytes in the effects file: it grows by one line per tool execution."""
        return self.effects.stat().st_size

    def log_tail(self, n: int = 2_000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class ServerFailed(Exception):
    pass


# ----------------------------------------------------------------------------- the driver


class Driver:
    def __init__(self, cfg: ChaosConfig, server: Server) -> None:
        self.cfg = cfg
        self.server = server
        self.rng = random.Random(cfg.seed)
        self.convs = [f"conv{i}" for i in range(cfg.conversations)]
        self.subs: dict[str, dict] = {}           # key -> submission record
        self.conflicts: list[dict] = []           # key reused with another body -> answer
        self.followers: list[dict] = []
        self.kills: list[dict] = []
        self.errors: list[dict] = []              # 5xx answers
        self.start_failures: list[str] = []
        self.chaos_over = trio.Event()
        self.submit_sent = trio.Event()           # replaced per kill arming
        self.frame_seen = trio.Event()
        self.conv_exists = {c: trio.Event() for c in self.convs}
        self.ack_cursors: dict[str, list[str]] = defaultdict(list)
        self.targets: dict[str, str | None] | None = None  # conv -> final tail, set at quiescence
        self.followers_done = trio.Event()
        self.follower_scopes: dict[int, tuple[dict, trio.CancelScope]] = {}
        self.counts: Counter = Counter()
        self.t0 = time.monotonic()

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                 timeout=kw.pop("timeout", httpx.Timeout(10.0)), **kw)

    def _note_status(self, what: str, r: httpx.Response) -> None:
        if r.status_code >= 500 and r.status_code != 503:
            self.errors.append({"what": what, "status": r.status_code, "body": r.text[:500]})

    # -- submissions -----------------------------------------------------------

    async def submit_until_acked(self, c: httpx.AsyncClient, key: str, *, deadline: float | None) -> bool:
        """Send (and re-send, same key and body) until acknowledged; False if the deadline passed first."""
        s = self.subs[key]
        while deadline is None or time.monotonic() < deadline:
            s["sends"] += 1
            if s["sends"] > 1:
                self.counts["retries"] += 1
            self.submit_sent.set()
            try:
                r = await c.post(f"/v1/conversations/{s['conv']}/messages", json=s["body"],
                                 headers={"Idempotency-Key": key})
            except httpx.ConnectError:
                s["unsent"] += 1  # no connection: the request never reached a server
                await self.server.up.wait()
                await trio.sleep(0.05)
                continue
            except httpx.TransportError:
                s["lost"] += 1  # it may have been received, even committed: its answer is lost
                await self.server.up.wait()
                await trio.sleep(0.05)
                continue
            self._note_status(f"submit {key}", r)
            if r.status_code in (200, 202):
                body = r.json()
                s["acks"].append({"status": r.status_code, "run_id": body["run_id"], "duplicate": body["duplicate"]})
                s["run_id"] = s["run_id"] or body["run_id"]
                if body.get("cursor"):
                    self.ack_cursors[s["conv"]].append(body["cursor"])
                self.conv_exists[s["conv"]].set()
                return True
            s["refusals"].append({"status": r.status_code, "body": r.text[:300]})
            if r.status_code == 409:  # same key, same body: a violation the checker names
                return True
            await trio.sleep(0.1)
        return False

    async def client_task(self, n: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/client/{n}")
        outstanding: list[str] = []
        i = 0
        async with self.client() as c:
            while not self.chaos_over.is_set():
                await self.server.up.wait()
                conv = rng.choice(self.convs)
                key = f"s{self.cfg.seed}-c{n}-{i}"
                i += 1
                self.subs[key] = {"key": key, "conv": conv, "body": {"message": f"message {key}"}, "sends": 0,
                                  "unsent": 0, "lost": 0, "acks": [], "refusals": [], "run_id": None, "cancel": None,
                                  "resend": None}
                if not await self.submit_until_acked(c, key, deadline=None):
                    continue
                outstanding.append(key)
                roll = rng.random()
                try:
                    if roll < 0.12:
                        await trio.sleep(rng.uniform(0, 0.4))
                        await self.cancel(c, key)
                    elif roll < 0.22:
                        await self.resend_same(c, key)
                    elif roll < 0.30:
                        await self.reuse_key(c, key, rng)
                    # keep a few runs in flight per client, not an unbounded queue
                    while len(outstanding) >= self.cfg.max_outstanding and not self.chaos_over.is_set():
                        outstanding = [k for k in outstanding if not await self.is_settled(c, k)]
                        if len(outstanding) >= self.cfg.max_outstanding:
                            await trio.sleep(0.1)
                except httpx.TransportError:
                    await self.server.up.wait()
                await trio.sleep(rng.uniform(0, 0.3))

    async def is_settled(self, c: httpx.AsyncClient, key: str) -> bool:
        r = await c.get(f"/v1/runs/{self.subs[key]['run_id']}")
        self._note_status("get run", r)
        return r.status_code == 200 and r.json()["status"] in SETTLED

    async def cancel(self, c: httpx.AsyncClient, key: str) -> None:
        s = self.subs[key]
        s["cancel"] = "maybe"  # sent: it may be recorded even if its answer is lost
        r = await c.post(f"/v1/runs/{s['run_id']}/cancel")
        self._note_status("cancel", r)
        if r.status_code == 202:
            s["cancel"] = "acked"
            self.counts["cancels"] += 1

    async def resend_same(self, c: httpx.AsyncClient, key: str) -> None:
        s = self.subs[key]
        r = await c.post(f"/v1/conversations/{s['conv']}/messages", json=s["body"], headers={"Idempotency-Key": key})
        self._note_status("resend", r)
        if r.status_code in (200, 202):
            body = r.json()
            s["acks"].append({"status": r.status_code, "run_id": body["run_id"], "duplicate": body["duplicate"]})
            self.counts["resends"] += 1

    async def reuse_key(self, c: httpx.AsyncClient, key: str, rng: random.Random) -> None:
        s = self.subs[key]
        other = {"message": f"another body for {key}"}
        conv = s["conv"] if rng.random() < 0.7 else rng.choice(self.convs)
        r = await c.post(f"/v1/conversations/{conv}/messages", json=other, headers={"Idempotency-Key": key})
        self._note_status("reuse", r)
        self.conflicts.append({"key": key, "conv": conv, "status": r.status_code, "body": r.text[:300]})

    # -- followers -------------------------------------------------------------

    async def follower_task(self, n: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/follower/{n}")
        conv = self.convs[n % len(self.convs)]
        await self.conv_exists[conv].wait()
        after = None
        if n >= len(self.convs) and self.ack_cursors[conv]:
            after = rng.choice(self.ack_cursors[conv])  # start mid-journal, from an ack's cursor
        rec = {"conv": conv, "after": after, "ids": [], "connects": 0, "drops": 0, "resumed": 0, "behind": [],
               "refused": []}
        cut = False  # the last connection dropped under us: the next frame is a resumption
        self.followers.append(rec)
        async with self.client(timeout=httpx.Timeout(10.0, read=30.0)) as c:
            while True:
                last = rec["ids"][-1] if rec["ids"] else after
                if self._caught_up(rec):
                    return
                headers = dict(SSE)
                if last:
                    headers["Last-Event-ID"] = last
                rec["connects"] += 1
                try:
                    with trio.CancelScope() as scope:
                        # quiesce() cancels it if the follower already is at the final tail (a quiet stream)
                        self.follower_scopes[n] = (rec, scope)
                        got = len(rec["ids"])
                        await self.follow_once(c, rec, headers, rng)
                except (httpx.TransportError, httpx.StreamError):
                    rec["drops"] += 1
                    if cut and len(rec["ids"]) > got:
                        rec["resumed"] += 1
                    cut = True
                    await self.server.up.wait()
                else:
                    if cut and len(rec["ids"]) > got:
                        rec["resumed"] += 1
                        cut = False
                await trio.sleep(rng.uniform(0, 0.05))

    async def follow_once(self, c: httpx.AsyncClient, rec: dict, headers: dict, rng: random.Random) -> None:
        """One connection: read frames until it drops, we drop it, or the follower is at the final tail."""
        async with c.stream("GET", f"/v1/conversations/{rec['conv']}/events", headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                self._note_status("sse", r)
                rec["refused"].append(r.status_code)
                await trio.sleep(0.1)
                return
            buf = ""
            async for chunk in r.aiter_text():
                frames, buf = parse_sse(buf + chunk)
                for f in frames:
                    if f.get("event") == "cursor.behind":
                        rec["behind"].append(f.get("data"))
                    if "id" in f:
                        rec["ids"].append(f["id"])
                        self.counts["events_followed"] += 1
                        self.frame_seen.set()
                if self._caught_up(rec):
                    return
                if rng.random() < 0.01:
                    return  # drop the connection ourselves, and resume

    def _caught_up(self, rec: dict) -> bool:
        if self.targets is None:
            return False
        target = self.targets.get(rec["conv"])
        last = rec["ids"][-1] if rec["ids"] else rec["after"]
        return target is None or (last is not None and last >= target)

    # -- the killer ------------------------------------------------------------

    def kill_modes(self, n: int) -> list[str]:
        rng = random.Random(f"{self.cfg.seed}/modes")
        modes: list[str] = []
        while len(modes) < n:
            block = list(KILL_MODES)
            rng.shuffle(block)
            if not modes:  # the first two kills: a tool mid-flight, an ack in flight (in either order)
                first = ["mid_tool", "after_submit"]
                rng.shuffle(first)
                block = first + [m for m in block if m not in first]
            modes += block
        return modes[:n]

    async def killer_task(self) -> None:
        rng = random.Random(f"{self.cfg.seed}/killer")
        n = self.cfg.planned_kills()
        modes = self.kill_modes(n)
        gap = self.cfg.seconds / (n + 1)
        for i, mode in enumerate(modes):
            # kills spread over the phase's wall time (restarts included), each after some work
            due = self.t0 + (i + 1) * gap + rng.uniform(-0.3, 0.3) * gap
            if mode == "at_ready":
                await trio.sleep(rng.uniform(0, 0.3))
            else:
                await trio.sleep(max(due - time.monotonic(), rng.uniform(*MIN_WORK)))
            how = mode
            with trio.move_on_after(TRIGGER_TIMEOUT) as scope:
                if mode == "mid_tool":
                    base = self.server.effects_size()
                    while self.server.effects_size() <= base:
                        await trio.sleep(0.005)
                    await trio.sleep(rng.uniform(0, 0.6 * self.cfg.tick_seconds))
                elif mode == "after_submit":
                    self.submit_sent = trio.Event()
                    await self.submit_sent.wait()
                    await trio.sleep(rng.uniform(0, 0.004))
                elif mode == "mid_stream":
                    self.frame_seen = trio.Event()
                    await self.frame_seen.wait()
            if scope.cancelled_caught:
                how = f"{mode}:timeout"
            if mode == "mid_term":
                self.server.kill(signal.SIGTERM)
                await trio.sleep(rng.uniform(0, 1.0))
                if self.server.proc is not None and self.server.proc.poll() is not None:
                    how += ":clean" if self.server.proc.returncode == 0 else f":exit {self.server.proc.returncode}"
            if mode == "mid_start":
                # kill the server, start another and kill that one before it answers: somewhere in its
                # imports, its log replay and checkpoint at open, or its first claims
                self.server.kill()
                await self.server.wait_dead()
                await self.server.spawn()
                await trio.sleep(rng.uniform(0.3, 1.0) * self.server.start_seconds)
                if self.server.proc is not None and self.server.proc.poll() is not None:
                    self.start_failures.append(f"exited {self.server.proc.returncode} while starting: "
                                               f"{self.server.log_tail()}")
                    raise ServerFailed("the server died while starting")
            self.server.kill()
            t = time.monotonic() - self.t0
            await self.server.wait_dead()
            self.kills.append({"n": i, "mode": how, "at": round(t, 3)})
            self.counts["kills"] += 1
            await self.restart()

    async def restart(self) -> None:
        try:
            await self.server.start()
        except (ServerFailed, trio.TooSlowError) as e:
            self.start_failures.append(f"{type(e).__name__}: {e} {self.server.log_tail()}")
            raise

    # -- quiescence and the final record ----------------------------------------

    async def quiesce(self) -> dict:
        """After the chaos: every submission acknowledged, every run settled, followers at the tail."""
        deadline = time.monotonic() + self.cfg.settle_timeout
        async with self.client() as c:
            for key, s in list(self.subs.items()):
                if not s["acks"] and not s["refusals"]:
                    await self.submit_until_acked(c, key, deadline=deadline)
            runs: dict[str, dict] = {}
            for key, s in self.subs.items():
                if not s["run_id"]:
                    continue
                while True:
                    r = await c.get(f"/v1/runs/{s['run_id']}")
                    self._note_status("get run", r)
                    if r.status_code == 200 and r.json()["status"] in SETTLED:
                        break
                    if time.monotonic() > deadline:
                        break
                    await trio.sleep(0.1)
                runs[s["run_id"]] = r.json() if r.status_code == 200 else {"status": f"http {r.status_code}"}
            # a settled key re-sent with its body answers with that same run
            for key, s in self.subs.items():
                if s["run_id"] and runs.get(s["run_id"], {}).get("status") in SETTLED:
                    r = await c.post(f"/v1/conversations/{s['conv']}/messages", json=s["body"],
                                     headers={"Idempotency-Key": key})
                    self._note_status("final resend", r)
                    s["resend"] = {"status": r.status_code,
                                   "run_id": r.json().get("run_id") if r.status_code in (200, 202) else None}
            journals = {conv: await self.read_journal(c, conv) for conv in self.convs}
            self.targets = {conv: (j[-1]["cursor"] if j else None) for conv, j in journals.items()}
            for rec, scope in self.follower_scopes.values():
                if self._caught_up(rec):
                    scope.cancel()  # blocked on a quiet stream, with nothing more to come
            caught = False
            with trio.move_on_after(30):
                await self.followers_done.wait()
                caught = True
            transcripts = {conv: await self.read_transcript(c, conv) for conv in self.convs}
            conv_runs = {}
            for conv in self.convs:
                r = await c.get(f"/v1/conversations/{conv}/runs")
                conv_runs[conv] = r.json()["runs"] if r.status_code == 200 else []
            journals = {conv: await self.read_journal(c, conv) for conv in self.convs}
        effects = [line.split() for line in self.server.effects.read_text().splitlines() if line.strip()]
        return {"runs": runs, "journals": journals, "transcripts": transcripts, "conv_runs": conv_runs,
                "effects": effects, "followers_caught_up": caught}

    async def read_journal(self, c: httpx.AsyncClient, conv: str) -> list[dict]:
        out: list[dict] = []
        after = None
        while True:
            params: dict[str, Any] = {"limit": MAX_PAGE}
            if after:
                params["after"] = after
            r = await c.get(f"/v1/conversations/{conv}/events", params=params)
            if r.status_code != 200:
                self._note_status("journal", r)
                return out
            page = r.json()
            out += [{"cursor": e["cursor"], "type": e["type"], "data": e["data"]} for e in page["events"]]
            if not page["more"]:
                return out
            after = page["next_cursor"]

    async def read_transcript(self, c: httpx.AsyncClient, conv: str) -> list[dict]:
        out: list[dict] = []
        start = 0
        while True:
            r = await c.get(f"/v1/conversations/{conv}/messages", params={"start": start, "limit": MAX_PAGE})
            if r.status_code != 200:
                self._note_status("transcript", r)
                return out
            page = r.json()
            out += page["messages"]
            if page["next"] is None:
                return out
            start = page["next"]

    # -- the whole soak ----------------------------------------------------------

    async def run(self) -> dict:
        final: dict = {}
        try:
            await self.server.start()
        except (ServerFailed, trio.TooSlowError) as e:
            self.start_failures.append(f"{type(e).__name__}: {e}")
            return self.record(final)
        try:
            async with trio.open_nursery() as nursery:
                followers_left = [self.cfg.followers]

                async def follower(n: int) -> None:
                    await self.follower_task(n)
                    followers_left[0] -= 1
                    if followers_left[0] == 0:
                        self.followers_done.set()

                if self.cfg.followers == 0:
                    self.followers_done.set()
                for n in range(self.cfg.followers):
                    nursery.start_soon(follower, n)
                if self.cfg.progress:
                    nursery.start_soon(self.progress_task)
                async with trio.open_nursery() as chaos:
                    for n in range(self.cfg.clients):
                        chaos.start_soon(self.client_task, n)
                    await self.killer_task()
                    self.chaos_over.set()
                    # a client cut mid-submission leaves it unacknowledged: quiesce() re-sends it
                    chaos.cancel_scope.cancel()
                final = await self.quiesce()
                nursery.cancel_scope.cancel()
        except (ServerFailed, trio.TooSlowError):
            pass  # recorded in start_failures
        except httpx.TransportError as e:
            self.start_failures.append(f"the server stopped answering after the chaos: {e!r} {self.server.log_tail()}")
        finally:
            with trio.CancelScope(shield=True):
                await self.server.stop()
        return self.record(final)

    async def progress_task(self) -> None:
        from rich.console import Console

        console = Console(stderr=True)
        with console.status("") as status:
            while True:
                acks = sum(1 for s in self.subs.values() if s["acks"])
                status.update(f"seed {self.cfg.seed} {time.monotonic() - self.t0:6.1f}s  kills {len(self.kills)}/"
                              f"{self.cfg.planned_kills()}  submits {len(self.subs)}  acks {acks}  "
                              f"retries {self.counts['retries']}  effects {len(self.server.effects.read_bytes().splitlines())}  "
                              f"events followed {self.counts['events_followed']}")
                await trio.sleep(0.5)

    def record(self, final: dict) -> dict:
        return {"seed": self.cfg.seed, "config": asdict(self.cfg), "seconds": round(time.monotonic() - self.t0, 1),
                "kills": self.kills, "starts": self.server.starts, "start_failures": self.start_failures,
                "submissions": list(self.subs.values()), "conflicts": self.conflicts, "followers": self.followers,
                "errors": self.errors, "counts": dict(self.counts), **final}


# ----------------------------------------------------------------------------- the checker


@dataclass
class Violation:
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclass
class Report:
    seed: int
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, detail: str) -> None:
        assert name in VIOLATIONS, name
        self.violations.append(Violation(name, detail))

    def names(self) -> set[str]:
        return {v.name for v in self.violations}


def check(rec: dict) -> Report:
    """Every promise the record breaks, by name (VIOLATIONS), and the soak's figures."""
    rep = Report(rec["seed"])
    for f in rec.get("start_failures", []):
        rep.add("server_start", f[:1500])
    if rec.get("start_failures") or "runs" not in rec:
        rep.stats = _stats(rec, {})
        return rep
    for e in rec["errors"]:
        rep.add("server_error", json.dumps(e))
    runs: dict[str, dict] = rec["runs"]
    journals: dict[str, list[dict]] = rec["journals"]
    transcripts: dict[str, list[dict]] = rec["transcripts"]

    # promise 1: acknowledgements, one run per key, 409 on another body
    run_of_key: dict[str, str] = {}
    for s in rec["submissions"]:
        key = s["key"]
        if not s["acks"]:
            if s["refusals"]:
                rep.add("one_run_per_key", f"{key}: its own body refused {s['refusals']}")
            else:
                rep.add("submit_unacknowledged", f"{key} sent {s['sends']} times, never acknowledged")
            continue
        ids = {a["run_id"] for a in s["acks"]}
        if len(ids) != 1:
            rep.add("one_run_per_key", f"{key}: acknowledgements name runs {sorted(ids)}")
        run_id = s["acks"][0]["run_id"]
        run_of_key[key] = run_id
        resend = s.get("resend")
        if resend is not None and (resend["status"] != 200 or resend["run_id"] != run_id):
            rep.add("one_run_per_key", f"{key}: settled re-send answered {resend} (run {run_id})")
        info = runs.get(run_id)
        status = info.get("status") if info else None
        allowed = {"completed"} | ({"cancelled"} if s["cancel"] else set())
        if status not in allowed:
            outcome = (info or {}).get("outcome")
            rep.add("ack_settled", f"{key} run {run_id}: {status} (cancel {s['cancel']}, outcome {outcome}, "
                                   f"attempt {(info or {}).get('attempt')})")
        if info and info.get("submission_id") not in (None, key):
            rep.add("one_run_per_key", f"{key}: run {run_id} belongs to submission {info.get('submission_id')}")
    for c in rec["conflicts"]:
        if c["status"] != 409:
            rep.add("key_conflict_409", f"{c['key']} reused with another body on {c['conv']}: {c['status']} {c['body']}")
    by_sub: dict[str, set[str]] = defaultdict(set)
    for conv, rs in rec["conv_runs"].items():
        for r in rs:
            by_sub[r.get("submission_id")].add(r["run_id"])
    known = {s["key"] for s in rec["submissions"]}
    for key, rids in by_sub.items():
        if len(rids) > 1:
            rep.add("one_run_per_key", f"submission {key} has runs {sorted(rids)}")
        if key not in known:
            rep.add("one_run_per_key", f"runs {sorted(rids)} for a submission nobody sent ({key})")

    # promise 1/2: a completed run's user message is in its transcript exactly once
    texts: dict[str, Counter] = {conv: Counter() for conv in transcripts}
    for conv, msgs in transcripts.items():
        for m in msgs:
            if m.get("role") == "user":
                texts[conv]["".join(p.get("text", "") for p in m.get("content") or [] if isinstance(p, dict))] += 1
    for s in rec["submissions"]:
        if not s["acks"]:
            continue
        n = texts.get(s["conv"], Counter())[s["body"]["message"]]
        status = runs.get(run_of_key.get(s["key"], ""), {}).get("status")
        if (status == "completed" and n != 1) or n > 1:
            rep.add("ack_in_transcript", f"{s['key']} ({status}) appears {n} times in {s['conv']}")

    # promise 2: each tool call exactly one result, after it; no result without a call
    results: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for conv, msgs in transcripts.items():
        calls_seen: set[str] = set()
        for i, m in enumerate(msgs):
            for p in m.get("content") or []:
                if not isinstance(p, dict):
                    continue
                if p.get("type") == "tool_call":
                    if p["id"] in calls_seen:
                        rep.add("transcript_well_formed", f"{conv}: call {p['id']} appears twice (message {i})")
                    calls_seen.add(p["id"])
                elif p.get("type") == "tool_result":
                    if p["call_id"] not in calls_seen:
                        rep.add("transcript_well_formed", f"{conv}: result for {p['call_id']} with no call before it "
                                                          f"(message {i})")
                    results[(conv, p["call_id"])].append(p)
        for cid in calls_seen:
            n = len(results[(conv, cid)])
            if n != 1:
                rep.add("transcript_well_formed", f"{conv}: call {cid} has {n} results")

    # promise 3: effects at most once; an effect without its result has an `interrupted` one
    keys = Counter(e[0] for e in rec["effects"])
    for k, n in keys.items():
        if n > 1:
            rep.add("tool_at_most_once", f"effect {k} recorded {n} times")
    interrupted_with_effect = 0
    seen_calls: set[tuple[str, str]] = set()
    for e in rec["effects"]:
        if len(e) != 4:
            rep.add("interrupted_result", f"malformed effect line {e}")
            continue
        _key, cid, _run, conv = e
        if (conv, cid) in seen_calls:
            continue
        seen_calls.add((conv, cid))
        rs = results.get((conv, cid), [])
        if len(rs) != 1:
            rep.add("interrupted_result", f"{conv} call {cid} (run {_run}) ran but has {len(rs)} results")
            continue
        r = rs[0]
        if r.get("reason") == "interrupted":
            interrupted_with_effect += 1
        elif r.get("is_error") or not str(r.get("content", "")).startswith("ok "):
            rep.add("interrupted_result", f"{conv} call {cid} ran; its result is {r}")
    for (conv, cid), rs in results.items():
        if (conv, cid) not in seen_calls and any(not r.get("is_error") for r in rs):
            rep.add("interrupted_result", f"{conv} call {cid} has the tool's result {rs[0].get('content')!r} "
                                          f"but no effect was recorded")

    # promise 9: the journal in order; one terminal event per settled run, matching it
    terminal: dict[str, list[str]] = defaultdict(list)
    everywhere = Counter(e["cursor"] for evs in journals.values() for e in evs)
    for cursor, n in everywhere.items():
        if n > 1:  # a versionstamp is never reused, not across conversations nor across restarts
            rep.add("journal_order", f"position {cursor} used {n} times")
    for conv, evs in journals.items():
        cursors = [e["cursor"] for e in evs]
        for a, b in itertools.pairwise(cursors):
            if not a < b:
                rep.add("journal_order", f"{conv}: {a} then {b}")
        for e in evs:
            if e["type"] in TERMINAL_EVENTS:
                terminal[e["data"].get("run_id")].append(e["type"].split(".", 1)[1])
    for run_id, info in runs.items():
        got = terminal.get(run_id, [])
        if info.get("status") in SETTLED and got != [info["status"]]:
            rep.add("settled_once", f"run {run_id} is {info['status']}; journal says {got}")

    # promise 9: each follower saw a contiguous slice of the final journal
    for i, f in enumerate(rec["followers"]):
        journal = [e["cursor"] for e in journals.get(f["conv"], [])]
        ids = f["ids"]
        start = 0 if f["after"] is None else sum(1 for c in journal if c <= f["after"])
        if ids != journal[start:start + len(ids)]:
            rep.add("stream_exact", f"follower {i} of {f['conv']}: {_first_mismatch(ids, journal[start:])}")
        if f["behind"]:
            rep.add("stream_exact", f"follower {i} of {f['conv']} told it fell behind retention: {f['behind'][:2]}")
    if rec["followers"] and not rec.get("followers_caught_up", True):
        for i, f in enumerate(rec["followers"]):
            journal = [e["cursor"] for e in journals.get(f["conv"], [])]
            last = f["ids"][-1] if f["ids"] else f["after"]
            if journal and (last is None or last < journal[-1]):
                rep.add("stream_caught_up", f"follower {i} of {f['conv']} stopped at {last}, journal ends "
                                            f"{journal[-1]} ({f['connects']} connects, refused {f['refused'][-3:]})")
    rep.stats = _stats(rec, {"interrupted_with_effect": interrupted_with_effect})
    return rep


def _first_mismatch(ids: list[str], expected: list[str]) -> str:
    for j, (a, b) in enumerate(zip(ids, expected)):
        if a != b:
            extra = "duplicate" if a in ids[:j] else ("gap" if a in expected else "unknown id")
            return f"at {j}: got {a}, expected {b} ({extra})"
    if len(ids) > len(expected):
        return f"{len(ids) - len(expected)} ids past the journal's end"
    return "ok"


def _stats(rec: dict, extra: dict) -> dict:
    subs = rec.get("submissions", [])
    counts = rec.get("counts", {})
    return {
        "seconds": rec.get("seconds"),
        "kills": len(rec.get("kills", [])),
        "kill_modes": dict(Counter(k["mode"] for k in rec.get("kills", []))),
        "submits": len(subs),
        "sends": sum(s["sends"] for s in subs),
        "retries": counts.get("retries", 0),
        "lost_acks": sum(1 for s in subs if s["lost"]),
        "lost_acks_retried": sum(1 for s in subs if s["lost"] and s["acks"]),
        "lost_acks_already_committed": sum(1 for s in subs if s["lost"] and s["acks"] and s["acks"][0]["duplicate"]),
        "acks": sum(1 for s in subs if s["acks"]),
        "resends": counts.get("resends", 0),
        "conflicts": len(rec.get("conflicts", [])),
        "cancels": sum(1 for s in subs if s["cancel"]),
        "runs": len(rec.get("runs", {})),
        "run_status": dict(Counter(r.get("status") for r in rec.get("runs", {}).values())),
        "effects": len(rec.get("effects", [])),
        "events_followed": counts.get("events_followed", 0),
        "follower_connects": sum(f["connects"] for f in rec.get("followers", [])),
        "follower_resumes": sum(f.get("resumed", 0) for f in rec.get("followers", [])),
        "journal_events": sum(len(j) for j in rec.get("journals", {}).values()),
        "longest_journal": max((len(j) for j in rec.get("journals", {}).values()), default=0),
        **extra,
    }


# ----------------------------------------------------------------------------- entry points


async def run_chaos(cfg: ChaosConfig, workdir: Path) -> dict:
    """One soak in ``workdir`` (a data directory, the effects file, the server log); returns the record."""
    workdir.mkdir(parents=True, exist_ok=True)
    return await Driver(cfg, Server(workdir, cfg)).run()


async def run_chaos_until_signalled(cfg: ChaosConfig, workdir: Path) -> dict | None:
    """:func:`run_chaos`, stopped by SIGTERM/SIGINT (None) with its server stopped too — a soak run
    in the background must not leave an orphaned server holding its port and directory."""
    out: dict[str, dict] = {}
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()  # Driver.run's finally stops the server, shielded
                    return

        nursery.start_soon(watch)
        out["rec"] = await run_chaos(cfg, workdir)
        nursery.cancel_scope.cancel()
    return out.get("rec")


def soak(cfg: ChaosConfig, workdir: Path | None = None) -> tuple[dict, Report]:
    """Run one soak (in a fresh temporary directory unless given) and check it; KeyboardInterrupt
    when a signal stopped it."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="surefoot-chaos-") as tmp:
            rec = trio.run(run_chaos_until_signalled, cfg, Path(tmp))
    else:
        rec = trio.run(run_chaos_until_signalled, cfg, workdir)
    if rec is None:
        raise KeyboardInterrupt
    return rec, check(rec)


def soak_many(cfgs: list[ChaosConfig], workdirs: list[Path]) -> list[tuple[dict, Report]]:
    """Several soaks at once (each its own server and directory), in one trio run: the CI test's
    seeds overlap their restarts instead of queueing them."""
    assert len(cfgs) == len(workdirs)
    records: list[dict] = [{} for _ in cfgs]

    async def all_of_them() -> None:
        async with trio.open_nursery() as nursery:
            for i, (cfg, wd) in enumerate(zip(cfgs, workdirs)):
                async def one(i: int = i, cfg: ChaosConfig = cfg, wd: Path = wd) -> None:
                    records[i] = await run_chaos(cfg, wd)
                nursery.start_soon(one)

    trio.run(all_of_them)
    return [(rec, check(rec)) for rec in records]


def command(cfg: ChaosConfig) -> str:
    """The command line that replays ``cfg``'s plan (its options that differ from the defaults)."""
    out = f"python tests/server/chaos.py --seconds {cfg.seconds:g} --seed {cfg.seed}"
    base = ChaosConfig(seconds=cfg.seconds)
    for name in ("kills", "clients", "followers", "conversations", "ticks", "tick_seconds", "lease_seconds",
                 "segment_bytes"):
        if getattr(cfg, name) != getattr(base, name):
            out += f" --{name.replace('_', '-')} {getattr(cfg, name):g}"
    return out


def summary(rep: Report) -> str:
    s = rep.stats
    head = (f"chaos seed {rep.seed}: {s.get('seconds')} s, kills {s.get('kills')} {s.get('kill_modes')}, "
            f"submits {s.get('submits')} (sends {s.get('sends')}, retries {s.get('retries')}), "
            f"acks {s.get('acks')}, lost acks retried {s.get('lost_acks_retried')} "
            f"(already committed {s.get('lost_acks_already_committed')}), runs {s.get('runs')} "
            f"{s.get('run_status')}, cancels {s.get('cancels')}, conflicts {s.get('conflicts')}, "
            f"effects {s.get('effects')} (interrupted {s.get('interrupted_with_effect')}), "
            f"events followed {s.get('events_followed')} over {s.get('follower_connects')} connects "
            f"({s.get('follower_resumes')} resumed after a drop), "
            f"violations {len(rep.violations)}")
    lines = [head]
    for v in rep.violations:
        lines.append(f"  VIOLATION {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the chaos phase")
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--kills", type=int, default=None, help="default: one per ~30 s")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--followers", type=int, default=0, help="default: one per conversation, plus two")
    p.add_argument("--conversations", type=int, default=0, help="default: 4, or one per 150 s of soak")
    p.add_argument("--ticks", type=int, default=ChaosConfig.ticks, help="tool calls per turn")
    p.add_argument("--tick-seconds", type=float, default=ChaosConfig.tick_seconds, help="each tool call's sleep")
    p.add_argument("--lease-seconds", type=float, default=ChaosConfig.lease_seconds)
    p.add_argument("--segment-bytes", type=int, default=ChaosConfig.segment_bytes, help="the log's segment size")
    p.add_argument("--record", type=Path, default=None, help="write the record (JSON) here")
    p.add_argument("--workdir", type=Path, default=None, help="keep the data directory and server log here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1, 1_000_000)
    cfg = ChaosConfig(seed=seed, seconds=args.seconds, kills=args.kills, clients=args.clients,
                      followers=args.followers, conversations=args.conversations, ticks=args.ticks,
                      tick_seconds=args.tick_seconds, lease_seconds=args.lease_seconds,
                      segment_bytes=args.segment_bytes, progress=not args.quiet)
    try:
        rec, rep = soak(cfg, args.workdir)
    except KeyboardInterrupt:
        print(f"chaos seed {seed}: stopped by a signal", file=sys.stderr)
        return 130
    if args.record:
        args.record.write_text(json.dumps(rec))
    print(summary(rep))
    print(json.dumps({"seed": seed, **rep.stats, "violations": sorted(rep.names())}))
    if rep.violations:
        print(f"reproduce: {command(cfg)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
