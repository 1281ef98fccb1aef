"""The log's sync helper process (kv/walsync.py, kv/_fsyncd.py).

A pipelined batch (one written while other tasks could run) is written by
the store on the loop and synced by a child process. These tests make
batches go that way (``INLINE_WHEN_IDLE`` off) and check what the store
promises around the child: a batch is acknowledged only once synced; a
helper that dies or cannot start costs speed, never a commit; a sync that
fails stops commits like any failed log write; and no helper outlives its
store or its parent process.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import kv
import kv.lmdb_engine
import kv.walsync
from kv import KVError
from kv.engine import Engine
from kv.lmdb_engine import LmdbStore
from kv.walsync import MAX_HELPER_STARTS, SyncHelper

ROOT = Path(__file__).resolve().parents[2]
WRITERS = 8  # concurrent committers: enough that batches form while one is on disk


@pytest.fixture(autouse=True)
def pipelined(monkeypatch):
    """Every batch goes through the helper (none is written inline on an idle loop)."""
    monkeypatch.setattr(kv.lmdb_engine, "INLINE_WHEN_IDLE", False)


def _open(path: Path) -> kv.Database:
    return kv.Database(Engine(LmdbStore(path), clock=time.time), url=f"lmdb:{path}")


async def _commit_concurrently(db, prefix: bytes, n: int) -> None:
    async def writer(w: int) -> None:
        for i in range(w, n, WRITERS):
            tr = db.create_transaction()
            tr.set(prefix + b"%05d" % i, b"v%d" % i)  # blind write: idempotent
            await tr.commit()

    async with trio.open_nursery() as nursery:
        for w in range(WRITERS):
            nursery.start_soon(writer, w)


async def _all(db, begin=b"", end=b"\xff") -> dict[bytes, bytes]:
    tr = db.create_transaction()
    return {r.key: r.value for r in await tr.get_range(begin, end)}


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def _fake_helper(tmp_path: Path, body: str) -> str:
    """A helper script speaking _fsyncd's protocol with ``body`` as its loop."""
    script = tmp_path / "fake_fsyncd.py"
    script.write_text(
        "import socket, struct, sys\n"
        "sock = socket.socket(fileno=int(sys.argv[1]))\n"
        "while True:\n"
        "    raw = sock.recv(8)\n"
        "    if len(raw) < 8:\n"
        "        sys.exit(0)\n" + body)
    return str(script)


def _swap_helper(db, tmp_path: Path, body: str) -> None:
    """Replace the store's sync helper (none may be out) by ``_fake_helper(body)``."""
    store = db.engine.store
    store._sync.close()
    store._sync = SyncHelper(store.path / "wal", script=_fake_helper(tmp_path, body))


def _after_gate(gate: Path, answer: str) -> str:
    """A fake helper's loop body: wait for ``gate`` to exist, then send ``answer`` (an expression)."""
    return ("    import os, time\n"
            "    while not os.path.exists(%r):\n"
            "        time.sleep(0.01)\n"
            "    sock.sendall(struct.pack('<I', %s))\n") % (str(gate), answer)


async def _hold_answers_until(db, tmp_path: Path, gate: Path) -> None:
    """After a warm-up (the real helper started), swap in a helper that answers
    each request (success) only once ``gate`` exists."""
    await _commit_concurrently(db, b"warm/", 16)
    _swap_helper(db, tmp_path, _after_gate(gate, "0"))


async def _start_writers_until_two_out(nursery, store, writer) -> None:
    """Start WRITERS ``writer(w)`` tasks; return once two sync requests are out (held by the gate)."""
    for w in range(WRITERS):
        nursery.start_soon(writer, w)
    while store._sync._out < 2:
        await trio.sleep(0.01)


async def test_pipelined_batches_are_synced_by_one_helper_that_exits_with_the_store(tmp_path):
    path = tmp_path / "data"
    db = _open(path)
    try:
        store = db.engine.store
        await _commit_concurrently(db, b"k/", 400)
        pid = store._sync.pid
        assert pid is not None and _alive(pid)
        assert store._sync.starts == 1  # one helper served every batch
        # Group commit: fewer syncs than commits, and each batch's sync was counted.
        assert 0 < store.stats["fsyncs"] < 400
        assert db.engine.stats["chained_batches"] > 0
    finally:
        await db.close()
    assert _wait_gone(pid, 1.0)  # close() ends the helper (and reaps it)
    async with _open(path) as db:
        data = await _all(db, b"k/", b"k0")
        assert len(data) == 400 and data[b"k/00399"] == b"v399"


