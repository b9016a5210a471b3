"""Rule (c)'s host walk compiled: `verify.walk_sparse` for every walked row of a step in one
numba call, from the step's one copy back (`treebatch.walk_sparse_all` calls it).

The walk is the reference's, operation for operation: each node's residual normalised by its
sum taken in support order, a drawn child's proposal q renormalised without its rejected
siblings, a matched child zeroed, the bonus drawn by inverting the residual's CDF over the
support and then the outside. Float64 throughout and sums in the reference's order, so every
acceptance and bonus is the reference walk's exactly. A step's walk costs microseconds per row
where the array version (`treebatch`'s fallback without numba) costs 0.25–0.94 ms at 4–48
walked rows (`bench.walk`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_TINY = 1e-300  # verify._TINY


@njit(cache=True)
def walk_rows(data, lens, ids, m_of, kid_node, kid_slot, kid_drawn, kid_q, path, plen, bonus):
    """Every row's walk: `data` `[W, N, K + 4]` (per node p on its support, p's mass outside
    it, a token drawn from the outside, the uniforms u and w: `treebatch.gather_support`),
    `lens` `[W * N]` the supports' lengths, `ids` `[W, N, K]` their tokens; `m_of` `[W * N]`
    each node's row in the children grids (-1: no children), whose `[M, J]` rows hold its
    children by rank (`kid_node`: node index, -1 past the last; `kid_slot`: the child's token's
    slot in the support; `kid_drawn`) and `kid_q` `[M, K]` its q on the support (0 outside
    q). Writes each row's accepted path (`path` `[W, N]`, `plen` `[W]`) and bonus token."""
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
            c = 1.0
            mass_out = data[b, node, k]
            chosen = -1
            m = m_of[at]
            if m >= 0:
                for s in range(size):
                    tried[s] = False
                for j in range(kid_node.shape[1]):
                    child = kid_node[m, j]
                    if child < 0:
                        break
                    x = kid_slot[m, j]
                    total = 0.0  # the residual normalised (`verify._normalised`)
                    for s in range(size):
                        total += values[s]
                    total += c * mass_out
                    if total > _TINY:
                        for s in range(size):
                            values[s] = values[s] / total
                        c = c / total
                    if kid_drawn[m, j]:  # rule (c): `verify.sparse_rrs_step`
                        qt = 0.0  # q without the rejected siblings (`verify._without`)
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
                        same = left + c * mass_out <= _TINY  # r == q_i: every draft accepted
                        if same:
                            accept = 1.0
                        if data[b, child, k + 2] < accept:
                            chosen = child
                            break
                        if not same:
                            for s in range(size):
                                values[s] = rest[s]
                    else:  # rule (b): `verify.sparse_match_step`
                        if data[b, child, k + 2] < values[x]:
                            chosen = child
                            break
                        values[x] = 0.0
                    tried[x] = True
            if chosen >= 0:
                path[b, depth] = chosen
                depth += 1
                node = chosen
                continue
            outside = c * mass_out  # the bonus (`verify._draw`)
            total = 0.0
            for s in range(size):
                total += values[s]
            total += outside
            target, cum, last, got = data[b, node, k + 3] * total, 0.0, -1, -1
            for s in range(size):
                if values[s] > 0:
                    last = s
                    cum += values[s]
                    if target < cum:
                        got = s
                        break
            if got >= 0:
                bonus[b] = ids[b, node, got]
            elif outside > 0 or last < 0:
                bonus[b] = np.int64(data[b, node, k + 1])
            else:
                bonus[b] = ids[b, node, last]
            plen[b] = depth
            break


def warm() -> None:
    """Compile (or load) the kernel once, on a one-node tree."""
    data = np.zeros((1, 1, 5))
    data[0, 0, 0], data[0, 0, 1] = 1.0, 0.0
    one, none = np.ones(1, np.int64), np.full(1, -1, np.int64)
    grid, q = np.zeros((0, 1), np.int64), np.zeros((0, 1))
    path, plen, bonus = np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    walk_rows(
        data, one, np.zeros((1, 1, 1), np.int64), none, grid, grid, grid.astype(np.bool_), q,
        path, plen, bonus,
    )  # fmt: skip


if __name__ == "__main__":
    warm()
    print("the rule (c) walk compiled")
