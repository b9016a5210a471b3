"""Accuracy of one (task, method) run, with bootstrap confidence intervals.

Definitions (each item has N trajectories, in index order):
- pass@1: the fraction of an item's trajectories that are correct, averaged over items.
- pass@k: the unbiased estimator 1 - C(N-c, k) / C(N, k) of Chen et al. (2021), c = correct
  trajectories; pass@N is "any trajectory correct".
- maj@k: the majority vote of the item's first k trajectories is correct (votes by equivalence
  class, as `aggregate.majority_vote`; for code, by normalised program). maj@N uses all N.
- confidence_maj@N and filtered_maj@N (runs with `confidence: true`): the same N samples voted
  by confidence weight, and by the 90% most confident (`aggregate.confidence`).
- acceptance length: committed tokens per target forward, bonus token included (1.0 is plain).
- no-answer rate: the fraction of an item's trajectories with no extractable answer, averaged
  over items; truncation rate: likewise for trajectories stopped by the token limit
  (finish_reason `length`). A score of 0 with either near 1 says the budget or the prompt is
  wrong, not the model.

Speed (tokens/s) is not a per-item metric: it is the run's `metrics.summarize()` figure, all new
tokens over the real elapsed time, recorded per invocation by the job (`report.py`).

Intervals are percentile bootstraps over items (`scipy.stats.bootstrap`, seeded), so they reflect
which questions happened to be asked, the dominant source of noise on 30-200 items.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np
from scipy.stats import bootstrap


@dataclass(frozen=True)
class ItemOutcome:
    """What the metrics need from one graded item."""

    correct: tuple[bool, ...]  # [N] per trajectory, index order
    maj_correct: dict[int, bool]  # k -> the vote of the first k trajectories is correct
    new_tokens: int
    target_forwards: int  # 0 when unknown (an OpenAI-compatible endpoint)
    no_answer: int = 0  # trajectories with no extracted answer
    truncated: int = 0  # trajectories stopped by the token limit (finish_reason "length")
    confidence_correct: bool | None = None  # the confidence-weighted vote of all N
    filtered_correct: bool | None = None  # the vote of the 90% most confident


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c correct of n samples (Chen et al. 2021, "Evaluating LLMs Trained
    on Code", eq. 1).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """Points of the accuracy-vs-N curve: powers of two below n, and n."""
    ks = [k for k in (2**i for i in range(7)) if k < n]
    return [*ks, n]


def _ratio(tokens: np.ndarray, forwards: np.ndarray, axis: int = -1) -> np.ndarray:
    """Sum over sum, item-paired (a ratio of totals, not a mean of per-item ratios)."""
    den = forwards.sum(axis=axis)
    num = tokens.sum(axis=axis)
    return np.divide(num, den, out=np.zeros(np.shape(num)), where=den > 0)


def _estimate(samples: tuple[np.ndarray, ...], statistic, resamples: int, conf: float, seed: int):
    """Point value and percentile bootstrap interval over items (one item: no interval)."""
    point = float(statistic(*samples, axis=-1))
    if len(samples[0]) < 2:
        return Estimate(round(point, 4), round(point, 4), round(point, 4))
    ci = bootstrap(
        samples,
        statistic,
        paired=True,
        vectorized=True,
        n_resamples=resamples,
        confidence_level=conf,
        method="percentile",
        rng=np.random.default_rng(seed),
    ).confidence_interval
    return Estimate(round(point, 4), round(float(ci.low), 4), round(float(ci.high), 4))


def summarize(
    outcomes: list[ItemOutcome], resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> dict:
    """Every metric with its interval, and the accuracy-vs-k curves.

    Raises:
        ValueError: no items, or items with different numbers of trajectories.
    """
    if not outcomes:
        raise ValueError("no graded items")
    n = len(outcomes[0].correct)
    if n == 0 or any(len(o.correct) != n for o in outcomes):
        raise ValueError("every item needs the same number (>= 1) of trajectories")
    counts = np.array([sum(o.correct) for o in outcomes])

    def est(values) -> dict:
        arr = np.asarray(values, dtype=float)
        return _estimate((arr,), np.mean, resamples, confidence, seed).to_dict()

    curve: dict[str, list] = {"k": ks_for(n), "pass@k": [], "maj@k": []}
    for k in curve["k"]:
        curve["pass@k"].append(est([pass_at_k(n, c, k) for c in counts]))
        curve["maj@k"].append(est([o.maj_correct[k] for o in outcomes]))
    tokens = np.array([o.new_tokens for o in outcomes], dtype=float)
    forwards = np.array([o.target_forwards for o in outcomes], dtype=float)
    acceptance = (
        _estimate((tokens, forwards), _ratio, resamples, confidence, seed).to_dict()
        if forwards.any()
        else None  # unknown: the trajectories came from an endpoint
    )
    weighted = {
        f"{name}_maj@n": est([getattr(o, f"{name}_correct") for o in outcomes])
        for name in ("confidence", "filtered")
        if all(getattr(o, f"{name}_correct") is not None for o in outcomes)
    }
    return {
        "items": len(outcomes),
        "n": n,
        "pass@1": est(counts / n),
        "maj@n": est([o.maj_correct[n] for o in outcomes]),
        **weighted,
        "pass@n": est(counts > 0),
        "no_answer_rate": est([o.no_answer / n for o in outcomes]),
        "truncation_rate": est([o.truncated / n for o in outcomes]),
        "acceptance_length": acceptance,
        "new_tokens": int(tokens.sum()),
        "curve": curve,
        "bootstrap": {
            "method": "percentile",
            "resamples": resamples,
            "confidence": confidence,
            "seed": seed,
        },
    }
