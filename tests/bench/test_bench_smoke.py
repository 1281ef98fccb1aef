"""Every benchmark still runs and reports every figure its issue names.

The benchmarks are scripts (``python tests/bench/bench_*.py``), and their
figures are only meaningful on a quiet machine, so CI does not judge them:
it runs each in its smallest mode and checks that the JSON line carries each
figure the issue asks for, with a sane value, and says whether each target
was met. A benchmark that rots (an import error, a renamed API, a figure
silently dropped) fails here instead of on the day someone needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parents[1]


def run_bench(name: str, *args: str, timeout: float = 240) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{name} printed no JSON line:\n{proc.stdout[-2000:]}"
    return json.loads(lines[-1])


def _positive(fig: dict, *keys: str) -> None:
    for k in keys:
        assert isinstance(fig[k], (int, float)) and fig[k] > 0, (k, fig.get(k))


def test_kv_bench_reports_the_issue_figures():
    fig = run_bench("bench_kv.py", "--quick")
    _positive(fig, "point_reads_per_s", "raw_lmdb_gets_per_s", "point_read_ratio", "seq_commit_p50_ms",
              "seq_commit_p99_ms", "raw_append_fsync_p50_ms", "seq_commit_ratio", "writers64_speedup",
              "resolver_1000_ranges_vs_10000_writes_ms")
    assert set(fig["commits_per_s"]) == {"1", "16", "64", "256"}
    assert all(v > 0 for v in fig["commits_per_s"].values())
    assert set(fig["targets_met"]) == {"point_read", "seq_commit", "writers64", "resolver"}
    assert all(isinstance(v, bool) for v in fig["targets_met"].values())


def test_ledger_bench_reports_the_issue_figures():
    fig = run_bench("bench_ledger.py", "--quick")
    _positive(fig, "submit1_per_s", "submit64_per_s", "raw_synced_lmdb_puts_per_s", "raw_fsync_p50_ms",
              "submit1_p50_ms", "submit64_vs_raw_synced", "submit1_p50_vs_fsync_p50", "claim_settle_per_s",
              "replay_20k_ms", "last_page_100_ms", "last_page_big_ms", "fork_100k_by_reference_ms")
    assert fig["big_journal_events"] >= 100_000
    assert set(fig["ok"]) >= {"submit64_vs_raw_synced", "submit1_p50_vs_fsync_p50", "replay_20k_ms"}


def test_turns_bench_reports_the_issue_figures():
    fig = run_bench("bench_turns.py", "--quick")
    assert len(fig["conc_turns_per_s_rounds"]) == fig["conc_rounds"] >= 1
    _positive(fig, "seq_turns_per_s", "seq_p50_ms", "seq_p99_ms", "conc_turns_per_s", "conc_p50_ms",
              "conc_p99_ms", "commits_per_turn", "fsyncs_per_turn_seq", "bytes_per_turn")
    assert fig["concurrent"] == 32
    # a turn is at least its durable acknowledgement and its tool-call record
    assert fig["commits_per_turn"] >= 2
    assert isinstance(fig["target_seq_p50_met"], bool) and isinstance(fig["target_conc32_met"], bool)


def test_server_bench_reports_the_issue_figures():
    fig = run_bench("bench_server.py", "--quick", timeout=280)
    _positive(fig, "acks_per_s", "bare_202_per_s", "ack_ratio", "fanout_p50_ms", "fanout_p99_ms",
              "kib_per_idle_sse")
    assert fig["ack_clients"] == 64
    assert fig["fanout_all_received"] is True  # every follower got every event, even in the smoke run
    assert fig["fanout_followers_complete"] == fig["followers"]
    assert isinstance(fig["all_targets_met"], bool)


def test_sim_bench_reports_the_issue_figures():
    fig = run_bench("bench_sim.py", "--random-runs", "5")
    assert fig["scenarios"] >= 10
    for mode in ("exhaustive", "random"):
        _positive(fig[mode], "runs", "runs_per_s", "runs_per_cpu_s", "crash_points_per_s")
        assert fig[mode]["failures"] == 0
    _positive(fig, "cycles_per_cpu_s", "cycles_per_wall_s")
    assert isinstance(fig["target_met"], bool)
