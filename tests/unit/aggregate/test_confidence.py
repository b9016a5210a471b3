"""DeepConf's confidences on tiny inputs, and the filtered vote."""

from __future__ import annotations

import math

import pytest

from tts_service.aggregate.confidence import (
    filtered_vote,
    group_confidences,
    token_confidence,
    trajectory_confidence,
    window_for,
)


def test_a_peaked_distribution_is_more_confident_than_a_flat_one():
    assert token_confidence([0.25] * 4) == pytest.approx(math.log(4))
    assert token_confidence([0.97, 0.01, 0.01, 0.01]) > token_confidence([0.25] * 4)
    assert token_confidence([1.0, 0.0]) == pytest.approx(-math.log(1e-12) / 2)  # floored


def test_windows_groups_and_the_summary():
    assert window_for(10) == 10 and window_for(400) == 50 and window_for(100_000) == 2048
    assert window_for(0) == 1
    assert group_confidences([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    assert group_confidences([1.0, 3.0], 5) == [2.0]  # shorter than a window: one group
    confs = [5.0] * 100 + [1.0] * 16 + [5.0] * 84  # one weak stretch of 16 tokens
    summary = trajectory_confidence(confs)
    assert summary["window"] == 25 and summary["mean"] == pytest.approx(4.68)
    assert summary["lowest_group"] == pytest.approx((16 * 1.0 + 9 * 5.0) / 25)
    assert summary["lowest_group"] <= summary["bottom10_group"] <= summary["mean"]
    assert summary["tail"] == 5.0
    assert trajectory_confidence([])["window"] == 0


def test_the_filtered_vote_keeps_the_most_confident_share():
    answers = ["A", "A", "A", "B", "B"]
    scores = [1.0, 1.0, 1.0, 9.0, 8.0]
    assert filtered_vote(answers, scores, 1.0, "choice").answer == "A"  # all: the majority
    assert filtered_vote(answers, scores, 0.4, "choice").answer == "B"  # the 2 most confident
    assert filtered_vote(answers, scores, 0.01, "choice").answer == "B"  # at least one
    with pytest.raises(ValueError):
        filtered_vote(answers, scores[:2], 0.5, "choice")


def _sure(score: float) -> dict:
    return {"mean": score, "lowest_group": score, "bottom10_group": score, "tail": score}


def test_the_three_votes_and_what_they_need():
    from tts_service.aggregate.confidence import aggregate_vote

    answers = ["A", "A", "A", "B", "B"]
    sure = [_sure(s) for s in (1.0, 1.0, 1.0, 9.0, 9.0)]
    assert aggregate_vote("majority", answers, None, "choice").answer == "A"
    assert aggregate_vote("confidence", answers, sure, "choice").answer == "B"  # 18 > 3
    flat = [_sure(1.0)] * 5
    assert aggregate_vote("confidence", answers, flat, "choice").answer == "A"  # = majority
    assert aggregate_vote("filtered", answers, sure, "choice").answer == "A"  # keeps 90%: 5
    with pytest.raises(ValueError, match="needs every trajectory's confidence"):
        aggregate_vote("filtered", answers, None, "choice")
    with pytest.raises(ValueError, match="unknown aggregate"):
        aggregate_vote("mode", answers, sure, "choice")


def test_a_weighted_vote_turns_early_stop_off_and_confidence_on_unless_told_otherwise():
    from tts_service.aggregate.confidence import vote_fields

    assert vote_fields({"aggregate": "majority", "early_stop": True}) == {
        "aggregate": "majority",
        "early_stop": True,
    }
    assert vote_fields({"aggregate": "confidence"}) == {
        "aggregate": "confidence",
        "early_stop": False,
        "confidence": True,
    }
    with pytest.raises(ValueError, match="^early_stop: exact for the majority vote only"):
        vote_fields({"aggregate": "filtered", "early_stop": True})
    with pytest.raises(ValueError, match="^confidence: the 'confidence' vote needs it"):
        vote_fields({"aggregate": "confidence", "confidence": False})
