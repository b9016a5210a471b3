"""Cost-aware batch speculation: how many draft nodes each row of a batch gets this step.

GTCP's Greater-Than rule applied to the whole batched forward (docs/design.md, "One
trajectory runner"). A step with B rows, each sending a tree of k draft nodes (width
w = k + 1 tokens, padded to the widest row), takes T(B, w) on the device, read off the learned
cost surface (`engine.surface`), plus the drafters' own time per node. It commits
Σ_rows (1 + Σ α̂) tokens on average, where α̂ of a node is the probability that it lies on the
accepted path, estimated per method and per tree slot (depth, rank among its siblings) from the
trees that method verified (`SlotStats`). The step takes the k with the most expected
committed tokens per second; k = 0 is plain batched decoding, with no drafting at all.

`SpeculationPlanner` decides on the surface's pessimistic bound, so a shape nobody timed yet
must pay even if it is dearer than the roofline says, and spends at most `explore_share` of the
steps on the optimistic bound where the surface is unsure: on a device where wider forwards
are nearly free (a GPU at small batch) that is big trees from the first step; on this CPU at 16
rows, where 16 × 4 tokens cost 2.2× 16 × 1, it is plain steps, and trees as rows leave the
batch. Every drafter keeps its own tree policy inside the k nodes it is given (GT-sized
drafters may send fewer).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import BatchCost
from tts_service.engine.options import DecoderOptions
from tts_service.engine.rates import smoothed_rate
from tts_service.engine.surface import CostSurface, power_bucket
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

MAX_DEPTH = 16  # slots deeper or wider than this share the last slot's statistics
MAX_RANK = 8


PRIOR = (
    0.6 ** torch.arange(MAX_DEPTH + 1, dtype=torch.float64)[:, None]
    * 0.5 ** torch.arange(MAX_RANK + 1, dtype=torch.float64)[None, :]
).numpy()
"""α̂'s prior per slot, 0.6^d · 0.5^r, read-only (every method's statistics share it), by
torch's pow as before the counts moved to numpy: numpy's differs in the last bit at d = 4, and
the planner's sums would with it."""
PRIOR.setflags(write=False)


class SlotStats:
    """α̂ per tree slot (depth d >= 1, rank r among siblings) for one drafting method.

    Counts of (drafted, on the accepted path) per slot, decayed once per step (`tick`), with a
    prior of `prior_weight` pseudo-observations at 0.6^d · 0.5^r, so a method that never
    drafted still gets a try. The decay is also the exploration: while the allocator drafts
    nothing, old evidence (say, from steps over a cold store) fades back to the prior until
    trees are tried again. Estimates are made non-increasing down a path and across siblings,
    as true path probabilities are, so the best k slots form a valid tree.

    numpy, not torch: the planner reads these every step, and on a 17 × 9 table a torch op's
    dispatch (~5 µs) is most of its cost; numpy's is a fifth of that."""

    def __init__(self, decay: float = 0.97, prior_weight: float = 4.0) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        shape = (MAX_DEPTH + 1, MAX_RANK + 1)
        self.drafted = np.zeros(shape)
        self.hits = np.zeros(shape)
        self.prior = PRIOR
        self._cumulative: list[float] | None = None
        self.version = 0  # trees recorded: a planner's cached decision is stale after one

    @staticmethod
    def slots(tree: DraftTree) -> list[tuple[int, int]]:
        """(depth, rank) of every draft node (root excluded), capped at the table's size."""
        out = []
        for v in range(1, tree.size):
            rank = tree.children[tree.parents[v]].index(v)
            out.append((min(tree.depths[v], MAX_DEPTH), min(rank, MAX_RANK)))
        return out

    def record(self, tree: DraftTree, acc: Acceptance) -> None:
        if tree.size == 1:
            return
        on_path = set(acc.path)
        for v, (d, r) in enumerate(self.slots(tree), start=1):
            self.drafted[d, r] += 1.0
            self.hits[d, r] += float(v in on_path)
        self._cumulative = None
        self.version += 1

    def tick(self) -> None:
        """One step went by: every count loses weight (memory of ~1 / (1 - decay) steps)."""
        self.drafted *= self.decay
        self.hits *= self.decay
        self._cumulative = None

    def alphas(self) -> np.ndarray:
        """`[depth, rank]` α̂, monotone (non-increasing) in both."""
        a = smoothed_rate(self.hits, self.drafted, self.prior, self.prior_weight)
        a[0, :] = 1.0  # the root is always "accepted"
        a = np.minimum.accumulate(a, axis=0)
        return np.minimum.accumulate(a, axis=1)

    def cumulative(self) -> list[float]:
        """Expected accepted draft tokens of the best k-node tree for k = 0, 1, ...: the sum of
        the k largest α̂ (as many entries as slots, plus k = 0)."""
        if self._cumulative is None:
            a = np.sort(self.alphas()[1:].ravel())[::-1]
            self._cumulative = [0.0, *np.cumsum(a).tolist()]
        return self._cumulative


