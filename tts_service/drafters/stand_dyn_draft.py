"""`StandDynDrafter.draft` compiled: the kernels that draft a step's `stand-dyn` trees
(`draft_rows`, called by `stand_kernel.StandDynGroup`).

`draft_tree` is `StandDynDrafter.draft` statement for statement: the same candidates
(`_candidates`: the store's longest entry, its back-off, the suffix counts, the successor
table), rates, heap order and stopping rule, and with `drawn` (under sampling) the same choice
of which nodes draw their children, drawn from the row's own `GumbelNoise` in the same order (a
step reads a window of it, as `stand_compiled` does, and says how far it read).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
from numba import njit

from store.hashtable import find_pair
from store.index import StoreArrays, lookup_slot
from tts_service.drafters.stand_compiled import NoiseWindow, NoiseWindows, gumbel_order, row_window
from tts_service.drafters.stand_dyn_arrays import (
    BINS,
    TAIL,
    CalibrationArrays,
    Successors,
    SuffixTable,
    count_suffixes,
    suffix_lookup,
)

MIN_SUFFIX = 4  # stand_dyn.MIN_SUFFIX
STORE, BACKOFF, SUFFIX, SUCCESSOR, DRAWN = range(5)  # a candidate's source (stand_dyn)
AGREE = 4  # stand_dyn.AGREE


class DraftSources(NamedTuple):
    """What a draft reads: the problem's store and suffix counts (which a step's rows count
    into first), the model's successor table and calibration."""

    store: StoreArrays
    suffix: SuffixTable
    successors: Successors
    calibration: CalibrationArrays


class NewTokens(NamedTuple):
    """What each row of a step counts (`SuffixIndex.advance`): row r the ends in
    [lo[r], hi[r]) of `seq[seq_at[r] : seq_at[r + 1]]`."""

    seq: np.ndarray
    seq_at: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class DraftRows(NamedTuple):
    """Each row's draft: from `tails[r, :tlens[r]]` at most `limits[r]` nodes, sized by cost
    `cost_of[r]` (-1: none), drawing children where `drawn[r]`."""

    tails: np.ndarray
    tlens: np.ndarray
    limits: np.ndarray
    cost_of: np.ndarray
    drawn: np.ndarray


class CostCurve(NamedTuple):
    """A verify cost's sizes and seconds (`VerifyCost`); empty: fill the budget."""

    xs: np.ndarray
    ys: np.ndarray


class CostCurves(NamedTuple):
    """A step's verify costs: cost c is `xs[c, :n[c]]`, `ys[c, :n[c]]`."""

    xs: np.ndarray
    ys: np.ndarray
    n: np.ndarray


class DynTrees(NamedTuple):
    """`draft_tree`'s output, `[N]` per node for one row (`[R, N]` for a step's rows): parent,
    token, candidate kind and q; per node that can have children (`[M]`, M one where no row
    draws: none is written) whether it drew them (`draws`), each child's drawn flag
    (`sampled`) and place in its parent's support (`slot`), and the support as
    `tree.DrawnBatch` holds it (`qn` its length, -1: none; `qids`, `qp` `[M, K]`); per row the
    noise it read (`noise_used`: 1 if it moved to the next buffer, values read from the one it
    ended in)."""

    parent: np.ndarray
    token: np.ndarray
    kind: np.ndarray
    q: np.ndarray
    draws: np.ndarray
    sampled: np.ndarray
    slot: np.ndarray
    qn: np.ndarray
    qids: np.ndarray
    qp: np.ndarray
    noise_used: np.ndarray

    @staticmethod
    def empty(rows: int, nodes: int, any_drawn: bool, width: int) -> DynTrees:
        """A step's buffers; parents -1 (past a tree's nodes: none). K is the store's top-k
        or a deterministic node's most children, whichever is more."""
        m, k = (nodes, max(width, nodes - 1)) if any_drawn else (1, 1)
        return DynTrees(
            np.full((rows, nodes), -1, np.int64), np.zeros((rows, nodes), np.int64),
            np.zeros((rows, nodes), np.int64), np.zeros((rows, nodes), np.float64),
            np.zeros((rows, m), np.bool_), np.zeros((rows, m), np.bool_),
            np.full((rows, m), -1, np.int64), np.full((rows, m), -1, np.int64),
            np.zeros((rows, m, k), np.int64), np.zeros((rows, m, k)),
            np.zeros((rows, 2), np.int64),
        )  # fmt: skip


