"""ledger/sessions benchmark: prints one JSON line of figures and target ratios.

    python tests/bench/bench_ledger.py [--quick]

All on the LMDB engine with durable defaults, in a temp dir; comparisons are
made in the same run on the same disk (only ratios mean anything on a shared
machine):

* acknowledged submissions/s with 1 and with 64 concurrent submitters (each
  its own conversation), beside the raw rate of synced single-put LMDB
  transactions (sampled just before and after the 64-submitter phase) and the
  raw write+fsync p50 (sampled in blocks interleaved with the 1-submitter
  ones) — targets: 64
  submitters >= 1.5x the raw synced rate (group commit beats one fsync per
  ack); 1 submitter p50 <= 3x raw fsync p50 (with a bare one-key kv commit's
  p50 beside it: the engine's floor under any acknowledgement); commits, fsyncs,
  bytes and process CPU per submission (the 1-submitter CPU without the
  interleaved raw fsync samples' own);
* claim + settle cycles/s (16 workers over many conversations);
* replay of 20,000 events (target <= 250 ms; best of 3, with its CPU time
  beside it, and the load average at start and end, because other tenants of a
  shared machine dominate wall-clock figures) and the last page of a
  1,000,000-event journal beside a 100-event one (target: same order, ratio
  <= 3);
* fork of a 100,000-message transcript (by reference, and by staged copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kv  # noqa: E402
from ledger import Ledger, completed  # noqa: E402
from sessions import Owner, Sessions, events  # noqa: E402

OWNER = Owner("bench", "user")
TARGETS = {
    "submit64_vs_raw_synced_min": 1.5,
    "submit1_p50_vs_fsync_p50_max": 3.0,
    "replay_20k_ms_max": 250.0,
    "last_page_1m_vs_100_max": 3.0,
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def raw_fsync_latencies(path: Path, n: int) -> list[float]:
    out = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 128)
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def raw_synced_puts_per_s(path: Path, n: int) -> float:
    env = lmdb.open(str(path), map_size=1 << 30, sync=True, metasync=True)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            with env.begin(write=True) as txn:
                txn.put(b"raw/%08d" % i, b"v" * 200)
        return n / (time.perf_counter() - t0)
    finally:
        env.close()


async def kv_commit_p50(db, n: int) -> float:
    """A bare one-key commit on the same engine: the floor under one acknowledgement."""
    out = []
    for i in range(n):
        async def fn(tr, i=i):  # blind write: idempotent
            tr.set(b"bench-floor/%08d" % i, b"v" * 100)

        t0 = time.perf_counter()
        await db.transact(fn)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def engine_stats(db) -> dict[str, float]:
    eng = db.engine
    return {"commits": eng.stats["commits"], "fsyncs": eng.store.stats["fsyncs"],
            "bytes": eng.store.stats["bytes_written"], "cpu": time.process_time()}


def per_op(before: dict[str, float], after: dict[str, float], n: int, prefix: str) -> dict[str, float]:
    """Commits, fsyncs, bytes written and process CPU (ms) per operation between two engine_stats."""
    return {f"{prefix}_commits_per": round((after["commits"] - before["commits"]) / n, 3),
            f"{prefix}_fsyncs_per": round((after["fsyncs"] - before["fsyncs"]) / n, 3),
            f"{prefix}_bytes_per": round((after["bytes"] - before["bytes"]) / n),
            f"{prefix}_cpu_ms_per": round((after["cpu"] - before["cpu"]) / n * 1e3, 3)}


async def bench_submit(L: Ledger, submitters: int, per_submitter: int, tag: str) -> tuple[float, list[float]]:
    lat: list[float] = []
    delivery = {"role": "user", "content": [{"type": "text", "text": "hello " * 20}]}

    async def submitter(k: int) -> None:
        for i in range(per_submitter):
            t0 = time.perf_counter()
            await L.submit(f"{tag}-{k}-{i}", delivery, None, owner=OWNER, conversation=f"{tag}-conv-{k}")
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for k in range(submitters):
            n.start_soon(submitter, k)
    elapsed = time.perf_counter() - t0
    return submitters * per_submitter / elapsed, lat


async def bench_claim_settle(L: Ledger, workers: int, runs: int) -> float:
    # the queue: `runs` runs over many conversations
    for start in range(0, runs, 64):
        async with trio.open_nursery() as n:
            for i in range(start, min(runs, start + 64)):
                n.start_soon(lambda i=i: L.submit(f"cs-{i}", {"i": i}, None, owner=OWNER, conversation=f"cs-{i % 500}"))
    done = [0]

    async def worker(w: int) -> None:
        while done[0] < runs:
            lease = await L.claim(f"w{w}", lease_seconds=60)
            if lease is None:
                await L.wait_for_work(0.005)
                continue
            await L.settle(lease, completed(None))
            done[0] += 1

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for w in range(workers):
            n.start_soon(worker, w)
    return runs / (time.perf_counter() - t0)


async def fill_journal(db, s: Sessions, conv: str, n: int, batch: int = 5_000) -> None:
    j = s.journal
    for start in range(0, n, batch):
        async def fn(tr, start=start):  # bench fill, retried only on conflict (none: single writer)
            for i in range(start, min(n, start + batch)):
                await j.emit(tr, OWNER, conv, events.PART_UPDATED, {"part": 0, "delta": "token ", "i": i})

        await db.transact(fn)


async def bench_replay(s: Sessions, conv: str) -> tuple[float, float]:
    c0 = time.process_time()
    t0 = time.perf_counter()
    cursor, count = None, 0
    while True:
        page = await s.journal.read(OWNER, conv, after=cursor, limit=5_000)
        count += len(page.events)
        cursor = page.next_cursor
        if not page.more:
            break
    ms = (time.perf_counter() - t0) * 1e3
    cpu_ms = (time.process_time() - c0) * 1e3
    assert count == 20_000, count
    return ms, cpu_ms


async def last_page_ms(s: Sessions, conv: str, reps: int = 30) -> float:
    tail = await s.journal.tail_cursor(OWNER, conv)
    # a cursor ~100 events before the tail: read the page before it, newest first
    j = s.journal
    sub = j.keys.events(OWNER.tag, conv)
    r = sub.range()

    async def locate(tr):  # read-only
        rows = await tr.get_range(r.start, r.stop, limit=101, reverse=True)
        return j._cursor_of(sub, rows[-1].key)

    start = await s.db.transact(locate)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        page = await j.read(OWNER, conv, after=start, limit=100)
        out.append(time.perf_counter() - t0)
        assert page.events[-1].cursor == tail
    return statistics.median(out) * 1e3


async def bench_fork(s: Sessions, n: int) -> tuple[float, float]:
    t = s.transcripts
    await t.create(OWNER, "fork-parent")
    for i in range(0, n, 5_000):
        await t.append(OWNER, "fork-parent", [{"role": "user", "content": f"message {j}"}
                                              for j in range(i, min(n, i + 5_000))], expected_head=i)
    t0 = time.perf_counter()
    info = await t.fork(OWNER, "fork-parent", n)
    by_ref = (time.perf_counter() - t0) * 1e3
    assert info.head == n
    t0 = time.perf_counter()
    info = await t.fork(OWNER, "fork-parent", n, by_reference=False)
    copy = (time.perf_counter() - t0) * 1e3
    assert info.head == n
    return by_ref, copy


async def main(quick: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    out: dict = {"bench": "ledger", "quick": quick, "loadavg_start": round(os.getloadavg()[0], 2)}
    db = await kv.open(f"lmdb:{tmp / 'data'}")
    try:
        s = Sessions(db, retention=0)
        L = Ledger(db, journal=s.journal)
        floor = await kv_commit_p50(db, 100 if quick else 300)
        n1, per64 = (100, 8) if quick else (400, 40)
        # The raw baselines are sampled in blocks interleaved with the
        # submissions they are compared with, so a burst of other tenants'
        # disk traffic lands on both sides (measured once up front, one
        # burst swung the fsync p50 from 0.2 to 4 ms and the ratio with it).
        raw_fsync: list[float] = []
        lat1: list[float] = []
        e0 = engine_stats(db)
        t1 = 0.0
        raw_cpu = 0.0  # the interleaved raw fsyncs' own CPU: not the submissions'
        for block in range(n1 // 20):
            c0 = time.process_time()
            raw_fsync += raw_fsync_latencies(tmp / "fsync.log", 20)
            raw_cpu += time.process_time() - c0
            t0 = time.perf_counter()
            _, lat = await bench_submit(L, 1, 20, f"one{block}")
            t1 += time.perf_counter() - t0
            lat1 += lat
        rate1 = len(lat1) / t1
        fsync_p50 = statistics.median(raw_fsync)
        e1 = engine_stats(db)
        raw_before = raw_synced_puts_per_s(tmp / "raw-lmdb", 50 if quick else 150)
        rate64, _ = await bench_submit(L, 64, per64, "many")
        e2 = engine_stats(db)
        raw_after = raw_synced_puts_per_s(tmp / "raw-lmdb", 50 if quick else 150)
        raw_rate = (raw_before + raw_after) / 2
        out.update(per_op(e0, {**e1, "cpu": e1["cpu"] - raw_cpu}, len(lat1), "submit1"))
        out.update(per_op(e1, e2, 64 * per64, "submit64"))
        out.update({
            "raw_fsync_p50_ms": round(fsync_p50 * 1e3, 3),
            "raw_synced_lmdb_puts_per_s": round(raw_rate),
            "submit1_per_s": round(rate1),
            "submit1_p50_ms": round(statistics.median(lat1) * 1e3, 3),
            "submit1_p99_ms": round(pct(lat1, 0.99) * 1e3, 3),
            "submit64_per_s": round(rate64),
        })
        out["submit64_vs_raw_synced"] = round(rate64 / raw_rate, 2)
        out["submit1_p50_vs_fsync_p50"] = round(statistics.median(lat1) / fsync_p50, 2)
        out["kv_commit_p50_ms"] = round(floor * 1e3, 3)
        out["submit1_p50_vs_kv_commit_p50"] = round(statistics.median(lat1) / floor, 2)
        out["claim_settle_per_s"] = round(await bench_claim_settle(L, 16, 500 if quick else 2_000))

        await fill_journal(db, s, "replay", 20_000)
        # best of 3 (wall), with the CPU time of that run: on a shared machine the
        # wall figure mostly measures other tenants
        best = min([await bench_replay(s, "replay") for _ in range(3)])
        out["replay_20k_ms"] = round(best[0], 1)
        out["replay_20k_cpu_ms"] = round(best[1], 1)

        big = 100_000 if quick else 1_000_000
        await fill_journal(db, s, "small", 100)
        await fill_journal(db, s, "big", big, batch=10_000)
        small_ms = await last_page_ms(s, "small")
        big_ms = await last_page_ms(s, "big")
        out["big_journal_events"] = big
        out["last_page_100_ms"] = round(small_ms, 3)
        out["last_page_big_ms"] = round(big_ms, 3)
        out["last_page_big_vs_100"] = round(big_ms / small_ms, 2)

        by_ref, copy = await bench_fork(s, 100_000)
        out["fork_100k_by_reference_ms"] = round(by_ref, 2)
        out["fork_100k_copy_ms"] = round(copy, 1)
    finally:
        await db.close()
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    out["targets"] = TARGETS
    out["ok"] = {
        "submit64_vs_raw_synced": out["submit64_vs_raw_synced"] >= TARGETS["submit64_vs_raw_synced_min"],
        "submit1_p50_vs_fsync_p50": out["submit1_p50_vs_fsync_p50"] <= TARGETS["submit1_p50_vs_fsync_p50_max"],
        "replay_20k_ms": out["replay_20k_ms"] <= TARGETS["replay_20k_ms_max"],
        "last_page_big_vs_100": out["last_page_big_vs_100"] <= TARGETS["last_page_1m_vs_100_max"],
    }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (100k-event journal), for a smoke run")
    args = ap.parse_args()
    print(json.dumps(trio.run(main, args.quick)))