class StepCost(Protocol):
    """Seconds of one batched verify step of `rows` rows of `width` tokens each."""

    def time(self, rows: int, width: int) -> float: ...


def expected_tokens(stats: Sequence[SlotStats], max_nodes: int) -> list[float]:
    """Committed tokens a step of `len(stats)` rows expects with k = 0..max_nodes draft nodes
    per row: rows + Σ_rows (the sum of the row's method's k best α̂)."""
    shared: dict[int, tuple[SlotStats, int]] = {}  # rows of one method share its statistics
    for s in stats:
        shared[id(s)] = (s, shared[id(s)][1] + 1 if id(s) in shared else 1)
    drafts = [0.0] * (max_nodes + 1)  # Σ over methods, summed in the rows' order of methods
    for s, n in shared.values():
        c = s.cumulative()
        c = c[: max_nodes + 1] + [c[-1]] * (max_nodes + 1 - len(c))
        drafts = [d + n * b for d, b in zip(drafts, c, strict=True)]
    return [len(stats) + d for d in drafts]


def best_rate(tokens: Sequence[float], seconds: Sequence[float], ks: range) -> tuple[int, float]:
    """The k among `ks` with the most tokens per second (the smallest such k), and that rate."""
    rates = [tokens[k] / seconds[k] for k in ks]
    best = max(rates)
    return ks[rates.index(best)], best


def step_seconds(forward: Sequence[float], rows: int, draft_s_per_node: float) -> list[float]:
    """Seconds of a step with k = 0, 1, ... nodes per row: its forward (`forward[k]`, width
    k + 1) and the drafting."""
    return [t + draft_s_per_node * rows * k for k, t in enumerate(forward)]


def nodes_for_step(
    cost: StepCost,
    stats: Sequence[SlotStats],
    max_nodes: int,
    draft_s_per_node: float = 0.0,
) -> int:
    """Draft nodes per row for a step of `len(stats)` rows (one `SlotStats` per row's method):
    the k in 0..max_nodes with the most expected committed tokens per second.

    Where T is convex in k this is the marginal rule (grow while the next node's expected
    tokens per extra second beat the current rate); comparing every k also sees past the jump
    a CPU shows from 1 to 2 tokens per row."""
    tokens = expected_tokens(stats, max_nodes)
    rows = len(stats)
    forward = [cost.time(rows, k + 1) for k in range(max_nodes + 1)]
    seconds = step_seconds(forward, rows, draft_s_per_node)
    return best_rate(tokens, seconds, range(max_nodes + 1))[0]


@dataclass
class DraftCost:
    """Host seconds of drafting per planned node (rows × nodes per row, what `step_seconds`
    prices), a decayed mean over drafted steps.

    Per planned node, not per drafted one: a drafter that sends smaller trees than asked (a
    cold store) still costs the step what it paid, and dividing by its few nodes priced every
    later tree several times too high. A step where a row's drafter catches up is left out
    (`record`'s caller): the first tree step indexes the whole prompt (a one-time cost ~10x a
    step's drafting), the first after plain steps every token they committed. On an H200 the
    first tree step of a fresh runner priced every later tree out that way, and `auto` took
    plain steps at 0.71-0.87x plain's speed."""

    rate: float = 0.2  # weight of the newest step
    per_node: float = 0.0
    steps: int = 0

    def record(self, seconds: float, planned_nodes: int) -> None:
        if planned_nodes <= 0:
            return
        sample = seconds / planned_nodes
        self.per_node += (sample - self.per_node) * (1.0 if not self.steps else self.rate)
        self.steps += 1


SURE_SIGMA = 0.1  # a bucket timed this well is not explored (a few recent steps)
REFRESH_STEPS = 4  # the planner re-reads the surface and re-decides at least this often
KEPT_DECISIONS = 256  # the planner's last decisions, kept for diagnosis (`decision_log`)


@dataclass(frozen=True)
class PlanDecision:
    """What one fresh decision rested on (the planner reuses it for up to `REFRESH_STEPS`):
    why a step drafted k nodes per row, or explored, on a device that says otherwise."""

    step: int
    rows: int
    context: int
    nodes: int  # the cautious choice, k
    explored: int | None  # the k explored instead, if any
    tokens: tuple[float, float]  # expected committed tokens per step at 0 and at k nodes
    seconds: tuple[float, float]  # cautious step seconds at 0 and at k (drafting included)
    bold_seconds: float  # the cautious k's optimistic step seconds (not the explored one's)
    sigma: float  # the surface's log-uncertainty at the cautious k's shape
    # the best tree (k >= 1) on the cautious line: its k, expected tokens and seconds, of
    # which drafting (what turned a plain decision: the tree's forward or its drafting)
    best_tree: tuple[int, float, float, float] | None