class Candidates(NamedTuple):
    """Candidates as parallel arrays: token, kind, q and −α̂ (a node's, or every opened
    node's plan one after another)."""

    tok: np.ndarray
    kind: np.ndarray
    q: np.ndarray
    neg: np.ndarray


class NodeStates(NamedTuple):
    """Per tree node: its context tail (`[N, TAIL]`, `tlens` long), α̂, and where its
    candidates lie in the plans (`plan_at`, `plan_n` of them)."""

    tails: np.ndarray
    tlens: np.ndarray
    alpha: np.ndarray
    plan_at: np.ndarray
    plan_n: np.ndarray


class DrawScratch(NamedTuple):
    """A drawn plan's scratch: the positive stored probabilities, their Gumbel keys, the draw
    order, and the probabilities largest first."""

    p: np.ndarray
    keys: np.ndarray
    rank: np.ndarray
    sorted_q: np.ndarray


class Longest(NamedTuple):
    """A node's lookups: the store's longest entry (`slot` -1: none) and its order, and the
    longest counted suffix (`suffix_slot` -1: none) and its order."""

    slot: int
    order: int
    suffix_order: int
    suffix_slot: int


@njit(cache=True)
def _kind(source: int, order: int, count: int) -> int:
    """stand_dyn.KINDS[source][order][min(count, 4)]."""
    return (((source * 10 + order) * 5 + min(count, 4)) * 2) * 4


