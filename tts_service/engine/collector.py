"""The cyclic collector's passes moved off the decode step's critical path.

A decode step makes thousands of short-lived container objects (trees, their nodes' tuples,
acceptances, the observations deferred to the next step): ~9,000 more made than freed per step
at 64 rows. CPython runs a young pass every 700 of those, so a 64-row step ran ~13 young passes
and one middle pass, ~2 ms a step on the host between two forwards, at no fixed point of it.

A runner host, once up (`startup.settle`), widens the young budget (`widen`: a pass per
`YOUNG` allocations) and the decoder runs the pass itself while the device computes the
forward (`collect_in_shadow`, beside the deferred observation): once half the budget is spent,
so that one step's allocations never reach the automatic trigger between two forwards. A wide
young generation is also cheaper: an object born and freed between two passes is never
scanned, and most of a step's are. The pass is the one CPython would run next (the oldest
generation whose count passed its threshold), so every generation is still collected and
cyclic garbage is freed, in a long-running replica too; without its full-pass ratio, a full
pass runs every 121 young ones (every few hundred steps at 64 rows), in the shadow.
"""

from __future__ import annotations

import gc

YOUNG = 100_000
"""Allocations (net of frees) between young passes while a runner host decodes."""


def widen() -> None:
    """Young passes every `YOUNG` allocations from here on (never narrower than they are)."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG), middle, old)


def collect_in_shadow() -> int | None:
    """Where the host would wait for the device: the collector's next pass once half its young
    budget is spent (the oldest generation whose count passed its threshold, as CPython picks);
    the generation collected, or None (too early, or the collector is off)."""
    if not gc.isenabled():
        return None
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if thresholds[0] == 0 or counts[0] < thresholds[0] // 2:
        return None
    generation = next((g for g in (2, 1) if counts[g] > thresholds[g]), 0)
    gc.collect(generation)
    return generation
