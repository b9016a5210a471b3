"""α̂, the one acceptance-rate estimate every allocator and drafter uses: how often a kind of
draft node (a tree slot, a static shape node, a candidate kind) was accepted, smoothed toward a
prior. The callers differ only in what they key on and how their counts decay."""

from __future__ import annotations

from typing import TypeVar

Count = TypeVar("Count")  # a float, or a tensor of counts


def smoothed_rate(hits: Count, drafted: Count, prior: Count, weight: float) -> Count:
    """(hits + weight·prior) / (drafted + weight): the prior counts as `weight` drafts, so a
    node never drafted reads its prior and evidence takes over as it accrues."""
    return (hits + weight * prior) / (drafted + weight)  # type: ignore[operator]
