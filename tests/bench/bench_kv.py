"""kv benchmark: prints one JSON line of figures and ratios against the targets.

    python tests/bench/bench_kv.py [--quick]

Every comparison is made in the same run on the same disk, because these
shared machines are noisy and only ratios mean anything:

* point reads/s from one task (``tr.get`` on the LMDB engine) beside raw
  py-lmdb ``txn.get`` on an environment holding the same keys — target: a
  point read costs <= 10x a raw get;
* sequential commit latency p50/p99 (one small transaction at a time) beside
  raw ``write`` + ``os.fsync`` p50 of an append-only file in the same
  directory — target: commit p50 <= 3x fsync p50 (a bare py-lmdb durable
  write transaction is reported beside them, as the floor LMDB itself sets);
* commits/s with 1, 16, 64 and 256 concurrent writers (group commit) —
  target: 64 writers >= 10x the sequential rate. Beside it, the ceiling the
  engine's own CPU sets for that workload: the same 64 writers on the memory
  engine (no disk at all), as commits/s and as a multiple of the LMDB
  engine's sequential rate (``cpu_bound_writers64_speedup``). A batch is one
  log append and one fdatasync: on a disk whose sync is fast next to the
  loop's CPU per batch (0.06-0.08 ms, seen here until 2026-12-01) the engine
  is CPU-bound at 64 writers, and the faster a lone durable commit, the lower
  this ceiling; on a slower one (0.2 ms, with 0.6 ms at p90 under load, seen
  from 2026-12-02) the loop waits for syncs instead. Which of the two held is
  reported per writer count: the share of the run the event loop sat idle in
  ``epoll`` (``loop_idle_fraction``, near 0 when CPU-bound) and the commits
  per batch (``commits_per_batch``). The process's
  CPU per commit for each writer count and for the memory engine's 64
  writers (``cpu_us_per_commit``: user + system, the figure a shared
  machine's load disturbs least; target 10x means about 1/10 of the
  sequential p50 per commit at 64 writers). Also the log
  segments sealed (each checkpointed by the helper process as one durable
  LMDB commit) and the keys left in the in-memory overlay at the end;
* the same 64-writer ratio from ``PAIRED_RUNS`` more pairs, each a block of
  sequential commits and a 1 s 64-writer run made back to back, with its
  median and spread (``writers64_speedup_paired``; informational: the headline
  ratio above decides ``targets_met``);
* the longest single task step with 1, 16, 64 and 256 writers (a trio
  Instrument), since disk work must never block the loop for more than a few
  ms; measured in 1 s runs of its own after the rates, because the
  instrument's two calls per task step would cost the rate runs ~40% of their
  CPU per commit (``StepTimer``);
* resolver time for one transaction with 1,000 read ranges checked against
  10,000 point writes newer than its read version, none of them in a range
  (so every range is checked to the end) — target: < 5 ms.

Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kv  # noqa: E402
from kv.resolver import Resolver  # noqa: E402

TARGETS = {
    "point_read_ratio_max": 10.0,
    "seq_commit_ratio_max": 3.0,
    "writers64_speedup_min": 10.0,
    "resolver_ms_max": 5.0,
}


def _key(i: int) -> bytes:
    return b"bench/%08d" % i


async def bench_point_reads(db, raw_path: Path, nkeys: int, nreads: int) -> dict:
    value = b"v" * 100
    for start in range(0, nkeys, 2000):
        async def load(tr, start=start):  # idempotent: plain sets
            for i in range(start, min(start + 2000, nkeys)):
                tr.set(_key(i), value)

        await db.transact(load)
    rng = random.Random(1)
    keys = [_key(rng.randrange(nkeys)) for _ in range(nreads)]

    # raw py-lmdb, same keys, same page-cache conditions
    env = lmdb.open(str(raw_path), map_size=1 << 30, sync=False)
    with env.begin(write=True) as txn:
        for i in range(nkeys):
            txn.put(_key(i), value)
    # interleaved chunks (CPU time: both are CPU-bound on this thread), so
    # background load hits both sides alike
    raw = ours = 0.0
    chunk = 5000
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        t0 = time.thread_time()
        with env.begin() as txn:
            for k in part:
                txn.get(k)
        raw += time.thread_time() - t0
        t0 = time.thread_time()
        tr = db.create_transaction()  # a fresh one per chunk stays inside the MVCC window
        for k in part:
            await tr.get(k)
        ours += time.thread_time() - t0
    env.close()
    return {
        "point_reads_per_s": round(nreads / ours),
        "raw_lmdb_gets_per_s": round(nreads / raw),
        "point_read_ratio": round(ours / raw, 2),
    }


def raw_fsync_latencies(path: Path, n: int) -> list[float]:
    out = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        record = b"x" * 128
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, record)
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def raw_lmdb_commit_latencies(env, n: int, start: int) -> list[float]:
    """One py-lmdb write transaction (one put, durable: sync=True) per sample:
    what LMDB itself costs per commit (it syncs data pages, then the meta page)."""
    out = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.put(b"raw/%08d" % i, b"v" * 100)
        out.append(time.perf_counter() - t0)
    return out


async def bench_sequential_commits(db, n: int, start: int = 0) -> list[float]:
    out = []
    for i in range(start, start + n):
        tr = db.create_transaction()
        tr.set(b"seq/%08d" % i, b"v" * 100)  # blind write: idempotent
        t0 = time.perf_counter()
        await tr.commit()
        out.append(time.perf_counter() - t0)
    return out


class IdleTimer(trio.abc.Instrument):
    """The wall time the loop spent waiting in ``epoll``: waiting for the disk
    (the log's sync helper), since every writer is either runnable or parked
    on a batch. Called once per scheduler pass, not per task step: cheap."""

    def __init__(self) -> None:
        self.idle = 0.0
        self._wait0 = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self._wait0 = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self.idle += time.perf_counter() - self._wait0


class StepTimer(trio.abc.Instrument):
    """The longest single task step, in CPU time of the event-loop thread: how
    much work one step did on the loop. CPU time, not wall time, because these
    shared machines are often oversubscribed (a preempted step is not a slow
    step); a Python GC pass landing inside a step is counted.

    Not installed while rates are measured: trio calls it twice per task step,
    and at 64 writers that cost ~5 us of the ~11 us of CPU a commit takes
    (measured 2026-12-02: 11-13 -> 16-18 us a commit), so the rates and CPU
    figures come from runs without it and the longest step from a run of its own.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self._task = None
        self._t0 = 0.0

    def before_task_step(self, task) -> None:
        self._task, self._t0 = task, time.thread_time()

    def after_task_step(self, task) -> None:
        if task is self._task:  # skip the step that was running when we were installed
            self.longest = max(self.longest, time.thread_time() - self._t0)


async def bench_writers(db, writers: int, seconds: float, *,
                        time_steps: bool = False) -> tuple[float, float, float, float, float]:
    """Commits/s with ``writers`` concurrent tasks, the longest task step
    meanwhile if ``time_steps`` (disk work must stay off the event loop; else
    0.0: see StepTimer), this process's CPU per commit in us (user + system:
    the figure a shared machine's load disturbs least), the share of the run
    the loop sat idle in ``epoll``, and the commits per batch (group commit)."""
    count = 0
    batches0 = db.engine.stats["batches"]
    deadline = trio.current_time() + seconds

    async def writer(w: int) -> None:
        nonlocal count
        n = 0
        while trio.current_time() < deadline:
            tr = db.create_transaction()
            tr.set(b"w%d/%03d/%08d" % (writers, w, n), b"v" * 100)  # unique blind write: never conflicts
            await tr.commit()
            n += 1
            count += 1

    idle = IdleTimer()
    steps = StepTimer() if time_steps else None
    instruments = [idle, steps] if steps else [idle]
    for instrument in instruments:
        trio.lowlevel.add_instrument(instrument)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
    finally:
        for instrument in instruments:
            trio.lowlevel.remove_instrument(instrument)
    elapsed = time.perf_counter() - t0
    cpu_us = (time.process_time() - cpu0) / max(count, 1) * 1e6
    per_batch = count / max(db.engine.stats["batches"] - batches0, 1)
    return count / elapsed, steps.longest if steps else 0.0, cpu_us, idle.idle / elapsed, per_batch


PAIRED_RUNS = 3  # extra (sequential block, 64-writer run) pairs, for the spread of the ratio


async def bench_paired_writers64(db, runs: int, seconds: float) -> list[dict]:
    """The 64-writer ratio again, ``runs`` times, each from a sequential block and a
    64-writer run made back to back (same workloads as the headline figures).

    Why: the headline ratio divides a rate measured in the writer phase by a
    sequential p50 measured ~10 s earlier, and on these shared machines the disk's
    sync time drifts by 10x within seconds (seen: raw fsync p50 0.2 ms, then 4 ms a
    minute later); a pair measured together sees the same disk. Reported beside
    the headline (which decides targets_met, unchanged) with its spread.
    """
    out = []
    for run in range(runs):
        seq = await bench_sequential_commits(db, 100, start=100_000 + run * 100)
        rate = (await bench_writers(db, 64, seconds))[0]
        p50 = statistics.median(seq)
        out.append({"seq_p50_ms": round(p50 * 1000, 3), "writers64_per_s": round(rate),
                    "speedup": round(rate * p50, 1)})
    return out


def bench_resolver(n_writes: int, n_reads: int, repeats: int) -> float:
    rng = random.Random(7)
    resolver = Resolver()
    version = 1_000_000
    read_version = version  # older than every write: each range must be checked against them all
    written: list[bytes] = []
    for v in range(n_writes // 10):  # 10 point writes per committed transaction
        version += 100
        keys = [b"key/%08d" % rng.randrange(10**8) for _ in range(10)]
        written.extend(keys)
        resolver.add(version, [(k, k + b"\x00") for k in keys])
    written.sort()

    def misses(begin: bytes, end: bytes) -> bool:  # no written key in [begin, end)
        i = bisect.bisect_left(written, begin)
        return i == len(written) or written[i] >= end

    # Worst case without a conflict: every range read misses every recent write, so
    # the check must look at all of them (a hit would stop it early).
    ranges = []
    while len(ranges) < n_reads:
        a = rng.randrange(10**8)
        if rng.random() < 0.5:
            k = b"key/%08d" % a
            r = (k, k + b"\x00")
        else:
            r = (b"key/%08d" % a, b"key/%08d" % (a + rng.randrange(1, 20_000)))
        if misses(*r):
            ranges.append(r)
    times = []
    for _ in range(repeats):
        # CPU time of this thread: the check is pure CPU work on the event loop,
        # and CPU time is not inflated when the shared machine preempts us
        t0 = time.thread_time()
        hit = resolver.conflicts(ranges, read_version)
        times.append(time.thread_time() - t0)
        assert not hit
    # a sanity check that the same structure does detect a conflict
    assert resolver.conflicts(ranges + [(b"key/", b"key0")], 0)
    return statistics.median(times) * 1000


async def main(quick: bool) -> dict:
    scale = 0.3 if quick else 1.0
    with tempfile.TemporaryDirectory(dir=os.environ.get("SUREFOOT_BENCH_DIR")) as tmp:
        tmpdir = Path(tmp)
        db = await kv.open(f"lmdb:{tmpdir / 'data'}")
        try:
            reads = await bench_point_reads(db, tmpdir / "raw-lmdb", 20_000, int(100_000 * scale))
            # interleaved blocks, so both sides see the same background load
            raw: list[float] = []
            seq: list[float] = []
            raw_lmdb: list[float] = []
            env = lmdb.open(str(tmpdir / "raw-lmdb-commits"), map_size=1 << 30, sync=True, metasync=True)
            for block in range(int(15 * scale) or 1):
                raw += raw_fsync_latencies(tmpdir / "raw-append.log", 20)
                seq += await bench_sequential_commits(db, 20, start=block * 20)
                raw_lmdb += raw_lmdb_commit_latencies(env, 20, start=block * 20)
            env.close()
            seq_p50 = statistics.median(seq)
            seq_p99 = statistics.quantiles(seq, n=100)[98]
            raw_p50 = statistics.median(raw)
            rates, stalls, cpus, idles, per_batch = {}, {}, {}, {}, {}
            mem = await kv.open("memory:")
            bound, _, mem_cpu, _, _ = await bench_writers(mem, 64, 1.5 * scale)
            for w in (1, 16, 64, 256):
                rate, _, cpu, idle, pb = await bench_writers(db, w, 3.0 * scale)
                rates[str(w)], cpus[str(w)] = round(rate), round(cpu, 2)
                idles[str(w)], per_batch[str(w)] = round(idle, 2), round(pb, 1)
            bound2, _, mem_cpu2, _, _ = await bench_writers(mem, 64, 1.5 * scale)
            bound, mem_cpu = (bound + bound2) / 2, (mem_cpu + mem_cpu2) / 2
            await mem.close()
            paired = await bench_paired_writers64(db, PAIRED_RUNS, 1.0 * scale)
            for w in (1, 16, 64, 256):  # the longest step, in runs of their own (see StepTimer)
                stall = (await bench_writers(db, w, 1.0 * scale, time_steps=True))[1]
                stalls[str(w)] = round(stall * 1000, 2)
            store = db.engine.store
            segments, overlay = store.stats["segments_sealed"], store.overlay_size()
        finally:
            await db.close()
    resolver_ms = bench_resolver(10_000, 1_000, 7)
    seq_rate = 1 / seq_p50
    result = {
        "bench": "kv",
        "engine": "lmdb",
        **reads,
        "seq_commit_p50_ms": round(seq_p50 * 1000, 3),
        "seq_commit_p99_ms": round(seq_p99 * 1000, 3),
        "raw_append_fsync_p50_ms": round(raw_p50 * 1000, 3),
        "seq_commit_ratio": round(seq_p50 / raw_p50, 2),
        "raw_lmdb_commit_p50_ms": round(statistics.median(raw_lmdb) * 1000, 3),
        "commits_per_s": rates,
        "cpu_us_per_commit": cpus,
        "loop_idle_fraction": idles,
        "commits_per_batch": per_batch,
        "memory_engine_64_writers_cpu_us_per_commit": round(mem_cpu, 2),
        "writers64_speedup": round(rates["64"] / seq_rate, 1),
        "writers64_speedup_paired": {
            "median": statistics.median(r["speedup"] for r in paired),
            "min": min(r["speedup"] for r in paired),
            "max": max(r["speedup"] for r in paired),
            "runs": paired,
        },
        "memory_engine_64_writers_per_s": round(bound),
        "cpu_bound_writers64_speedup": round(bound / seq_rate, 1),
        "writers64_vs_cpu_bound": round(rates["64"] / bound, 2),
        "log_segments_sealed": segments,
        "overlay_keys_at_end": overlay,
        "longest_task_step_cpu_ms": stalls,
        "resolver_1000_ranges_vs_10000_writes_ms": round(resolver_ms, 3),
    }
    result["targets"] = TARGETS
    result["targets_met"] = {
        "point_read": result["point_read_ratio"] <= TARGETS["point_read_ratio_max"],
        "seq_commit": result["seq_commit_ratio"] <= TARGETS["seq_commit_ratio_max"],
        "writers64": result["writers64_speedup"] >= TARGETS["writers64_speedup_min"],
        "resolver": resolver_ms < TARGETS["resolver_ms_max"],
    }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    args = parser.parse_args()
    print(json.dumps(trio.run(main, args.quick)))
