"""`stand` drafting compiled: the trees of `StandDrafter`, drafted by one numba call per step
for all of a problem's rows instead of a Python loop over each row's shape nodes (the host's
budget; docs/design.md, "The compiled drafter").

`stand_tree` is `StandDrafter.grow` from the root statement for statement: the same shape
nodes, the same store lookups (on the store's arrays, `InMemoryNgramStore.compiled()`), the same
Gumbel noise consumed in the same order and the same stable sort, so a tree is the Python
drafter's node for node, its `q` snapshots included (tests compare them through the runner).
The noise stays the row's `GumbelNoise`: a step reads a window of it (`GumbelNoise.window`),
and the kernel says how far it read. Where it does not apply (a Redis or tiered store, a noise
buffer smaller than a step can read, numba missing) the Python drafter runs
(`stand.compiled_applies`). Spines (`stand-spine`) keep the Python drafter.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from itertools import accumulate
from typing import NamedTuple

import numpy as np
from numba import njit

from store.base import NgramRow, NgramStore
from store.index import StoreArrays, StoreIndex, lookup_slot
from tts_service.config import resolve_tree_path
from tts_service.drafters.base import ShapedTree, shape_prefix
from tts_service.drafters.gumbel import GumbelNoise
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.drafters.store_feed import feed_index, feed_root, learned_nodes
from tts_service.engine import walk_compiled
from tts_service.engine.seam import Deferred, DraftContext, NodeTopK
from tts_service.engine.tree import (
    DraftTree,
    DrawnArrays,
    DrawnBatch,
    DrawnQ,
    TreeShape,
    load_tree_shape,
)
from tts_service.engine.verify import Acceptance

_NONE = np.zeros(0)  # a row's noise where it draws nothing


class NoiseWindow(NamedTuple):
    """What one row's step may read of its `GumbelNoise` (`GumbelNoise.window`): the current
    buffer's next values, how many it has left, and the next buffer's first."""

    cur: np.ndarray
    rem: int
    nxt: np.ndarray


class NoiseWindows(NamedTuple):
    """Every row's `NoiseWindow` for one step, flat (one copy for all rows, not one per row):
    row r's is `cur[cur_at[r] : cur_at[r + 1]]`, `rem[r]`, `nxt[nxt_at[r] : nxt_at[r + 1]]`."""

    cur: np.ndarray
    cur_at: np.ndarray
    rem: np.ndarray
    nxt: np.ndarray
    nxt_at: np.ndarray


@njit(cache=True)
def row_window(noise: NoiseWindows, r: int) -> NoiseWindow:
    """Row r's window of a step's noise."""
    cur = noise.cur[noise.cur_at[r] : noise.cur_at[r + 1]]
    return NoiseWindow(cur, noise.rem[r], noise.nxt[noise.nxt_at[r] : noise.nxt_at[r + 1]])


def noise_windows(noises: Sequence[GumbelNoise | None], need: Sequence[int]) -> NoiseWindows:
    """The rows' noise for a compiled step: row r's window of its `GumbelNoise` reading at most
    `need[r]` values; a row that draws nothing (None) has none."""
    rows = len(noises)
    if all(x is None for x in noises):  # deterministic rows only
        none = np.zeros(rows + 1, np.int64)
        return NoiseWindows(_NONE, none, none[:rows], _NONE, none)
    curs, nxts, rems = [], [], []
    for noise, n in zip(noises, need, strict=True):
        window, left, ahead = noise.window(n) if noise is not None else (_NONE, 0, _NONE)
        curs.append(window)
        nxts.append(ahead)
        rems.append(left)
    cur_at = np.array([0, *accumulate(map(len, curs))], np.int64)
    nxt_at = np.array([0, *accumulate(map(len, nxts))], np.int64)
    return NoiseWindows(
        np.concatenate(curs), cur_at, np.array(rems, np.int64), np.concatenate(nxts), nxt_at
    )


