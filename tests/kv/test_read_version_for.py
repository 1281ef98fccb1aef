"""Engine.read_version_for with comparisons in place of max/min: the same read version as
the formula it replaced, for every order of the clock's version, the snapshot's and a batch
being applied (its bound: below that batch's version, never below the snapshot's)."""

from __future__ import annotations

import itertools

from kv.engine import Engine, VERSIONS_PER_SECOND
from kv.memory import MemoryStore


def _reference(snapshot_version: int, now: int, applying: int | None) -> int:
    rv = max(snapshot_version, now)
    if applying is not None and snapshot_version < applying:
        rv = min(rv, applying - 1)
    return max(rv, snapshot_version)


def test_read_version_for_matches_the_max_min_formula():
    now = [0]
    engine = Engine(MemoryStore(), clock=lambda: now[0] / VERSIONS_PER_SECOND)
    values = [0, 1, 5, 9, 10, 11, 20]
    for sv, clock_v, applying in itertools.product(values, values, [None, *values]):
        now[0] = clock_v
        engine._applying_version = applying
        engine._max_read_version = 0
        expected = _reference(sv, clock_v, applying)
        assert engine.read_version_for(sv) == expected, (sv, clock_v, applying)
        assert engine._max_read_version == expected
