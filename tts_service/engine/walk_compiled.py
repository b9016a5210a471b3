"""Rule (c)'s host work compiled: `verify.walk_sparse` for every walked row of a step in one
numba call, from the step's one copy back (`treebatch.walk_sparse_all` calls it), and the
layout of the walked trees that a compiled drafter drew (`treebatch.SparseLayout.of`).

The walk is the reference's, operation for operation: each node's residual normalised by its
sum taken in support order, a drawn child's proposal q renormalised without its rejected
siblings, a matched child zeroed, the bonus drawn by inverting the residual's CDF over the
support and then the outside. Float64 throughout and sums in the reference's order, so every
acceptance and bonus is the reference walk's exactly. A step's walk costs microseconds per row
where the array version (`treebatch`'s fallback without numba) costs 0.25–0.94 ms at 4–48
walked rows (`bench.walk`).

`walk_rows` and `gather_rows` take the arrays one by one, as `treebatch` holds them, and hand
the kernels their named groups (`Supports`, `ChildGrid`, `Walked`; `DrawnLayout`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

_TINY = 1e-300  # verify._TINY


class Supports(NamedTuple):
    """Every walked node's support: `data` `[W, N, K + 4]` (per node p on its support, p's mass
    outside it, a token drawn from the outside, the uniforms u and w:
    `treebatch.gather_support`), `lens` `[W * N]` the supports' lengths, `ids` `[W, N, K]` their
    tokens."""

    data: np.ndarray
    lens: np.ndarray
    ids: np.ndarray


class ChildGrid(NamedTuple):
    """The children of the nodes that have some: `m_of` `[W * N]` each node's row in the grids
    (-1: no children), whose `[M, J]` rows hold its children by rank (`node`: node index, -1
    past the last; `slot`: the child's token's slot in the support; `drawn`) and `q` `[M, K]`
    its q on the support (0 outside q)."""

    m_of: np.ndarray
    node: np.ndarray
    slot: np.ndarray
    drawn: np.ndarray
    q: np.ndarray


class Walked(NamedTuple):
    """The walk's output: each row's accepted path (`path` `[W, N]`, `plen` `[W]`) and bonus
    token."""

    path: np.ndarray
    plen: np.ndarray
    bonus: np.ndarray


class WalkScratch(NamedTuple):
    """One node's residual on its support, the residual after a drawn child's rejection, and
    which support slots were tried."""

    values: np.ndarray
    rest: np.ndarray
    tried: np.ndarray


@njit(cache=True)
def _normalised(values, size: int, c: float, mass_out: float) -> float:
    """The residual normalised (`verify._normalised`) in place; returns the outside's new
    scale."""
    total = 0.0
    for s in range(size):
        total += values[s]
    total += c * mass_out
    if total > _TINY:
        for s in range(size):
            values[s] = values[s] / total
        c = c / total
    return c


@njit(cache=True)
def _drawn_acceptance(
    kids: ChildGrid, m: int, x: int, size: int, c: float, mass_out: float, scratch: WalkScratch
) -> tuple[float, bool]:
    """Rule (c) (`verify.sparse_rrs_step`) for a drawn child at slot x: its acceptance
    probability, and whether the residual equals q (every draft accepted); the residual after
    its rejection in `scratch.rest`."""
    values, rest, tried = scratch.values, scratch.rest, scratch.tried
    qt = 0.0  # q without the rejected siblings (`verify._without`)
    for s in range(size):
        if not tried[s]:
            qt += kids.q[m, s]
    qx = kids.q[m, x] / qt if qt > 0 and not tried[x] else 0.0
    accept = min(1.0, values[x] / qx) if qx > 0 else 0.0
    left = 0.0
    for s in range(size):
        qs = kids.q[m, s] / qt if qt > 0 and not tried[s] else 0.0
        rest[s] = max(0.0, values[s] - qs)
        left += rest[s]
    same = left + c * mass_out <= _TINY  # r == q_i: every draft accepted
    if same:
        accept = 1.0
    return accept, same


@njit(cache=True)
def _try_children(
    sup: Supports, kids: ChildGrid, scratch: WalkScratch, b: int, m: int, size: int,
    mass_out: float,
) -> tuple[int, float]:  # fmt: skip
    """Row b's node (grid row m) tries its children in rank order: the accepted one (-1: none)
    and the outside's scale; the residual left in `scratch.values`."""
    k = sup.data.shape[2] - 4
    values, tried = scratch.values, scratch.tried
    c = 1.0
    for s in range(size):
        tried[s] = False
    for j in range(kids.node.shape[1]):
        child = kids.node[m, j]
        if child < 0:
            break
        x = kids.slot[m, j]
        c = _normalised(values, size, c, mass_out)
        if kids.drawn[m, j]:  # rule (c): `verify.sparse_rrs_step`
            accept, same = _drawn_acceptance(kids, m, x, size, c, mass_out, scratch)
            if sup.data[b, child, k + 2] < accept:
                return child, c
            if not same:
                for s in range(size):
                    values[s] = scratch.rest[s]
        else:  # rule (b): `verify.sparse_match_step`
            if sup.data[b, child, k + 2] < values[x]:
                return child, c
            values[x] = 0.0
        tried[x] = True
    return -1, c


