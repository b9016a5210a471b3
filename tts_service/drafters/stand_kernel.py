"""`stand-dyn` drafting compiled: the same trees as `StandDynDrafter`, drafted by one numba
call per step for all of a problem's rows instead of ~10 Python candidate lists per opened node
(docs/design.md, "The compiled drafter").

Everything the Python drafter reads lives as arrays a kernel can walk without the interpreter:
the problem's store (`InMemoryNgramStore.compiled()`, where its entries live from then on), the
suffix counts over the problem's trajectories and, per model, the successor table and the
calibration (`stand_dyn_arrays`). `StandDynGroup` drafts a step's rows in one call of
`stand_dyn_draft.draft_rows`, which is `StandDynDrafter.draft` statement for statement, so a
tree is identical to the Python drafter's, node for node, its drawn flags and q included (tests
compare them through the runner). Where it does not apply (a Redis or tiered store, a noise
buffer smaller than a step can read, numba missing) the Python drafter runs
(`stand_dyn._build`). Kernels are cached on disk (`cache=True`): the first run after an install
compiles them (`python -m tts_service.drafters.stand_kernel` does it ahead, `scripts/setup.sh`
runs it); later processes load them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from store.base import NgramRow, NgramStore
from store.index import StoreIndex
from tts_service.drafters.gumbel import GumbelNoise
from tts_service.drafters.stand_compiled import noise_windows
from tts_service.drafters.stand_dyn_arrays import (
    TAIL,
    CalibrationIndex,
    SuccessorIndex,
    SuffixIndex,
)
from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig
from tts_service.drafters.stand_dyn_draft import (
    CostCurves,
    DraftRows,
    DraftSources,
    DynTrees,
    NewTokens,
    draft_rows,
)
from tts_service.drafters.store_feed import feed_index, feed_root, learned_nodes
from tts_service.engine import walk_compiled
from tts_service.engine.cost import VerifyCost, VerifyCostSource
from tts_service.engine.seam import Deferred, DraftContext, NodeTopK
from tts_service.engine.tree import DraftTree, DrawnArrays, DrawnBatch, DrawnQ
from tts_service.engine.verify import Acceptance


def _cost_curves(costs: Sequence[tuple[np.ndarray, np.ndarray]]) -> CostCurves:
    """The distinct verify costs of a step's rows as one padded array each."""
    width = max(2, *(len(x) for x, _ in costs)) if costs else 2
    cost_xs = np.zeros((max(len(costs), 1), width), np.float64)
    cost_ys = np.zeros_like(cost_xs)
    cost_n = np.zeros(len(cost_xs), np.int64)
    for c, (xs, ys) in enumerate(costs):
        cost_xs[c, : len(xs)], cost_ys[c, : len(ys)], cost_n[c] = xs, ys, len(xs)
    return CostCurves(cost_xs, cost_ys, cost_n)


def _dyn_trees(
    members: Sequence[CompiledStandDyn], trees: DynTrees, drawn: np.ndarray, sizes: np.ndarray
) -> list[DraftTree]:
    """`draft_rows`' output as each member's tree; each member keeps what its nodes were
    drafted as, and a drawing member's noise moves past what it read."""
    out = []
    tokens, parents = trees.token.tolist(), trees.parent.tolist()
    if drawn.any():  # the drawing rows' trees carry the arrays rule (c) lays out
        flags = trees.sampled.tolist()
        batch = DrawnBatch(trees.parent, trees.slot, trees.qn, trees.qids, trees.qp, trees.sampled)
    for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
        m.kinds, m.qs = trees.kind[r, :n], trees.q[r, :n]  # what each node was drafted as
        if drawn[r]:
            m.noise.advance(bool(trees.noise_used[r, 0]), int(trees.noise_used[r, 1]))
            tree = DraftTree(
                tuple(tokens[r][:n]),
                tuple(parents[r][:n]),
                tuple(flags[r][:n]),
                DrawnQ(trees.draws, trees.qn, trees.qids, trees.qp, r, n),  # <= the top-k
                DrawnArrays(batch, r),
            )
        else:
            tree = DraftTree(tuple(tokens[r][:n]), tuple(parents[r][:n]), (False,) * n, (None,) * n)
        out.append(tree)
    return out


