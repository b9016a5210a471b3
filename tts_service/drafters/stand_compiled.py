"""`stand` drafting compiled: the trees of `StandDrafter`, drafted by one numba call per step
for all of a problem's rows instead of a Python loop over each row's shape nodes (issue 27's
host budget; docs/design.md, "The compiled drafter").

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

import numpy as np
from numba import njit

from store.base import NgramRow, NgramStore
from store.index import StoreIndex, lookup_slot
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


def noise_windows(
    noises: Sequence[GumbelNoise | None], need: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows' noise for a compiled step, flat (one copy for all rows, not one per row): row
    r's window of its `GumbelNoise` reading at most `need[r]` values is `cur[cur_at[r] :
    cur_at[r + 1]]` with `rem[r]` values left in its buffer, and the next buffer's first are
    `nxt[nxt_at[r] : nxt_at[r + 1]]`; a row that draws nothing (None) has none."""
    rows = len(noises)
    if all(x is None for x in noises):  # deterministic rows only
        none = np.zeros(rows + 1, np.int64)
        return _NONE, none, none[:rows], _NONE, none
    curs, nxts, rems = [], [], []
    for noise, n in zip(noises, need, strict=True):
        window, left, ahead = noise.window(n) if noise is not None else (_NONE, 0, _NONE)
        curs.append(window)
        nxts.append(ahead)
        rems.append(left)
    cur_at = np.array([0, *accumulate(map(len, curs))], np.int64)
    nxt_at = np.array([0, *accumulate(map(len, nxts))], np.int64)
    return np.concatenate(curs), cur_at, np.array(rems, np.int64), np.concatenate(nxts), nxt_at


@njit(cache=True)
def gumbel_order(c_p, nc: int, cur, rem: int, nxt, pos: int, moved: bool, keys, rank):
    """Gumbel-top-k over `c_p[:nc]` as `stand.gumbel_top_k` draws it: `GumbelNoise.take(nc)`
    from a step's window (`cur`, `rem` values left in it, `nxt` the next buffer's first; `pos`
    read so far, `moved` to the next buffer: the tail is discarded, as `take` does), keys
    log p + g in `keys`, and in `rank` the order, a stable sort by key, largest first. Returns
    the new (pos, moved)."""
    if not moved and pos + nc > rem:
        moved, pos = True, 0
    for i in range(nc):
        keys[i] = math.log(c_p[i]) + (nxt[pos + i] if moved else cur[pos + i])
        rank[i] = i
    for i in range(1, nc):
        r, key = rank[i], keys[rank[i]]
        j = i - 1
        while j >= 0 and keys[rank[j]] < key:
            rank[j + 1] = rank[j]
            j -= 1
        rank[j + 1] = r
    return pos + nc, moved


@njit(cache=True)
def stand_tree(
    tab, keytok, ids, probs, nids, count, meta, max_order, kid_at, kid_list,
    keep, stochastic, cur, rem, nxt, used,
    ctx, clen, token, parent, sampled, shape, slot_of, qn, qids, qp,
):  # fmt: skip
    """One row's tree (`StandDrafter.grow` from the root over the shape nodes in `keep`); node
    0's context `ctx[0]` (right-aligned, `clen[0]` tokens) is set. Writes every node's token,
    parent, drawn flag, shape node, place among its parent's stored ids (`slot_of`), context,
    and its `q` snapshot (`qn` -1: none); returns the
    size. Noise: `cur` holds the current buffer's next values, `rem` how many it has left,
    `nxt` the next buffer's first; `used` gets (1 if it moved to the next buffer, values read
    from the one it ended in)."""
    order = ctx.shape[1]
    placed = np.full(len(kid_at) - 1, -1, np.int64)  # shape node -> tree node
    placed[0] = 0
    width = ids.shape[1]
    c_ids = np.empty(width, np.int64)
    c_p = np.empty(width, np.float64)
    c_at = np.empty(width, np.int64)  # where each candidate sits in the stored entry
    keys = np.empty(width, np.float64)
    rank = np.empty(width, np.int64)
    token[0], parent[0], sampled[0], shape[0], slot_of[0] = ctx[0, order - 1], -1, False, 0, -1
    qn[0] = -1
    size, pos, moved = 1, 0, False
    for s in range(len(kid_at) - 1):
        node = placed[s]
        if node < 0:
            continue
        kids = 0
        for j in range(kid_at[s], kid_at[s + 1]):
            kids += keep[kid_list[j]]
        if kids == 0:
            continue
        tl = clen[node]
        slot, _ = lookup_slot(tab, keytok, meta, ctx[node, order - tl :], tl, max_order)
        if slot < 0:
            continue
        nc = 0
        for j in range(nids[slot]):
            if probs[slot, j] > 0:
                c_ids[nc], c_p[nc], c_at[nc] = ids[slot, j], probs[slot, j], j
                nc += 1
        k = min(kids, nc)
        for i in range(nc):
            rank[i] = i
        if stochastic:  # Gumbel-top-k
            pos, moved = gumbel_order(c_p, nc, cur, rem, nxt, pos, moved, keys, rank)
            qn[node] = nids[slot]
            for j in range(nids[slot]):
                qids[node, j], qp[node, j] = ids[slot, j], probs[slot, j]
        placed_kids = 0
        for j in range(kid_at[s], kid_at[s + 1]):
            kid = kid_list[j]
            if placed_kids == k:
                break
            if not keep[kid]:
                continue
            child = size
            token[child], slot_of[child] = c_ids[rank[placed_kids]], c_at[rank[placed_kids]]
            parent[child], sampled[child], shape[child], qn[child] = node, stochastic, kid, -1
            ctx[child, : order - 1] = ctx[node, 1:]
            ctx[child, order - 1] = token[child]
            clen[child] = min(order, tl + 1)
            placed[kid] = child
            placed_kids += 1
            size += 1
    used[0], used[1] = moved, pos
    return size


