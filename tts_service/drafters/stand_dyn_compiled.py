"""`stand-dyn` drafting compiled: the same trees as `StandDynDrafter`, drafted by one numba
call per row-step instead of ~10 Python candidate lists per opened node (docs/design.md, "The
compiled drafter").

Everything the Python drafter reads lives here as arrays a kernel can walk without the
interpreter:

* the problem's store: `InMemoryNgramStore.compiled()`, where its entries live from then on;
* the suffix counts over the problem's trajectories (`SuffixIndex`, `SuffixCounts`' rule);
* the successor table's unigram tier (`SuccessorIndex`, `AdjacencyTable` as `stand-dyn` uses
  it) and the calibration (`CalibrationIndex`, `AcceptanceCalibration`'s lines), per model.

`stand_kernel.draft_tree` is `StandDynDrafter.draft` statement for statement: the same
candidates, rates, heap order and stopping rule, and with `drawn` (under sampling) the same
choice of which nodes draw their children, drawn from the row's own `GumbelNoise` in the same
order (a step reads a window of it, as `stand_compiled` does, and says how far it read), so a
tree is identical to the Python drafter's, node for node, its drawn flags and q included (tests
compare them through the runner). Where it does not apply (a Redis or tiered store, a noise
buffer smaller than a step can read) the Python drafter runs (`stand_dyn._build`). Kernels are
cached on disk (`cache=True`): the first run after an install compiles them (`python -m
tts_service.drafters.stand_dyn_compiled` does it ahead, `scripts/setup.sh` runs it); later
processes load them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit

from store.base import NgramRow, NgramStore
from store.index import StoreIndex
from tts_service.drafters.gumbel import GumbelNoise
from tts_service.drafters.stand_compiled import noise_windows
from tts_service.drafters.stand_dyn_config import BINS, KIND_COUNT, TAIL, StandDynDrafterConfig
from tts_service.drafters.stand_kernel import DynOut, RowInputs, draft_rows
from tts_service.drafters.store_feed import feed_index, feed_root, learned_nodes
from tts_service.drafters.suffix_index import SuffixIndex
from tts_service.engine import walk_compiled
from tts_service.engine.cost import VerifyCost, VerifyCostSource
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, DrawnArrays, DrawnBatch, DrawnQ
from tts_service.engine.verify import Acceptance


# -- per-model state ---------------------------------------------------------------------------
class SuccessorIndex:
    """The unigram tier of `AdjacencyTable` (what `stand-dyn` reads: the last target
    distribution seen after a token, its top `k`) as `[vocab, k]` arrays."""

    def __init__(self, vocab: int, k: int = 10) -> None:
        self.vocab, self.k = vocab, k
        self.ids = np.zeros((vocab, k), np.int64)
        self.probs = np.zeros((vocab, k), np.float64)
        self.n = np.zeros(vocab, np.int64)  # 0: never seen

    def update(self, tokens: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        """Row i: the target's top-k after `tokens[i]` (later rows win, as in the dict)."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab)][0])
            raise IndexError(f"token {bad} outside the vocabulary of {self.vocab}")
        _set_successors(self.ids, self.probs, self.n, tokens, ids, probs, min(self.k, ids.shape[1]))


@njit(cache=True)
def _set_successors(succ_ids, succ_p, succ_n, tokens, ids, probs, k: int) -> None:
    for r in range(len(tokens)):  # in order: a repeated token keeps its last row
        t = tokens[r]
        succ_ids[t, :k], succ_p[t, :k], succ_n[t] = ids[r, :k], probs[r, :k], k


class CalibrationIndex:
    """`AcceptanceCalibration` as arrays: per key (kind × probability decile) the draws, the
    hits and the line α̂ = a + b·q; a key never drawn reads the prior line (0, s)."""

    def __init__(self, prior_weight: float = 4.0, prior_scale: float = 0.8) -> None:
        self.prior_weight, self.prior_scale = prior_weight, prior_scale
        size = KIND_COUNT * BINS
        self.drawn = np.zeros(size, np.float64)
        self.hits = np.zeros(size, np.float64)
        self.a = np.zeros(size, np.float64)
        self.b = np.full(size, prior_scale, np.float64)


