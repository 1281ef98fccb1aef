"""The memory engine's fault hooks, as the simulator uses them (issue 2, section 4).

A crash before a batch is applied loses the batch; a crash after it is
applied keeps it although nobody heard; a hook can turn a commit that did
apply into commit_unknown_result (1021). A restarted "process" is a new
Database on the same MemoryEngine.
"""

from __future__ import annotations

import pytest

import kv
from kv import KVError
from kvtest_helpers import dump, raises_code, read, write


class Crash(BaseException):
    """The simulator's process death: not an Exception, so nothing swallows it."""


class Hooks(kv.FaultHooks):
    def __init__(self) -> None:
        self.crash_before_apply = False
        self.crash_after_apply = False
        self.unknown_after_apply = False
        self.fail_before_commit: int | None = None
        self.fail_on_read: int | None = None
        self.applied_versions: list[int] = []

    def on_read(self, tr) -> None:
        if self.fail_on_read is not None:
            raise KVError(self.fail_on_read, "injected")

    def before_commit(self, tr) -> None:
        if self.fail_before_commit is not None:
            raise KVError(self.fail_before_commit, "injected")

    def before_apply(self, version, batch) -> None:
        if self.crash_before_apply:
            raise Crash()

    def after_apply(self, version, batch):
        self.applied_versions.append(version)
        if self.crash_after_apply:
            raise Crash()
        if self.unknown_after_apply:
            return {req: KVError(1021, "injected: applied") for req in batch}
        return None


@pytest.fixture
def engine_and_hooks():
    hooks = Hooks()
    return kv.MemoryEngine(hooks=hooks), hooks


async def test_crash_before_apply_loses_the_batch(engine_and_hooks):
    engine, hooks = engine_and_hooks
    db = engine.database()
    await write(db, (b"k", b"before"))
    hooks.crash_before_apply = True
    tr = db.create_transaction()
    tr.set(b"k", b"lost")
    with pytest.raises(Crash):
        await tr.commit()
    hooks.crash_before_apply = False
    restarted = engine.database()
    assert await read(restarted, b"k") == b"before"
    await write(restarted, (b"k", b"after"))  # the engine keeps working
    assert await read(restarted, b"k") == b"after"


async def test_crash_after_apply_keeps_the_batch_unheard(engine_and_hooks):
    engine, hooks = engine_and_hooks
    db = engine.database()
    hooks.crash_after_apply = True
    tr = db.create_transaction()
    tr.set(b"k", b"kept")
    vs = tr.get_versionstamp()
    with pytest.raises(Crash):
        await tr.commit()
    hooks.crash_after_apply = False
    restarted = engine.database()
    assert await read(restarted, b"k") == b"kept"
    # versions keep increasing past the unheard batch
    tr2 = restarted.create_transaction()
    tr2.set(b"k2", b"v")
    await tr2.commit()
    assert tr2.get_committed_version() > hooks.applied_versions[0]
    with pytest.raises(BaseException):
        await vs


async def test_commit_unknown_result_for_a_commit_that_applied(engine_and_hooks):
    engine, hooks = engine_and_hooks
    db = engine.database()
    hooks.unknown_after_apply = True
    tr = db.create_transaction()
    tr.add(b"counter", b"\x01")
    with raises_code(1021) as info:
        await tr.commit()
    assert info.value.maybe_committed and info.value.retryable
    hooks.unknown_after_apply = False
    assert await read(db, b"counter") == b"\x01"  # it did commit


async def test_transact_retries_1021_and_a_guard_keeps_it_idempotent(engine_and_hooks):
    engine, hooks = engine_and_hooks
    db = engine.database()
    attempts = 0

    async def guarded_increment(tr):  # guarded: a marker key records that it ran
        nonlocal attempts
        attempts += 1
        hooks.unknown_after_apply = attempts == 1
        if await tr.get(b"marker/op-1") is not None:
            return
        tr.set(b"marker/op-1", b"")
        tr.add(b"counter", b"\x01")

    await db.transact(guarded_increment)
    assert attempts == 2
    assert await read(db, b"counter") == b"\x01"


@pytest.mark.parametrize("code", [1020, 1007])
async def test_injected_errors_before_commit_are_retried(engine_and_hooks, code):
    engine, hooks = engine_and_hooks
    db = engine.database()
    attempts = 0

    async def fn(tr):
        nonlocal attempts
        attempts += 1
        hooks.fail_before_commit = code if attempts < 3 else None
        tr.set(b"k", b"%d" % attempts)

    await db.transact(fn)
    assert attempts == 3 and await read(db, b"k") == b"3"
    assert await dump(db) == [(b"k", b"3")]


@pytest.mark.parametrize("code", [1007, 1009])
async def test_injected_read_errors(engine_and_hooks, code):
    engine, hooks = engine_and_hooks
    db = engine.database()
    hooks.fail_on_read = code
    tr = db.create_transaction()
    with raises_code(code):
        await tr.get(b"k")
    hooks.fail_on_read = None
    await tr.on_error(KVError(code))  # retryable
    assert await tr.get(b"k") is None