async def test_a_helper_killed_between_batches_costs_no_commit_and_is_replaced(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kv.walsync")
    path = tmp_path / "data"
    async with _open(path) as db:
        store = db.engine.store
        await _commit_concurrently(db, b"a/", 100)
        first = store._sync.pid
        os.kill(first, signal.SIGKILL)
        assert _wait_gone(first)
        await _commit_concurrently(db, b"b/", 100)  # the first request to the dead helper fails over
        assert store._sync.starts == 2
        second = store._sync.pid
        assert second is not None and second != first and _alive(second)
        assert len(await _all(db)) == 200
    assert "sync helper" in caplog.text and "synced on the event loop" in caplog.text
    async with _open(path) as db:
        assert len(await _all(db)) == 200


async def test_a_helper_that_never_answers_leaves_every_batch_synced_on_the_loop(tmp_path, monkeypatch, caplog):
    """An interpreter that fails at once: each start is a lost helper, its batch is
    synced here; after MAX_HELPER_STARTS no more starts, and commits still succeed."""
    caplog.set_level(logging.WARNING, logger="kv.walsync")
    monkeypatch.setattr(kv.walsync.sys, "executable", "/bin/false")
    path = tmp_path / "data"
    async with _open(path) as db:
        store = db.engine.store
        await _commit_concurrently(db, b"k/", 300)
        assert store._sync.starts == MAX_HELPER_STARTS
        assert store._sync.pid is None
        assert len(await _all(db)) == 300
    assert "and so is every later one" in caplog.text
    monkeypatch.undo()
    async with _open(path) as db:
        assert len(await _all(db)) == 300


async def test_a_sync_the_helper_reports_failed_stops_commits_until_reopened(tmp_path):
    path = tmp_path / "data"
    db = _open(path)
    try:
        await _commit_concurrently(db, b"ok/", 40)
        _swap_helper(db, tmp_path, "    sock.sendall(struct.pack('<I', %d))\n" % errno.EIO)
        tr = db.create_transaction()
        tr.set(b"doomed", b"x")
        with pytest.raises(KVError) as info:
            await tr.commit()
        assert info.value.code == 1021 and info.value.maybe_committed  # written, durability unknown
        assert "fdatasync" in str(info.value.__cause__)
        tr = db.create_transaction()
        assert await tr.get(b"doomed") is None  # never visible in this process
        tr.set(b"later", b"y")
        with pytest.raises(KVError) as info:
            await tr.commit()
        assert info.value.code == 4100 and "reopen" in str(info.value)
        assert len(await _all(db, b"ok/", b"ok0")) == 40  # reads go on
    finally:
        await db.close()
    async with _open(path) as db:
        data = await _all(db)
        assert len([k for k in data if k.startswith(b"ok/")]) == 40 and b"later" not in data


async def test_no_batch_is_acknowledged_before_its_sync_is_answered(tmp_path):
    """A helper that holds its answer: the commit waits (it is not acknowledged
    on the buffered write alone), and is acknowledged once the answer comes."""
    gate = tmp_path / "gate"
    path = tmp_path / "data"
    async with _open(path) as db:
        await _hold_answers_until(db, tmp_path, gate)
        done = trio.Event()

        async def commit() -> None:
            tr = db.create_transaction()
            tr.set(b"held", b"x")
            await tr.commit()
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(commit)
            await trio.sleep(0.3)
            assert not done.is_set()  # written to the page cache, not yet answered
            reader = db.create_transaction()
            assert await reader.get(b"held") is None  # nor visible
            gate.touch()
            with trio.fail_after(10):
                await done.wait()
        tr = db.create_transaction()
        assert await tr.get(b"held") == b"x"


def test_the_helper_exits_when_its_parent_is_killed(tmp_path):
    """SIGKILL of the store's process: the helper reads end-of-input and exits
    (no orphan keeps running), and every acknowledged commit is in the log."""
    code = (
        "import os, sys, time, trio, kv, kv.lmdb_engine\n"
        "kv.lmdb_engine.INLINE_WHEN_IDLE = False\n"
        "async def main():\n"
        "    db = await kv.open('lmdb:' + sys.argv[1])\n"
        "    async def w(k):\n"
        "        for i in range(50):\n"
        "            tr = db.create_transaction(); tr.set(b'c/%d/%03d' % (k, i), b'v'); await tr.commit()\n"
        "    async with trio.open_nursery() as n:\n"
        "        for k in range(4): n.start_soon(w, k)\n"
        "    print(db.engine.store._sync.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "trio.run(main)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "data")], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        helper = int(proc.stdout.readline())
        assert _alive(helper)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    assert _wait_gone(helper)

    async def check() -> None:
        async with _open(tmp_path / "data") as db:
            assert len(await _all(db, b"c/", b"c0")) == 200

    trio.run(check)