@njit(cache=True)
def gumbel_order(c_p, nc: int, noise: NoiseWindow, pos: int, moved: bool, keys, rank):
    """Gumbel-top-k over `c_p[:nc]` as `gumbel.gumbel_top_k` draws it: `GumbelNoise.take(nc)`
    from a step's window (`pos` read so far, `moved` to the next buffer: the tail is
    discarded, as `take` does), keys log p + g in `keys`, and in `rank` the order, a stable
    sort by key, largest first. Returns the new (pos, moved)."""
    if not moved and pos + nc > noise.rem:
        moved, pos = True, 0
    for i in range(nc):
        keys[i] = math.log(c_p[i]) + (noise.nxt[pos + i] if moved else noise.cur[pos + i])
        rank[i] = i
    for i in range(1, nc):
        r, key = rank[i], keys[rank[i]]
        j = i - 1
        while j >= 0 and keys[rank[j]] < key:
            rank[j + 1] = rank[j]
            j -= 1
        rank[j + 1] = r
    return pos + nc, moved


class ShapeChildren(NamedTuple):
    """A tree shape's children as CSR: those of node s are `kid_list[kid_at[s]:kid_at[s + 1]]`."""

    kid_at: np.ndarray
    kid_list: np.ndarray


def shape_children(shape: TreeShape) -> ShapeChildren:
    """`shape`'s children as a kernel reads them."""
    kid_at = np.cumsum([0] + [len(k) for k in shape.children]).astype(np.int64)
    return ShapeChildren(kid_at, np.array([c for k in shape.children for c in k], np.int64))


class StandTrees(NamedTuple):
    """`stand_tree`'s output: per node (`[N]` for one row, `[R, N]` for a step's rows) its
    context (right-aligned, -1 padded, `[.., order]`) and its length, token, parent, drawn
    flag, shape node, place among its parent's stored ids, and `q` snapshot (`qn` -1: none;
    `qids`, `qp` `[.., width]`); per row the noise it read (`noise_used`: 1 if it moved to the
    next buffer, values read from the one it ended in)."""

    ctx: np.ndarray
    clen: np.ndarray
    token: np.ndarray
    parent: np.ndarray
    sampled: np.ndarray
    shape: np.ndarray
    slot_of: np.ndarray
    qn: np.ndarray
    qids: np.ndarray
    qp: np.ndarray
    noise_used: np.ndarray

    @staticmethod
    def empty(rows: int, nodes: int, order: int, width: int) -> StandTrees:
        """A step's buffers; contexts and parents -1 (past a tree's nodes: none)."""
        zeros = [np.zeros((rows, nodes), np.int64) for _ in range(3)]  # token, shape, slot_of
        return StandTrees(
            np.full((rows, nodes, order), -1, np.int64), np.zeros((rows, nodes), np.int64),
            zeros[0], np.full((rows, nodes), -1, np.int64), np.zeros((rows, nodes), np.bool_),
            zeros[1], zeros[2], np.full((rows, nodes), -1, np.int64),
            np.zeros((rows, nodes, width), np.int64), np.zeros((rows, nodes, width)),
            np.zeros((rows, 2), np.int64),
        )  # fmt: skip


class NodeCandidates(NamedTuple):
    """Scratch for one node's stored candidates (the store's top-k each): ids, probabilities,
    places in the stored entry, Gumbel keys and the draw order."""

    ids: np.ndarray
    p: np.ndarray
    at: np.ndarray
    keys: np.ndarray
    rank: np.ndarray


@njit(cache=True)
def _kept_children(shape: ShapeChildren, keep, s: int) -> int:
    """How many of shape node s's children `keep` holds."""
    kids = 0
    for j in range(shape.kid_at[s], shape.kid_at[s + 1]):
        kids += keep[shape.kid_list[j]]
    return kids


