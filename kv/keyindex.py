"""The ordered key index of the engines' stores (a sortedcontainers SortedList): adding a
batch of new keys.

Both stores keep the keys first written since the last walk in a dict (``_unindexed``) and
add them to the SortedList just before a range read or range clear walks it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from sortedcontainers import SortedList

__all__ = ["add_sorted"]


# Up to this many new keys for one sublist are insorted (a C bisect and memmove each); more
# are appended and the sublist sorted (a C merge of two runs, but a pass over the whole
# sublist, ~up to 2,000 keys: dearer than a few insorts, measured).
_INSORT_MAX = 16


def add_sorted(keys: SortedList, new: list[bytes]) -> None:
    """Add ``new`` (sorted, none of them in ``keys`` yet) to ``keys``.

    Why not ``keys.update(new)``: for a batch small beside the list (the new keys of a
    turn or two, ~40, into an overlay of thousands) sortedcontainers' update calls
    ``add`` per key, Python-level bisects and bookkeeping each (~1.5 us). Here each
    sublist the batch lands in takes its share by C-level ``insort`` (or, for many, one
    ``extend`` and ``sort``), as ``add`` would place each key: in the first
    sublist whose max is above it, or the last one past every max. Then the sublists
    grown past twice the load are split as ``add``'s ``_expand`` does, and the
    positional index (rebuilt lazily by positional calls; walks by key need none) is
    dropped. Relies on SortedList's internals (sortedcontainers 2.4, pinned in
    pyproject.toml); tests/kv/test_keyindex.py checks them (``SortedList._check``).
    """
    maxes = keys._maxes
    if not maxes or len(new) * 4 >= keys._len:
        keys.update(new)  # (update's own path for a big batch: one rebuild)
        return
    lists = keys._lists
    n, last = len(new), len(maxes) - 1
    grown: list[int] = []
    i = 0
    while i < n:
        pos = bisect_right(maxes, new[i])
        if pos > last:  # past every max: the rest goes to the end of the last sublist
            sub = lists[last]
            sub.extend(new[i:] if i else new)
            maxes[last] = new[-1]
            pos, j = last, n
        else:
            j = bisect_left(new, maxes[pos], i)
            sub = lists[pos]
            if j - i <= _INSORT_MAX:
                for k in new[i:j]:
                    insort(sub, k)
            else:
                sub.extend(new[i:j])
                sub.sort()
        if len(sub) > keys._load << 1:
            grown.append(pos)
        i = j
    keys._len += n
    del keys._index[:]
    for pos in reversed(grown):  # (later positions first: a split shifts the ones after it)
        while len(lists[pos]) > keys._load << 1:
            keys._expand(pos)
            pos += 1
