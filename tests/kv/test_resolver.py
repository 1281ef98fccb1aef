"""The resolver against a brute-force model of FoundationDB's conflict rule,
with forgetting between commits (history kept past the window, a generation of
it at a time, must never change an answer for a read version inside it)."""

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
    probes=st.lists(st.tuples(st.lists(_ranges, max_size=2), st.lists(_keys, max_size=2), st.integers(0, 30)), max_size=10),
    scan=_scan_limits,
)
def test_conflicts_match_the_model_while_forgetting(commits, floors, probes, scan):
    r = Resolver(scan_recent_keys=scan)
    history = []
    floor = 0
    for i, (points, ranges) in enumerate(commits, start=1):
        r.add(i, [(b, e) for b, e in ranges], points)
        history.append((i, points, ranges))
        if i - 1 < len(floors):
            floor = max(floor, floors[i - 1])
            r.forget_before(floor)
    for read_ranges, read_points, rv in probes:
        rv = max(rv, floor)  # older read versions are transaction_too_old before the resolver
        read_ranges = [(b, e) for b, e in read_ranges if b < e]
        assert r.conflicts(read_ranges, rv, read_points) == _model_conflicts(history, read_ranges, read_points, rv)


def test_point_writes_are_forgotten_a_generation_at_a_time():
    r = Resolver()
    r.add(1, [], [b"k%05d" % i for i in range(5_000)])
    r.add(2, [(b"x", b"y")], [b"late"])
    r.forget_before(2)  # the range of version 2 is young; the point writes become the old generation
    assert len(r) == 5_000 + 1 + 1
    assert r.conflicts([(b"late", key_after(b"late"))], 1)
    assert r.conflicts([(b"k00000", b"k99999")], 0)  # the old generation answers reads older than it
    assert not r.conflicts([(b"k00000", b"k99999")], 1)  # nothing newer than 1 there
    r.add(3, [], [b"late", b"new"])  # young again; "late" in both generations
    assert r.conflicts([], 2, [b"late"]) and not r.conflicts([], 3, [b"late"])
    r.forget_before(3)  # the old generation's newest write (2) is below 3: dropped whole
    assert len(r) == 2  # "late" and "new" at 3 (the range at 2 went too)
    assert r.conflicts([], 2, [b"new"]) and not r.conflicts([(b"k", b"l")], 0)
    r.forget_before(3)  # nothing newer than the old generation's newest (3) expired: kept
    assert len(r) == 2
    r.forget_before(4)
    r.forget_before(4)
    assert len(r) == 0


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(_commit, st.integers(0, 30), st.lists(st.tuples(st.lists(_ranges, max_size=2),
                                                                             st.lists(_keys, max_size=2),
                                                                             st.integers(0, 30)), max_size=2)),
                   min_size=1, max_size=30),
    scan=_scan_limits,
)
def test_conflicts_match_the_model_with_range_checks_between_commits_and_forgets(steps, scan):
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
        r.forget_before(floor)
        for read_ranges, read_points, rv in probes:
            rv = max(rv, floor)
            read_ranges = [(b, e) for b, e in read_ranges if b < e]
            assert r.conflicts(read_ranges, rv, read_points) == _model_conflicts(history, read_ranges, read_points, rv)
