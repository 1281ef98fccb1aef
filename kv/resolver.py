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
  range). That list is brought up to date only then: keys first written since
  wait in a dict. A sorted insert and its later removal cost a few
  microseconds per key written, a dict insert a tenth of that, so a store
  whose range reads are all fresh never pays for the sorted list at all.

Range writes (``clear_range``, explicit conflict ranges) are kept in commit
order and scanned newest-first, stopping at the read version.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, Sequence

from sortedcontainers import SortedList

__all__ = ["Resolver", "key_after", "is_point", "FORGET_BUDGET_KEYS", "SCAN_RECENT_KEYS"]

# Point keys forgotten per commit batch at most (see Resolver.forget_before).
FORGET_BUDGET_KEYS = 2_000
# A range read is checked against the keys written after its read version directly
# when there are at most this many (each test is two byte comparisons); past it, the
# sorted key list answers in O(log n) per range.
SCAN_RECENT_KEYS = 64
_UNKNOWN = object()  # conflicts(): the recent keys not looked up yet


def key_after(key: bytes) -> bytes:
    return key + b"\x00"


def is_point(begin: bytes, end: bytes) -> bool:
    return len(end) == len(begin) + 1 and end[-1] == 0 and end.startswith(begin)


class Resolver:
    def __init__(self, *, scan_recent_keys: int = SCAN_RECENT_KEYS) -> None:
        assert scan_recent_keys >= 0
        self.scan_recent_keys = scan_recent_keys  # tests choose 0 to exercise the sorted list
        self._points: dict[bytes, int] = {}
        self._point_keys: SortedList = SortedList()  # every key of _points not in _new_points
        # keys of _points not yet in _point_keys; a dict of None, not a set: a dict holding only
        # bytes and None is never tracked by the garbage collector, a set always is (and a full
        # collection visits every element of a tracked container)
        self._new_points: dict[bytes, None] = {}
        self._ranges: list[tuple[int, bytes, bytes]] = []  # (version, begin, end), ascending version
        # The point keys each commit wrote, in commit order: versions and keys in two deques
        # (a commit of one key stores the key itself, of several a tuple of them), so that a
        # single-key commit allocates nothing the garbage collector tracks, and a larger one
        # a single tuple (every tracked allocation brings the next collection nearer, and
        # each collection walks all the commits in flight).
        self._history_versions: deque[int] = deque()
        self._history_keys: deque[bytes | tuple[bytes, ...]] = deque()

    def conflicts(self, read_ranges: Iterable[tuple[bytes, bytes]], read_version: int,
                  read_points: Iterable[bytes] = ()) -> bool:
        """True if a write newer than ``read_version`` meets a read range or read key."""
        points = self._points
        ranges = self._ranges
        newest_range = ranges[-1][0] if ranges else -1
        recent: list[bytes] | None | object = _UNKNOWN  # keys written after read_version (None: too many)
        for k in read_points:
            v = points.get(k)
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
                    if self._new_points:
                        self._point_keys.update(self._new_points)
                        self._new_points.clear()
                    for k in self._point_keys.irange(begin, end, inclusive=(True, False)):
                        if points[k] > read_version:
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

        Exact: the history holds every point write in the window in commit order,
        and forget_before only drops versions below the window, which no checked
        read version is."""
        out: list[bytes] = []
        limit = self.scan_recent_keys
        versions, keys = self._history_versions, self._history_keys
        for i in range(len(versions) - 1, -1, -1):
            if versions[i] <= read_version:
                break
            written = keys[i]
            if type(written) is bytes:
                out.append(written)
            else:
                out.extend(written)
            if len(out) > limit:
                return None
        return out

    def add(self, version: int, write_ranges: Sequence[tuple[bytes, bytes]],
            write_points: Sequence[bytes] = ()) -> None:
        points = self._points
        new = self._new_points
        for k in write_points:
            if k not in points:
                new[k] = None
            points[k] = version
        written = write_points  # the keys for the history (a copy only if ranges add points)
        for begin, end in write_ranges:
            if is_point(begin, end):
                if begin not in points:
                    new[begin] = None
                points[begin] = version
                if written is write_points:
                    written = list(write_points)
                written.append(begin)
            elif begin < end:
                self._ranges.append((version, begin, end))
        if written:  # (see __init__ for why a key alone, not a 1-tuple)
            self._history_versions.append(version)
            self._history_keys.append(written[0] if len(written) == 1 else tuple(written))

    def forget_before(self, oldest_version: int, budget: int = FORGET_BUDGET_KEYS) -> None:
        """Drop writes at versions < ``oldest_version`` (outside the MVCC window).

        At most ``budget`` point keys per call:
        after a burst (a bulk load writing 20,000 keys), forgetting it all at
        once would stall one commit for tens of ms on the event loop. What is
        left waits for the next calls, and keeping it meanwhile is harmless:
        every read version checked is at or above ``oldest_version`` (older
        ones are ``transaction_too_old`` first), so an older write can never
        be newer than one.
        """
        points = self._points
        versions, history = self._history_versions, self._history_keys
        dropped = 0
        while versions and versions[0] < oldest_version and dropped < budget:
            version, keys = versions[0], history[0]
            if type(keys) is bytes:
                keys = (keys,)
            take = budget - dropped
            if len(keys) <= take:
                versions.popleft()
                history.popleft()
            else:  # a huge commit: forget part of it now, the rest later
                keys, history[0] = keys[:take], keys[take:]
            new = self._new_points
            for k in keys:
                if points.get(k) == version:
                    del points[k]
                    if k in new:
                        del new[k]
                    else:
                        self._point_keys.discard(k)
            dropped += len(keys)
        ranges = self._ranges
        if ranges and ranges[0][0] < oldest_version:
            # ascending versions: everything before the first young one goes
            cut = bisect.bisect_left(ranges, (oldest_version,))
            del ranges[:cut]

    def __len__(self) -> int:
        return len(self._points) + len(self._ranges)