@njit(cache=True)
def _time(xs, ys, n: int) -> float:
    """VerifyCost.time."""
    if n <= xs[0]:
        return ys[0]
    i = min(np.searchsorted(xs, n), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


@njit(cache=True)
def _worth_growing(xs, ys, tree_tokens: int, expected: float, alpha: float, most: int) -> bool:
    """engine.cost.worth_growing."""
    if tree_tokens >= most:
        return False
    rate = expected / _time(xs, ys, tree_tokens)
    if (expected + alpha) / _time(xs, ys, tree_tokens + 1) > rate:
        return True
    for m in xs:
        if tree_tokens + 1 < m < most and (
            (expected + (m - tree_tokens) * alpha) / _time(xs, ys, m) > rate
        ):
            return True
    return (expected + (most - tree_tokens) * alpha) / _time(xs, ys, most) > rate


@njit(cache=True, inline="always")
def _inverse_mass(probs, s: int, n: int) -> float:
    """1 / the sum of row `s`'s first n probabilities (1 if it is 0), summed in order as
    the Python drafter sums them (`verify.ordered_sum`)."""
    total = 0.0
    for j in range(n):
        total += probs[s, j]
    return 1.0 / (total if total != 0.0 else 1.0)


@njit(cache=True)
def _found_at(f_tok, nf: int, token: int) -> int:
    for i in range(nf):
        if f_tok[i] == token:
            return i
    return -1


# -- a node's candidates -----------------------------------------------------------------------
@njit(cache=True)
def _flag(suffix: SuffixTable, ss: int, token: int, absent: int, named: int) -> int:
    """A token's suffix flag: `named` where the counts after suffix slot `ss` name it."""
    return named if named and find_pair(suffix.ptab, suffix.pk, ss, token) >= 0 else absent


@njit(cache=True)
def _entry_candidates(
    src: DraftSources, at: Longest, absent: int, named: int, found: Candidates
) -> int:
    """The longest stored entry's ids with a positive probability, first in `found`; how
    many."""
    store, slot = src.store, at.slot
    base = _kind(STORE, at.order, store.count[slot])
    inv = _inverse_mass(store.probs, slot, store.nids[slot])
    nf = 0
    for j in range(store.nids[slot]):
        p = store.probs[slot, j]
        if p > 0:
            token = store.ids[slot, j]
            flag = _flag(src.suffix, at.suffix_slot, token, absent, named)
            i = _found_at(found.tok, nf, token)
            if i < 0:
                i = nf
                nf += 1
            found.tok[i], found.kind[i], found.q[i] = token, base + flag, p * inv
    return nf


@njit(cache=True)
def _backoff_candidates(
    src: DraftSources, at: Longest, sh: int, sho: int, absent: int, named: int,
    found: Candidates, nf: int,
) -> int:  # fmt: skip
    """The next shorter stored entry (slot `sh`, order `sho`): whether its top choice agrees,
    then its ids the longest lacks; how many candidates now."""
    store = src.store
    top = store.ids[sh, 0] if store.nids[sh] > 0 else -1
    i = _found_at(found.tok, nf, top)
    if i >= 0:
        found.kind[i] += AGREE
    base = _kind(BACKOFF, sho, store.count[sh])
    inv = _inverse_mass(store.probs, sh, store.nids[sh])
    for j in range(store.nids[sh]):
        p = store.probs[sh, j]
        token = store.ids[sh, j]
        if p > 0 and _found_at(found.tok, nf, token) < 0:
            flag = _flag(src.suffix, at.suffix_slot, token, absent, named)
            found.tok[nf], found.kind[nf], found.q[nf] = token, base + flag, p * inv
            nf += 1
    return nf


@njit(cache=True)
def _suffix_candidates(
    suffix: SuffixTable, ss: int, kind: int, found: Candidates, nf: int, dedupe: bool
) -> int:
    """The tokens counted after suffix slot `ss` (with `dedupe` those not found yet), rated by
    their share of the count; how many candidates now."""
    inv = 1.0 / suffix.total[ss]
    i = suffix.head[ss]
    while i >= 0:
        if not dedupe or _found_at(found.tok, nf, suffix.pk[i, 1]) < 0:
            found.tok[nf], found.kind[nf] = suffix.pk[i, 1], kind
            found.q[nf] = suffix.icnt[i] * inv
            nf += 1
        i = suffix.inext[i]
    return nf


@njit(cache=True)
def _successor_candidates(
    src: DraftSources, last: int, at: Longest, absent: int, named: int, found: Candidates,
    nf: int,
) -> int:  # fmt: skip
    """The successor table's ids after token `last` not found yet; how many candidates now."""
    succ = src.successors
    base = _kind(SUCCESSOR, 0, 0)
    for j in range(succ.n[last]):
        p = succ.probs[last, j]
        token = succ.ids[last, j]
        if p > 0 and _found_at(found.tok, nf, token) < 0:
            flag = _flag(src.suffix, at.suffix_slot, token, absent, named)
            found.tok[nf], found.kind[nf], found.q[nf] = token, base + flag, p
            nf += 1
    return nf


@njit(cache=True)
def _rank_candidates(cal: CalibrationArrays, found: Candidates, nf: int) -> None:
    """Rate the nf candidates (−α̂ = −a − b·q of their key's line) and sort them best first:
    (−α̂, token), as Python sorts the tuples."""
    for i in range(nf):
        q = found.q[i]
        key = found.kind[i] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
        found.neg[i] = -cal.a[key] - cal.b[key] * q
    tok, kind, qs, neg = found
    for i in range(1, nf):
        nt, nk, nq, nn = tok[i], kind[i], qs[i], neg[i]
        j = i - 1
        while j >= 0 and (neg[j] > nn or (neg[j] == nn and tok[j] > nt)):
            tok[j + 1], kind[j + 1], qs[j + 1], neg[j + 1] = tok[j], kind[j], qs[j], neg[j]
            j -= 1
        tok[j + 1], kind[j + 1], qs[j + 1], neg[j + 1] = nt, nk, nq, nn


@njit(cache=True)
def _candidates(src: DraftSources, tail, tlen: int, at: Longest, found: Candidates) -> int:
    """`StandDynDrafter._ranked`: the node's candidates in `found` (best first by −α̂, then
    token; room for every one); returns how many."""
    n, ss = at.suffix_order, at.suffix_slot
    absent, named = 0, 0
    if n >= MIN_SUFFIX:
        absent, named = 1, 3 if n >= 8 else 2
    nf = 0
    if at.slot >= 0:
        sh, sho = -1, 0
        if at.order > 1:
            sh, sho = lookup_slot(src.store, tail, tlen, at.order - 1)
        nf = _entry_candidates(src, at, absent, named, found)
        if sh >= 0:
            nf = _backoff_candidates(src, at, sh, sho, absent, named, found, nf)
    if n >= MIN_SUFFIX:
        nf = _suffix_candidates(src.suffix, ss, _kind(SUFFIX, 0, 0) + named, found, nf, True)
    if nf == 0 and tlen > 0:
        if n:
            nf = _suffix_candidates(src.suffix, ss, _kind(SUFFIX, n, 0), found, nf, False)
        nf = _successor_candidates(src, tail[tlen - 1], at, absent, named, found, nf)
    _rank_candidates(src.calibration, found, nf)
    return nf


# -- drawn children ----------------------------------------------------------------------------
@njit(cache=True)
def _draws_first(src: DraftSources, slot: int, o: int, f_neg, nf: int) -> bool:
    """Whether a node whose longest stored entry is `slot` (order `o`) draws its children:
    `StandDynDrafter.drawn_first` rates the plan's first slot (the largest stored probability,
    normalised) at least as high as the best deterministic candidate `f_neg[0]` (or there is
    none)."""
    store, cal = src.store, src.calibration
    top = 0.0
    for j in range(store.nids[slot]):
        top = max(top, store.probs[slot, j])
    if top <= 0:
        return False
    q = top * _inverse_mass(store.probs, slot, store.nids[slot])
    key = _kind(DRAWN, o, store.count[slot]) * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
    return nf == 0 or -cal.a[key] - cal.b[key] * q <= f_neg[0]


@njit(cache=True)
def _draw_support(
    store: StoreArrays, slot: int, noise: NoiseWindow, pos: int, moved: bool,
    scratch: DrawScratch, tree: DynTrees, node: int,
) -> tuple[int, bool]:  # fmt: skip
    """A drawing node's support (the stored ids with a positive probability, its q) in
    `tree`, and their draw order in `scratch.rank`, the noise taken as `GumbelNoise.take`
    hands it; returns the noise's new (pos, moved)."""
    nc = 0
    for j in range(store.nids[slot]):
        if store.probs[slot, j] > 0:
            tree.qids[node, nc], tree.qp[node, nc] = store.ids[slot, j], store.probs[slot, j]
            scratch.p[nc] = store.probs[slot, j]
            nc += 1
    tree.qn[node] = nc
    return gumbel_order(scratch.p, nc, noise, pos, moved, scratch.keys, scratch.rank)


@njit(cache=True)
def _drawn_plan(
    c_ids, scratch: DrawScratch, nc: int, base: int, cal: CalibrationArrays, found: Candidates
) -> int:
    """`StandDynDrafter.drawn_plan` given the draw order `scratch.rank` of the `nc` stored
    ids `c_ids` (`gumbel_order`): the children in that order in `found`, slot j calibrated on
    the j-th largest normalised probability (kind `base` + min(j, 3)); returns nc."""
    c_p, qs = scratch.p, scratch.sorted_q
    total = 0.0
    for i in range(nc):
        total += c_p[i]
    inv = 1.0 / total
    for i in range(nc):  # largest first (insertion: a node has at most the store's top-k)
        q = c_p[i] * inv
        j = i - 1
        while j >= 0 and qs[j] < q:
            qs[j + 1] = qs[j]
            j -= 1
        qs[j + 1] = q
    for j in range(nc):
        q = qs[j]
        kind = base + min(j, 3)
        key = kind * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
        found.tok[j], found.kind[j] = c_ids[scratch.rank[j]], kind
        found.q[j], found.neg[j] = q, -cal.a[key] - cal.b[key] * q
    return nc


# -- the tree ----------------------------------------------------------------------------------
@njit(cache=True)
def _candidate_buffers(size: int) -> Candidates:
    return Candidates(
        np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.float64),
        np.empty(size, np.float64),
    )  # fmt: skip


