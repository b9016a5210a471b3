"""`stand` drafting compiled: the trees of `StandDrafter`, drafted by one numba call per step
for all of a problem's rows instead of a Python loop over each row's shape nodes (the host's
budget between forwards; docs/design.md, "The compiled drafter").

`stand_tree` is `StandDrafter.grow` from the root statement for statement: the same shape
nodes, the same store lookups (on the store's arrays, `InMemoryNgramStore.compiled()`), the same
Gumbel noise consumed in the same order and the same stable sort, so a tree is the Python
drafter's node for node, its `q` snapshots included (tests compare them through the runner).
The noise stays the row's `GumbelNoise`: a step reads a window of it (`GumbelNoise.window`),
and the kernel says how far it read. Where it does not apply (a Redis or tiered store, a noise
buffer smaller than a step can read) the Python drafter runs
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
from store.index import StoreIndex, lookup_slot
from tts_service.config import resolve_tree_path
from tts_service.drafters.base import ShapedTree, shape_prefix
from tts_service.drafters.gumbel import GumbelNoise
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.drafters.store_feed import feed_index, feed_root, learned_nodes
from tts_service.engine import walk_compiled
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
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


class NoiseWindows(NamedTuple):
    """The rows' Gumbel noise for one compiled step, flat (one copy for all rows, not one per
    row): row r's window of its `GumbelNoise` is `cur[cur_at[r] : cur_at[r + 1]]`, with `rem[r]`
    values left in its buffer, and the next buffer's first values are `nxt[nxt_at[r] :
    nxt_at[r + 1]]`; a row that draws nothing has none. Kernels take it as a plain tuple in
    this order (numba types a named tuple's fields one by one in Python at every call, a plain
    one by its C fingerprint: microseconds a call saved)."""

    cur: np.ndarray  # float64
    cur_at: np.ndarray  # int64 [R + 1]
    rem: np.ndarray  # int64 [R]
    nxt: np.ndarray  # float64
    nxt_at: np.ndarray  # int64 [R + 1]


class StandOut(NamedTuple):
    """`stand_rows`' output, per row and node `[R, M]` (`qids`, `qp` `[R, M, K]`, `ctx`
    `[R, M, order]`): each node's token, parent (-1 past a tree), drawn flag, shape node, place
    among its parent's stored ids, its `q` snapshot (`qn` -1: none) and its context
    (right-aligned, -1 padded; `clen` tokens). Kernels take a row's slices as a plain tuple in
    this order."""

    token: np.ndarray
    parent: np.ndarray
    sampled: np.ndarray
    shape: np.ndarray
    slot_of: np.ndarray
    qn: np.ndarray
    qids: np.ndarray
    qp: np.ndarray
    ctx: np.ndarray
    clen: np.ndarray

    @staticmethod
    def empty(rows: int, nodes: int, width: int, order: int) -> StandOut:
        """Buffers for `rows` trees of at most `nodes` nodes."""
        ints = [np.zeros((rows, nodes), np.int64) for _ in range(3)]
        return StandOut(
            ints[0],
            np.full((rows, nodes), -1, np.int64),
            np.zeros((rows, nodes), np.bool_),
            ints[1],
            ints[2],
            np.full((rows, nodes), -1, np.int64),
            np.zeros((rows, nodes, width), np.int64),
            np.zeros((rows, nodes, width)),
            np.full((rows, nodes, order), -1, np.int64),
            np.zeros((rows, nodes), np.int64),
        )


def noise_windows(noises: Sequence[GumbelNoise | None], need: Sequence[int]) -> NoiseWindows:
    """The rows' noise for a compiled step: row r's window reads at most `need[r]` values; a
    row that draws nothing (None) has none."""
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
def row_noise(noise, used, r: int):
    """Row `r`'s noise as `gumbel_order` reads it: (its window, the values left in its buffer,
    the next buffer's first, where to write how far it read)."""
    cur, cur_at, rem, nxt, nxt_at = noise
    return cur[cur_at[r] : cur_at[r + 1]], rem[r], nxt[nxt_at[r] : nxt_at[r + 1]], used[r]


@njit(cache=True)
def gumbel_order(c_p, nc: int, cur, rem: int, nxt, pos: int, moved: bool, keys, rank):
    """Gumbel-top-k over `c_p[:nc]` as `stand.gumbel_top_k` draws it: `GumbelNoise.take(nc)`
    from a row's noise (`row_noise`: `cur` its window, `rem` the values left in its buffer,
    `nxt` the next buffer's first; `pos` read so far, `moved` to the next buffer: the tail is
    discarded, as `take` does), keys log p + g in `keys`, and in `rank` the order, a stable
    sort by key, largest first. Returns the new (pos, moved)."""
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
def _stored(ids, probs, nids, slot: int, c_ids, c_p, c_at) -> int:
    """The entry at `slot`'s ids with a positive probability, in stored order: ids,
    probabilities, places in the entry; returns how many."""
    nc = 0
    for j in range(nids[slot]):
        if probs[slot, j] > 0:
            c_ids[nc], c_p[nc], c_at[nc] = ids[slot, j], probs[slot, j], j
            nc += 1
    return nc


@njit(cache=True)
def _kept_kids(kid_at, kid_list, keep, s: int, k: int, kids) -> int:
    """Shape node `s`'s first `k` kept children, in order, into `kids`; returns how many."""
    m = 0
    for j in range(kid_at[s], kid_at[s + 1]):
        if m == k:
            break
        if keep[kid_list[j]]:
            kids[m] = kid_list[j]
            m += 1
    return m


@njit(cache=True)
def _child_context(ctx, clen, node: int, child: int, token: int) -> None:
    """`child`'s context: its parent's shifted by its token (right-aligned, `order` long)."""
    order = ctx.shape[1]
    ctx[child, : order - 1] = ctx[node, 1:]
    ctx[child, order - 1] = token
    clen[child] = min(order, clen[node] + 1)


@njit(cache=True)
def stand_tree(store, shape, keep, stochastic: bool, noise, out) -> int:
    """One row's tree (`StandDrafter.grow` from the root over the shape nodes in `keep`):
    `store` the index's arrays (`StoreIndex.arrays()`), `shape` the shape's
    children as CSR (`shape_arrays`), `noise` as `row_noise` hands it, `out` the row's slices
    of `StandOut`, node 0's context set; returns the size. The groups are unpacked once here:
    the per-node work takes arrays (a tuple unpacked per node counts a reference to each of
    its arrays)."""
    tab, keytok, ids, probs, nids, _, meta, max_order = store
    kid_at, kid_list = shape
    cur, rem, nxt, used = noise
    token, parent, sampled, shape_of, slot_of, qn, qids, qp, ctx, clen = out
    order, width = ctx.shape[1], ids.shape[1]
    placed = np.full(len(kid_at) - 1, -1, np.int64)  # shape node -> tree node
    placed[0] = 0
    c_ids, c_p, c_at = np.empty(width, np.int64), np.empty(width), np.empty(width, np.int64)
    keys, rank, kids = np.empty(width), np.empty(width, np.int64), np.empty(width + 1, np.int64)
    token[0], parent[0], sampled[0], shape_of[0], slot_of[0] = ctx[0, order - 1], -1, False, 0, -1
    qn[0] = -1
    size, pos, moved = 1, 0, False
    for s in range(len(kid_at) - 1):
        node = placed[s]
        if node < 0 or _kept_kids(kid_at, kid_list, keep, s, 1, kids) == 0:
            continue
        tl = clen[node]
        slot, _ = lookup_slot(tab, keytok, meta, ctx[node, order - tl :], tl, max_order)
        if slot < 0:
            continue
        nc = _stored(ids, probs, nids, slot, c_ids, c_p, c_at)
        for i in range(nc):
            rank[i] = i
        if stochastic:  # Gumbel-top-k
            pos, moved = gumbel_order(c_p, nc, cur, rem, nxt, pos, moved, keys, rank)
            n = nids[slot]
            qn[node] = n
            qids[node, :n], qp[node, :n] = ids[slot, :n], probs[slot, :n]
        m = _kept_kids(kid_at, kid_list, keep, s, nc, kids)
        for i in range(m):
            child, kid = size + i, kids[i]
            token[child], slot_of[child] = c_ids[rank[i]], c_at[rank[i]]
            parent[child], sampled[child], shape_of[child], qn[child] = node, stochastic, kid, -1
            _child_context(ctx, clen, node, child, token[child])
            placed[kid] = child
        size += m
    used[0], used[1] = moved, pos
    return size


@njit(cache=True)
def stand_rows(store, shape, keep, stochastic, noise, used, out, sizes) -> None:
    """`stand_tree` for every row: row r's `keep[r]`, `stochastic[r]`, its noise as
    `noise_windows` lays it out (`used[r]` gets how far it read) and `out`'s r-th slices."""
    for r in range(len(sizes)):
        row_out = (
            out[0][r], out[1][r], out[2][r], out[3][r], out[4][r],
            out[5][r], out[6][r], out[7][r], out[8][r], out[9][r],
        )  # fmt: skip
        sizes[r] = stand_tree(
            store, shape, keep[r], stochastic[r], row_noise(noise, used, r), row_out
        )


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
        rows, order = len(members), index.max_order
        keep = np.zeros((rows, len(self.shape.parents)), np.bool_)
        for r, kept in enumerate(keeps):
            if isinstance(kept, range):
                keep[r, kept.start : kept.stop] = True
            else:
                keep[r, list(kept)] = True
        most = [len(kept) + 1 for kept in keeps]  # the most nodes each tree can have
        stochastic = np.array(
            [m.stochastic and not c.greedy for m, c in zip(members, ctxs, strict=True)], np.bool_
        )
        # the most noise a row's step can read (every node opened, every stored id drawable):
        # its own, which its buffer holds (`stand.compiled_applies`)
        noise = noise_windows(
            [m.noise if s else None for m, s in zip(members, stochastic.tolist(), strict=True)],
            [n * index.topk for n in most],
        )
        out = StandOut.empty(rows, max(most), index.topk, order)
        for r, c in enumerate(ctxs):
            tail = c.tokens[-order:]
            out.ctx[r, 0, order - len(tail) :] = tail
            out.clen[r, 0] = min(order, len(c.tokens))
        used, sizes = np.zeros((rows, 2), np.int64), np.zeros(rows, np.int64)
        shape = (self.kid_at, self.kid_list)
        stand_rows(index.arrays(), shape, keep, stochastic, tuple(noise), used, tuple(out), sizes)
        return self._trees(members, stochastic, used, out, sizes)

    @staticmethod
    def _trees(
        members: Sequence[CompiledStand],
        stochastic: np.ndarray,
        used: np.ndarray,
        out: StandOut,
        sizes: np.ndarray,
    ) -> list[ShapedTree]:
        """The kernel's trees as `ShapedTree`s (to Python once for all rows; a node's q where it
        drew its children); each drawing row's noise advanced past what it read."""
        tokens, parents = out.token.tolist(), out.parent.tolist()
        drawn, shapes = out.sampled.tolist(), out.shape.tolist()
        has_q = out.qn >= 0
        batch = DrawnBatch(out.parent, out.slot_of, out.qn, out.qids, out.qp)
        trees = []
        for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
            if stochastic[r]:
                m.noise.advance(bool(used[r, 0]), int(used[r, 1]))
            tree = DraftTree(
                tuple(tokens[r][:n]),
                tuple(parents[r][:n]),
                tuple(drawn[r][:n]),
                DrawnQ(has_q, out.qn, out.qids, out.qp, r, n) if stochastic[r] else (None,) * n,
                DrawnArrays(batch, r) if stochastic[r] else None,
            )
            m.contexts = (out.ctx[r, :n], out.clen[r, :n])
            trees.append(ShapedTree(tree, tuple(shapes[r][:n])))
        return trees


class CompiledStand(Drafter):
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