class StandDynGroup:
    """One problem's compiled state, shared by its rows: the suffix index, and the store's and
    the model's arrays; `draft_all` drafts every member row of a step in one kernel call."""

    def __init__(self) -> None:
        self.suffix = SuffixIndex()
        self.index: StoreIndex | None = None
        self.successors: SuccessorIndex | None = None
        self.calibration: CalibrationIndex | None = None
        self._costs: dict[int, tuple[VerifyCost, np.ndarray, np.ndarray]] = {}

    def bind(
        self, index: StoreIndex, successors: SuccessorIndex, calibration: CalibrationIndex
    ) -> None:
        """The problem store's arrays and the model's state, which every member shares (not
        the store itself: the group lives in the store's own per-problem state)."""
        if self.index is None:
            self.index, self.successors, self.calibration = index, successors, calibration
        elif self.index is not index or self.successors is not successors:
            raise ValueError("a problem's compiled rows must share one store and one model")

    def draft_all(
        self, members: Sequence[CompiledStandDyn], ctxs: Sequence[DraftContext]
    ) -> list[DraftTree]:
        """The members' trees, as each drafting in turn would make them: each row's tokens are
        booked in order, and where a row's restarts the suffix counts, the rows before it are
        drafted first (one call each side)."""
        out: list[DraftTree] = []
        start, counted = 0, []
        for r, (m, ctx) in enumerate(zip(members, ctxs, strict=True)):
            if self.suffix.needs_reset(m.doc, len(ctx.tokens)):  # the counts restart here
                out += self._draft(members[start:r], ctxs[start:r], counted)
                self.suffix.reset_for(m.doc)
                start, counted = r, []
            counted.append(self.suffix.advance(m.doc, ctx.tokens))
        return out + self._draft(members[start:], ctxs[start:], counted)

    def _rows(
        self,
        members: Sequence[CompiledStandDyn],
        ctxs: Sequence[DraftContext],
        counted: Sequence[tuple[list[int], int, int]],
    ) -> tuple[NewTokens, DraftRows, CostCurves]:
        """What each row counts and drafts from, and the step's distinct verify costs; each
        member keeps its root's context."""
        rows = len(members)
        seqs, seq_at = [], [0]
        lo, hi = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        tails = np.zeros((rows, TAIL), np.int64)
        tlens, limits = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        cost_of = np.full(rows, -1, np.int64)
        costs: list[tuple[np.ndarray, np.ndarray]] = []
        seen: dict[int, int] = {}
        for r, (m, ctx, (seq, a, b)) in enumerate(zip(members, ctxs, counted, strict=True)):
            lo[r], hi[r] = a, b
            seqs += seq
            seq_at.append(len(seqs))
            tail = ctx.tokens[-TAIL:]
            tails[r, : len(tail)] = tail
            tlens[r] = len(tail)
            limits[r] = min(m.num_nodes, ctx.max_nodes)
            m.root_tail = tuple(tail)
            if m.cost is not None and not ctx.fill:
                cost = m.cost.at(len(ctx.tokens))
                if id(cost) not in seen:
                    seen[id(cost)] = len(costs)
                    costs.append(self._cost(cost))
                cost_of[r] = seen[id(cost)]
        drawn = np.array(
            [m.drawn and not ctx.greedy for m, ctx in zip(members, ctxs, strict=True)], np.bool_
        )
        counts = NewTokens(np.array(seqs, np.int64), np.array(seq_at, np.int64), lo, hi)
        return counts, DraftRows(tails, tlens, limits, cost_of, drawn), _cost_curves(costs)

    def _draft(
        self,
        members: Sequence[CompiledStandDyn],
        ctxs: Sequence[DraftContext],
        counted: Sequence[tuple[list[int], int, int]],
    ) -> list[DraftTree]:
        """One kernel call for `members`, with what each row counts (`SuffixIndex.advance`,
        booked already)."""
        if not members:
            return []
        idx, succ, cal = self.index, self.successors, self.calibration
        assert idx is not None and succ is not None and cal is not None
        counts, rows, costs = self._rows(members, ctxs, counted)
        self.suffix.room(int((counts.hi - counts.lo).sum()))
        # a drawing row's window of its noise: as much as its own tree can read (every node
        # opened, every stored id drawn), which its buffer holds (`stand_dyn.compiled_applies`)
        drawn = rows.drawn
        noise = noise_windows(
            [m.noise if d else None for m, d in zip(members, drawn.tolist(), strict=True)],
            ((rows.limits + 1) * idx.topk).tolist(),
        )
        nodes = int(rows.limits.max()) + 1
        trees = DynTrees.empty(len(members), nodes, bool(drawn.any()), idx.topk)
        sizes = np.zeros(len(members), np.int64)
        src = DraftSources(idx.arrays(), self.suffix.arrays(), succ.arrays(), cal.arrays())
        draft_rows(src, counts, rows, costs, noise, trees, sizes)
        return _dyn_trees(members, trees, drawn, sizes)

    def _cost(self, cost: VerifyCost) -> tuple[np.ndarray, np.ndarray]:
        hit = self._costs.get(id(cost))
        if hit is None or hit[0] is not cost:
            xs, ys = np.array(cost.sizes, np.float64), np.array(cost.seconds, np.float64)
            hit = self._costs[id(cost)] = (cost, xs, ys)
        return hit[1], hit[2]