@njit(cache=True)
def _with_room(found: Candidates, src: DraftSources, ss: int) -> Candidates:
    """`found`, or larger buffers where a node's candidates may not fit (distinct suffix
    tokens <= their total count)."""
    room = 2 * src.store.ids.shape[1] + src.successors.ids.shape[1]
    room += src.suffix.total[ss] if ss >= 0 else 0
    return _candidate_buffers(room) if room > found.tok.shape[0] else found


@njit(cache=True)
def _appended(plans: Candidates, used: int, found: Candidates, nf: int) -> Candidates:
    """`found[:nf]` written into the plans at `used` (grown where full)."""
    if used + nf > plans.tok.shape[0]:
        grow = max(2 * plans.tok.shape[0], used + nf)
        plans = Candidates(
            np.concatenate((plans.tok, np.empty(grow, np.int64))),
            np.concatenate((plans.kind, np.empty(grow, np.int64))),
            np.concatenate((plans.q, np.empty(grow, np.float64))),
            np.concatenate((plans.neg, np.empty(grow, np.float64))),
        )
    plans.tok[used : used + nf] = found.tok[:nf]
    plans.kind[used : used + nf] = found.kind[:nf]
    plans.q[used : used + nf] = found.q[:nf]
    plans.neg[used : used + nf] = found.neg[:nf]
    return plans


