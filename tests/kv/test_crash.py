"""Durability of the LMDB engine across SIGKILL, and one process per data directory.

A child process (crash_child.py) commits in a loop with eight concurrent
writers and reports each acknowledged commit on a pipe; it is SIGKILLed at
random points, 22 times on the same data directory. After every kill the
directory is reopened and checked:

* every acknowledged commit is present, entirely;
* no transaction is partial, and no batch is: transactions sharing a commit
  version carry batch orders 0..n-1 (a missing order would be a torn batch);
* versions are never reused across restarts: each run's stamps exceed every
  stamp of the runs before it.

It runs twice: with the default log segment size, and with tiny segments so
the store's checkpointer process is busy (and orphaned) when the kills land.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import kv

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHILD = HERE / "crash_child.py"
KILLS = 22
KEYS_PER_TX = 4


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


async def _check(path: Path, acked: set[bytes]) -> dict[bytes, bytes]:
    db = await kv.open(f"lmdb:{path}")
    try:
        async def read_all(tr):  # read-only
            data = [(r.key, r.value) for r in await tr.get_range(b"data/", b"data0")]
            stamps = [(r.key, r.value) for r in await tr.get_range(b"stamp/", b"stamp0")]
            return data, stamps

        data, stamp_rows = await db.transact(read_all)
    finally:
        await db.close()
    per_tx: dict[bytes, list[bytes]] = {}
    for k, v in data:
        _, txid, _j = k.split(b"/")
        assert v == txid * 8
        per_tx.setdefault(txid, []).append(k)
    stamps = {k[len(b"stamp/") :]: v for k, v in stamp_rows}
    # all-or-nothing per transaction
    for txid, keys in per_tx.items():
        assert len(keys) == KEYS_PER_TX, f"transaction {txid!r} is partial: {keys}"
        assert txid in stamps, f"transaction {txid!r} lost its versionstamped value"
    assert set(stamps) == set(per_tx)
    # every acknowledged commit survived
    missing = acked - set(per_tx)
    assert not missing, f"acknowledged commits lost after SIGKILL: {sorted(missing)[:5]}"
    # no batch partial: the orders within one commit version are 0..n-1
    by_version: dict[bytes, list[int]] = {}
    for s in stamps.values():
        by_version.setdefault(s[:8], []).append(int.from_bytes(s[8:10], "big"))
    for version, orders in by_version.items():
        assert sorted(orders) == list(range(len(orders))), f"batch at {version.hex()} is partial: {sorted(orders)}"
    return stamps


@pytest.mark.parametrize("segment_bytes", [None, 4096], ids=["default-segments", "checkpointing"])
def test_sigkill_loses_no_acknowledged_commit_and_tears_no_batch(tmp_path, segment_bytes):
    """With 4 KiB segments the store seals one every few batches, so the kills
    also land while its checkpointer process is mid-pass (and leave it
    orphaned: the reopen waits for its pass, then it exits)."""
    path = tmp_path / "data"
    rng = random.Random(0xC0FFEE)
    acked: set[bytes] = set()
    rounds_with_acks = 0
    max_stamp_before = b""
    multi_tx_batches = 0
    checkpointed_while_running = 0
    for round_no in range(KILLS):
        applied_before = _applied(path)
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(path), str(round_no)] + ([str(segment_bytes)] if segment_bytes else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(),
        )
        try:
            ready = child.stdout.readline()
            assert ready == b"ready\n", (ready, child.stderr.read() if child.poll() is not None else b"")
            time.sleep(rng.uniform(0.0, 0.25))  # a random point in the commit loop
        finally:
            child.send_signal(signal.SIGKILL)
            out, err = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL, err.decode()[-2000:]
        checkpointed_while_running += _applied(path) > applied_before
        round_acks = {line[4:] for line in out.split(b"\n") if line.startswith(b"ack ")}
        # a line cut by the kill has no newline and is not counted (split keeps it last)
        if out and not out.endswith(b"\n"):
            round_acks.discard(out.split(b"\n")[-1][4:])
        rounds_with_acks += bool(round_acks)
        acked |= round_acks
        stamps = trio.run(_check, path, acked)
        this_round = [s for t, s in stamps.items() if t.startswith(b"%03d." % round_no)]
        if this_round:
            assert min(this_round) > max_stamp_before, "a versionstamp was reused after restart"
        max_stamp_before = max(stamps.values(), default=b"")
        versions = [s[:8] for s in this_round]
        multi_tx_batches += len(versions) - len(set(versions))
    assert rounds_with_acks >= KILLS // 2, rounds_with_acks
    assert len(acked) > 100
    assert multi_tx_batches > 0  # the kills really hit a group-committing engine
    if segment_bytes:
        assert checkpointed_while_running > 0  # the checkpointer really ran during the rounds


def _applied(path: Path) -> int:
    """The tree's ``mapplied`` (0 before the first open)."""
    import lmdb

    if not (path / "data.mdb").exists():
        return 0
    env = lmdb.open(str(path), max_dbs=0, readonly=True)
    try:
        with env.begin() as txn:
            raw = txn.get(b"mapplied")
            return int.from_bytes(raw, "big") if raw else 0
    finally:
        env.close()


async def test_second_open_in_another_process_fails_at_once_naming_the_holder(tmp_path):
    path = tmp_path / "data"
    db = await kv.open(f"lmdb:{path}")
    try:
        code = "import sys, trio, kv; trio.run(kv.open, 'lmdb:' + sys.argv[1])"
        proc = await trio.run_process(
            [sys.executable, "-c", code, str(path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_child_env(),
        )
        err = proc.stderr.decode()
        assert proc.returncode != 0
        assert "DataDirectoryLocked" in err, err
        assert f"pid {os.getpid()}" in err, err  # names the holder
        # the holder is unaffected
        async def fn(tr):
            tr.set(b"still", b"mine")

        await db.transact(fn)
    finally:
        await db.close()
    # once closed, another process may open it
    proc = await trio.run_process(
        [sys.executable, "-c", "import sys, trio, kv\nasync def m():\n    db = await kv.open('lmdb:' + sys.argv[1])\n    await db.close()\ntrio.run(m)", str(path)],
        check=False,
        capture_stderr=True,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr.decode()


async def test_second_open_in_the_same_process_fails(tmp_path):
    path = tmp_path / "data"
    db = await kv.open(f"lmdb:{path}")
    try:
        with pytest.raises(kv.DataDirectoryLocked, match=str(os.getpid())):
            await kv.open(f"lmdb:{path}")
    finally:
        await db.close()


async def test_urls_reach_the_right_engine(tmp_path, monkeypatch):
    # a bare path and lmdb:PATH are the same durable engine
    monkeypatch.chdir(tmp_path)
    async with await kv.open("./bare") as db:
        async def fn(tr):
            tr.set(b"k", b"durable")

        await db.transact(fn)
    async with await kv.open(f"lmdb:{tmp_path / 'bare'}") as db:
        async def get(tr):
            return await tr.get(b"k")

        assert await db.transact(get) == b"durable"
    # memory: is fresh every time
    async with await kv.open("memory:") as db:
        async def fn(tr):
            tr.set(b"k", b"gone")

        await db.transact(fn)
    async with await kv.open("memory:") as db:
        async def get(tr):
            return await tr.get(b"k")

        assert await db.transact(get) is None
    with pytest.raises(ValueError):
        await kv.open("nosuchscheme:x")
