"""Fault injection: crashes at chosen writes, FoundationDB-client-style BUGGIFY, the kv fault hooks.

Write numbering.  Every transaction that reaches ``commit`` with mutations
is a *write*, numbered 1, 2, 3 ... in the order the world sees them (across
all processes; retries count again).  With the same seed a run is identical
up to any write, so "crash before/after write k" names one exact point in
the history: *before* = the process dies as it hands the write to the
engine (it never happens); *after* = the write was resolved (applied, or
refused) and the process dies before its caller hears.

BUGGIFY (flow/include/flow/Buggify.h): a fault site is enabled for a run
with probability 1/4 the first time it is reached, and an enabled site
fires with probability 1/4 each time.  Sites are only consulted while
``world.faults_on`` (recovery to quiescence runs fault-free, as FDB's
simulator stops its chaos workloads before the final checks).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import cbor2

import kv
from kv.engine import CommitRequest, FaultHooks
from ledger.keyspace import LedgerKeyspace
from loop.keyspace import LoopKeyspace

if TYPE_CHECKING:
    from .world import World

__all__ = ["Crash", "FaultPlan", "Buggify", "SimHooks", "BUGGIFY_ENABLE", "BUGGIFY_FIRE"]

BUGGIFY_ENABLE = 0.25
BUGGIFY_FIRE = 0.25
# A process that keeps crashing must still make progress: random-mode crashes stop after this many.
MAX_RANDOM_CRASHES = 4
# A poison run (random mode, BUGGIFY site ``crash.poison_run``): once the site picks a run being
# taken over (see SimHooks._poisoned) as its lease is written, the processes that drive that run
# die, one after another, as a run that runs its worker out of memory kills each worker it
# lands on, up to MAX_POISON_CRASHES times (then the run is processed normally). Where each one
# dies is the poison's depth, drawn once per run from POISON_DEPTHS: 0 = right after any commit
# that writes the run's lease (its claim, a renewal), so no attempt gets past its claim; d >= 1 =
# right after the d-th commit of the run's own progress a process makes (a commit that checks the
# run's lease — reads its key — without writing it: a model step, a tool's start or result, a
# park, the settle), so every attempt gets d steps further than the one before and leaves what
# that crash leaves behind (a dangling tool call, an unfinished model step) to the next.
# Independent random crashes almost never chain so: session 12's soak needed ~1,000 exhaustion
# runs to meet every exhausted-run finaliser dying right after its claim
# (ledger.runs.FINALIZE_CLAIMS = 3 in a row, after max_attempts = 3).
# Above max_attempts + FINALIZE_CLAIMS of the scenarios that exhaust a run (3 + 3).
MAX_POISON_CRASHES = 8
POISON_DEPTHS = (0, 1, 2)
# The runtimes' lease keys (the default root: every simulated runtime uses it).
_LEASES = LedgerKeyspace().lease_range()
# The fence check (SimHooks.fence): a run's lease key and its loop-state key are a prefix and the
# packed run id, the same packed run id under both (``range``'s start is the prefix + \x00).
_LEASE_PREFIX = _LEASES.start[:-1]
_STATE_PREFIX = LoopKeyspace().base.range(("r",)).start[:-1]
assert LedgerKeyspace().lease("x")[len(_LEASE_PREFIX):] == LoopKeyspace().state("x")[len(_STATE_PREFIX):]

assert 0 < BUGGIFY_ENABLE <= 1 and 0 < BUGGIFY_FIRE <= 1


class Crash(BaseException):
    """The simulated process died here.

    A ``BaseException`` so the code under test cannot swallow it with
    ``except Exception`` and carry on as if it were alive.
    """


@dataclass(frozen=True)
class FaultPlan:
    """What goes wrong in one run."""

    crash_at: int | None = None  # write number (1-based) to crash at, exhaustive mode
    crash_when: str = "before"  # "before" | "after"
    buggify: bool = False  # random mode: BUGGIFY sites (kv errors, provider errors, tool errors, crashes)
    crash_rate: float = 0.0  # random mode: chance that a write is a crash point (when its site is on)
    # A sure poison run at this depth (POISON_DEPTHS): the first run taken over is poisoned,
    # instead of BUGGIFY's chance of it (about 1 random run in 7) at a random depth — a search
    # that must meet the poison (tests/sim's bite tests) need not hope for it. With ``buggify``
    # (random mode) on top of its other faults; alone, the only fault of the run.
    poison: int | None = None

    def __post_init__(self) -> None:
        assert self.crash_when in ("before", "after")
        assert self.crash_at is None or self.crash_at >= 1
        assert self.poison is None or (self.poison >= 0 and self.crash_at is None)

    def with_crash(self, k: int, when: str) -> "FaultPlan":
        return replace(self, crash_at=k, crash_when=when)

    def describe(self) -> str:
        parts = []
        if self.crash_at is not None:
            parts.append(f"crash {self.crash_when} write {self.crash_at}")
        if self.buggify:
            parts.append("buggify")
        if self.poison is not None:
            parts.append(f"poison depth {self.poison}")
        return ", ".join(parts) or "no faults"


class Buggify:
    """Per-run fault sites: enabled with 1/4 at first use, then firing with 1/4."""

    def __init__(self, rng: random.Random, *, enabled: bool) -> None:
        self.rng = rng
        self.enabled = enabled
        self.sites: dict[str, bool] = {}
        self.gate = True  # world.faults_on, mirrored by the world

    def __call__(self, site: str, fire: float = BUGGIFY_FIRE) -> bool:
        if not (self.enabled and self.gate):
            return False
        on = self.sites.get(site)
        if on is None:
            on = self.sites[site] = self.rng.random() < BUGGIFY_ENABLE
        return on and self.rng.random() < fire


_KIND_BYTES = {"set": b"set", "clear": b"clear"}


def digest_mutations(mutations: list[Any]) -> str:
    """A short hash of a commit's mutations for the trace: every part, each followed by a NUL."""
    parts: list[bytes] = []
    append = parts.append
    extend = parts.extend
    for m in mutations:
        kind = _KIND_BYTES.get(m[0])  # set/clear of bytes (most mutations): their parts as they are
        if kind is not None and len(m) == 3 and type(m[1]) is bytes and type(m[2]) is bytes:
            extend((kind, m[1], m[2]))
            continue
        for part in m:
            t = type(part)
            if t is bytes:  # (exact types first: the common cases, without isinstance)
                append(part)
            elif t is str:
                append(part.encode())
            else:
                append(part if isinstance(part, bytes) else
                       bytes(part) if isinstance(part, bytearray) else str(part).encode())
    append(b"")
    return hashlib.blake2b(b"\x00".join(parts), digest_size=8).hexdigest()


