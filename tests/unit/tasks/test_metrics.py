"""Metrics on hand-made outcomes with known values."""

from __future__ import annotations

from math import comb

import pytest

from tts_service.tasks.metrics import ItemOutcome, ks_for, pass_at_k, summarize


def _item(correct, maj, tokens=100, forwards=50, wall=2.0) -> ItemOutcome:
    return ItemOutcome(tuple(correct), maj, tokens, forwards, wall)


# 4 items x 4 trajectories; maj_correct written by hand for k = 1, 2, 4
OUTCOMES = [
    _item([1, 1, 1, 1], {1: True, 2: True, 4: True}),
    _item([0, 1, 0, 1], {1: False, 2: False, 4: True}),
    _item([0, 0, 0, 1], {1: False, 2: False, 4: False}),
    _item([0, 0, 0, 0], {1: False, 2: False, 4: False}, tokens=300, forwards=100, wall=4.0),
]


def test_pass_at_k_matches_the_closed_form():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # = 0.5
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer wrong samples than k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_curve_points():
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(1) == [1]


def test_summary_values_on_known_outcomes():
    s = summarize(OUTCOMES)
    assert s["pass@1"]["value"] == pytest.approx((1 + 0.5 + 0.25 + 0) / 4)
    assert s["maj@n"]["value"] == 0.5
    assert s["pass@n"]["value"] == 0.75
    assert s["tokens_per_s"]["value"] == pytest.approx(600 / 10.0)  # summed, not averaged
    assert s["acceptance_length"]["value"] == pytest.approx(600 / 250)
    assert s["curve"]["k"] == [1, 2, 4]
    assert [e["value"] for e in s["curve"]["maj@k"]] == [0.25, 0.25, 0.5]
    assert s["curve"]["pass@k"][0]["value"] == s["pass@1"]["value"]


def test_bootstrap_intervals_contain_the_point_and_are_seeded():
    s = summarize(OUTCOMES)
    for key in ("pass@1", "maj@n", "pass@n", "tokens_per_s", "acceptance_length"):
        e = s[key]
        assert e["low"] <= e["value"] <= e["high"], key
    assert s["maj@n"]["low"] < s["maj@n"]["high"]  # 4 items: a wide interval
    assert summarize(OUTCOMES) == s
    same = [_item([1, 0], {1: True, 2: True})] * 5
    e = summarize(same)["pass@1"]
    assert e["value"] == e["low"] == e["high"] == 0.5  # no spread across identical items


def test_summary_rejects_ragged_items():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize([_item([1], {1: True}), _item([1, 0], {1: True, 2: True})])
