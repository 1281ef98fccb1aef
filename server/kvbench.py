"""`surefoot kv-bench`: a quick, honest measure of the storage underneath everything.

Opens the embedded engine (a temporary directory unless ``--data``/``--kv`` says
otherwise), runs N small write transactions from M concurrent writers and reports
commits/s with p50/p99 commit latency. Concurrent writers are what group commit is
for: with M > 1 several commits share one fsync, so commits/s should exceed
1 / fsync-latency. Each transaction writes its own key (no conflicts), so the
figure is the engine's commit path, not the resolver's retry rate.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import trio

import kv

#: Upper bounds that keep an accidental `kv-bench -n 10**9` from running for hours.
MAX_TRANSACTIONS = 10_000_000
MAX_WRITERS = 10_000
#: Size of each written value: small, like a journal event or a lease record.
VALUE_SIZE = 100
#: Key prefix for the benchmark's keys, cleared afterwards when --data is a real store.
BENCH_PREFIX = b"\xfe__kv_bench__/"


@dataclass(frozen=True)
class KvBenchResult:
    url: str
    transactions: int
    writers: int
    seconds: float
    commits_per_s: float
    p50_ms: float
    p99_ms: float


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of an already sorted list."""
    assert sorted_values, "percentile of nothing"
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


async def run_kv_bench(url: str, transactions: int, writers: int) -> KvBenchResult:
    """Run the benchmark against ``url`` and return its figures."""
    assert 1 <= transactions <= MAX_TRANSACTIONS, transactions
    assert 1 <= writers <= MAX_WRITERS, writers
    latencies: list[float] = []
    value = b"x" * VALUE_SIZE
    counter = iter(range(transactions))

    async with await kv.open(url) as db:

        async def writer() -> None:
            for i in counter:
                key = BENCH_PREFIX + i.to_bytes(8, "big")

                async def fn(tr: kv.Transaction) -> None:
                    # Idempotent: a blind set of a fixed value to a fixed key.
                    tr.set(key, value)

                t0 = time.perf_counter()
                await db.transact(fn)
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(writers):
                nursery.start_soon(writer)
        elapsed = time.perf_counter() - start

        async def cleanup(tr: kv.Transaction) -> None:
            # Idempotent: clearing a range twice is clearing it once.
            tr.clear_range(BENCH_PREFIX, BENCH_PREFIX + b"\xff")

        await db.transact(cleanup)

    latencies.sort()
    return KvBenchResult(
        url=url,
        transactions=transactions,
        writers=writers,
        seconds=round(elapsed, 4),
        commits_per_s=round(transactions / elapsed, 1),
        p50_ms=round(_percentile(latencies, 0.50) * 1000, 3),
        p99_ms=round(_percentile(latencies, 0.99) * 1000, 3),
    )


def kv_bench_main(url: str | None, data: str | None, transactions: int, writers: int) -> dict:
    """Resolve where to run (a temp dir by default) and run; returns the result as a dict."""
    if url is None and data is not None:
        url = f"lmdb:{data}"
    if url is not None:
        return asdict(trio.run(run_kv_bench, url, transactions, writers))
    with tempfile.TemporaryDirectory(prefix="surefoot-kv-bench-") as tmp:
        return asdict(trio.run(run_kv_bench, f"lmdb:{os.path.join(tmp, 'data')}", transactions, writers))
