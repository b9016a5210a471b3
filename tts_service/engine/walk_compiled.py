"""Rule (c)'s host work compiled: `verify.walk_sparse` for every walked row of a step in one
numba call, from the step's one copy back (`treebatch.walk_sparse_all` calls it), and the
layout of the walked trees that a compiled drafter drew (`treebatch.SparseLayout.of`).

The walk is the reference's, operation for operation: each node's residual normalised by its
sum taken in support order, a drawn child's proposal q renormalised without its rejected
siblings, a matched child zeroed, the bonus drawn by inverting the residual's CDF over the
support and then the outside. Float64 throughout and sums in the reference's order, so every
acceptance and bonus is the reference walk's exactly. A step's walk costs a few microseconds
a walked row (`bench.walk`).

The kernels take their arrays grouped in plain tuples laid out as `treebatch`'s `NamedTuple`s
(`Children`, `WalkOut`, `TreeRows`): numba types a plain tuple about as fast as separate
arguments. `walk_rows` unpacks them once; its helpers take arrays, not the tuples, and are few
(a drawn child, the bonus): a call counts a reference to each array it passes, which a helper
per sibling (the normalisation) or unpacking a tuple per node made 30-50% of the kernel's time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tts_service.engine.verify import TINY


@njit(cache=True)
def _drawn_child(values, rest, tried, kid_q, m: int, size: int, x: int, outside: float, u: float):
    """Rule (c) for a drawn child at slot `x` (`verify.sparse_rrs_step`): its parent's q
    (`kid_q[m]`, on the support) without the rejected siblings (`tried`, `verify._without`)
    against the residual `values` (the outside's mass `outside`), accepted at the uniform `u`
    (returns True); rejected, `values` become the residual less q (unless it was q: every draft
    accepted)."""
    qt = 0.0
    for s in range(size):
        if not tried[s]:
            qt += kid_q[m, s]
    qx = kid_q[m, x] / qt if qt > 0 and not tried[x] else 0.0
    accept = min(1.0, values[x] / qx) if qx > 0 else 0.0
    left = 0.0
    for s in range(size):
        qs = kid_q[m, s] / qt if qt > 0 and not tried[s] else 0.0
        rest[s] = max(0.0, values[s] - qs)
        left += rest[s]
    same = left + outside <= TINY  # r == q_i: every draft accepted
    if same:
        accept = 1.0
    if u < accept:
        return True
    if not same:
        for s in range(size):
            values[s] = rest[s]
    return False


@njit(cache=True)
def _bonus_slot(values, size: int, outside: float, w: float) -> int:
    """The bonus (`verify._draw`): the support slot where the residual's CDF (`values[:size]`,
    then the `outside` mass) passes `w` × its total; -1: the outside's token."""
    total = 0.0
    for s in range(size):
        total += values[s]
    total += outside
    target, cum, last = w * total, 0.0, -1
    for s in range(size):
        if values[s] > 0:
            last = s
            cum += values[s]
            if target < cum:
                return s
    if outside > 0 or last < 0:
        return -1
    return last  # w × the total rounded past the support's mass and nothing is outside


@njit(cache=True)
def walk_rows(data, lens, ids, m_of, kids, out):
    """Every row's walk: `data` `[W, N, K + 4]` (per node p on its support, p's mass outside
    it, a token drawn from the outside, the uniforms u and w: `treebatch.gather_support`),
    `lens` `[W * N]` the supports' lengths, `ids` `[W, N, K]` their tokens; `m_of` `[W * N]`
    each node's row in the children grids (-1: no children), `kids` (`treebatch.Children`, a
    plain tuple) its children by rank and its q. Writes each row's accepted path, its length
    and bonus token into `out` (`treebatch.WalkOut`, a plain tuple)."""
    kid_node, kid_slot, kid_drawn, kid_q = kids
    path, plen, bonus = out
    rows, n, width = data.shape
    k = width - 4
    values = np.empty(max(k, 1), np.float64)
    rest = np.empty(max(k, 1), np.float64)
    tried = np.zeros(max(k, 1), np.bool_)
    for b in range(rows):
        node, depth = 0, 0
        while True:
            at = b * n + node
            size = lens[at]
            for s in range(size):
                values[s] = data[b, node, s]
            c, mass_out, chosen, m = 1.0, data[b, node, k], -1, m_of[at]
            if m >= 0:  # its children by rank
                for s in range(size):
                    tried[s] = False
                for j in range(kid_node.shape[1]):
                    child, x = kid_node[m, j], kid_slot[m, j]
                    if child < 0:
                        break
                    total = 0.0  # the residual normalised (`verify._normalised`)
                    for s in range(size):
                        total += values[s]
                    total += c * mass_out
                    if total > TINY:
                        for s in range(size):
                            values[s] = values[s] / total
                        c = c / total
                    u = data[b, child, k + 2]
                    if kid_drawn[m, j]:  # rule (c): `verify.sparse_rrs_step`
                        if _drawn_child(values, rest, tried, kid_q, m, size, x, c * mass_out, u):
                            chosen = child
                            break
                    elif u < values[x]:  # rule (b): `verify.sparse_match_step`
                        chosen = child
                        break
                    else:
                        values[x] = 0.0
                    tried[x] = True
            if chosen < 0:  # the bonus, from the residual left
                got = _bonus_slot(values, size, c * mass_out, data[b, node, k + 3])
                bonus[b] = ids[b, node, got] if got >= 0 else np.int64(data[b, node, k + 1])
                plen[b] = depth
                break
            path[b, depth] = chosen
            depth += 1
            node = chosen


@njit(cache=True)
def gather_rows(src, rows, at, dst):
    """Rows `rows` of one batch's arrays (`src`: `treebatch.TreeRows` of a `tree.DrawnBatch`,
    `drawn` `[*, 0]`: every child drawn) into rows `at` of `dst` (`TreeRows`, `layout_rows`'
    inputs; both plain tuples), their first N nodes (a tree's all lie there) and each node's
    support (past it the batch holds zeros, as `dst` does)."""
    parents, slot, sampled, q_len, q_ids, q_probs = src
    parent_to, slot_to, drawn_to, q_len_to, q_ids_to, q_probs_to = dst
    n, k = min(parent_to.shape[1], parents.shape[1]), q_ids.shape[2]
    for i in range(len(rows)):
        r, b = rows[i], at[i]
        for c in range(n):
            parent_to[b, c], slot_to[b, c], q_len_to[b, c] = parents[r, c], slot[r, c], q_len[r, c]
            drawn_to[b, c] = sampled[r, c] if sampled.shape[1] else True
            for j in range(min(q_len[r, c], k)):  # numba checks no bounds
                q_ids_to[b, c, j], q_probs_to[b, c, j] = q_ids[r, c, j], q_probs[r, c, j]


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
    out = (np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
    kids = (grid, grid, grid.astype(np.bool_), q)
    walk_rows(data, one, np.zeros((1, 1, 1), np.int64), none, kids, out)
    z, ids, probs = np.zeros((1, 1), np.int64), np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 1))
    drawn, at = np.ones((1, 1), np.bool_), np.zeros(1, np.int64)  # a one-node tree, all zeros
    tree = (z - 1, z, drawn, z, ids, probs)
    gather_rows(tree, at, at, tree)
    layout_rows(*tree, False)


if __name__ == "__main__":
    warm()
    print("the rule (c) walk and layout compiled")