class CompiledStandDyn:
    """`StandDynDrafter`, one row of a `StandDynGroup` (which drafts the step's rows in one
    call); it draws from its trajectory's noise as the Python drafter does, and observes as it
    does (calibration, store, successors), deferred likewise."""

    def __init__(
        self,
        cfg: StandDynDrafterConfig,
        store: NgramStore,
        group: StandDynGroup,
        cost: VerifyCostSource | None = None,
        seed: int = 0,
    ) -> None:
        self.num_nodes, self.harvest_rejected = cfg.num_nodes, cfg.harvest_rejected
        self.drawn = cfg.drawn
        self.noise = GumbelNoise(cfg.noise_buffer, seed)  # the trajectory's draft stream
        self.store, self.group, self.cost = store, group, cost
        self.doc = -1
        # the last tree's: each node's candidate kind and stored probability, the root's context
        self.kinds, self.qs = np.zeros(0, np.int64), np.zeros(0, np.float64)
        self.root_tail: tuple[int, ...] = ()

    def start(self, prompt_ids: list[int]) -> None:
        self.doc = self.group.suffix.new_doc()

    def grouped(self) -> tuple[StandDynGroup, CompiledStandDyn]:
        return self.group, self

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.group.draft_all([self], [ctx])[0]

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred:
        tail, store, succ = tuple(tokens[-TAIL:]), self.store, self.group.successors
        assert succ is not None

        def later() -> None:
            feed_root(store, tail, topk)
            if topk.has(0):
                succ.update(np.array(tail[-1:], np.int64), topk.ids[:1], topk.probs[:1])

        return later

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred:
        kinds, qs, root_tail = self.kinds, self.qs, self.root_tail  # the next draft rebinds them
        return lambda: self._learn(tree, acc, topk, kinds, qs, root_tail)

    def _learn(
        self,
        tree: DraftTree,
        acc: Acceptance,
        topk: NodeTopK,
        kinds: np.ndarray,
        qs: np.ndarray,
        root_tail: tuple[int, ...],
    ) -> None:
        """`StandDynDrafter._learn`: calibration, the store and the successor table."""
        index, succ, cal = self.group.index, self.group.successors, self.group.calibration
        assert index is not None and succ is not None and cal is not None
        n = tree.size
        parents = np.array(tree.parents, np.int64)
        on_path = np.zeros(n, np.bool_)
        on_path[list(acc.path)] = True
        cal.record(kinds, qs, parents, on_path)
        # the store: `feed_store`'s rows as arrays; a node's context is its path's last
        # `max_order` tokens
        order = index.max_order
        ctx = np.full((n, order), -1, np.int64)
        clen = np.zeros(n, np.int64)
        root = root_tail[-order:]
        ctx[0, order - len(root) :], clen[0] = root, len(root)
        for v in range(1, n):
            p = tree.parents[v]
            ctx[v, :-1], ctx[v, -1], clen[v] = ctx[p, 1:], tree.tokens[v], min(order, clen[p] + 1)
        feed_index(index, (ctx, clen), learned_nodes(tree, acc, topk, self.harvest_rejected), topk)
        known = [v for v in range(n) if topk.has(v)]
        if known:
            tokens = np.array(tree.tokens, np.int64)[known]
            succ.update(tokens, topk.ids[known], topk.probs[known])


def warm() -> int:
    """Compile (or load) every kernel once, on a tiny problem; the size of the tree drafted."""
    index = StoreIndex(4, 10, 1000)  # adds and looks up as an in-process store does
    index.add([NgramRow((1, 2, 3), (4, 5), (0.6, 0.3))])
    group = StandDynGroup()
    group.bind(index, SuccessorIndex(16), CalibrationIndex())
    cfg = StandDynDrafterConfig(num_nodes=8, drawn=True)
    drafter = CompiledStandDyn(cfg, index, group)  # type: ignore[arg-type]
    drafter.start([1, 2])
    tree = drafter.draft(DraftContext([1, 2, 3, 4, 1, 2, 3], 2, 8))
    drafter.draft(DraftContext([1, 2, 3, 4, 1, 2, 3], 2, 8, greedy=True))
    topk = NodeTopK(np.zeros((tree.size, 2), np.int64), np.full((tree.size, 2), 0.5))
    later = drafter.observe(tree, Acceptance((), (), 0), topk)
    later()
    walk_compiled.warm()  # what lays out and walks its drawn children on a GPU
    return tree.size


if __name__ == "__main__":
    print(f"stand-dyn kernels compiled (a {warm()}-node tree)")
