"""Runtime.open's collector thresholds: set while a runtime is open, only over CPython's defaults,
given back when the last runtime closes (see loop.runtime.GC_THRESHOLDS)."""

from __future__ import annotations

import gc

import pytest

from loop import Runtime
from loop.runtime import GC_THRESHOLDS, PYTHON_GC_THRESHOLDS


@pytest.fixture
def thresholds():
    """Each test starts at CPython's defaults; the session's thresholds come back after."""
    before = gc.get_threshold()
    gc.set_threshold(*PYTHON_GC_THRESHOLDS)
    yield
    gc.set_threshold(*before)


async def test_an_open_runtime_tunes_the_collector_and_gives_the_defaults_back(thresholds):
    async with Runtime.open("memory:"):
        assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_threshold() == PYTHON_GC_THRESHOLDS


async def test_the_thresholds_come_back_when_the_last_of_two_runtimes_closes(thresholds):
    async with Runtime.open("memory:"):
        async with Runtime.open("memory:"):
            assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_threshold() == GC_THRESHOLDS  # the outer one is still open
    assert gc.get_threshold() == PYTHON_GC_THRESHOLDS


async def test_thresholds_an_application_chose_are_left_alone(thresholds):
    gc.set_threshold(5_000, 7, 9)
    async with Runtime.open("memory:"):
        assert gc.get_threshold() == (5_000, 7, 9)
    assert gc.get_threshold() == (5_000, 7, 9)


async def test_tune_gc_false_leaves_the_collector_alone(thresholds):
    async with Runtime.open("memory:", tune_gc=False):
        assert gc.get_threshold() == PYTHON_GC_THRESHOLDS


async def test_thresholds_changed_while_open_are_not_overwritten_at_close(thresholds):
    async with Runtime.open("memory:"):
        gc.set_threshold(1_234, 5, 6)
    assert gc.get_threshold() == (1_234, 5, 6)


async def test_a_runtime_that_fails_to_start_gives_the_thresholds_back(thresholds):
    with pytest.raises(TypeError):
        async with Runtime.open("memory:", no_such_option=1):
            pass
    assert gc.get_threshold() == PYTHON_GC_THRESHOLDS
