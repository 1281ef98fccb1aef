"""The resolver against a brute-force model of FoundationDB's conflict rule,
with forgetting done in small budgets (history kept past the window must
never change an answer for a read version inside it)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv.resolver import Resolver, key_after

_keys = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
_ranges = st.tuples(_keys, _keys).map(sorted).map(tuple)
_commit = st.tuples(st.lists(_keys, max_size=6), st.lists(_ranges, max_size=2))
# How many recently written keys a range check may scan before it uses the sorted list:
# 0 always uses the list, a large limit always scans, small ones switch between the two.
_scan_limits = st.sampled_from([0, 1, 3, 8, 10_000])


def _model_conflicts(history, read_ranges, read_points, read_version) -> bool:
    for version, points, ranges in history:
        if version <= read_version:
            continue
        for k in points:
            if any(b <= k < e for b, e in read_ranges) or k in read_points:
                return True
        for wb, we in ranges:
            if wb >= we:
                continue
            if any(b < we and wb < e for b, e in read_ranges) or any(wb <= k < we for k in read_points):
                return True
    return False


@settings(max_examples=300, deadline=None)
@given(
    commits=st.lists(_commit, min_size=1, max_size=30),
    floors=st.lists(st.integers(0, 30), max_size=10),
    budget=st.integers(1, 4),
    probes=st.lists(st.tuples(st.lists(_ranges, max_size=2), st.lists(_keys, max_size=2), st.integers(0, 30)), max_size=10),
    scan=_scan_limits,
)
def test_conflicts_match_the_model_while_forgetting_in_small_budgets(commits, floors, budget, probes, scan):
    r = Resolver(scan_recent_keys=scan)
    history = []
    floor = 0
    for i, (points, ranges) in enumerate(commits, start=1):
        r.add(i, [(b, e) for b, e in ranges], points)
        history.append((i, points, ranges))
        if i - 1 < len(floors):
            floor = max(floor, floors[i - 1])
            r.forget_before(floor, budget=budget)
    for read_ranges, read_points, rv in probes:
        rv = max(rv, floor)  # older read versions are transaction_too_old before the resolver
        read_ranges = [(b, e) for b, e in read_ranges if b < e]
        assert r.conflicts(read_ranges, rv, read_points) == _model_conflicts(history, read_ranges, read_points, rv)


def test_a_burst_is_forgotten_a_budget_at_a_time():
    r = Resolver()
    r.add(1, [], [b"k%05d" % i for i in range(5_000)])
    r.add(2, [(b"x", b"y")], [b"late"])
    r.forget_before(2, budget=2_000)
    assert len(r) == 3_000 + 2  # 2,000 forgotten; the rest of the burst, the range and "late" kept
    r.forget_before(2, budget=2_000)
    r.forget_before(2, budget=2_000)
    assert len(r) == 2
    assert r.conflicts([(b"late", key_after(b"late"))], 1)
    assert not r.conflicts([(b"k00000", b"k99999")], 1)  # version 1 writes are gone, nothing newer there
    r.forget_before(3)
    assert len(r) == 0


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(_commit, st.integers(0, 30), st.lists(st.tuples(st.lists(_ranges, max_size=2),
                                                                             st.lists(_keys, max_size=2),
                                                                             st.integers(0, 30)), max_size=2)),
                   min_size=1, max_size=30),
    budget=st.integers(1, 4),
    scan=_scan_limits,
)
def test_conflicts_match_the_model_with_range_checks_between_commits_and_forgets(steps, budget, scan):
    """Range checks index the keys written since the last one (or scan them, when
    few); keys written, forgotten and written again around those checks must still
    be found exactly when the model finds them."""
    r = Resolver(scan_recent_keys=scan)
    history = []
    floor = 0
    for i, ((points, ranges), new_floor, probes) in enumerate(steps, start=1):
        r.add(i, [(b, e) for b, e in ranges], points)
        history.append((i, points, ranges))
        floor = max(floor, min(new_floor, i))
        r.forget_before(floor, budget=budget)
        for read_ranges, read_points, rv in probes:
            rv = max(rv, floor)
            read_ranges = [(b, e) for b, e in read_ranges if b < e]
            assert r.conflicts(read_ranges, rv, read_points) == _model_conflicts(history, read_ranges, read_points, rv)
