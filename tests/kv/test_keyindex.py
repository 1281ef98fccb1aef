"""The stores' ordered key index (memory and LMDB) takes a batch of new keys in one pass per sublist
(kv.keyindex.add_sorted): the result must be the SortedList that adding them one by one
gives, its internal invariants whole (sortedcontainers' own ``_check``)."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st
from sortedcontainers import SortedList

from kv.keyindex import add_sorted as _add_sorted

_keys = st.binary(min_size=0, max_size=3)


@settings(max_examples=300, deadline=None)
@given(base=st.sets(_keys, max_size=400), batches=st.lists(st.sets(_keys, max_size=60), max_size=6),
       load=st.sampled_from([4, 8, 1000]))
def test_batches_land_as_one_by_one_adds(base, batches, load):
    sl = SortedList()
    sl._reset(load)  # (a small load factor: many sublists, splits)
    sl.update(sorted(base))
    model = set(base)
    for batch in batches:
        new = sorted(batch - model)
        _add_sorted(sl, new)
        model |= set(new)
        sl._check()
        assert list(sl) == sorted(model)
        assert len(sl) == len(model)
        # positional calls still work (the index is rebuilt lazily)
        if model:
            k = random.Random(len(model)).choice(sorted(model))
            assert sl[sl.index(k)] == k


def test_large_overlay_small_batches():
    rnd = random.Random(7)
    sl = SortedList(rnd.randbytes(8) for _ in range(20_000))
    model = sorted(sl)
    for _ in range(200):
        new = sorted({rnd.randbytes(8) for _ in range(40)} - set(model))
        _add_sorted(sl, new)
        model = sorted(model + new)
    sl._check()
    assert list(sl) == model
    assert list(sl.irange(model[100], model[200], inclusive=(True, False))) == model[100:200]