@njit(cache=True)
def _bonus(sup: Supports, b: int, node: int, size: int, outside: float, values) -> int:
    """The bonus token at row b's `node` (`verify._draw`): the residual's CDF inverted over the
    support, then the outside (mass `outside`)."""
    k = sup.data.shape[2] - 4
    total = 0.0
    for s in range(size):
        total += values[s]
    total += outside
    target, cum, last, got = sup.data[b, node, k + 3] * total, 0.0, -1, -1
    for s in range(size):
        if values[s] > 0:
            last = s
            cum += values[s]
            if target < cum:
                got = s
                break
    if got >= 0:
        return sup.ids[b, node, got]
    if outside > 0 or last < 0:
        return np.int64(sup.data[b, node, k + 1])
    return sup.ids[b, node, last]


@njit(cache=True)
def _walk(sup: Supports, kids: ChildGrid, out: Walked) -> None:
    """Every row's walk from its root: accepted children in turn, then the bonus."""
    rows, n, width = sup.data.shape
    k = width - 4
    scratch = WalkScratch(
        np.empty(max(k, 1), np.float64), np.empty(max(k, 1), np.float64),
        np.zeros(max(k, 1), np.bool_),
    )  # fmt: skip
    for b in range(rows):
        node, depth = 0, 0
        while True:
            at = b * n + node
            size = sup.lens[at]
            for s in range(size):
                scratch.values[s] = sup.data[b, node, s]
            mass_out = sup.data[b, node, k]
            chosen, c = -1, 1.0
            m = kids.m_of[at]
            if m >= 0:
                chosen, c = _try_children(sup, kids, scratch, b, m, size, mass_out)
            if chosen >= 0:
                out.path[b, depth] = chosen
                depth += 1
                node = chosen
                continue
            out.bonus[b] = _bonus(sup, b, node, size, c * mass_out, scratch.values)
            out.plen[b] = depth
            break


def walk_rows(
    data: np.ndarray, lens: np.ndarray, ids: np.ndarray, m_of: np.ndarray,
    kid_node: np.ndarray, kid_slot: np.ndarray, kid_drawn: np.ndarray, kid_q: np.ndarray,
    path: np.ndarray, plen: np.ndarray, bonus: np.ndarray,
) -> None:  # fmt: skip
    """Every row's walk (`Supports`, `ChildGrid`): writes each row's accepted path (`path`
    `[W, N]`, `plen` `[W]`) and bonus token."""
    _walk(
        Supports(data, lens, ids),
        ChildGrid(m_of, kid_node, kid_slot, kid_drawn, kid_q),
        Walked(path, plen, bonus),
    )


class DrawnLayout(NamedTuple):
    """A batch's drawn trees as `tree.DrawnBatch` holds them, `[W, N]` / `[W, N, K]`: each
    node's parent, its place in its parent's support, whether it was drawn, and its support's
    length, ids and q."""

    parent: np.ndarray
    slot: np.ndarray
    drawn: np.ndarray
    q_len: np.ndarray
    q_ids: np.ndarray
    q_probs: np.ndarray


@njit(cache=True)
def _gather(src: DrawnLayout, rows, at, dst: DrawnLayout) -> None:
    """Rows `rows` of `src` (`drawn` `[*, 0]`: every child drawn) into rows `at` of `dst`,
    their first N nodes (a tree's all lie there) and each node's support (past it `src` holds
    zeros, as `dst` does)."""
    n, k = min(dst.parent.shape[1], src.parent.shape[1]), src.q_ids.shape[2]
    for i in range(len(rows)):
        r, b = rows[i], at[i]
        for c in range(n):
            dst.parent[b, c], dst.slot[b, c] = src.parent[r, c], src.slot[r, c]
            dst.q_len[b, c] = src.q_len[r, c]
            dst.drawn[b, c] = src.drawn[r, c] if src.drawn.shape[1] else True
            for j in range(min(src.q_len[r, c], k)):  # numba checks no bounds
                dst.q_ids[b, c, j], dst.q_probs[b, c, j] = src.q_ids[r, c, j], src.q_probs[r, c, j]


