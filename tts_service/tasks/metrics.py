"""Accuracy and speed of one (task, method) run, with bootstrap confidence intervals.

Definitions (each item has N trajectories, in index order):
- pass@1: the fraction of an item's trajectories that are correct, averaged over items.
- pass@k: the unbiased estimator 1 - C(N-c, k) / C(N, k) of Chen et al. (2021), c = correct
  trajectories; pass@N is "any trajectory correct".
- maj@k: the majority vote of the item's first k trajectories is correct (votes by equivalence
  class, as `aggregate.majority_vote`; for code, by normalised program). maj@N uses all N.
- tokens/s: generated tokens over decoding seconds, summed over trajectories. A trajectory's
  seconds are its own latency in the runner's batch (join to finish), so this is the speed one
  trajectory sees, not the run's throughput (the job's summary.json has that).
- acceptance length: committed tokens per target forward, bonus token included (1.0 is plain).

Intervals are percentile bootstraps over items (resampled with replacement, seeded), so they
reflect which questions happened to be asked, the dominant source of noise on 30-200 items.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np


@dataclass(frozen=True)
class ItemOutcome:
    """What the metrics need from one graded item."""

    correct: tuple[bool, ...]  # [N] per trajectory, index order
    maj_correct: dict[int, bool]  # k -> the vote of the first k trajectories is correct
    new_tokens: int
    target_forwards: int
    wall_s: float


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


def _bootstrap(per_item: np.ndarray, weights: np.ndarray | None, idx: np.ndarray, conf: float):
    """Point value and percentile interval of a mean (or a ratio of sums, with weights)."""
    if weights is None:
        point = float(per_item.mean())
        samples = per_item[idx].mean(axis=1)
    else:
        point = float(per_item.sum() / weights.sum()) if weights.sum() else 0.0
        den = weights[idx].sum(axis=1)
        samples = np.divide(per_item[idx].sum(axis=1), den, out=np.zeros(len(den)), where=den > 0)
    tail = (1 - conf) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Estimate(round(point, 4), round(float(low), 4), round(float(high), 4))


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
    idx = np.random.default_rng(seed).integers(0, len(outcomes), size=(resamples, len(outcomes)))
    counts = np.array([sum(o.correct) for o in outcomes])

    def est(values, weights=None) -> Estimate:
        return _bootstrap(np.asarray(values, dtype=float), weights, idx, confidence)

    curve: dict[str, list] = {"k": ks_for(n), "pass@k": [], "maj@k": []}
    for k in curve["k"]:
        curve["pass@k"].append(est([pass_at_k(n, c, k) for c in counts]).to_dict())
        curve["maj@k"].append(est([o.maj_correct[k] for o in outcomes]).to_dict())
    tokens = np.array([o.new_tokens for o in outcomes], dtype=float)
    return {
        "items": len(outcomes),
        "n": n,
        "pass@1": est(counts / n).to_dict(),
        "maj@n": est([o.maj_correct[n] for o in outcomes]).to_dict(),
        "pass@n": est(counts > 0).to_dict(),
        "tokens_per_s": est(tokens, np.array([o.wall_s for o in outcomes])).to_dict(),
        "acceptance_length": est(
            tokens, np.array([o.target_forwards for o in outcomes], dtype=float)
        ).to_dict(),
        "new_tokens": int(tokens.sum()),
        "curve": curve,
        "bootstrap": {"resamples": resamples, "confidence": confidence, "seed": seed},
    }