async def test_closing_while_a_commit_waits_for_its_sync_answers_it_committed(tmp_path):
    """close() with a batch's waiter parked on the helper's socket: close sees
    the sync through, wakes the waiter (a task waiting on a closed socket is
    never woken otherwise) and the commit is acknowledged: it is durable."""
    import threading

    gate = tmp_path / "gate"
    path = tmp_path / "data"
    db = _open(path)
    await _hold_answers_until(db, tmp_path, gate)
    outcome: list[str] = []

    async def commit() -> None:
        tr = db.create_transaction()
        tr.set(b"held", b"x")
        await tr.commit()
        outcome.append("ok")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(commit)
            await trio.sleep(0.2)  # the commit is parked on the helper's answer
            assert outcome == []
            threading.Timer(0.2, gate.touch).start()  # answered while close() waits for it
            await db.close()
    assert outcome == ["ok"]
    async with _open(path) as db:
        tr = db.create_transaction()
        assert await tr.get(b"held") == b"x"


# -- the next batch written while one syncs (MAX_IN_FLIGHT) -------------------------------------


def test_a_segment_is_sealed_only_once_all_it_holds_is_synced(tmp_path):
    """A record written ahead of the previous one's sync stays in the segment,
    and the segment is sealed (handed to the checkpointer) only when both are
    durable; once full, nothing more is written ahead."""
    from kv.wal import LogWriter

    (tmp_path / "wal").mkdir()
    w = LogWriter(tmp_path / "wal", segment_bytes=100)
    w.write(b"a" * 60)
    assert w.has_room()
    w.write(b"b" * 60)  # ahead of the first one's sync; the segment is now full
    assert not w.has_room()
    assert w.synced(60) is False and w.number == 1  # the second record is still unsynced: no seal
    assert w.synced(60) is True and w.number == 2  # all durable: sealed, the next segment begins
    assert w.has_room() and w.size == w.written == 0
    w.write(b"c" * 110)  # full by itself
    w.write(b"d" * 10)  # (a caller ignoring has_room)
    assert w.synced(110) is False and w.number == 2  # full, but 10 bytes are not durable yet
    assert w.synced(10) is True and w.number == 3
    w.close()


async def test_the_next_batch_is_written_while_one_syncs_and_waits_for_it(tmp_path):
    """With the helper's answers held back, a second batch goes out behind the
    first (never a third), nothing is acknowledged or visible before its
    answer, and both are acknowledged in order once answered."""
    gate = tmp_path / "gate"
    path = tmp_path / "data"
    async with _open(path) as db:
        store = db.engine.store
        await _hold_answers_until(db, tmp_path, gate)
        ahead = db.engine.stats["ahead_batches"]
        acked: list[bytes] = []

        async def writer(w: int) -> None:
            for i in range(5):
                tr = db.create_transaction()
                key = b"k/%d/%d" % (w, i)
                tr.set(key, b"v")  # blind write: idempotent
                await tr.commit()
                acked.append(key)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await _start_writers_until_two_out(nursery, store, writer)
                await trio.sleep(0.2)
                assert store._sync._out == 2  # two batches out, the rest queued behind them
                assert db.engine.stats["ahead_batches"] > ahead
                assert acked == []
                reader = db.create_transaction()
                assert await reader.get_range(b"k/", b"k0") == []  # nothing visible before its sync
                gate.touch()
        assert len(acked) == WRITERS * 5
    async with _open(path) as db:
        assert len(await _all(db, b"k/", b"k0")) == WRITERS * 5


async def test_a_failed_sync_fails_the_batch_written_behind_it(tmp_path):
    """The first batch's sync fails while a second is out behind it: both are
    reported commit_unknown_result (the second's own sync "succeeded", but the
    log cannot be trusted past the failure), and the store refuses commits, the ones
    still queued behind them included (4100: never written)."""
    gate = tmp_path / "gate"
    path = tmp_path / "data"
    db = _open(path)
    try:
        store = db.engine.store
        await _commit_concurrently(db, b"ok/", 40)
        # EIO for the first answer only ('answered' marks the helper's module globals)
        _swap_helper(db, tmp_path, "    first = 'answered' not in globals()\n    answered = True\n"
                     + _after_gate(gate, "%d if first else 0" % errno.EIO))
        outcomes: dict[bytes, int | str] = {}

        async def writer(w: int) -> None:
            tr = db.create_transaction()
            tr.set(b"doomed/%d" % w, b"x")
            try:
                await tr.commit()
                outcomes[b"doomed/%d" % w] = "ok"
            except KVError as e:
                outcomes[b"doomed/%d" % w] = e.code

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await _start_writers_until_two_out(nursery, store, writer)
                await trio.sleep(0.05)  # every writer has reached commit()
                queued = len(db.engine._pending)  # not written yet (the batch behind took its share)
                gate.touch()
        assert len(outcomes) == WRITERS and "ok" not in outcomes.values(), outcomes  # none acknowledged
        # Both batches out were written before the failure: 1021 (maybe committed). The commits
        # still queued were never written: the store refuses them (4100, not committed).
        assert sorted(outcomes.values()) == [1021] * (WRITERS - queued) + [4100] * queued, (queued, outcomes)
        tr = db.create_transaction()
        assert await tr.get_range(b"doomed/", b"doomed0") == []  # nor visible
        tr.set(b"later", b"y")
        with pytest.raises(KVError) as info:
            await tr.commit()
        assert info.value.code == 4100
    finally:
        await db.close()


