"""Metrics on hand-made outcomes with known values."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from tts_service.tasks.metrics import ItemOutcome, ks_for, pass_at_k, summarize


def _item(correct, maj, tokens=100, forwards=50, no_answer=0, truncated=0) -> ItemOutcome:
    return ItemOutcome(tuple(correct), maj, tokens, forwards, no_answer, truncated)


# 4 items x 4 trajectories; maj_correct written by hand for k = 1, 2, 4
OUTCOMES = [
    _item([1, 1, 1, 1], {1: True, 2: True, 4: True}),
    _item([0, 1, 0, 1], {1: False, 2: False, 4: True}),
    _item([0, 0, 0, 1], {1: False, 2: False, 4: False}),
    _item([0, 0, 0, 0], {1: False, 2: False, 4: False}, 300, 100, no_answer=4, truncated=3),
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
    assert s["acceptance_length"]["value"] == pytest.approx(600 / 250)  # summed, not averaged
    assert s["no_answer_rate"]["value"] == pytest.approx(0.25)  # 4 of 4 on one item in 4
    assert s["truncation_rate"]["value"] == pytest.approx(3 / 16)
    assert s["curve"]["k"] == [1, 2, 4]
    assert [e["value"] for e in s["curve"]["maj@k"]] == [0.25, 0.25, 0.5]
    assert s["curve"]["pass@k"][0]["value"] == s["pass@1"]["value"]


def test_bootstrap_intervals_contain_the_point_and_are_seeded():
    s = summarize(OUTCOMES)
    keys = ("pass@1", "maj@n", "pass@n", "no_answer_rate", "truncation_rate", "acceptance_length")
    for key in keys:
        e = s[key]
        assert e["low"] <= e["value"] <= e["high"], key
    assert s["maj@n"]["low"] < s["maj@n"]["high"]  # 4 items: a wide interval
    assert summarize(OUTCOMES) == s
    same = [_item([1, 0], {1: True, 2: True})] * 5
    e = summarize(same)["pass@1"]
    assert e["value"] == e["low"] == e["high"] == 0.5  # no spread across identical items
    assert s["bootstrap"]["method"] == "percentile"


def test_intervals_are_scipys_percentile_bootstrap():
    from scipy.stats import bootstrap

    s = summarize(OUTCOMES, resamples=500, seed=3)
    values = [0.0 if o.correct == (0, 0, 0, 0) else 1.0 for o in OUTCOMES]
    ci = bootstrap(
        ([float(x) for x in values],),
        np.mean,
        n_resamples=500,
        method="percentile",
        rng=np.random.default_rng(3),
    ).confidence_interval
    assert (s["pass@n"]["low"], s["pass@n"]["high"]) == (round(ci.low, 4), round(ci.high, 4))


def test_one_item_has_no_interval_and_endpoint_runs_no_acceptance_length():
    s = summarize([_item([1, 0], {1: True, 2: True}, forwards=0)])
    assert s["pass@1"] == {"value": 0.5, "low": 0.5, "high": 0.5}
    assert s["acceptance_length"] is None


def test_summary_rejects_ragged_items():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize([_item([1], {1: True}), _item([1, 0], {1: True, 2: True})])
