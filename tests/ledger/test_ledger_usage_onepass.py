"""Session 18: record_tr checks a step's usage and builds its packed add operand in one pass
(ledger.usage._checked_and_packed): the same figures, operand and other-field keys as the
check-then-pack of session 17 (kept here as the reference), the same inputs refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.usage import (MAX_FIGURE, MAX_USAGE_FIELDS, PACKED_FIELD_BYTES, PACKED_FIELDS, TOTAL_TOKENS,
                          _checked_and_packed)


def _reference(usage):
    """Session 17's _check_usage then _packed, verbatim in effect."""
    if len(usage) > MAX_USAGE_FIELDS:
        raise ValueError("too many")
    figures = {}
    for k, v in usage.items():
        if not isinstance(k, str) or not k or k == TOTAL_TOKENS:
            raise ValueError("bad field")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > MAX_FIGURE:
            raise ValueError("bad figure")
        figures[k] = v
    vals, rest = None, {}
    for k, v in figures.items():
        if k not in PACKED_FIELDS:
            if v:
                rest[k] = v
        elif v:
            vals = vals or [0] * len(PACKED_FIELDS)
            vals[PACKED_FIELDS.index(k)] = v
    packed = None if vals is None else b"".join(v.to_bytes(PACKED_FIELD_BYTES, "little") for v in vals)
    return figures, packed, rest


_FIGURE = st.one_of(st.integers(0, 1000), st.integers(0, MAX_FIGURE), st.just(MAX_FIGURE))
_NAMES = st.one_of(st.sampled_from(PACKED_FIELDS), st.sampled_from(("audio_tokens", "reasoning_tokens", "x")))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_NAMES, _FIGURE, max_size=8))
def test_one_pass_gives_the_check_then_pack_result(usage):
    got = _checked_and_packed(usage)
    assert got == _reference(usage)
    figures, packed, rest = got
    assert list(figures) == list(usage)  # (the marker's value keeps the caller's order)
    if packed is not None:
        assert len(packed) == PACKED_FIELD_BYTES * len(PACKED_FIELDS)


class _IntSub(int):
    pass


@pytest.mark.parametrize("usage", [
    {"input_tokens": -1}, {"input_tokens": MAX_FIGURE + 1}, {"input_tokens": True}, {"audio_tokens": False},
    {"output_tokens": 1.0}, {"x": "3"}, {"": 1}, {TOTAL_TOKENS: 5}, {3: 1}, {b"input_tokens": 1},
    {f"f{i}": 1 for i in range(MAX_USAGE_FIELDS + 1)},
])
def test_what_the_check_refused_is_refused(usage):
    with pytest.raises(ValueError):
        _reference(usage)
    with pytest.raises(ValueError):
        _checked_and_packed(usage)


def test_an_int_subclass_is_counted_as_before_and_zeros_add_nothing():
    usage = {"input_tokens": _IntSub(5), "audio_tokens": _IntSub(2), "output_tokens": 0}
    assert _checked_and_packed(usage) == _reference(usage)
    assert _checked_and_packed({"input_tokens": 0, "audio_tokens": 0}) == (
        {"input_tokens": 0, "audio_tokens": 0}, None, {})
    # every packed field at its largest: each in its own 12 bytes, none carried into the next
    top = {f: MAX_FIGURE for f in PACKED_FIELDS}
    _, packed, _ = _checked_and_packed(top)
    assert packed == MAX_FIGURE.to_bytes(PACKED_FIELD_BYTES, "little") * len(PACKED_FIELDS)