async def test_the_helper_is_woken_by_its_eventfd_not_by_the_request_on_the_socket(tmp_path):
    """The helper sleeps on an eventfd (a socket write would wake it synchronously,
    on the event loop's own core: see _fsyncd's docstring). A request that reaches
    the socket without the eventfd's poke is not answered; once poked, it is. The
    helper still exits when the socket is closed (the hang-up wakes it)."""
    import select

    from kv import _fsyncd
    from kv.wal import LogWriter

    wal_dir = tmp_path / "wal"
    wal_dir.mkdir()
    log = LogWriter(wal_dir)
    helper = SyncHelper(wal_dir)
    try:
        log.write(b"x" * 10)
        helper.request(log.number, log.wfd)
        with trio.fail_after(10):
            await helper.done()  # the helper is up and has answered once
        assert helper._efd >= 0
        pid = helper.pid
        sock = helper._sock
        sock.send(_fsyncd.REQUEST.pack(log.number))  # the request alone, no poke
        assert select.select([sock], [], [], 0.5)[0] == []  # not answered: the socket did not wake it
        os.eventfd_write(helper._efd, 1)
        assert select.select([sock], [], [], 10)[0] == [sock]
        assert _fsyncd.REPLY.unpack(sock.recv(_fsyncd.REPLY.size)) == (0,)  # synced
    finally:
        helper.close()
        log.close()
    assert _wait_gone(pid)


def test_the_helper_spins_for_the_next_request_only_while_they_come_soon(monkeypatch):
    """After an answer the helper looks for the next request (``poll(0)``) for
    ``SPIN_SECONDS`` before it sleeps, but only while requests keep coming that
    soon: one spin that finds nothing stops the spinning, and a quiet store's
    helper sleeps straight away (``_fsyncd._requests``)."""
    import select
    import socket
    import threading

    from kv import _fsyncd

    calls: list = []
    real_poll = select.poll

    class RecordingPoll:
        def __init__(self) -> None:
            self._poll = real_poll()

        def register(self, *args) -> None:
            self._poll.register(*args)

        def poll(self, timeout=None):
            calls.append(timeout)
            return self._poll.poll(timeout) if timeout is not None else self._poll.poll()

    monkeypatch.setattr(_fsyncd.select, "poll", RecordingPoll)
    # a window wide enough that a busy CI machine's scheduling cannot close it between two
    # lines, and still far below the 0.2 s by which the late requests come
    monkeypatch.setattr(_fsyncd, "SPIN_SECONDS", 0.02)
    parent, child = socket.socketpair()
    efd = os.eventfd(0, os.EFD_CLOEXEC)

    def send(number: int) -> None:
        parent.send(_fsyncd.REQUEST.pack(number))
        os.eventfd_write(efd, 1)

    def taken(number: int, *, later: float = 0.0) -> list:
        """The poll calls made to take request ``number`` (sent now, or ``later`` s from now)."""
        calls.clear()
        timer = threading.Timer(later, send, (number,)) if later else None
        if timer:
            timer.start()
        else:
            send(number)
        assert next(requests) == number
        if timer:
            timer.join()
        return list(calls)

    requests = _fsyncd._requests(child, efd)
    try:
        assert taken(1) == [None]  # the first: slept for (nothing answered before it)
        assert taken(2) == [None]  # came straight after an answer, but no spin was on yet ...
        spun = taken(3)  # ... so this one is looked for before sleeping
        assert spun[0] == 0 and None not in spun
        missed = taken(4, later=0.2)  # too late for the spin: it gives up, then sleeps
        assert missed[0] == 0 and missed[-1] is None and set(missed) == {0, None}
        assert taken(5, later=0.2) == [None]  # and no longer spins: straight to sleep
    finally:
        requests.close()
        parent.close()
        child.close()
        os.close(efd)
