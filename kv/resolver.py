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
into the young generation (the dict, its sorted list and history above); when
every write of the old generation is older than the window, the old one is
dropped whole (one C-level free) and the young one becomes old. A generation
spans about one window, so at most about two windows of point writes are
kept. A key written in both is found in the young one first (its newest
write); the old one is consulted only by reads older than its newest write.
Forgetting key by key cost about a third of the resolver's CPU in steady
state (see forget_before).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Sequence

from sortedcontainers import SortedList

__all__ = ["Resolver", "key_after", "is_point", "SCAN_RECENT_KEYS"]

# A range read is checked against the keys written after its read version directly
# when there are at most this many (each test is two byte comparisons); past it, the
# sorted key list answers in O(log n) per range.
SCAN_RECENT_KEYS = 64
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


class Resolver:
    def __init__(self, *, scan_recent_keys: int = SCAN_RECENT_KEYS) -> None:
        assert scan_recent_keys >= 0
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
        # The old generation: the same structures, as they were when it was young,
        # and the newest version written into it (-1: none). Everything in it is older
        # than everything in the young one.
        self._old_points: dict[bytes, int] = {}
        self._old_point_keys: SortedList = SortedList()
        self._old_listed: dict[bytes, None] = {}
        self._old_listed_upto = 0
        self._old_history_versions: list[int] = []
        self._old_history_keys: list[bytes | tuple[bytes, ...]] = []
        self._old_top = -1
        self._last_added = -1  # the newest version given to add

    def conflicts(self, read_ranges: Iterable[tuple[bytes, bytes]], read_version: int,
                  read_points: Iterable[bytes] = ()) -> bool:
        """True if a write newer than ``read_version`` meets a read range or read key."""
        points = self._points
        # the old generation can only matter to a read older than its newest write
        # (in steady state, never: reads are milliseconds old, a generation a window)
        old = self._old_points if self._old_top > read_version else None
        ranges = self._ranges
        newest_range = ranges[-1][0] if ranges else -1
        recent: list[bytes] | None | object = _UNKNOWN  # keys written after read_version (None: too many)
        for k in read_points:
            v = points.get(k)
            if v is None and old:  # (a young write of k is newer than any old one)
                v = old.get(k)
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
                if v is None and old:
                    v = old.get(begin)
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
                    # a key's old write may be newer than the read too: either one conflicts
                    if old:
                        if self._old_listed_upto < len(self._old_history_keys):
                            self._old_listed_upto = _catch_up(self._old_point_keys, self._old_listed,
                                                              self._old_history_keys, self._old_listed_upto)
                        if _written_in(old, self._old_point_keys, begin, end, read_version):
                            return True
            for i in range(len(ranges) - 1, -1, -1):
                v, rb, re = ranges[i]
                if v <= read_version:
                    break
                if rb < end and begin < re:
                    return True
        return False

    def _written_after(self, read_version: int) -> list[bytes] | None:
        """The point keys written at versions > ``read_version`` (repeats possible),
        or None when there are more than ``scan_recent_keys``.

        Exact: the two generations' histories hold every point write in the window
        in commit order (the old one's all older), and forget_before only drops a
        generation whose writes are all below the window, which no checked read
        version is."""
        out: list[bytes] = []
        limit = self.scan_recent_keys
        versions, keys = self._history_versions, self._history_keys
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
            # the young history is all newer than the read: the old one may hold more
            if versions is self._old_history_versions or self._old_top <= read_version:
                return out
            versions, keys = self._old_history_versions, self._old_history_keys

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

        Once every point write of the old generation is older than
        ``oldest_version``, it is dropped whole and the young one becomes old
        (so a point write is forgotten between one and two windows after it
        was made). Keeping the old writes until then is harmless: every read
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
        # (with nothing written since the last rotation and the old generation already
        # empty there is nothing to drop: no new empty structures every batch)
        if self._old_top < oldest_version and (self._last_added > self._old_top or self._old_points):
            self._old_points, self._points = self._points, {}
            self._old_point_keys, self._point_keys = self._point_keys, SortedList()
            self._old_listed, self._listed = self._listed, {}
            self._old_listed_upto, self._listed_upto = self._listed_upto, 0
            self._old_history_versions, self._history_versions = self._history_versions, []
            self._old_history_keys, self._history_keys = self._history_keys, []
            self._old_top = self._last_added
        ranges = self._ranges
        if ranges and ranges[0][0] < oldest_version:
            # ascending versions: everything before the first young one goes
            cut = bisect.bisect_left(ranges, (oldest_version,))
            del ranges[:cut]

    def __len__(self) -> int:
        """Point writes and range writes kept (a key in both generations counts twice)."""
        return len(self._points) + len(self._old_points) + len(self._ranges)
