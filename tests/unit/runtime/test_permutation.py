"""The keyed permutation behind an epoch's order: a bijection on [0, n) for any n,
the same in every process for one label, computed without a list."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.runtime.permutation import Permutation

SIZES = st.one_of(st.integers(1, 3000), st.sampled_from([1, 2, 3, 4, 5, 8, 9, 1024, 1025]))


@settings(max_examples=200, deadline=None)
@given(n=SIZES, label=st.text(max_size=12))
def test_is_a_bijection_on_the_range(n: int, label: str) -> None:
    p = Permutation(n, label)
    assert sorted(p) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(n=SIZES, label=st.text(max_size=12), data=st.data())
def test_a_batch_at_once_equals_position_by_position(n: int, label: str,
                                                     data: st.DataObject) -> None:
    p = Permutation(n, label)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, min(n, start + 200)))
    assert p.take(range(start, stop)) == [p[i] for i in range(start, stop)]
    assert p[start:stop] == p.take(range(start, stop))


def test_the_label_decides_the_order() -> None:
    assert list(Permutation(100, "a")) == list(Permutation(100, "a"))
    assert list(Permutation(100, "a")) != list(Permutation(100, "b"))
    assert list(Permutation(100, "a")) != list(range(100)), "it shuffles"


def test_a_billion_positions_without_a_list() -> None:
    n = 10**9
    p = Permutation(n, "big")
    picked = [*p.take(range(n - 100, n)), p[0], p[-1]]
    assert all(0 <= i < n for i in picked)
    assert len(set(picked[:100])) == 100
    assert p[-1] == picked[99]


def test_positions_outside_are_refused() -> None:
    with pytest.raises(IndexError):
        Permutation(5, "x")[5]
    with pytest.raises(ValueError):
        Permutation(0, "x")