class ModelArrays(NamedTuple):
    """What a loaded model's drafters share, as the draft kernels read it (a plain tuple in
    this order): the successor table (`SuccessorIndex`: `succ_ids`, `succ_p` `[vocab, k]`,
    `succ_n`) and the calibration's lines (`CalibrationIndex`: α̂ = `la` + `lb`·q per key)."""

    succ_ids: np.ndarray
    succ_p: np.ndarray
    succ_n: np.ndarray
    la: np.ndarray
    lb: np.ndarray

    @staticmethod
    def of(successors: SuccessorIndex, calibration: CalibrationIndex) -> tuple:
        return (successors.ids, successors.probs, successors.n, calibration.a, calibration.b)


@njit(cache=True)
def _record(cal, nodes, size: int, w: float, s: float) -> None:
    """`StandDynDrafter._learn`'s calibration part: every node whose parent was reached.
    `cal`: the calibration's (drawn, hits, a, b); `nodes`: the tree's (kinds, qs, parents,
    on_path)."""
    drawn, hits, la, lb = cal
    kinds, qs, parents, on_path = nodes
    for v in range(1, size):
        p = parents[v]
        if p == 0 or on_path[p]:
            q = qs[v]
            key = kinds[v] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
            drawn[key] += 1.0
            hits[key] += 1.0 if on_path[v] else 0.0
            la[key] = (hits[key] + w * 0.0) / (drawn[key] + w)
            lb[key] = (0.0 + w * s) / (drawn[key] + w)


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

    def _draft(
        self,
        members: Sequence[CompiledStandDyn],
        ctxs: Sequence[DraftContext],
        counted: Sequence[tuple[list[int], int, int]],
    ) -> list[DraftTree]:
        """One kernel call for `members`, with what each row counts (`SuffixIndex.advance`,
        booked already)."""
        rows = len(members)
        if not rows:
            return []
        idx, succ, cal = self.index, self.successors, self.calibration
        assert idx is not None and succ is not None and cal is not None
        inputs = self._inputs(members, ctxs, counted)
        # a drawing row's window of its noise: as much as its own tree can read (every node
        # opened, every stored id drawn), which its buffer holds (`stand_dyn.compiled_applies`)
        noise = noise_windows(
            [m.noise if d else None for m, d in zip(members, inputs.drawn.tolist(), strict=True)],
            ((inputs.limits + 1) * idx.topk).tolist(),
        )
        used, sizes = np.zeros((rows, 2), np.int64), np.zeros(rows, np.int64)
        out = DynOut.empty(inputs.drawn, int(inputs.limits.max()) + 1, idx.topk)
        src = (idx.arrays(), self.suffix.arrays(), ModelArrays.of(succ, cal))
        draft_rows(src, tuple(inputs), tuple(noise), used, tuple(out), sizes)
        return self._trees(members, inputs.drawn, used, out, sizes)

    def _inputs(
        self,
        members: Sequence[CompiledStandDyn],
        ctxs: Sequence[DraftContext],
        counted: Sequence[tuple[list[int], int, int]],
    ) -> RowInputs:
        """What the kernel drafts each row from; the suffix index made room for what they
        count."""
        rows = len(members)
        seqs: list[int] = []
        seq_at, lo, hi = [0], np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        tails = np.zeros((rows, TAIL), np.int64)
        tlens, limits = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        for r, (m, ctx, (seq, a, b)) in enumerate(zip(members, ctxs, counted, strict=True)):
            lo[r], hi[r] = a, b
            seqs += seq
            seq_at.append(len(seqs))
            tail = ctx.tokens[-TAIL:]
            tails[r, : len(tail)] = tail
            tlens[r] = len(tail)
            limits[r] = min(m.num_nodes, ctx.max_nodes)
            m.root_tail = tuple(tail)
        self.suffix.room(int((hi - lo).sum()))
        drawn = np.array(
            [m.drawn and not ctx.greedy for m, ctx in zip(members, ctxs, strict=True)], np.bool_
        )
        seq_arr, seq_at_arr = np.array(seqs, np.int64), np.array(seq_at, np.int64)
        costs = self._cost_table(members, ctxs)
        return RowInputs(seq_arr, seq_at_arr, lo, hi, tails, tlens, limits, drawn, *costs)

    def _cost_table(
        self, members: Sequence[CompiledStandDyn], ctxs: Sequence[DraftContext]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`RowInputs`' costs: each distinct verify cost the rows size by, and which each row's
        is (-1: none; a row filling its budget, or without a cost source)."""
        cost_of = np.full(len(members), -1, np.int64)
        costs: list[tuple[np.ndarray, np.ndarray]] = []
        seen: dict[int, int] = {}
        for r, (m, ctx) in enumerate(zip(members, ctxs, strict=True)):
            if m.cost is not None and not ctx.fill:
                cost = m.cost.at(len(ctx.tokens))
                if id(cost) not in seen:
                    seen[id(cost)] = len(costs)
                    costs.append(self._cost(cost))
                cost_of[r] = seen[id(cost)]
        width = max(2, *(len(x) for x, _ in costs)) if costs else 2
        cost_xs = np.zeros((max(len(costs), 1), width), np.float64)
        cost_ys = np.zeros_like(cost_xs)
        cost_n = np.zeros(len(cost_xs), np.int64)
        for c, (xs, ys) in enumerate(costs):
            cost_xs[c, : len(xs)], cost_ys[c, : len(ys)], cost_n[c] = xs, ys, len(xs)
        return cost_xs, cost_ys, cost_n, cost_of

    @staticmethod
    def _trees(
        members: Sequence[CompiledStandDyn],
        drawn: np.ndarray,
        used: np.ndarray,
        out: DynOut,
        sizes: np.ndarray,
    ) -> list[DraftTree]:
        """The kernel's trees (to Python once for all rows; a drawing row's carry the arrays
        rule (c) lays out); each drawing row's noise advanced past what it read."""
        trees = []
        tokens, parents = out.token.tolist(), out.parent.tolist()
        if drawn.any():
            flags = out.sampled.tolist()
            batch = DrawnBatch(out.parent, out.slot, out.qn, out.qids, out.qp, out.sampled)
        for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
            m.kinds, m.qs = out.kind[r, :n], out.q[r, :n]  # what each node was drafted as
            if drawn[r]:
                m.noise.advance(bool(used[r, 0]), int(used[r, 1]))
                tree = DraftTree(
                    tuple(tokens[r][:n]),
                    tuple(parents[r][:n]),
                    tuple(flags[r][:n]),
                    DrawnQ(out.draws, out.qn, out.qids, out.qp, r, n),  # at most the top-k
                    DrawnArrays(batch, r),
                )
            else:
                tree = DraftTree(
                    tuple(tokens[r][:n]), tuple(parents[r][:n]), (False,) * n, (None,) * n
                )
            trees.append(tree)
        return trees

    def _cost(self, cost: VerifyCost) -> tuple[np.ndarray, np.ndarray]:
        hit = self._costs.get(id(cost))
        if hit is None or hit[0] is not cost:
            xs, ys = np.array(cost.sizes, np.float64), np.array(cost.seconds, np.float64)
            hit = self._costs[id(cost)] = (cost, xs, ys)
        return hit[1], hit[2]


class CompiledStandDyn(Drafter):
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
        calibration = (cal.drawn, cal.hits, cal.a, cal.b)
        _record(calibration, (kinds, qs, parents, on_path), n, cal.prior_weight, cal.prior_scale)
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