@njit(cache=True)
def _root(limit: int, root_tail, tree: DynTrees) -> NodeStates:
    """The node states of a tree of at most `limit` nodes past the root, which is set."""
    nodes = NodeStates(
        np.full((limit + 1, TAIL), -1, np.int64), np.zeros(limit + 1, np.int64),
        np.zeros(limit + 1, np.float64), np.zeros(limit + 1, np.int64),
        np.zeros(limit + 1, np.int64),
    )  # fmt: skip
    rl = len(root_tail)
    nodes.tails[0, :rl] = root_tail
    nodes.tlens[0] = rl
    nodes.alpha[0] = 1.0
    tree.parent[0], tree.token[0], tree.kind[0], tree.q[0] = -1, root_tail[rl - 1], -1, 0.0
    return nodes


@njit(cache=True)
def _open(
    src: DraftSources, nodes: NodeStates, node: int, drawn: bool, noise: NoiseWindow,
    pos: int, moved: bool, found: Candidates, scratch: DrawScratch, tree: DynTrees,
) -> tuple[int, int, bool, Candidates]:  # fmt: skip
    """A node's plan (its candidates, or with `drawn` its drawn children where they rate
    higher) in `found`: (how many, the noise's pos and moved, `found` or larger buffers)."""
    tail, tl = nodes.tails[node], nodes.tlens[node]
    slot, o = lookup_slot(src.store, tail, tl, src.store.max_order)
    n, ss = suffix_lookup(src.suffix, tail, tl)
    found = _with_room(found, src, ss)
    nf = _candidates(src, tail, tl, Longest(slot, o, n, ss), found)
    if drawn and slot >= 0 and _draws_first(src, slot, o, found.neg, nf):
        # `StandDynDrafter.drawn_plan`, the noise taken as `GumbelNoise.take` hands it
        pos, moved = _draw_support(src.store, slot, noise, pos, moved, scratch, tree, node)
        base = _kind(DRAWN, o, src.store.count[slot])
        nf = _drawn_plan(tree.qids[node], scratch, tree.qn[node], base, src.calibration, found)
        tree.draws[node] = True
    return nf, pos, moved, found


@njit(cache=True)
def _add_child(
    tree: DynTrees, nodes: NodeStates, plans: Candidates, node: int, c: int, child: int,
    drawn: bool, alpha: float,
) -> None:  # fmt: skip
    """Plan entry c as `node`'s next child (tree node `child`, α̂ `alpha`)."""
    token = plans.tok[c]
    tree.parent[child], tree.token[child] = node, token
    tree.kind[child], tree.q[child] = plans.kind[c], plans.q[c]
    if drawn:  # the child's place in its parent's support
        tree.sampled[child] = tree.draws[node]
        if tree.draws[node]:
            tree.slot[child] = _found_at(tree.qids[node], tree.qn[node], token)
        else:
            k = max(tree.qn[node], 0)
            tree.qids[node, k], tree.slot[child], tree.qn[node] = token, k, k + 1
    tails, tl = nodes.tails, nodes.tlens[node]
    if tl < TAIL:
        tails[child, :tl] = tails[node, :tl]
        tails[child, tl] = token
        nodes.tlens[child] = tl + 1
    else:
        tails[child, : TAIL - 1] = tails[node, 1:]
        tails[child, TAIL - 1] = token
        nodes.tlens[child] = TAIL
    nodes.alpha[child] = alpha


