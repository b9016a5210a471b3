"""STAND's merge rule for logit n-gram entries, on hand-made data."""

from __future__ import annotations

import pytest

from store.base import NgramEntry, merge


def test_merge_first_observation_sorts_and_truncates():
    e = merge(None, [5, 6, 7], [0.2, 0.5, 0.3], topk=2)
    assert e == NgramEntry((6, 7), (0.5, 0.3), 1)


def test_merge_is_the_count_weighted_running_mean_over_the_union():
    old = NgramEntry((1, 2), (0.6, 0.4), count=3)
    # new = 3/4 * old + 1/4 * incoming, absent ids count as 0
    e = merge(old, [2, 9], [0.8, 0.2], topk=10)
    expect = {1: 0.6 * 0.75, 2: 0.4 * 0.75 + 0.8 * 0.25, 9: 0.2 * 0.25}
    assert e.count == 4
    assert e.ids == (2, 1, 9)  # 0.5, 0.45, 0.05
    assert e.probs == pytest.approx([expect[i] for i in e.ids], abs=1e-15)


def test_merge_truncates_back_to_topk_with_deterministic_ties():
    old = NgramEntry((1, 2, 3), (0.4, 0.3, 0.3), count=1)
    e = merge(old, [4, 5], [0.6, 0.4], topk=3)
    # halves: 1: .2, 2: .15, 3: .15, 4: .3, 5: .2 -> 4, then 1 and 5 tie at .2 (lower id first)
    assert e.ids == (4, 1, 5) and e.count == 2