@njit(cache=True)
def stand_rows(
    tab, keytok, ids, probs, nids, count, meta, max_order, kid_at, kid_list,
    keep, stochastic, cur, cur_at, rem, nxt, nxt_at, used,
    ctx, clen, token, parent, sampled, shape, slot_of, qn, qids, qp, sizes,
):  # fmt: skip
    """`stand_tree` for every row (row r's arrays are the r-th of each; its noise as
    `noise_windows` lays it out)."""
    for r in range(len(sizes)):
        sizes[r] = stand_tree(
            tab, keytok, ids, probs, nids, count, meta, max_order, kid_at, kid_list,
            keep[r], stochastic[r], cur[cur_at[r] : cur_at[r + 1]], rem[r],
            nxt[nxt_at[r] : nxt_at[r + 1]], used[r],
            ctx[r], clen[r], token[r], parent[r], sampled[r], shape[r], slot_of[r],
            qn[r], qids[r], qp[r],
        )  # fmt: skip


def shape_arrays(shape: TreeShape) -> tuple[np.ndarray, np.ndarray]:
    """The shape's children as CSR: those of node s are `kid_list[kid_at[s]:kid_at[s + 1]]`."""
    kid_at = np.cumsum([0] + [len(k) for k in shape.children]).astype(np.int64)
    return kid_at, np.array([c for k in shape.children for c in k], np.int64)


class StandGroup:
    """One problem's compiled STAND rows over one tree shape: they read the same store, so
    `draft_all` drafts every member row of a step in one kernel call (drafting reads the store
    and each row's own noise only: the order of the rows changes nothing but lookup counts,
    which add up the same)."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self.kid_at, self.kid_list = shape_arrays(shape)
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
        nodes = max(most)
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
        ctx = np.full((rows, nodes, order), -1, np.int64)
        ctx[:, 0] = tails
        clen = np.zeros((rows, nodes), np.int64)
        clen[:, 0] = [min(order, len(c.tokens)) for c in ctxs]
        used = np.zeros((rows, 2), np.int64)
        token, shape_ids, slot_of = (np.zeros((rows, nodes), np.int64) for _ in range(3))
        parent = np.full((rows, nodes), -1, np.int64)  # past a tree's nodes: none
        qn = np.full((rows, nodes), -1, np.int64)
        sampled = np.zeros((rows, nodes), np.bool_)
        qids, qp = np.zeros((rows, nodes, width), np.int64), np.zeros((rows, nodes, width))
        sizes = np.zeros(rows, np.int64)
        stand_rows(
            *index.arrays(), order, self.kid_at, self.kid_list,
            keep, stochastic, *noise, used,
            ctx, clen, token, parent, sampled, shape_ids, slot_of, qn, qids, qp, sizes,
        )  # fmt: skip
        # to Python once for all rows; a node's q where it drew its children
        tokens, parents, drawn, shapes = (x.tolist() for x in (token, parent, sampled, shape_ids))
        has_q = qn >= 0
        drawn_batch = DrawnBatch(parent, slot_of, qn, qids, qp)
        out = []
        for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
            if stochastic[r]:
                m.noise.advance(bool(used[r, 0]), int(used[r, 1]))
            tree = DraftTree(
                tuple(tokens[r][:n]),
                tuple(parents[r][:n]),
                tuple(drawn[r][:n]),
                DrawnQ(has_q, qn, qids, qp, r, n) if stochastic[r] else (None,) * n,
                DrawnArrays(drawn_batch, r) if stochastic[r] else None,
            )
            m.contexts = (ctx[r, :n], clen[r, :n])
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
    print(f"stand kernels compiled (a {warm()}-node tree)")