def gather_rows(
    parents: np.ndarray, slot: np.ndarray, sampled: np.ndarray, q_len: np.ndarray,
    q_ids: np.ndarray, q_probs: np.ndarray, rows: np.ndarray, at: np.ndarray,
    parent_to: np.ndarray, slot_to: np.ndarray, drawn_to: np.ndarray, q_len_to: np.ndarray,
    q_ids_to: np.ndarray, q_probs_to: np.ndarray,
) -> None:  # fmt: skip
    """Rows `rows` of one batch's arrays (`tree.DrawnBatch`'s; `sampled` `[*, 0]`: every child
    drawn) into rows `at` of `layout_rows`' inputs (`DrawnLayout`, `_gather`)."""
    _gather(
        DrawnLayout(parents, slot, sampled, q_len, q_ids, q_probs),
        rows,
        at,
        DrawnLayout(parent_to, slot_to, drawn_to, q_len_to, q_ids_to, q_probs_to),
    )


@njit(cache=True)
def layout_rows(parent, slot, drawn, q_len, q_ids, q_probs, bucket: bool):
    """`SparseLayout.of` of W trees from their drafter's arrays `[W, N]` / `[W, N, K]`
    (`tree.DrawnBatch`'s, gathered): every node's support ids `[W, N, k]` (pads repeat its
    last id; an empty support reads its first stored id, 0) and length `[W * N]`, k its
    longest (a power of two with `bucket`); the M nodes with children (`b * N + node`), their
    children by rank `[M, J]` (node index, -1 past the last; slot in the support; drawn) and
    each such node's q on its support `[M, k]`."""
    w, n = parent.shape
    width = q_ids.shape[2]
    lens = np.empty(w * n, np.int64)
    count = np.zeros(w * n, np.int64)
    k = 1
    for b in range(w):
        for c in range(n):
            lens[b * n + c] = max(q_len[b, c], 0)
            k = max(k, lens[b * n + c])
            if parent[b, c] >= 0:
                count[b * n + parent[b, c]] += 1
    if bucket:
        size = 1
        while size < k:
            size *= 2
        k = size
    ids = np.empty((w * n, k), np.int64)
    for i in range(w * n):
        b, c = i // n, i % n
        last = min(width - 1, max(lens[i] - 1, 0))
        for s in range(k):
            ids[i, s] = q_ids[b, c, min(s, last)]
    m_of = np.full(w * n, -1, np.int64)
    m, ranks = 0, 0
    for i in range(w * n):
        if count[i] > 0:
            m_of[i] = m
            m += 1
            ranks = max(ranks, count[i])
    parents = np.empty(m, np.int64)
    q = np.zeros((m, k))
    for i in range(w * n):
        if m_of[i] >= 0:
            parents[m_of[i]] = i
            for s in range(min(k, width)):
                q[m_of[i], s] = q_probs[i // n, i % n, s]
    kid_node = np.full((m, ranks), -1, np.int64)
    kid_slot = np.zeros((m, ranks), np.int64)
    kid_drawn = np.zeros((m, ranks), np.bool_)
    filled = np.zeros(m, np.int64)
    for b in range(w):
        for c in range(n):  # a parent's children in node order: their ranks
            if parent[b, c] >= 0:
                g = m_of[b * n + parent[b, c]]
                j = filled[g]
                filled[g] += 1
                kid_node[g, j], kid_slot[g, j], kid_drawn[g, j] = c, slot[b, c], drawn[b, c]
    return ids.reshape(w, n, k), lens, parents, kid_node, kid_slot, kid_drawn, q


def warm() -> None:
    """Compile (or load) the kernels once, on a one-node tree."""
    data = np.zeros((1, 1, 5))
    data[0, 0, 0], data[0, 0, 1] = 1.0, 0.0
    one, none = np.ones(1, np.int64), np.full(1, -1, np.int64)
    grid, q = np.zeros((0, 1), np.int64), np.zeros((0, 1))
    path, plen, bonus = np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    walk_rows(
        data, one, np.zeros((1, 1, 1), np.int64), none, grid, grid, grid.astype(np.bool_), q,
        path, plen, bonus,
    )  # fmt: skip
    z, ids, probs = np.zeros((1, 1), np.int64), np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 1))
    drawn, at = np.ones((1, 1), np.bool_), np.zeros(1, np.int64)  # a one-node tree, all zeros
    gather_rows(z - 1, z, drawn, z, ids, probs, at, at, z, z, drawn, z, ids, probs)
    layout_rows(z - 1, z, drawn, z, ids, probs, False)


if __name__ == "__main__":
    # warmed as imported: the disk cache keys a kernel by its arguments' types, and this
    # module's NamedTuples run as `__main__` are other types than those a later process imports
    from tts_service.engine import walk_compiled

    walk_compiled.warm()
    print("the rule (c) walk and layout compiled")