@dataclass
class SpeculationPlanner:
    """Each step's draft nodes per row, on a learned `CostSurface` (or a fixed `StepCost`:
    tests, replay, `--assume-flat-cost`).

    The decision is cautious: a tree must beat plain decoding with the tree's cost `z` sigmas
    up and plain's `z` sigmas down, so an untimed shape never wins on the roofline's word.
    Exploring is the bold reverse (trees down, plain up), one width bucket at a time: while
    drafting, a plain step (plain is the baseline every decision compares with); the best tree
    of the next wider and of the next narrower width bucket where its bold rate beats the
    decision's cautious one; of these, the least well timed, if any is not timed well enough.
    At most `explore_share` of the steps explore, which bounds what exploring can cost; without
    it a surface that starts wrong would never learn otherwise.

    `max_step_tokens` (the decoder's `graph_tokens`): no tree is planned whose padded step
    passes it. Past it a GPU runs the forward eagerly, launch-bound, at twice a graph's time: a
    cliff the surface's smooth roofline does not draw (on an H100 the planner's first run drew
    64-node trees there and ran best-of-16 at half plain's speed).

    `decision_log` keeps the last `KEPT_DECISIONS` fresh decisions and what each rested on
    (`PlanDecision`), for the timing replay's report (`bench.device.timing_replay`)."""

    surface: CostSurface | None = None
    fixed: StepCost | None = None
    max_nodes: int = 64
    max_step_tokens: int | None = None
    explore_share: float = 0.01
    z: float = 1.0
    steps: int = 0
    explored: int = 0
    last_explored: bool = field(default=False, init=False)
    decision_log: deque[PlanDecision] = field(
        default_factory=lambda: deque(maxlen=KEPT_DECISIONS), init=False, repr=False
    )
    _lines: dict = field(default_factory=dict, init=False, repr=False)
    _decisions: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.surface is None) == (self.fixed is None):
            raise ValueError("give the planner one of a surface or a fixed cost")

    def plan(self, context: int, stats: Sequence[SlotStats], draft_s_per_node: float = 0.0) -> int:
        """Draft nodes per row for this step (0: a plain step)."""
        self.steps += 1
        if self.fixed is not None:
            k = nodes_for_step(self.fixed, stats, self.cap(len(stats)), draft_s_per_node)
            self.last_explored = False
        else:
            k, self.last_explored = self._learned(context, stats, draft_s_per_node)
        self.explored += self.last_explored
        return k

    def cap(self, rows: int) -> int:
        """The most nodes per row a step of `rows` rows may plan."""
        if self.max_step_tokens is None:
            return self.max_nodes
        return max(0, min(self.max_nodes, self.max_step_tokens // power_bucket(rows) - 1))

    def _cost_lines(
        self, rows: int, context: int, per_node: float
    ) -> tuple[list, list, list, float]:
        """Cautious and bold step seconds for k = 0..max_nodes, each k's sigma, and the
        drafting seconds per node they priced; re-read from the surface per (rows, context
        bucket) every `REFRESH_STEPS` steps, or at once when a step surprised it."""
        surface = self.surface
        assert surface is not None
        key = (rows, surface.bucket(1, 1, context)[2])
        cached = self._lines.get(key)
        stale = cached is None or cached[4] != surface.surprises
        if stale or self.steps - cached[0] >= REFRESH_STEPS:
            z, line = self.z, surface.line(rows, self.max_nodes + 1, context)

            def seconds(z_tree: float, z_plain: float) -> list[float]:  # `time`, per k
                forward = [
                    t * math.exp(mean + (z_tree if k else z_plain) * sd)
                    for k, (t, mean, sd) in enumerate(line)
                ]
                return step_seconds(forward, rows, per_node)

            cautious, bold, sigma = seconds(z, -z), seconds(-z, z), [sd for *_, sd in line]
            cached = (self.steps, cautious, bold, sigma, surface.surprises, per_node)
            self._lines[key] = cached
        return cached[1], cached[2], cached[3], cached[5]

    def _learned(
        self, context: int, stats: Sequence[SlotStats], per_node: float
    ) -> tuple[int, bool]:
        surface = self.surface
        assert surface is not None
        key = (len(stats), surface.bucket(1, 1, context)[2])
        version = (surface.surprises, *sorted({id(s): s.version for s in stats}.items()))
        may_explore = (self.explored + 1) <= self.explore_share * self.steps
        cached = self._decisions.get(key)
        if (  # the same decision as a few steps ago: nothing it rests on has moved
            not may_explore
            and cached is not None
            and cached[0] == version
            and self.steps - cached[1] < REFRESH_STEPS
        ):
            return cached[2], False
        cautious, bold, sigma, per_node = self._cost_lines(len(stats), context, per_node)
        tokens = expected_tokens(stats, self.max_nodes)
        cap = self.cap(len(stats))
        k, rate = best_rate(tokens, cautious, range(cap + 1))
        self._decisions[key] = (version, self.steps, k)
        explored = self._explore(k, rate, tokens, bold, sigma, cap) if may_explore else None
        self.decision_log.append(
            PlanDecision(
                self.steps,
                len(stats),
                context,
                k,
                explored,
                (tokens[0], tokens[k]),
                (cautious[0], cautious[k]),
                bold[k],
                sigma[k],
                self._best_tree(tokens, cautious, cap, len(stats), per_node),
            )
        )
        return (k, False) if explored is None else (explored, True)

    @staticmethod
    def _best_tree(
        tokens: Sequence[float], cautious: Sequence[float], cap: int, rows: int, per_node: float
    ) -> tuple[int, float, float, float] | None:
        if cap < 1:
            return None
        k = best_rate(tokens, cautious, range(1, cap + 1))[0]
        return k, tokens[k], cautious[k], per_node * rows * k

    @staticmethod
    def _explore(
        k: int,
        rate: float,
        tokens: Sequence[float],
        bold: Sequence[float],
        sigma: Sequence[float],
        cap: int,
    ) -> int | None:
        """The k to explore instead of the decision `k` (at `rate`), if any: of plain, the next
        wider and the next narrower width bucket, each bucket's best on the bold bound where
        that beats the decision (plain always qualifies), the least well timed of those not
        timed well enough."""
        width = power_bucket(k + 1)
        buckets = [(0, 0)] if k > 0 else []  # k ranges: plain, the next wider, the narrower
        buckets.append((width, min(2 * width - 1, cap)))
        if k > 0:  # at the cap, the narrower bucket ends there
            buckets.append((width // 2, min(width - 1, cap)))
        options = []
        for lo, hi in buckets:
            if lo > hi:
                continue
            option, bold_rate = best_rate(tokens, bold, range(lo, hi + 1))
            if sigma[option] > SURE_SIGMA and (option == 0 or bold_rate > rate):
                options.append(option)
        return max(options, key=lambda o: sigma[o]) if options else None  # the least known

    @property
    def source(self) -> str:
        """Where the cost comes from (the report's `cost_surface`)."""
        return self.surface.source if self.surface is not None else "fixed"


@torch.inference_mode()
def measure_batch_cost(
    model: PreTrainedModel,
    context_len: int,
    max_rows: int,
    max_tokens: int,
    repeats: int = 2,
    seed: int = 0,
    cuda_graphs: bool = True,
) -> BatchCost:
    """Time batched verify steps (rows × tokens per row) over a `context_len` cache, through
    the engine's own forward (`BatchDecoder.time_forward`: the static cache, and CUDA graphs
    where they run).

    Rows are 1, 4, 16, 64 up to `max_rows` (and `max_rows` itself); widths 1, 2, 4, ... while
    rows × width <= `max_tokens`. Shapes are interleaved across repeats and the fastest kept
    (a busy machine only ever adds time)."""
    row_counts = sorted({r for r in (1, 4, 16, 64) if r < max_rows} | {max_rows})
    widths = [w for w in (1, 2, 4, 8, 16, 32, 64) if w == 1 or w * row_counts[0] <= max_tokens]
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(cuda_graphs=cuda_graphs))
    decoder.fill_random(max_rows, max(1, context_len), seed)
    timings: dict[tuple[int, int], list[float]] = {}
    shapes = [(r, w) for r in row_counts for w in widths if w == 1 or r * w <= max_tokens]
    for rnd in range(repeats + 1):  # the first round warms up kernels, allocators and graphs
        for rows, width in shapes:
            seconds = decoder.time_forward(rows, width)
            if rnd:
                timings.setdefault((rows, width), []).append(seconds)
    table = []
    for rows in row_counts:
        line = [min(timings[rows, w]) for w in widths if (rows, w) in timings]
        for j in range(len(line), len(widths)):  # past max_tokens: the last measured slope
            x0, x1 = (widths[j - 2], widths[j - 1]) if j > 1 else (0, widths[0])
            y0 = line[j - 2] if j > 1 else 0.0
            slope = (line[j - 1] - y0) / (x1 - x0)
            line.append(line[j - 1] + slope * (widths[j] - x1))
        table.append(line)
    return BatchCost.fit(row_counts, widths, table, context_len)
