"""Conflict resolution: FoundationDB's rule, over the MVCC window.

A transaction T fails ``not_committed`` iff some transaction committed with a
version greater than T's read version wrote a range intersecting T's read
conflict ranges (fdbserver/resolver/ConflictSet.cpp). The resolver remembers
recent write ranges with their commit versions for the MVCC window and
forgets older ones: a read version that old is ``transaction_too_old``
anyway, so nothing older can matter.

Point writes (``[k, k+\\x00)``, by far the common case) live in a dict
(key -> newest version) and in a commit-ordered history, so a point read
checks in O(1). A range read is checked one of two ways:

* when at most ``SCAN_RECENT_KEYS`` keys were written after its read version
  (the usual case: a transaction reads, decides and commits within a batch or
  two), by testing those keys, found newest-first in the history, against the
  range;
* otherwise through a sorted key list, in O(log n + keys written in the
  range). That list is brought up to date only then, from the commit-ordered
  history (the entries past the last such catch-up, each key new to the list
  added once): a write costs one dict store, and a store whose range reads are
  all fresh never pays for the sorted list at all.

Range writes (``clear_range``, explicit conflict ranges) are kept in commit
order and scanned newest-first, stopping at the read version.

Point writes are forgotten a generation at a time, not key by key: they go
into the young generation (the dict, its sorted list and history above).
The young generation is closed, and a new one started, at the first
forget_before (once a batch) after its dict holds ``RESOLVER_GENERATION_KEYS``
keys, or, when no older generation is left, at the next forget_before (so at a low commit rate a generation spans about one
window, as it always did). Closed generations are kept in commit order, and
each is dropped whole (one C-level free) once its newest write is older than
the window. Why bound by keys too: a generation spanning a whole window held,
at ~94k commits/s, ~470k keys in one dict, and CPython rebuilds a dict as it
grows: one ``add`` that crossed a size step took 2 / 4.3 / 8.5 / 23 ms at
44k / 87k / 175k / 349k keys, a whole step of the trio loop (issue #2); a
dict of at most 16,384 keys last resizes at 5,461 (a fraction of a ms), and
dropping one costs ~0.5 ms. Lookups stay exact and cheap: every generation
is older than the ones after it, so a key's newest write is in the newest
generation holding it, and a generation is consulted only by a read older
than its newest write (a fresh read: the young dict alone, as before).
Forgetting key by key cost about a third of the resolver's CPU in steady
state (see forget_before).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Sequence

from sortedcontainers import SortedList

__all__ = ["Resolver", "key_after", "is_point", "SCAN_RECENT_KEYS", "RESOLVER_GENERATION_KEYS"]

# A range read is checked against the keys written after its read version directly
# when there are at most this many (each test is two byte comparisons); past it, the
# sorted key list answers in O(log n) per range.
SCAN_RECENT_KEYS = 64
# The young generation is closed once its dict holds this many keys (at the batch's
# forget_before): no dict of point writes grows much past it, so none is resized at more
# than 5,461 keys (CPython's steps around it: 5,461 and 21,845) and a closed one is freed
# in ~0.5 ms; small enough that neither is a long step of
# the event loop, large enough that a generation is closed at most every ~0.2 s at
# ~94k commits/s (a window holds ~30 of them then).
RESOLVER_GENERATION_KEYS = 16_384
_UNKNOWN = object()  # conflicts(): the recent keys not looked up yet


def key_after(key: bytes) -> bytes:
    return key + b"\x00"


def is_point(begin: bytes, end: bytes) -> bool:
    return len(end) == len(begin) + 1 and end[-1] == 0 and end.startswith(begin)


def _catch_up(sorted_keys: SortedList, listed: dict[bytes, None], history_keys: list, start: int) -> int:
    """Add to one generation's ``sorted_keys`` the keys its history holds from ``start`` on
    that it does not list yet (``listed``: the sorted list's keys, for membership); returns
    the history's length, the next catch-up's start."""
    new: dict[bytes, None] = {}
    for written in itertools.islice(history_keys, start, None):
        if type(written) is bytes:
            if written not in listed:
                new[written] = None
        else:
            for k in written:
                if k not in listed:
                    new[k] = None
    if new:
        listed.update(new)
        sorted_keys.update(new)
    return len(history_keys)


def _written_in(points: dict[bytes, int], sorted_keys: SortedList, begin: bytes, end: bytes,
                read_version: int) -> bool:
    """Whether one generation (its sorted list caught up) wrote a key in [begin, end) after
    ``read_version``."""
    for k in sorted_keys.irange(begin, end, inclusive=(True, False)):
        if points[k] > read_version:
            return True
    return False


class _Generation:
    """A closed generation of point writes: the young generation's structures as they
    were when it was closed (see Resolver.__init__), and its newest version."""

    __slots__ = ("points", "point_keys", "listed", "listed_upto", "history_versions", "history_keys", "top")

    def __init__(self, points: dict[bytes, int], point_keys: SortedList, listed: dict[bytes, None],
                 listed_upto: int, history_versions: list[int], history_keys: list, top: int) -> None:
        self.points = points
        self.point_keys = point_keys
        self.listed = listed
        self.listed_upto = listed_upto
        self.history_versions = history_versions
        self.history_keys = history_keys
        self.top = top

    def catch_up(self) -> None:
        if self.listed_upto < len(self.history_keys):
            self.listed_upto = _catch_up(self.point_keys, self.listed, self.history_keys, self.listed_upto)


class Resolver:
    def __init__(self, *, scan_recent_keys: int = SCAN_RECENT_KEYS,
                 generation_keys: int = RESOLVER_GENERATION_KEYS) -> None:
        assert scan_recent_keys >= 0 and generation_keys >= 1
        self.generation_keys = generation_keys  # tests choose small ones to have many generations
        self.scan_recent_keys = scan_recent_keys  # tests choose 0 to exercise the sorted list
        self._points: dict[bytes, int] = {}
        # The keys of _points in order, as of the history's first _listed_upto entries (caught
        # up by _catch_up when a range check needs it), and the same keys for membership: a
        # dict of None, not a set: a dict holding only bytes and None is never tracked by the
        # garbage collector, a set always is (and a full collection visits every element of a
        # tracked container). Why not listed as written: a write then costs its dict store
        # only, not a test whether its key is new and a second store (~50 keys a turn).
        self._point_keys: SortedList = SortedList()
        self._listed: dict[bytes, None] = {}
        self._listed_upto = 0
        self._ranges: list[tuple[int, bytes, bytes]] = []  # (version, begin, end), ascending version
        # The point keys each commit wrote, in commit order: versions and keys in two lists
        # (a commit of one key stores the key itself, of several a tuple of them), so that a
        # single-key commit allocates nothing the garbage collector tracks, and a larger one
        # a single tuple (every tracked allocation brings the next collection nearer, and
        # each collection walks all the commits in flight).
        self._history_versions: list[int] = []
        self._history_keys: list[bytes | tuple[bytes, ...]] = []
        # The closed generations, oldest first: each one's writes are no newer than the next
        # one's (and the young one's), and _old_top is the newest version written into any
        # of them (-1: none), so that a fresh read tests one int to know none can matter.
        self._olds: list[_Generation] = []
        self._old_top = -1
        self._last_added = -1  # the newest version given to add

    def conflicts(self, read_ranges: Iterable[tuple[bytes, bytes]], read_version: int,
                  read_points: Iterable[bytes] = ()) -> bool:
        """True if a write newer than ``read_version`` meets a read range or read key."""
        points = self._points
        # the closed generations can only matter to a read older than their newest write
        # (in steady state, rarely: reads are milliseconds old, one closes every ~0.2 s at most)
        olds = self._olds if self._old_top > read_version else None
        ranges = self._ranges
        newest_range = ranges[-1][0] if ranges else -1
        recent: list[bytes] | None | object = _UNKNOWN  # keys written after read_version (None: too many)
        for k in read_points:
            v = points.get(k)
            if v is None and olds:  # (a young write of k is newer than any closed one)
                v = self._closed_version(k, read_version)
            if v is not None and v > read_version:
                return True
            if newest_range > read_version:
                for i in range(len(ranges) - 1, -1, -1):
                    v, rb, re = ranges[i]
                    if v <= read_version:
                        break
                    if rb <= k < re:
                        return True
        for begin, end in read_ranges:
            if is_point(begin, end):
                v = points.get(begin)
                if v is None and olds:
                    v = self._closed_version(begin, read_version)
                if v is not None and v > read_version:
                    return True
            else:
                if recent is _UNKNOWN:
                    recent = self._written_after(read_version)
                if recent is not None:
                    for k in recent:  # type: ignore[union-attr]
                        if begin <= k < end:
                            return True
                else:
                    if self._listed_upto < len(self._history_keys):
                        self._listed_upto = _catch_up(self._point_keys, self._listed, self._history_keys,
                                                      self._listed_upto)
                    if _written_in(points, self._point_keys, begin, end, read_version):
                        return True
                    # a key's older writes may be newer than the read too: any one conflicts
                    if olds:
                        for gen in reversed(olds):
                            if gen.top <= read_version:
                                break  # (this one and all before it: nothing newer than the read)
                            gen.catch_up()
                            if _written_in(gen.points, gen.point_keys, begin, end, read_version):
                                return True
            for i in range(len(ranges) - 1, -1, -1):
                v, rb, re = ranges[i]
                if v <= read_version:
                    break
                if rb < end and begin < re:
                    return True
        return False

    def _closed_version(self, key: bytes, read_version: int) -> int | None:
        """The version of ``key``'s newest write in the closed generations, if one is
        newer than ``read_version`` can be (None: none is newer).

        Exact: generations are in commit order, so the newest one holding ``key``
        holds its newest write, and one whose newest write is no newer than the
        read (and every one before it) cannot hold a newer one."""
        for gen in reversed(self._olds):
            if gen.top <= read_version:
                return None
            v = gen.points.get(key)
            if v is not None:
                return v
        return None

    def _written_after(self, read_version: int) -> list[bytes] | None:
        """The point keys written at versions > ``read_version`` (repeats possible),
        or None when there are more than ``scan_recent_keys``.

        Exact: the generations' histories hold every point write in the window in
        commit order (each closed one's no newer than the next one's), and
        forget_before only drops a generation whose writes are all below the
        window, which no checked read version is."""
        out: list[bytes] = []
        limit = self.scan_recent_keys
        versions, keys = self._history_versions, self._history_keys
        olds = self._olds
        older = len(olds)  # the next older generation's index
        while True:
            for i in range(len(versions) - 1, -1, -1):
                if versions[i] <= read_version:
                    return out
                written = keys[i]
                if type(written) is bytes:
                    out.append(written)
                else:
                    out.extend(written)
                if len(out) > limit:
                    return None
            # this history is all newer than the read: the generation before it may hold more
            older -= 1
            if older < 0 or olds[older].top <= read_version:
                return out
            versions, keys = olds[older].history_versions, olds[older].history_keys

    def add(self, version: int, write_ranges: Sequence[tuple[bytes, bytes]],
            write_points: Sequence[bytes] = ()) -> None:
        points = self._points
        for k in write_points:  # (new keys reach the sorted list from the history: _catch_up)
            points[k] = version
        written = write_points  # the keys for the history (a copy only if ranges add points)
        for begin, end in write_ranges:
            if is_point(begin, end):
                points[begin] = version
                if written is write_points:
                    written = list(write_points)
                written.append(begin)
            elif begin < end:
                self._ranges.append((version, begin, end))
        if written:  # (see __init__ for why a key alone, not a 1-tuple)
            self._history_versions.append(version)
            self._history_keys.append(written[0] if len(written) == 1 else tuple(written))
            self._last_added = version

    def forget_before(self, oldest_version: int) -> None:
        """Drop writes at versions < ``oldest_version`` (outside the MVCC window),
        a generation of point writes at a time.

        Each closed generation is dropped whole once every point write in it is
        older than ``oldest_version``; when none is left, the young one is
        closed (so at a low commit rate a point write is forgotten between one
        and two windows after it was made; at a high one, generations close at
        RESOLVER_GENERATION_KEYS keys and go about one window after their
        newest write). Keeping the old writes until then is harmless: every read
        version checked is at or above ``oldest_version`` (older ones are
        ``transaction_too_old`` first), so an older write can never be newer
        than one.

        Why by generation: forgetting key by key (look each key of each expired
        commit up, delete it unless rewritten since, from the dict and the sorted
        list or its pending dict) was a Python step per key written, about a third
        of the resolver's CPU in steady state; dropping a generation is one
        C-level free of its dict, lists and sorted list, ~27-32 ns a key (a
        20,000-key burst 0.53 ms, 200,000 keys 6.5 ms, measured with the keys
        freed too), once, where the old key-by-key way spread ~0.3 us a key over
        the batches in budgets of 2,000 keys.
        """
        olds = self._olds
        if olds and olds[0].top < oldest_version:
            cut = 1
            while cut < len(olds) and olds[cut].top < oldest_version:
                cut += 1
            del olds[:cut]
            if not olds:
                self._old_top = -1
        # Close the young generation when none closed is left (with nothing written since
        # the last closing there is nothing to close: no new empty structures every batch)
        # or when it is full. Tested here, once a batch, not in add (once a commit when
        # commits read): the young dict holds at most the limit plus the keys of the
        # batches resolved since the last call (one or two), still short of its next
        # resize (at 21,845 keys for a limit of 16,384).
        if (not olds and self._history_versions) or len(self._points) >= self.generation_keys:
            self._close_young()
        ranges = self._ranges
        if ranges and ranges[0][0] < oldest_version:
            # ascending versions: everything before the first young one goes
            cut = bisect.bisect_left(ranges, (oldest_version,))
            del ranges[:cut]

    def _close_young(self) -> None:
        """Close the young generation (it has writes) and start a new one."""
        self._olds.append(_Generation(self._points, self._point_keys, self._listed, self._listed_upto,
                                      self._history_versions, self._history_keys, self._last_added))
        self._old_top = self._last_added
        self._points = {}
        self._point_keys = SortedList()
        self._listed = {}
        self._listed_upto = 0
        self._history_versions = []
        self._history_keys = []

    def __len__(self) -> int:
        """Point writes and range writes kept (a key in several generations counts in each)."""
        return len(self._points) + sum(len(gen.points) for gen in self._olds) + len(self._ranges)