@njit(cache=True)
def _stored_candidates(store: StoreArrays, slot: int, cand: NodeCandidates) -> int:
    """Entry `slot`'s ids with a positive probability into `cand`, ranked as stored; how many."""
    nc = 0
    for j in range(store.nids[slot]):
        if store.probs[slot, j] > 0:
            cand.ids[nc], cand.p[nc], cand.at[nc] = store.ids[slot, j], store.probs[slot, j], j
            nc += 1
    for i in range(nc):
        cand.rank[i] = i
    return nc


@njit(cache=True)
def _hang_children(
    shape: ShapeChildren, keep, s: int, k: int, cand: NodeCandidates, stochastic: bool,
    tree: StandTrees, placed, size: int,
) -> int:  # fmt: skip
    """The first k kept children of shape node s, hung below its tree node with `cand`'s
    tokens in rank order; returns the tree's new size."""
    order = tree.ctx.shape[1]
    node = placed[s]
    tl = tree.clen[node]
    placed_kids = 0
    for j in range(shape.kid_at[s], shape.kid_at[s + 1]):
        kid = shape.kid_list[j]
        if placed_kids == k:
            break
        if not keep[kid]:
            continue
        child = size
        tree.token[child] = cand.ids[cand.rank[placed_kids]]
        tree.slot_of[child] = cand.at[cand.rank[placed_kids]]
        tree.parent[child], tree.sampled[child], tree.shape[child] = node, stochastic, kid
        tree.qn[child] = -1
        tree.ctx[child, : order - 1] = tree.ctx[node, 1:]
        tree.ctx[child, order - 1] = tree.token[child]
        tree.clen[child] = min(order, tl + 1)
        placed[kid] = child
        placed_kids += 1
        size += 1
    return size


@njit(cache=True)
def stand_tree(
    store: StoreArrays, shape: ShapeChildren, keep, stochastic: bool, noise: NoiseWindow,
    tree: StandTrees,
) -> int:  # fmt: skip
    """One row's tree (`StandDrafter.grow` from the root over the shape nodes in `keep`) into
    `tree` (one row's), whose node 0 context `ctx[0]` (right-aligned, `clen[0]` tokens) is set;
    returns the size."""
    order = tree.ctx.shape[1]
    placed = np.full(len(shape.kid_at) - 1, -1, np.int64)  # shape node -> tree node
    placed[0] = 0
    width = store.ids.shape[1]
    cand = NodeCandidates(
        np.empty(width, np.int64), np.empty(width, np.float64), np.empty(width, np.int64),
        np.empty(width, np.float64), np.empty(width, np.int64),
    )  # fmt: skip
    tree.token[0], tree.parent[0], tree.sampled[0] = tree.ctx[0, order - 1], -1, False
    tree.shape[0], tree.slot_of[0], tree.qn[0] = 0, -1, -1
    size, pos, moved = 1, 0, False
    for s in range(len(shape.kid_at) - 1):
        node = placed[s]
        if node < 0:
            continue
        kids = _kept_children(shape, keep, s)
        if kids == 0:
            continue
        tl = tree.clen[node]
        slot, _ = lookup_slot(store, tree.ctx[node, order - tl :], tl, store.max_order)
        if slot < 0:
            continue
        nc = _stored_candidates(store, slot, cand)
        if stochastic:  # Gumbel-top-k
            pos, moved = gumbel_order(cand.p, nc, noise, pos, moved, cand.keys, cand.rank)
            tree.qn[node] = store.nids[slot]
            for j in range(store.nids[slot]):
                tree.qids[node, j], tree.qp[node, j] = store.ids[slot, j], store.probs[slot, j]
        size = _hang_children(shape, keep, s, min(kids, nc), cand, stochastic, tree, placed, size)
    tree.noise_used[0], tree.noise_used[1] = moved, pos
    return size


@njit(cache=True)
def _row_trees(trees: StandTrees, r: int) -> StandTrees:
    """Row r's part of a step's buffers."""
    return StandTrees(
        trees.ctx[r], trees.clen[r], trees.token[r], trees.parent[r], trees.sampled[r],
        trees.shape[r], trees.slot_of[r], trees.qn[r], trees.qids[r], trees.qp[r],
        trees.noise_used[r],
    )  # fmt: skip


