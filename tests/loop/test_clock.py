"""loop.calls.Clock: wall time for records, mapped onto each trio run's clock."""

from __future__ import annotations

import time

import trio
import trio.testing

from loop.calls import Clock

# A run's times may differ from the wall clock by the time the test itself takes between
# the two readings; trio's per-run clock offsets differ by up to ~190,000 s.
TOLERANCE_S = 5.0


def _skew(clock: Clock, **run_kw) -> float:
    async def read() -> float:
        return clock.now() - time.time()

    return trio.run(read, **run_kw)


def test_each_run_maps_its_own_clock() -> None:
    """A Clock used across several trio runs (as the shared SYSTEM_CLOCK is, by every
    runtime a process opens) reads wall time in each: trio starts each run's clock at a
    random offset, and an offset kept from the first run was off by up to ~190,000 s."""
    clock = Clock()
    for _ in range(4):
        assert abs(_skew(clock)) < TOLERANCE_S


def test_virtual_time_then_a_real_run() -> None:
    """Within a MockClock run, now() moves with virtual time; the next (real) run reads wall time."""
    clock = Clock()

    async def jump() -> float:
        t0 = clock.now()
        await trio.sleep(1_000)  # virtual: autojump
        return clock.now() - t0

    moved = trio.run(jump, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 1_000 <= moved < 1_000 + TOLERANCE_S
    assert abs(_skew(clock)) < TOLERANCE_S


def test_outside_trio_is_wall_time() -> None:
    assert abs(Clock().now() - time.time()) < TOLERANCE_S