class SimHooks(FaultHooks):
    """The world's view into the kv engine: numbering writes, crashing processes, BUGGIFY errors."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.buggify = world.buggify  # (the world's, made before its hooks: read on every kv request)
        self.random_crashes = 0
        self.poison: bytes | None = None  # crash.poison_run: the poisoned run's lease key
        self.poison_depth = 0  # ... and where its processes die (POISON_DEPTHS)
        self.poison_steps: dict[str, int] = {}  # process label -> its progress commits of that run
        self.poison_crashes = 0
        # The fence check: packed run id -> (lease token, label of the process whose commit wrote
        # that token first: the claim) for every run with a lease (see fence).
        self.lease_holders: dict[bytes, tuple[int, str]] = {}

    def _proc(self, tr: Any) -> Any:
        return getattr(tr.db, "process", None)

    def on_read(self, tr: Any) -> None:
        # Every kv read comes through here (~150 a run): a dead process's read dies, BUGGIFY only when on.
        proc = getattr(tr.db, "process", None)
        if proc is not None and proc.dead:
            raise Crash(f"{proc.label} is dead")
        b = self.buggify
        if not (b.enabled and b.gate):
            return
        if b("kv.read.1007", 0.05):
            self.world.fault("kv.read.1007")
            raise kv.KVError(1007)
        if b("kv.read.1009", 0.05):
            self.world.fault("kv.read.1009")
            raise kv.KVError(1009)

    def before_commit(self, tr: Any) -> None:
        world = self.world
        proc = self._proc(tr)
        if proc is not None:
            proc.check_alive()
        world.stats["writes"] += 1
        k = world.stats["writes"]
        tr._sim_k = k
        plan = world.plan
        if world.recorder is not None:
            world.snapshot(proc, k, "before")
        if plan.crash_at == k and plan.crash_when == "before" and proc is not None:
            world.fault("crash.before_commit", k)
            proc.kill(f"before write {k}")
            raise Crash(f"before write {k}")
        b = world.buggify
        if (proc is not None and plan.crash_rate and self.random_crashes < MAX_RANDOM_CRASHES
                and b("crash.before_commit", plan.crash_rate)):
            self.random_crashes += 1
            world.fault("crash.before_commit", k)
            proc.kill(f"before write {k}")
            raise Crash(f"before write {k}")
        if not (b.enabled and b.gate):  # (what Buggify.__call__ answers first, without the calls)
            return
        if b("kv.commit.1020"):
            world.fault("kv.commit.1020", k)
            raise kv.KVError(1020)
        if b("kv.commit.1007", 0.1):
            world.fault("kv.commit.1007", k)
            raise kv.KVError(1007)

    def crash_after(self, tr: Any) -> bool:
        """Called when a write's commit call returns (or fails): should the process die right here?"""
        world = self.world
        k = getattr(tr, "_sim_k", None)
        proc = self._proc(tr)
        if k is None or proc is None or proc.dead:
            return False
        plan = world.plan
        if world.recorder is not None:
            world.snapshot(proc, k, "after")
        if plan.crash_at == k and plan.crash_when == "after":
            world.fault("crash.after_commit", k)
            proc.kill(f"after write {k}")
            return True
        if ((plan.crash_rate or plan.poison is not None) and self.poison_crashes < MAX_POISON_CRASHES
                and self._poisoned(tr)):
            self.poison_crashes += 1
            world.fault("crash.poison_run", k)
            proc.kill(f"after write {k} (poison run)")
            return True
        if (plan.crash_rate and self.random_crashes < MAX_RANDOM_CRASHES
                and world.buggify("crash.after_commit", plan.crash_rate)):
            self.random_crashes += 1
            world.fault("crash.after_commit", k)
            proc.kill(f"after write {k}")
            return True
        return False

    def _poisoned(self, tr: Any) -> bool:
        """Whether the process that committed ``tr`` dies of the poisoned run (picking that run
        first, if none is yet: only a run being taken over, its lease token past 1, as the run
        that killed one worker goes on to kill the next — so that the run has got somewhere
        before the poison strikes). See MAX_POISON_CRASHES for the depths."""
        start, stop = _LEASES.start, _LEASES.stop
        label = self._proc(tr).label
        for m in tr._mutations:
            if m[0] != "set" or not start <= m[1] < stop:
                continue
            token = cbor2.loads(m[2]).get("token", 0)
            held = self.lease_holders.get(m[1][len(_LEASE_PREFIX):])
            if (held is not None and held[0] == token and held[1] != label
                    and tr._committed_version is not None):
                # The lease rewritten under its holder's token by another process, and applied
                # (a cancel carried by the lease record, docs/loop.md): neither a claim or a
                # renewal nor a step of the run's progress — the poison takes no notice.
                if m[1] == self.poison:
                    return False
                continue
            if self.poison is None and token > 1:
                sure = self.world.plan.poison
                if sure is not None:  # (a sure poison: no BUGGIFY draw)
                    self.poison, self.poison_depth = m[1], sure
                elif self.world.buggify("crash.poison_run"):
                    self.poison = m[1]
                    self.poison_depth = self.world.rng.choice(POISON_DEPTHS)
            if m[1] == self.poison:
                return self.poison_depth == 0  # a claim or a renewal is not a step of progress
        if not self.poison_depth or self.poison not in tr._read_points:
            return False
        steps = self.poison_steps[label] = self.poison_steps.get(label, 0) + 1
        return steps == self.poison_depth

    def fence(self, mutations: list[Any], label: str) -> None:
        """Promise 5 (fencing) checked at the commit itself: a commit that writes a run's loop
        state (``("lp", "r", run)``, written only in transactions that check the run's lease, or
        while the run is parked and has none: loop/keyspace.py) must come from the process
        whose claim wrote the run's current lease token.  Any other writer is a stale worker
        whose write got past the fencing — seen here whatever it wrote and whatever happens
        after it (the journal and the settled run show a stale write only when it is one of
        theirs: a settle, an event journaled after the new attempt's start).

        The holder of a token is the process whose commit first wrote it (a renewal, or any
        other update of the record under the same token, keeps it); a cleared lease has none."""
        holders = self.lease_holders
        cleared: list[tuple[bytes, bytes]] | None = None
        for m in mutations:
            kind, key = m[0], m[1]
            if kind == "set" and type(key) is bytes and key.startswith(_LEASE_PREFIX):
                run = key[len(_LEASE_PREFIX):]
                try:
                    token = cbor2.loads(m[2]).get("token")
                except Exception:  # noqa: BLE001 - not a lease record this check knows: no holder known
                    holders.pop(run, None)
                    continue
                held = holders.get(run)
                if held is None or held[0] != token:
                    holders[run] = (token, label)
            elif kind == "clear" and type(key) is bytes and key < _LEASES.stop and m[2] > _LEASES.start:
                (cleared := cleared or []).append((key, m[2]))
        for m in mutations:
            key = m[1]
            if m[0] == "set" and type(key) is bytes and key.startswith(_STATE_PREFIX):
                run = key[len(_STATE_PREFIX):]
                held = holders.get(run)
                if held is not None and held[1] != label:
                    self.world.violate("no_stale_lease_writes", 5,
                                       f"{label} wrote the loop state of run {kv.tuple.unpack(run)[0]} "
                                       f"while {held[1]}'s claim (lease token {held[0]}) held it")
        if cleared:  # (after the writes: a settle writes the state and clears the lease in one commit)
            for run in [r for r in holders if any(b <= _LEASE_PREFIX + r < e for b, e in cleared)]:
                del holders[run]

    def before_apply(self, version: int, batch: list[CommitRequest]) -> None:
        pass

    def after_apply(self, version: int, batch: list[CommitRequest]) -> dict[CommitRequest, BaseException] | None:
        world = self.world
        b = self.buggify
        failures: dict[CommitRequest, BaseException] = {}
        for order, req in enumerate(batch):
            world.stats["commits"] += 1
            proc = self._proc(req.tag)
            world.oracle.committed(version, order, req)
            if proc is not None:
                self.fence(req.mutations, proc.label)
            # (Trace.add's line, joined here: every part is an int or a str)
            world.trace.add_line(f"commit|{version}|{order}|{proc.label if proc else '-'}|"
                                 f"{getattr(req.tag, '_sim_k', '-')}|{digest_mutations(req.mutations)}")
            if world.commit_listeners:
                world.commit_listeners[:] = [f for f in world.commit_listeners if not f(proc)]
            if b.enabled and b.gate and b("kv.commit.1021"):  # (the check Buggify.__call__ starts with)
                world.fault("kv.commit.1021", getattr(req.tag, "_sim_k", "-"))
                failures[req] = kv.KVError(1021)
        return failures or None
