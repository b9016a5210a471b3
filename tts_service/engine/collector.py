"""The cyclic collector's passes moved off the decode step's critical path.

A decode step makes thousands of short-lived container objects (trees, their nodes' tuples,
acceptances, the observations deferred to the next step). Most are freed within the step, but
at its peak a step holds more than CPython's young budget (700 allocations net of frees), so
a young pass fell between two forwards wherever a step's allocations peaked: 1.7 passes a step
for `stand` at 64 rows and 8 nodes (`bench.host`), ~0.2 ms of host time a step in the
`observe` phase alone.

A runner host, once up, widens the young budget (`widen`: a pass per `YOUNG` allocations), and
the decoder runs the pass itself while the device computes the forward (`collect_in_shadow`,
beside the deferred observation), once half the budget is spent: a step ends only a few
hundred allocations above where it started, and its peak stays far below the half left, so
the automatic trigger is never reached between two forwards. Where no host widened the budget
(a replay, a calibration), the automatic passes run as before and the shadow runs none. The
pass is the one CPython would run next (the oldest generation whose count passed its
threshold), so every generation is still collected and cyclic garbage is freed, in a
long-running replica too. CPython's other
condition for a full pass (the long-lived objects grown by a quarter since the last) cannot be
read from Python, so a full pass runs every 121 young ones instead: at a few hundred
allocations a step, tens of thousands of steps apart. A full pass scans every object not
frozen at start-up (a replica's growing stores among them) and may take longer than a forward;
it is the only pass that can still hold a step up, and it comes no more often than this.
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
    the generation collected, or None (too early, the collector off, or its budget not widened:
    under CPython's own, a step's allocations reach the automatic trigger anyway, and a pass
    here would only add to its passes)."""
    if not gc.isenabled():
        return None
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if thresholds[0] < YOUNG or counts[0] < thresholds[0] // 2:
        return None
    generation = next((g for g in (2, 1) if counts[g] > thresholds[g]), 0)
    gc.collect(generation)
    return generation