@njit(cache=True)
def draft_tree(
    src: DraftSources, root_tail, limit: int, cost: CostCurve, drawn: bool, noise: NoiseWindow,
    tree: DynTrees,
) -> int:  # fmt: skip
    """`StandDynDrafter.draft`: the tree in `tree` (node 0 the root); returns its size. `cost`
    empty: fill the budget. With `drawn`, a node may draw its children (`_drawn_plan`;
    `tree.draws`); each node's support is laid out as `tree.DrawnBatch` holds it: a drawing
    node's stored ids with a positive probability (`qp` its q), else its deterministic
    children's tokens (`qp` 0)."""
    nodes = _root(limit, root_tail, tree)
    plans, found = _candidate_buffers(64 * (limit + 1)), _candidate_buffers(64)
    width = src.store.ids.shape[1]
    scratch = DrawScratch(
        np.empty(width, np.float64), np.empty(width, np.float64), np.empty(width, np.int64),
        np.empty(width, np.float64),
    )  # fmt: skip
    used, pos, moved = 0, 0, False
    heap = [(-1.0, 0, -1)]
    expected, size = 1.0, 1
    sized = len(cost.xs) > 0
    while len(heap) > 0 and size <= limit:
        neg, node, rank = heapq.heappop(heap)
        if rank < 0:
            nf, pos, moved, found = _open(
                src, nodes, node, drawn, noise, pos, moved, found, scratch, tree
            )
            if nf > 0:
                plans = _appended(plans, used, found, nf)
                nodes.plan_at[node], nodes.plan_n[node] = used, nf
                used += nf
                heapq.heappush(heap, (nodes.alpha[node] * plans.neg[used - nf], node, 0))
            continue
        if sized and not _worth_growing(cost.xs, cost.ys, size, expected, -neg, limit + 1):
            break
        c = nodes.plan_at[node] + rank
        child = size
        _add_child(tree, nodes, plans, node, c, child, drawn, -neg)
        size += 1
        expected -= neg
        if rank + 1 < nodes.plan_n[node]:
            heapq.heappush(heap, (nodes.alpha[node] * plans.neg[c + 1], node, rank + 1))
        heapq.heappush(heap, (neg, child, -1))
    tree.noise_used[0], tree.noise_used[1] = moved, pos
    return size


@njit(cache=True)
def _row_trees(trees: DynTrees, r: int) -> DynTrees:
    """Row r's part of a step's buffers."""
    return DynTrees(
        trees.parent[r], trees.token[r], trees.kind[r], trees.q[r], trees.draws[r],
        trees.sampled[r], trees.slot[r], trees.qn[r], trees.qids[r], trees.qp[r],
        trees.noise_used[r],
    )  # fmt: skip


@njit(cache=True)
def draft_rows(
    src: DraftSources, counts: NewTokens, rows: DraftRows, costs: CostCurves,
    noise: NoiseWindows, trees: DynTrees, sizes,
) -> None:  # fmt: skip
    """Every row's suffix counting and tree, row after row, as the rows would run one by one:
    row r counts its new tokens (`counts`; the caller made room), then drafts (`rows`) into
    row r of `trees`, drawing from its noise window (`stand_compiled.noise_windows`)."""
    empty = np.zeros(0, np.float64)
    for r in range(len(rows.limits)):
        if counts.hi[r] > counts.lo[r]:
            seq = counts.seq[counts.seq_at[r] : counts.seq_at[r + 1]]
            count_suffixes(src.suffix, seq, counts.lo[r], counts.hi[r])
        c = rows.cost_of[r]
        xs = costs.xs[c, : costs.n[c]] if c >= 0 else empty
        ys = costs.ys[c, : costs.n[c]] if c >= 0 else empty
        sizes[r] = draft_tree(
            src, rows.tails[r, : rows.tlens[r]], rows.limits[r], CostCurve(xs, ys),
            rows.drawn[r], row_window(noise, r), _row_trees(trees, r),
        )  # fmt: skip
