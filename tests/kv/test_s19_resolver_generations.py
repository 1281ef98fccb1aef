"""The resolver's generations bounded by key count (issue #2: one generation spanning
a whole MVCC window held ~470k keys at ~94k commits/s, and CPython's resizes of that
dict were 2-23 ms steps of the event loop), with FoundationDB's conflict rule kept
exact over many generations: checked against a brute-force model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv.resolver import RESOLVER_GENERATION_KEYS, Resolver, key_after
from kvtest_helpers import commit_code


def _model_conflicts(history, read_ranges, read_points, read_version) -> bool:
    """FoundationDB's rule by brute force: a committed write newer than the read
    version intersecting a read range or read key."""
    for version, points, ranges in history:
        if version <= read_version:
            continue
        for k in points:
            if any(b <= k < e for b, e in read_ranges) or k in read_points:
                return True
        for wb, we in ranges:
            if wb < we and (any(b < we and wb < e for b, e in read_ranges) or any(wb <= k < we for k in read_points)):
                return True
    return False


def test_no_generation_grows_past_the_key_limit_under_many_writes():
    """A steady stream of unique keys, one commit a version, forgotten a window behind:
    the young dict never holds more than the limit (one window held all of them before),
    and what is kept is about one window plus a generation."""
    window = 100_000
    r = Resolver()
    most_young = most_gens = most_kept = 0
    for v in range(1, 250_001):
        r.add(v, [], [b"k%08d" % v])
        r.forget_before(v - window)
        if v % 1_000 == 0:
            most_young = max(most_young, len(r._points))
            most_gens = max(most_gens, len(r._olds))
            most_kept = max(most_kept, len(r))
    assert most_young <= RESOLVER_GENERATION_KEYS
    assert most_gens <= window // RESOLVER_GENERATION_KEYS + 2
    assert most_kept <= window + 2 * RESOLVER_GENERATION_KEYS
    # and a read older than all of them still sees the newest writes
    assert r.conflicts([], 250_000 - window, [b"k%08d" % 250_000])
    assert not r.conflicts([], 250_000, [b"k%08d" % 250_000])


def test_rewritten_keys_stay_in_one_small_generation():
    """The limit counts distinct keys: rewriting a few keys never closes a generation
    (only the first forget_before closes one by time, as none was closed yet)."""
    r = Resolver(generation_keys=8)
    for v in range(1, 1_001):
        r.add(v, [], [b"k%d" % (v % 5)])
        r.forget_before(v - 10_000)
    assert len(r._points) == 5 and len(r._olds) == 1


def test_a_fresh_point_read_consults_only_the_young_dict():
    r = Resolver(generation_keys=4)
    for v in range(1, 101):
        r.add(v, [], [b"k%03d" % v])
        r.forget_before(0)
    assert len(r._olds) >= 20

    def no(*_):
        raise AssertionError("a closed generation consulted by a fresh read")

    r._closed_version = no
    last_closed = r._olds[-1].top
    for rv in range(last_closed, 101):
        assert r.conflicts([], rv, [b"k%03d" % 100]) == (rv < 100)
        assert r.conflicts([(b"k050", key_after(b"k050"))], rv) is False
    del r._closed_version
    assert r.conflicts([], 49, [b"k050"]) and not r.conflicts([], 50, [b"k050"])


_keys = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"i", b"j"])
_ranges = st.tuples(_keys, _keys).map(sorted).map(tuple)
_commit = st.tuples(st.lists(_keys, max_size=5), st.lists(_ranges, max_size=2), st.booleans())
_probe = st.tuples(st.lists(_ranges, max_size=2), st.lists(_keys, max_size=3), st.integers(0, 80))


@settings(max_examples=400, deadline=None)
@given(
    commits=st.lists(_commit, min_size=1, max_size=80),
    window=st.integers(1, 90),
    probes=st.lists(st.tuples(st.integers(0, 80), _probe), max_size=25),
    scan=st.sampled_from([0, 1, 3, 10_000]),
    generation_keys=st.integers(1, 5),
)
def test_conflicts_match_the_model_over_many_generations(commits, window, probes, scan, generation_keys):
    """Many small generations, closed by key count and by forgetting; commits share a
    version as a batch's do (the flag: same version as the one before); probes between
    commits with read versions both old (down to the window's floor) and fresh, point
    and range reads, through the scan of recent keys and through the sorted lists."""
    r = Resolver(scan_recent_keys=scan, generation_keys=generation_keys)
    history = []
    version = 0
    floor = 0
    at: dict[int, list] = {}
    for after, probe in probes:
        at.setdefault(after, []).append(probe)
    for i, (points, ranges, same_version) in enumerate(commits):
        if not (same_version and version):
            version += 1
        r.add(version, list(ranges), points)
        history.append((version, points, ranges))
        floor = max(floor, version - window)
        r.forget_before(floor)
        for read_ranges, read_points, rv in at.get(i, ()):
            rv = min(max(rv, floor), version)  # older read versions are transaction_too_old first
            read_ranges = [(b, e) for b, e in read_ranges if b < e]
            want = _model_conflicts(history, read_ranges, read_points, rv)
            assert r.conflicts(read_ranges, rv, read_points) == want
            # each read alone too (a range read, then a point read, may take different paths)
            for b, e in read_ranges:
                assert r.conflicts([(b, e)], rv) == _model_conflicts(history, [(b, e)], [], rv)
            for k in read_points:
                assert r.conflicts([], rv, [k]) == _model_conflicts(history, [], [k], rv)
                assert r.conflicts([(k, key_after(k))], rv) == _model_conflicts(history, [], [k], rv)
    # everything forgotten is older than the floor; nothing kept is needed past it
    assert all(gen.top >= floor for gen in r._olds)


async def test_conflicts_across_many_generations_in_the_engine(edb):
    """End to end: with generations of 2 keys, a transaction whose read is many
    generations old still conflicts with a write among them, and one whose reads
    no later write touched still commits."""
    edb.engine.resolver.generation_keys = 2
    stale = edb.create_transaction()
    await stale.get(b"g/005")
    await stale.get_range(b"g/100", b"g/200")
    stale.set(b"g/out", b"1")
    clean = edb.create_transaction()
    await clean.get(b"g/zzz")
    await clean.get_range(b"h/", b"h0")
    clean.set(b"g/out2", b"1")
    for i in range(60):
        async def fn(tr, i=i):  # idempotent: a plain set
            tr.set(b"g/%03d" % i, b"v")

        await edb.transact(fn)
    assert len(edb.engine.resolver._olds) >= 10
    assert await commit_code(clean) is None
    assert await commit_code(stale) == 1020
    stale2 = edb.create_transaction()
    await stale2.get_range(b"g/100", b"g/200")
    stale2.set(b"g/out3", b"1")
    for i in range(60):
        async def fn2(tr, i=i):  # idempotent: a plain set
            tr.set(b"g/1%02d" % i, b"v")

        await edb.transact(fn2)
    assert await commit_code(stale2) == 1020
