"""How sure a trajectory was, from the target's distributions at its committed positions
(DeepConf's definitions, docs/design.md, "Confidence"), and the two votes that use it. Both
change answers, so neither is the default: `majority` is (`aggregate.vote`).

A token's confidence is minus the mean log-probability of the target's top k at its position:
high where the distribution is peaked. A trajectory's group confidences are the means over a
sliding window of `window_for(length)` tokens (DeepConf's 2,048, scaled down for shorter
trajectories: an eighth of the length, at least 16).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from tts_service.aggregate.extract import Task
from tts_service.aggregate.vote import Vote, majority_vote, with_indices

FLOOR = 1e-12  # a top-k probability's floor before the log (a rounded-off zero)
MAX_WINDOW = 2048  # DeepConf's window
BOTTOM = 0.10  # the share of lowest groups `bottom10_group` averages
SCORE = "bottom10_group"  # the trajectory confidence the weighted and filtered votes use
FILTER_KEEP = 0.9  # the share `filtered` keeps (DeepConf's conservative setting; 0.1: aggressive)
Aggregate = Literal["majority", "confidence", "filtered"]
AGGREGATES: tuple[str, ...] = get_args(Aggregate)
"""The votes a user can ask for: `majority` (the default: exact, early stop applies),
`confidence` (weighted by `SCORE`), `filtered` (the `FILTER_KEEP` most confident vote)."""


def token_confidences(top_probs: np.ndarray | Sequence[Sequence[float]]) -> list[float]:
    """Each position's confidence: -mean log p over the target's top-k probabilities there
    (`top_probs`: [positions, k])."""
    probs = np.asarray(top_probs, dtype=np.float64).reshape(len(top_probs), -1)
    return (-np.log(np.maximum(probs, FLOOR)).mean(axis=1)).tolist()


def token_confidence(top_probs: Sequence[float]) -> float:
    """One position's `token_confidences`."""
    return token_confidences([top_probs])[0]


def window_for(length: int) -> int:
    """The sliding window for a trajectory of `length` tokens."""
    return max(1, min(MAX_WINDOW, max(16, length // 8), length))


def group_confidences(confidences: Sequence[float], window: int) -> list[float]:
    """The mean over every full window of `window` consecutive tokens (one group, the mean
    of all, when the trajectory is shorter)."""
    if not confidences:
        return []
    if len(confidences) <= window:
        return [sum(confidences) / len(confidences)]
    prefix = [0.0]
    for c in confidences:
        prefix.append(prefix[-1] + c)
    return [(prefix[i + window] - prefix[i]) / window for i in range(len(confidences) - window + 1)]


def trajectory_confidence(confidences: Sequence[float]) -> dict[str, float | int]:
    """A trajectory's confidences from its tokens': `mean`, `lowest_group`, `bottom10_group`
    (the mean of its lowest 10% of groups), `tail` (the mean of its last window) and the
    `window` used."""
    if not confidences:
        return {"mean": 0.0, "lowest_group": 0.0, "bottom10_group": 0.0, "tail": 0.0, "window": 0}
    window = window_for(len(confidences))
    groups = sorted(group_confidences(confidences, window))
    lowest = groups[: max(1, math.ceil(BOTTOM * len(groups)))]
    tail = confidences[-window:]
    return {
        "mean": round(sum(confidences) / len(confidences), 4),
        "lowest_group": round(groups[0], 4),
        "bottom10_group": round(sum(lowest) / len(lowest), 4),
        "tail": round(sum(tail) / len(tail), 4),
        "window": window,
    }


def filtered_vote(
    answers: Sequence[str | None], scores: Sequence[float], keep: float, task: Task
) -> Vote:
    """The majority vote of the `keep` share (at least one) of trajectories with the highest
    `scores` (DeepConf's offline filter: η = 10% or 90% of them, by lowest group confidence);
    its winners named by their positions in `answers`."""
    if len(answers) != len(scores) or not 0 < keep <= 1:
        raise ValueError("one score per answer, and 0 < keep <= 1")
    count = max(1, math.ceil(keep * len(answers)))
    kept = sorted(sorted(range(len(answers)), key=lambda i: -scores[i])[:count])
    return with_indices(majority_vote([answers[i] for i in kept], task), kept)


def aggregate_vote(
    aggregate: str,
    answers: Sequence[str | None],
    confidences: Sequence[dict] | None,
    task: Task,
) -> Vote:
    """The vote `aggregate` names over `answers` (`confidences`: each trajectory's
    `trajectory_confidence`, needed by all but `majority`)."""
    if aggregate == "majority":
        return majority_vote(answers, task)
    if confidences is None or len(confidences) != len(answers):
        raise ValueError(f"aggregate {aggregate!r} needs every trajectory's confidence")
    scores = [float(c[SCORE]) for c in confidences]
    if aggregate == "confidence":
        return majority_vote(answers, task, weights=scores)
    if aggregate == "filtered":
        return filtered_vote(answers, scores, FILTER_KEEP, task)
    raise ValueError(f"unknown aggregate {aggregate!r} (choose {', '.join(AGGREGATES)})")


def labelled_vote(
    aggregate: str,
    answers: Sequence[str | None],
    confidences: Sequence[dict | None],
    order: Sequence[int],
    task: Task,
) -> dict:
    """The vote `aggregate` names as every report shows it (`Vote.to_dict`, its winners by the
    trajectory indices in `order`); a weighted or filtered one also says which it is and what
    the `majority` voted. `confidences`: each trajectory's (None where one has none)."""
    sure = None if None in confidences else confidences
    out = with_indices(aggregate_vote(aggregate, answers, sure, task), order).to_dict()
    if aggregate != "majority":
        out |= {"aggregate": aggregate, "majority": majority_vote(answers, task).answer}
    return out


def vote_fields(data: object) -> object:
    """A request's raw fields with `aggregate`'s consequences (a schema's before-validator): a
    weighted or filtered vote needs every trajectory's confidence and all N of them (the early
    stop is exact for the majority only), so it turns early stop off and confidence on, unless
    the request asked otherwise, which is a ValueError naming the field."""
    if not isinstance(data, dict) or data.get("aggregate", "majority") == "majority":
        return data
    aggregate = data["aggregate"]
    if data.get("early_stop"):
        raise ValueError(f"early_stop: exact for the majority vote only, not {aggregate!r}")
    if data.get("confidence") is False:
        raise ValueError(f"confidence: the {aggregate!r} vote needs it")
    return {**data, "early_stop": False, "confidence": True}