@njit(cache=True)
def stand_rows(
    store: StoreArrays, shape: ShapeChildren, keep, stochastic, noise: NoiseWindows,
    trees: StandTrees, sizes,
) -> None:  # fmt: skip
    """`stand_tree` for every row (row r's arrays are the r-th of each)."""
    for r in range(len(sizes)):
        sizes[r] = stand_tree(
            store, shape, keep[r], stochastic[r], row_window(noise, r), _row_trees(trees, r)
        )


class StandGroup:
    """One problem's compiled STAND rows over one tree shape: they read the same store, so
    `draft_all` drafts every member row of a step in one kernel call (drafting reads the store
    and each row's own noise only: the order of the rows changes nothing but lookup counts,
    which add up the same)."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self.children = shape_children(shape)
        self.index: StoreIndex | None = None

    def bind(self, index: StoreIndex) -> None:
        if self.index is None:
            self.index = index
        elif self.index is not index:
            raise ValueError("a problem's compiled rows must share one store")

    def draft_all(
        self, members: Sequence[CompiledStand], ctxs: Sequence[DraftContext]
    ) -> list[DraftTree]:
        keeps = [shape_prefix(m, ctx) for m, ctx in zip(members, ctxs, strict=True)]
        return [t.tree for t in self.draft(members, ctxs, keeps)]

    def draft(
        self,
        members: Sequence[CompiledStand],
        ctxs: Sequence[DraftContext],
        keeps: Sequence[Collection[int]],
    ) -> list[ShapedTree]:
        """Each member's tree over the shape nodes its `keep` holds (a `range` of the first
        ones, or any set closed under parents and earlier siblings)."""
        index = self.index
        assert index is not None
        rows, order, width = len(members), index.max_order, index.topk
        keep = np.zeros((rows, len(self.shape.parents)), np.bool_)
        for r, kept in enumerate(keeps):
            if isinstance(kept, range):
                keep[r, kept.start : kept.stop] = True
            else:
                keep[r, list(kept)] = True
        most = [len(kept) + 1 for kept in keeps]  # the most nodes each tree can have
        stochastic = np.zeros(rows, np.bool_)
        tails = []
        for r, (m, c) in enumerate(zip(members, ctxs, strict=True)):
            tail = c.tokens[-order:]
            tails.append([-1] * (order - len(tail)) + tail)
            stochastic[r] = m.stochastic and not c.greedy
        # the most noise a row's step can read (every node opened, every stored id drawable):
        # its own, which its buffer holds (`stand.compiled_applies`)
        noise = noise_windows(
            [m.noise if s else None for m, s in zip(members, stochastic.tolist(), strict=True)],
            [n * width for n in most],
        )
        trees = StandTrees.empty(rows, max(most), order, width)
        trees.ctx[:, 0] = tails
        trees.clen[:, 0] = [min(order, len(c.tokens)) for c in ctxs]
        sizes = np.zeros(rows, np.int64)
        stand_rows(index.arrays(), self.children, keep, stochastic, noise, trees, sizes)
        return _shaped_trees(members, trees, stochastic, sizes)


def _shaped_trees(
    members: Sequence[CompiledStand], trees: StandTrees, stochastic: np.ndarray, sizes: np.ndarray
) -> list[ShapedTree]:
    """`stand_rows`' output as each member's tree, converted to Python once for all rows; a
    node's q where it drew its children. Each member's noise moves past what it read."""
    tokens, parents, drawn, shapes = (
        x.tolist() for x in (trees.token, trees.parent, trees.sampled, trees.shape)
    )
    has_q = trees.qn >= 0
    drawn_batch = DrawnBatch(trees.parent, trees.slot_of, trees.qn, trees.qids, trees.qp)
    used = trees.noise_used
    out = []
    for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
        if stochastic[r]:
            m.noise.advance(bool(used[r, 0]), int(used[r, 1]))
        tree = DraftTree(
            tuple(tokens[r][:n]),
            tuple(parents[r][:n]),
            tuple(drawn[r][:n]),
            DrawnQ(has_q, trees.qn, trees.qids, trees.qp, r, n) if stochastic[r] else (None,) * n,
            DrawnArrays(drawn_batch, r) if stochastic[r] else None,
        )
        m.contexts = (trees.ctx[r, :n], trees.clen[r, :n])
        out.append(ShapedTree(tree, tuple(shapes[r][:n])))
    return out


class CompiledStand:
    """`StandDrafter`, one row of a `StandGroup` (which drafts the step's rows in one call); it
    observes as the Python drafter does, deferred likewise, merging into the store's arrays."""

    def __init__(
        self, cfg: StandDrafterConfig, store: NgramStore, group: StandGroup, seed: int = 0
    ) -> None:
        self.cfg, self.store, self.group = cfg, store, group
        self.shape = group.shape
        self.num_nodes = cfg.num_nodes
        self.stochastic = cfg.stochastic
        self.noise = GumbelNoise(cfg.noise_buffer, seed)
        # the last tree's: every node's context (right-aligned, -1 padded) and its length
        self.contexts = (np.zeros((0, 0), np.int64), np.zeros(0, np.int64))

    def start(self, prompt_ids: list[int]) -> None:
        """Trajectories share the store; nothing is per-trajectory."""

    def grouped(self) -> tuple[StandGroup, CompiledStand]:
        return self.group, self

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.group.draft_all([self], [ctx])[0]

    def draft_subtree(self, ctx: DraftContext, keep: Collection[int]) -> ShapedTree:
        """Draft only the shape nodes in `keep` (GT sizing's choice), this row alone."""
        return self.group.draft([self], [ctx], [keep])[0]

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred:
        contexts, harvest = self.contexts, self.cfg.harvest_rejected  # the next draft rebinds
        return lambda: self._learn(tree, acc, topk, contexts, harvest)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred:
        tail, store = tuple(tokens[-self.store.max_order :]), self.store
        return lambda: feed_root(store, tail, topk)

    def _learn(
        self,
        tree: DraftTree,
        acc: Acceptance,
        topk: NodeTopK,
        contexts: tuple[np.ndarray, np.ndarray],
        harvest: bool,
    ) -> None:
        """`store_feed.feed_store` on the store's arrays: the target's distributions at the
        learned nodes, under each node's context."""
        assert self.group.index is not None
        feed_index(self.group.index, contexts, learned_nodes(tree, acc, topk, harvest), topk)


def new_group(cfg: StandDrafterConfig) -> StandGroup:
    return StandGroup(load_tree_shape(resolve_tree_path(cfg.tree)))


def warm() -> int:
    """Compile (or load) the kernels once, on a tiny problem; the size of the tree drafted."""
    index = StoreIndex(4, 10, 1000)
    index.add([NgramRow((1, 2, 3), (4, 5), (0.6, 0.3))])
    cfg = StandDrafterConfig(tree="stand-80", num_nodes=8)
    group = new_group(cfg)
    group.bind(index)
    drafter = CompiledStand(cfg, index, group)  # type: ignore[arg-type]
    tree = drafter.draft(DraftContext([1, 2, 3], 2, 8))
    topk = NodeTopK(np.zeros((tree.size, 2), np.int64), np.full((tree.size, 2), 0.5))
    drafter.observe(tree, Acceptance((), (), 0), topk)()
    walk_compiled.warm()  # what lays out and walks its drawn children on a GPU
    return tree.size


if __name__ == "__main__":
    # warmed as imported: the disk cache keys a kernel by its arguments' types, and this
    # module's NamedTuples run as `__main__` are other types than those a later process imports
    from tts_service.drafters import stand_compiled

    print(f"stand kernels compiled (a {stand_compiled.warm()}-node tree)")
