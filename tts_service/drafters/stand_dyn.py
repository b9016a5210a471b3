"""STAND, dynamic: best-first trees over STAND's store that spend the whole node budget on the
candidates most likely to be accepted (docs/design.md, "STAND, dynamic").

Every node's candidates come from four sources, best first by calibrated acceptance:

* the store's longest stored n-gram of the node's context (STAND's lookup);
* back-off: the next shorter stored n-gram's ids the longest one lacks;
* suffix counts over this problem's trajectories and prompt (`SuffixCounts`, contexts of up to
  12 tokens): how often each token followed the node's longest counted suffix;
* when the store knows nothing of the context, the last target distribution seen after the
  node's token in any earlier problem (Token Recycling's successor table, the hot start).

A stored probability is not an acceptance rate: a 1-gram context's distribution is a guess
about a different context, and one seen once is noisy. `AcceptanceCalibration` learns, online
and per loaded model, how often a candidate of each kind (source, order, count, whether the next
shorter order's top choice agrees, whether the suffix counts name it) and stored probability was
accepted when its parent was reached. α̂ of a node is the product of its path's calibrated
rates; the tree grows best first on α̂ until the budget is spent or, with `sizing: gt`, until
no larger tree can raise the expected tokens per second under the measured verify cost.

Under greedy decoding every child is deterministic (the verifier takes the argmax). Under
sampling, with `drawn: true` (`auto`'s default on a CPU, `registry.AUTO_FIELDS`), a
node may instead draw its children without replacement from the distribution stored
for its context (`drawn_plan`, Gumbel order over the trajectory's draft stream), verified by
recursive rejection sampling: where the stored q is close to the target's p, a drawn child is
accepted with probability sum(min(p, q)), where the best deterministic one gets max p, and at
T = 1.0 p is flat (`bench/drawn_children.py`). Per node, the plan with the higher calibrated
rate for its first child wins; drawn slots are calibrated by rank and the j-th largest stored
probability, never by the token drawn into them. Deterministic nodes keep sample-and-match
(siblings in order, shared residual) on the device's one-sync path; a row with drawn children
is walked on the host (`verify.walk_sparse`).

The product's `stand-dyn` drafts compiled (`stand_dyn_compiled`, the same trees node for node). This
Python drafter runs only where the kernel cannot serve or does not pay: over a Redis or tiered
store (the kernel walks an in-process store's arrays), with drawn children and a noise buffer
smaller than a step can read, and under `auto` on a CPU, where a forward dwarfs the saving and
loading the kernels costs a short run more (`registry.AUTO_FIELDS`). It is also the reference the
compiled drafter is tested against.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from store.base import NgramEntry, NgramStore
from store.indexed import IndexedStore
from tts_service.drafters.goose import AdjacencyTable
from tts_service.drafters.gumbel import GumbelNoise, gumbel_top_k
from tts_service.drafters.matching import SuffixCounts
from tts_service.drafters.spec import DraftEnv, DrafterSpec, Method, Shared
from tts_service.drafters.stand_dyn_config import (
    AGREE,
    BACKOFF,
    BINS,
    DRAWN,
    MIN_SUFFIX,
    STORE,
    SUCCESSOR,
    SUFFIX,
    SUFFIX_ORDERS,
    TAIL,
    StandDynDrafterConfig,
    candidate_kind,
)
from tts_service.drafters.store_feed import feed_root, feed_store
from tts_service.engine.cost import VerifyCostSource, worth_growing
from tts_service.engine.rates import smoothed_rate
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, SparseDist, TreeBuilder
from tts_service.engine.verify import Acceptance, ordered_sum

Candidate = tuple[float, int, int, float]
"""A node's candidate child: (−α̂, token, kind, q). −α̂ is its calibrated acceptance rate given
the parent was reached, negated so that sorting puts the best first (ties: the lower token);
`kind` is `candidate_kind(...)`, what calibration keys on; `q` the source's own probability.
A plain tuple: drafting builds ~10 per opened node, and a named tuple costs 4× as much here."""


class AcceptanceCalibration:
    """How often a candidate of a given kind and stored probability was accepted once its
    parent was reached: per (kind, probability decile), a count and a hit count, with
    `prior_weight` pseudo-draws at `prior_scale` × q (stores are overconfident).

    α̂ = (hits + w·s·q) / (drawn + w) (`rates.smoothed_rate`) is linear in q within a key, so
    each key keeps its (intercept, slope) and ranking a candidate is one dict probe."""

    def __init__(self, prior_weight: float = 4.0, prior_scale: float = 0.8, bins: int = BINS):
        self.prior_weight, self.prior_scale, self.bins = prior_weight, prior_scale, bins
        self.drawn: dict[int, float] = {}  # key: kind * bins + the probability's decile
        self.hits: dict[int, float] = {}
        self.lines: dict[int, tuple[float, float]] = {}  # key -> (intercept, slope) in q
        self.prior_line = (0.0, prior_scale)  # a key never drawn: α̂ = s·q

    def _key(self, kind: int, q: float) -> int:
        return kind * self.bins + (int(q * self.bins) if q < 1.0 else self.bins - 1)

    def rank(self, found: dict[int, tuple[int, float]]) -> list[Candidate]:
        """`found` (token -> (kind, q), 0 <= q <= 1) as candidates, best first. Drafting's hot
        loop: every opened node ranks ~10 (`rated`'s loop, inlined)."""
        bins, top, line, prior = self.bins, self.bins - 1, self.lines.get, self.prior_line
        out: list[Candidate] = []
        add = out.append
        for token, (kind, q) in found.items():
            a, b = line(kind * bins + (int(q * bins) if q < 1.0 else top), prior)
            add((-a - b * q, token, kind, q))
        out.sort()
        return out

    def rated(self, cands: Iterable[tuple[int, int, float]]) -> list[Candidate]:
        """(token, kind, q) triples as candidates with their calibrated rates, in the order
        given."""
        bins, top, line, prior = self.bins, self.bins - 1, self.lines.get, self.prior_line
        out = []
        for token, kind, q in cands:
            a, b = line(kind * bins + (int(q * bins) if q < 1.0 else top), prior)
            out.append((-a - b * q, token, kind, q))
        return out

    def negated(self, kind: int, q: float) -> float:
        """−α̂ of one candidate of `kind` and stored probability `q` (what `rated` sorts by)."""
        a, b = self.lines.get(self._key(kind, q), self.prior_line)
        return -a - b * q

    def record(self, kind: int, q: float, accepted: bool) -> None:
        key = self._key(kind, q)
        drawn = self.drawn[key] = self.drawn.get(key, 0.0) + 1.0
        hits = self.hits[key] = self.hits.get(key, 0.0) + float(accepted)
        w = self.prior_weight
        self.lines[key] = (
            smoothed_rate(hits, drawn, 0.0, w),
            smoothed_rate(0.0, drawn, self.prior_scale, w),
        )


KINDS = tuple(
    tuple(
        tuple(candidate_kind(source, order, count, 0, 0) for count in range(5))
        for order in range(9)
    )
    for source in range(5)
)
"""`KINDS[source][order][count]`: `candidate_kind` without the agree and suffix flags (a table:
drafting looks up ~3 kinds per opened node)."""


def suffix_flags(order: int) -> tuple[int, int]:
    """The suffix flag, after a suffix match of `order` tokens, of a token the counts do not
    name and of one they do. 0: no match of >= MIN_SUFFIX tokens; 1: a match that does not
    name the token; 2: a short match (< 8 tokens) that does; 3: a long one that does."""
    if order < MIN_SUFFIX:
        return 0, 0
    return 1, 3 if order >= 8 else 2


class StandDynDrafter(Drafter):
    def __init__(
        self,
        cfg: StandDynDrafterConfig,
        store: NgramStore,
        suffix: SuffixCounts,
        successors: AdjacencyTable,
        calibration: AcceptanceCalibration,
        cost: VerifyCostSource | None = None,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.noise = GumbelNoise(cfg.noise_buffer, seed)  # the trajectory's draft stream
        self.store = store
        self.suffix = suffix  # shared by the problem's trajectories
        self.successors = successors  # shared by the loaded model's problems
        self.calibration = calibration  # likewise
        self.cost = cost  # None: fill the budget (sizing: fixed)
        self.doc = -1
        self._tails: list[tuple[int, ...]] = []
        self._kinds: list[Candidate | None] = []  # tree node -> what it was drafted as

    def start(self, prompt_ids: list[int]) -> None:
        self.doc = self.suffix.new_doc()

    def candidates(self, tail: Sequence[int]) -> list[Candidate]:
        """The candidates after `tail`, best first by calibrated acceptance."""
        return self._ranked(tail, self.store.lookup(tail[-self.store.max_order :]))

    def _ranked(self, tail: Sequence[int], longest: NgramEntry | None) -> list[Candidate]:
        """`candidates`, given the store's longest entry for `tail`."""
        n, counts = self.suffix.lookup(tail)
        absent, named = suffix_flags(n)
        found: dict[int, tuple[int, float]] = {}  # token -> (kind, q)
        if longest is not None:
            shorter = self.store.lookup(tail[-longest.order + 1 :]) if longest.order > 1 else None
            base = KINDS[STORE][longest.order][min(longest.count, 4)]
            inv = 1.0 / (ordered_sum(longest.probs) or 1.0)
            for token, p in zip(longest.ids, longest.probs, strict=True):
                if p > 0:
                    found[token] = (base + (named if token in counts else absent), p * inv)
            if shorter is not None:
                top = shorter.ids[0] if shorter.ids else -1
                if top in found:  # the next shorter order's top choice agrees
                    kind, q = found[top]
                    found[top] = (kind + AGREE, q)
                base = KINDS[BACKOFF][shorter.order][min(shorter.count, 4)]
                inv = 1.0 / (ordered_sum(shorter.probs) or 1.0)
                for token, p in zip(shorter.ids, shorter.probs, strict=True):
                    if p > 0 and token not in found:
                        found[token] = (base + (named if token in counts else absent), p * inv)
        if n >= MIN_SUFFIX:
            inv = 1.0 / sum(counts.values())
            kind = KINDS[SUFFIX][0][0] + named
            for token, k in counts.items():
                if token not in found:
                    found[token] = (kind, k * inv)
        if not found and tail:
            if n:  # a short suffix match (the prompt, say) is better than nothing
                inv = 1.0 / sum(counts.values())
                kind = KINDS[SUFFIX][n][0]
                for token, k in counts.items():
                    found[token] = (kind, k * inv)
            base = KINDS[SUCCESSOR][0][0]
            for token, p in self.successors.successors(-1, tail[-1]):
                if p > 0 and token not in found:
                    found[token] = (base + (named if token in counts else absent), p)
        return self.calibration.rank(found)

    def drawn_first(self, entry: NgramEntry) -> float | None:
        """−α̂ of the first slot of `entry`'s drawn plan (`drawn_plan`), None if no stored
        probability is positive. A slot's rate rests on the stored probabilities, not on the
        draw, so whether a node draws is decided before drawing: a node that keeps its
        deterministic candidates spends neither the Gumbel keys nor the trajectory's noise."""
        top = max(entry.probs, default=0.0)
        if top <= 0:
            return None
        inv = 1.0 / ordered_sum(entry.probs)  # as `drawn_plan` normalises (its zeros add nothing)
        return self.calibration.negated(KINDS[DRAWN][entry.order][min(entry.count, 4)], top * inv)

    def drawn_plan(self, entry: NgramEntry) -> tuple[list[Candidate], SparseDist]:
        """Children drawn without replacement from a stored distribution (a context's longest
        n-gram, with a positive probability: `drawn_first` is not None), in draw order, and
        that distribution (the verifier's q). Slot j's rate is calibrated on the j-th largest
        stored probability, not on what was drawn into it: whether a slot is used must not
        depend on its own draw (rejection sampling needs every drafted child to be a draw from
        q given the earlier ones)."""
        pairs = [(i, p) for i, p in zip(entry.ids, entry.probs, strict=True) if p > 0]
        ids, probs = [i for i, _ in pairs], [p for _, p in pairs]
        order = gumbel_top_k(ids, probs, len(ids), self.noise.take(len(ids)))
        inv = 1.0 / ordered_sum(probs)
        ranked = sorted((p * inv for p in probs), reverse=True)
        base = KINDS[DRAWN][entry.order][min(entry.count, 4)]
        slots = zip(order, ranked, strict=True)
        plan = self.calibration.rated((x, base + min(j, 3), q) for j, (x, q) in enumerate(slots))
        return plan, SparseDist(tuple(ids), tuple(probs))

    def draft(self, ctx: DraftContext) -> DraftTree:
        self.suffix.sync(self.doc, ctx.tokens)
        limit = min(self.cfg.num_nodes, ctx.max_nodes)
        cost = self.cost.at(len(ctx.tokens)) if self.cost is not None and not ctx.fill else None
        drawn = self.cfg.drawn and not ctx.greedy  # sampled children buy nothing under greedy
        builder = TreeBuilder(ctx.tokens[-1])
        tails: list[tuple[int, ...]] = [tuple(ctx.tokens[-TAIL:])]
        kinds: list[Candidate | None] = [None]
        self._tails, self._kinds = tails, kinds
        alpha = [1.0]
        plans: dict[int, list[Candidate]] = {}
        sampled: set[int] = set()  # nodes whose children are drawn
        # (-α̂ of the slot, node, candidate rank); rank -1: the node's candidates are not
        # looked up yet, and α̂ of the node bounds every child's, so it is opened only when
        # that bound is the best slot left (most leaves never are)
        heap: list[tuple[float, int, int]] = [(-1.0, 0, -1)]
        push, pop = heapq.heappush, heapq.heappop
        expected, size = 1.0, 1  # expected tokens committed; tree tokens, root included
        while heap and size <= limit:
            neg, node, rank = pop(heap)
            if rank < 0:
                longest = self.store.lookup(tails[node][-self.store.max_order :])
                plan = self._ranked(tails[node], longest)
                if drawn and longest is not None:
                    first = self.drawn_first(longest)
                    if first is not None and (not plan or first <= plan[0][0]):
                        plan, q = self.drawn_plan(longest)
                        sampled.add(node)
                        builder.set_q(node, q)
                if plan:
                    plans[node] = plan
                    push(heap, (alpha[node] * plan[0][0], node, 0))
                continue
            if cost is not None and not worth_growing(cost, size, expected, -neg, limit + 1):
                break
            plan = plans[node]
            cand = plan[rank]
            token = cand[1]
            child = builder.add(node, token, sampled=node in sampled)
            size += 1
            tails.append((*tails[node], token)[-TAIL:])
            kinds.append(cand)
            alpha.append(-neg)
            expected -= neg
            if rank + 1 < len(plan):
                push(heap, (alpha[node] * plan[rank + 1][0], node, rank + 1))
            push(heap, (neg, child, -1))
        return builder.build()

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred:
        tail = tuple(tokens[-TAIL:])

        def later() -> None:
            feed_root(self.store, tail, topk)
            if topk.has(0):
                self.successors.update([-1], [tail[-1]], topk.ids[:1], topk.probs[:1])

        return later

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred:
        kinds, tails = self._kinds, self._tails  # the next draft rebinds them
        return lambda: self._learn(tree, acc, topk, kinds, tails)

    def _learn(
        self,
        tree: DraftTree,
        acc: Acceptance,
        topk: NodeTopK,
        kinds: list[Candidate | None],
        tails: list[tuple[int, ...]],
    ) -> None:
        """Calibration, the store and the successor table learn from one verified tree."""
        reached = {0, *acc.path}
        for v in range(1, tree.size):
            cand = kinds[v]
            if cand is not None and tree.parents[v] in reached:
                _, _, kind, q = cand
                self.calibration.record(kind, q, v in acc.path)
        order = self.store.max_order
        feed_store(
            self.store, [t[-order:] for t in tails], tree, acc, topk, self.cfg.harvest_rejected
        )
        rows = [v for v in range(tree.size) if topk.has(v)]
        if rows:
            self.successors.update(
                [-1] * len(rows), [tree.tokens[v] for v in rows], topk.ids[rows], topk.probs[rows]
            )


MODEL_STATE: Shared[StandDynDrafterConfig, tuple[AdjacencyTable, AcceptanceCalibration]] = Shared(
    "stand_dyn.model",
    "model",
    lambda cfg, vocab: (AdjacencyTable(vocab, 10), AcceptanceCalibration()),
)
"""The successor table and the calibration, per loaded model (what a candidate's acceptance
rate is depends on the model, not the problem)."""
SUFFIX_COUNTS: Shared[StandDynDrafterConfig, SuffixCounts] = Shared(
    "stand_dyn.suffix_counts", "problem", lambda cfg, vocab: SuffixCounts(SUFFIX_ORDERS)
)
"""Suffix counts over one problem's trajectories."""


def _compiled_model(cfg: StandDynDrafterConfig, vocab: int):
    from tts_service.drafters.stand_dyn_compiled import CalibrationIndex, SuccessorIndex

    return SuccessorIndex(vocab, 10), CalibrationIndex()


def _compiled_group(cfg: StandDynDrafterConfig, vocab: int):
    from tts_service.drafters.stand_dyn_compiled import StandDynGroup

    return StandDynGroup()


COMPILED_MODEL: Shared[StandDynDrafterConfig, tuple] = Shared(
    "stand_dyn.compiled_model", "model", _compiled_model
)
"""`MODEL_STATE` as the compiled drafter keeps it (arrays), per loaded model."""
COMPILED_GROUP: Shared[StandDynDrafterConfig, object] = Shared(
    "stand_dyn.compiled_group", "problem", _compiled_group
)
"""One problem's compiled rows: `SUFFIX_COUNTS` as arrays, and one kernel call a step."""


KERNELS = "tts_service.drafters.stand_dyn_compiled"
"""The compiled drafter's module (its `warm()` loads the kernels)."""


def compiled_applies(cfg: StandDynDrafterConfig, store: NgramStore) -> bool:
    """Whether `stand_dyn_compiled` may draft for `cfg` over `store`: asked for, an in-process store
    (one that can index itself), and with `drawn` a noise buffer that holds what a step can read
    (every node opened, every stored id drawn)."""
    if not cfg.compiled or not isinstance(store, IndexedStore):
        return False
    return not cfg.drawn or cfg.noise_buffer >= (cfg.num_nodes + 1) * store.topk


def _build(cfg: StandDynDrafterConfig, env: DraftEnv) -> Drafter:
    cost = env.need_cost(cfg.kind) if cfg.sizing == "gt" else None
    store = env.need_store(cfg.kind)
    index = store.compiled() if compiled_applies(cfg, store) else None  # type: ignore[attr-defined]
    if index is not None:
        from tts_service.drafters.stand_dyn_compiled import CompiledStandDyn

        group = env.shared(COMPILED_GROUP, cfg)
        group.bind(index, *env.shared(COMPILED_MODEL, cfg))
        return CompiledStandDyn(cfg, store, group, cost, env.seed)
    successors, calibration = env.shared(MODEL_STATE, cfg)
    counts = env.shared(SUFFIX_COUNTS, cfg)
    return StandDynDrafter(cfg, store, counts, successors, calibration, cost, env.seed)


SPEC = DrafterSpec(
    StandDynDrafterConfig,
    _build,
    methods=(
        Method(
            "stand-dyn",
            "STAND, dynamic: best-first over the store, calibrated acceptance, GT-sized",
        ),
    ),
    size_field="num_nodes",
    needs_cost=True,
    uses_store=True,
    shared=(MODEL_STATE, SUFFIX_COUNTS, COMPILED_MODEL, COMPILED_GROUP),
    kernels=lambda cfg: KERNELS if cfg.compiled else None,
)
