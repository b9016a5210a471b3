"""`stand-dyn`'s draft kernels (numba): `draft_rows` drafts every row of a step's problem in one
call, `draft_tree` one row's tree, statement for statement as `StandDynDrafter.draft` grows it
(`stand_dyn_compiled` holds the arrays they read and the drafter that calls them).

Arrays arrive grouped in tuples laid out as the named tuples beside their owners
(`store.index.StoreIndex.arrays()`, `suffix_index.SuffixArrays`,
`stand_dyn_compiled.ModelArrays`, `RowInputs`, `stand_compiled.NoiseWindows`, `DynOut`), passed
plain: numba types a named tuple's fields one by one in Python at every call, a plain one by its
C fingerprint. A kernel unpacks them into names at its top.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
from numba import njit

from store.hashtable import find_pair
from store.index import lookup_slot
from tts_service.drafters.stand_compiled import gumbel_order, row_noise
from tts_service.drafters.stand_dyn_config import (
    AGREE,
    BACKOFF,
    BINS,
    DRAWN,
    MIN_SUFFIX,
    STORE,
    SUCCESSOR,
    SUFFIX,
    TAIL,
    candidate_kind,
)
from tts_service.drafters.suffix_index import count_ends, suffix_lookup

_candidate_kind = njit(cache=True)(candidate_kind)


@njit(cache=True)
def _kind(source: int, order: int, count: int) -> int:
    """`stand_dyn.KINDS[source][order][min(count, 4)]`."""
    return _candidate_kind(source, order, min(count, 4), 0, 0)


# -- the draft ---------------------------------------------------------------------------------
class DynOut(NamedTuple):
    """`draft_rows`' trees, per row and node `[R, M]` (`qids`, `qp` `[R, M, K]`): each node's
    parent (-1 past a tree), token, candidate kind and stored probability; with drawn children,
    whether it draws them (`draws`), whether it was drawn (`sampled`), its place in its parent's
    support (`slot`) and its own support (`qids[:qn]`: a drawing node's stored ids with a
    positive probability, `qp` its q; else its deterministic children's tokens, `qp` 0; `qn` -1:
    none). Kernels take a row's slices as a plain tuple in this order."""

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

    @staticmethod
    def empty(drawn: np.ndarray, nodes: int, width: int) -> DynOut:
        """Buffers for one tree a row, each of at most `nodes` nodes; the drawn ones `[R, 1]`
        where no row draws (none is written), else K the store's top-k or a deterministic
        node's most children, whichever is more."""
        rows = len(drawn)
        m, k = (nodes, max(width, nodes - 1)) if drawn.any() else (1, 1)
        return DynOut(
            np.full((rows, nodes), -1, np.int64),
            np.zeros((rows, nodes), np.int64),
            np.zeros((rows, nodes), np.int64),
            np.zeros((rows, nodes), np.float64),
            np.zeros((rows, m), np.bool_),
            np.zeros((rows, m), np.bool_),
            np.full((rows, m), -1, np.int64),
            np.full((rows, m), -1, np.int64),
            np.zeros((rows, m, k), np.int64),
            np.zeros((rows, m, k)),
        )


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


@njit(cache=True)
def _entry(ids, probs, nids, s: int, base: int, f_tok, f_kind, f_q, nf: int, overwrite: bool):
    """Stored entry `s`'s ids with a positive probability as candidates of kind `base`, their
    probability normalised over the entry: new ones appended, ones `f_tok[:nf]` holds
    overwritten (`overwrite`) or kept; returns how many candidates there are."""
    inv = _inverse_mass(probs, s, nids[s])
    for j in range(nids[s]):
        p, token = probs[s, j], ids[s, j]
        if p > 0:
            at = _found_at(f_tok, nf, token)
            if at < 0:
                at = nf
                nf += 1
            elif not overwrite:
                continue
            f_tok[at], f_kind[at], f_q[at] = token, base, p * inv
    return nf


@njit(cache=True)
def _suffix_flags(ptab, pk, ss: int, absent: int, named: int, f_tok, f_kind, lo: int, hi: int):
    """Candidates lo..hi-1 get their suffix flag (`stand_dyn.suffix_flags`): `named` if the
    suffix counts at `ss` name the token, else `absent`."""
    for i in range(lo, hi):
        hit = named > 0 and find_pair(ptab, pk, ss, f_tok[i]) >= 0
        f_kind[i] += named if hit else absent


@njit(cache=True)
def _counted(pk, icnt, inext, first: int, inv: float, kind: int, f_tok, f_kind, f_q, nf: int):
    """The suffix counts' tokens after one counted suffix (its items from `first` on; `inv`: 1 /
    its count) not among the `nf` candidates before them (its own are distinct), with `kind`
    and their share of the count; returns how many candidates there are."""
    before, i = nf, first
    while i >= 0:
        if _found_at(f_tok, before, pk[i, 1]) < 0:
            f_tok[nf], f_kind[nf], f_q[nf] = pk[i, 1], kind, icnt[i] * inv
            nf += 1
        i = inext[i]
    return nf


@njit(cache=True)
def _successors(succ_ids, succ_p, succ_n, last: int, base: int, f_tok, f_kind, f_q, nf: int):
    """The successor table's tokens after `last` not yet among the candidates; returns how
    many candidates there are."""
    for j in range(succ_n[last]):
        p, token = succ_p[last, j], succ_ids[last, j]
        if p > 0 and _found_at(f_tok, nf, token) < 0:
            f_tok[nf], f_kind[nf], f_q[nf] = token, base, p
            nf += 1
    return nf


@njit(cache=True)
def _rank(la, lb, f_tok, f_kind, f_q, f_neg, nf: int) -> None:
    """Rate the candidates (−α̂ = −a − b·q of the key's line) and sort them best first:
    (−α̂, token), as Python sorts the tuples."""
    for i in range(nf):
        q = f_q[i]
        key = f_kind[i] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
        f_neg[i] = -la[key] - lb[key] * q
    for i in range(1, nf):  # insertion
        nt, nk, nq, nn = f_tok[i], f_kind[i], f_q[i], f_neg[i]
        j = i - 1
        while j >= 0 and (f_neg[j] > nn or (f_neg[j] == nn and f_tok[j] > nt)):
            f_tok[j + 1], f_kind[j + 1], f_q[j + 1], f_neg[j + 1] = (
                f_tok[j],
                f_kind[j],
                f_q[j],
                f_neg[j],
            )
            j -= 1
        f_tok[j + 1], f_kind[j + 1], f_q[j + 1], f_neg[j + 1] = nt, nk, nq, nn


@njit(cache=True)
def _candidates(
    tab, keytok, ids, probs, nids, count, meta, total, head, ptab, pk, icnt, inext,
    succ_ids, succ_p, succ_n, la, lb, tail, tlen, slot, o, n, ss, f_tok, f_kind, f_q, f_neg,
):  # fmt: skip
    """`StandDynDrafter._ranked`: the node's candidates in f_* (best first by −α̂, then
    token; room for every one); returns how many. `slot`, `o`: the store's longest entry (-1:
    none); `n`, `ss`: the longest counted suffix (`suffix_lookup`). Its arrays arrive one by
    one (`KNOWN` in tests/unit/test_structure.py): it runs at every opened node, where
    unpacking the groups' tuples counts a reference to each of their arrays (numba's reference
    counts: the kernel ran 1.3-1.6x slower)."""
    absent, named = (1, 3 if n >= 8 else 2) if n >= MIN_SUFFIX else (0, 0)
    nf = 0
    if slot >= 0:
        nf = _entry(
            ids, probs, nids, slot, _kind(STORE, o, count[slot]), f_tok, f_kind, f_q, 0, True
        )
        sh, sho = lookup_slot(tab, keytok, meta, tail, tlen, o - 1) if o > 1 else (-1, 0)
        if sh >= 0:
            at = _found_at(f_tok, nf, ids[sh, 0] if nids[sh] > 0 else -1)
            if at >= 0:
                f_kind[at] += AGREE
            base = _kind(BACKOFF, sho, count[sh])
            nf = _entry(ids, probs, nids, sh, base, f_tok, f_kind, f_q, nf, False)
    _suffix_flags(ptab, pk, ss, absent, named, f_tok, f_kind, 0, nf)
    if n >= MIN_SUFFIX:
        kind = _kind(SUFFIX, 0, 0) + named
        nf = _counted(pk, icnt, inext, head[ss], 1.0 / total[ss], kind, f_tok, f_kind, f_q, nf)
    if nf == 0 and tlen > 0:
        if n:
            kind = _kind(SUFFIX, n, 0)
            nf = _counted(pk, icnt, inext, head[ss], 1.0 / total[ss], kind, f_tok, f_kind, f_q, 0)
        lo, base = nf, _kind(SUCCESSOR, 0, 0)
        nf = _successors(succ_ids, succ_p, succ_n, tail[tlen - 1], base, f_tok, f_kind, f_q, nf)
        _suffix_flags(ptab, pk, ss, absent, named, f_tok, f_kind, lo, nf)
    _rank(la, lb, f_tok, f_kind, f_q, f_neg, nf)
    return nf


@njit(cache=True)
def _draws_first(probs, nids, count, la, lb, slot: int, o: int, f_neg, nf: int) -> bool:
    """Whether a node whose longest stored entry is `slot` (order `o`) draws its children:
    `StandDynDrafter.drawn_first` rates the plan's first slot (the largest stored probability,
    normalised) at least as high as the best deterministic candidate `f_neg[0]` (or there is
    none)."""
    top = 0.0
    for j in range(nids[slot]):
        top = max(top, probs[slot, j])
    if top <= 0:
        return False
    q = top * _inverse_mass(probs, slot, nids[slot])
    key = _kind(DRAWN, o, count[slot]) * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
    return nf == 0 or -la[key] - lb[key] * q <= f_neg[0]


@njit(cache=True)
def _drawn_plan(c_ids, c_p, nc: int, rank, base: int, la, lb, found, qs) -> int:
    """`StandDynDrafter.drawn_plan` given the draw order `rank` of the `nc` stored ids
    (`gumbel_order`): the children in that order in `found` (tokens, kinds, q, −α̂), slot j
    calibrated on the j-th largest normalised probability (kind `base` + min(j, 3), sorted in
    `qs`); returns nc."""
    f_tok, f_kind, f_q, f_neg = found
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
        f_tok[j], f_kind[j], f_q[j], f_neg[j] = c_ids[rank[j]], kind, q, -la[key] - lb[key] * q
    return nc


@njit(cache=True)
def _found_arrays(size: int):
    """Room for `size` candidates: (tokens, kinds, q, −α̂)."""
    return (
        np.empty(size, np.int64),
        np.empty(size, np.int64),
        np.empty(size, np.float64),
        np.empty(size, np.float64),
    )


@njit(cache=True)
def _draw_children(src, slot: int, o: int, node: int, draw, found, noise, at, out):
    """`StandDynDrafter.drawn_plan` at `node`, whose longest stored entry is `slot` (order
    `o`): its support (the stored ids with a positive probability) in `out` (`DynOut`'s row
    slices), the children in their Gumbel order from the row's noise (`at`: read so far, moved
    on) in `found`, with the scratch `draw` (`_draw_arrays`); returns (how many, the noise's
    new (pos, moved)). Once per drawing node."""
    ids, probs, nids, count = src[0][2], src[0][3], src[0][4], src[0][5]
    la, lb = src[2][3], src[2][4]
    draws, qn, qids, qp = out[4], out[7], out[8], out[9]
    c_p, keys, by_key, sorted_q = draw
    nc = 0
    for j in range(nids[slot]):
        if probs[slot, j] > 0:
            qids[node, nc], qp[node, nc] = ids[slot, j], probs[slot, j]
            c_p[nc] = probs[slot, j]
            nc += 1
    qn[node] = nc
    cur, rem, nxt, _ = noise
    pos, moved = gumbel_order(c_p, nc, cur, rem, nxt, at[0], at[1], keys, by_key)
    base = _kind(DRAWN, o, count[slot])
    nf = _drawn_plan(qids[node], c_p, nc, by_key, base, la, lb, found, sorted_q)
    draws[node] = True
    return nf, pos, moved


@njit(cache=True)
def _grown(plan, size: int):
    """The plan's arrays with room for at least `size` candidates."""
    more = _found_arrays(max(2 * plan[0].shape[0], size))
    return (
        np.concatenate((plan[0], more[0])),
        np.concatenate((plan[1], more[1])),
        np.concatenate((plan[2], more[2])),
        np.concatenate((plan[3], more[3])),
    )


@njit(cache=True)
def _support_slot(draws, sampled, slot, qn, qids, node: int, child: int, token: int) -> None:
    """With drawn children: `child`'s place in its parent `node`'s support (a deterministic
    child's token joins it)."""
    sampled[child] = draws[node]
    if draws[node]:
        slot[child] = _found_at(qids[node], qn[node], token)
    else:
        k = max(qn[node], 0)
        qids[node, k], slot[child], qn[node] = token, k, k + 1


@njit(cache=True)
def _extend_tail(tails, tlens, node: int, child: int, token: int) -> None:
    """`child`'s tail: its parent's, then its token (the last TAIL tokens)."""
    tl = tlens[node]
    if tl < TAIL:
        tails[child, :tl] = tails[node, :tl]
        tails[child, tl] = token
        tlens[child] = tl + 1
    else:
        tails[child, : TAIL - 1] = tails[node, 1:]
        tails[child, TAIL - 1] = token
        tlens[child] = TAIL


@njit(cache=True)
def _append(p_tok, p_kind, p_q, p_neg, f_tok, f_kind, f_q, f_neg, used: int, nf: int) -> None:
    """The `nf` candidates into the plan from `used` on."""
    p_tok[used : used + nf] = f_tok[:nf]
    p_kind[used : used + nf] = f_kind[:nf]
    p_q[used : used + nf] = f_q[:nf]
    p_neg[used : used + nf] = f_neg[:nf]


@njit(cache=True)
def _draw_arrays(width: int):
    """A drawn plan's scratch, one slot per stored id: positive stored probabilities, Gumbel
    keys, draw order, probabilities largest first."""
    return (
        np.empty(width, np.float64),
        np.empty(width, np.float64),
        np.empty(width, np.int64),
        np.empty(width, np.float64),
    )


@njit(cache=True)
def _node_arrays(limit: int, root_tail):
    """Per node: its tail (the root's set), the tail's length, α̂ (the root's 1), its
    candidates' start in the plan and how many."""
    tails = np.full((limit + 1, TAIL), -1, np.int64)
    tlens, alpha = np.zeros(limit + 1, np.int64), np.zeros(limit + 1, np.float64)
    tails[0, : len(root_tail)] = root_tail
    tlens[0], alpha[0] = len(root_tail), 1.0
    return tails, tlens, alpha, np.zeros(limit + 1, np.int64), np.zeros(limit + 1, np.int64)


@njit(cache=True)
def draft_tree(src, root_tail, limit: int, cost, drawn: bool, noise, out) -> int:
    """`StandDynDrafter.draft`: the tree in `out` (a row's `DynOut` slices; node 0 the root);
    returns its size. `src`: (store, suffix, model) arrays, unpacked once here (the per-node
    work takes arrays); `cost`: the verify cost's sizes and seconds (empty: fill the budget).
    With `drawn`, a node may draw its children (`_draw_children`) from the row's `noise`
    (`stand_compiled.row_noise`, which gets how far it read). The plan holds every opened
    node's candidates, flat."""
    tab, keytok, ids, probs, nids, count, meta, max_order = src[0]
    stab, skt, total, head, ptab, pk, icnt, inext, _ = src[1]
    succ_ids, succ_p, succ_n, la, lb = src[2]
    parent, token, kind, q, draws, sampled, slot, qn, qids, _ = out
    tails, tlens, alpha, plan_at, plan_n = _node_arrays(limit, root_tail)
    p_tok, p_kind, p_q, p_neg = _found_arrays(64 * (limit + 1))
    f_tok, f_kind, f_q, f_neg = _found_arrays(64)
    xs, ys, draw = cost[0], cost[1], _draw_arrays(ids.shape[1])
    parent[0], token[0], kind[0], q[0] = -1, root_tail[len(root_tail) - 1], -1, 0.0
    heap = [(-1.0, 0, -1)]
    expected, size, used, pos, moved = 1.0, 1, 0, 0, False
    while len(heap) > 0 and size <= limit:
        neg, node, rank = heapq.heappop(heap)
        if rank < 0:  # open the node: rank its candidates (or draw its children)
            tail, tl = tails[node], tlens[node]
            s, o = lookup_slot(tab, keytok, meta, tail, tl, max_order)
            n, ss = suffix_lookup(stab, skt, tail, tl)
            room = 2 * ids.shape[1] + succ_ids.shape[1] + (total[ss] if ss >= 0 else 0)
            if room > f_tok.shape[0]:  # distinct suffix tokens <= their total count
                f_tok, f_kind, f_q, f_neg = _found_arrays(room)
            nf = _candidates(
                tab, keytok, ids, probs, nids, count, meta, total, head, ptab, pk, icnt, inext,
                succ_ids, succ_p, succ_n, la, lb, tail, tl, s, o, n, ss, f_tok, f_kind, f_q, f_neg,
            )  # fmt: skip
            if drawn and s >= 0 and _draws_first(probs, nids, count, la, lb, s, o, f_neg, nf):
                found, at = (f_tok, f_kind, f_q, f_neg), (pos, moved)
                nf, pos, moved = _draw_children(src, s, o, node, draw, found, noise, at, out)
            if nf > 0:
                if used + nf > p_tok.shape[0]:
                    p_tok, p_kind, p_q, p_neg = _grown((p_tok, p_kind, p_q, p_neg), used + nf)
                _append(p_tok, p_kind, p_q, p_neg, f_tok, f_kind, f_q, f_neg, used, nf)
                plan_at[node], plan_n[node] = used, nf
                used += nf
                heapq.heappush(heap, (alpha[node] * f_neg[0], node, 0))
            continue
        if len(xs) > 0 and not _worth_growing(xs, ys, size, expected, -neg, limit + 1):
            break
        c = plan_at[node] + rank
        t = p_tok[c]
        parent[size], token[size], kind[size], q[size] = node, t, p_kind[c], p_q[c]
        if drawn:
            _support_slot(draws, sampled, slot, qn, qids, node, size, t)
        _extend_tail(tails, tlens, node, size, t)
        alpha[size], expected = -neg, expected - neg
        if rank + 1 < plan_n[node]:
            heapq.heappush(heap, (alpha[node] * p_neg[c + 1], node, rank + 1))
        heapq.heappush(heap, (neg, size, -1))
        size += 1
    noise[3][0], noise[3][1] = moved, pos
    return size


class RowInputs(NamedTuple):
    """What `draft_rows` drafts each row r from (a plain tuple in this order): the tokens it
    counts (`seq[seq_at[r] : seq_at[r + 1]]`, ends in [lo[r], hi[r])), its root's tail
    (`tails[r, :tlens[r]]`), its node budget, whether it draws children, and its verify cost
    (`cost_of[r]` a row of `cost_xs`/`cost_ys`, `cost_n` long; -1: none)."""

    seq: np.ndarray
    seq_at: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    tails: np.ndarray
    tlens: np.ndarray
    limits: np.ndarray
    drawn: np.ndarray
    cost_xs: np.ndarray
    cost_ys: np.ndarray
    cost_n: np.ndarray
    cost_of: np.ndarray


@njit(cache=True)
def draft_rows(src, rows, noise, used, out, sizes) -> None:
    """Every row's suffix counting and tree, row after row, as the rows would run one by one
    (`rows`: `RowInputs`; `noise` as `stand_compiled.noise_windows` lays it out, `used[r]`
    gets how far row r read; `out`: `DynOut`)."""
    seq, seq_at, lo, hi, tails, tlens, limits, drawn, cost_xs, cost_ys, cost_n, cost_of = rows
    empty = np.zeros(0, np.float64)
    for r in range(len(limits)):
        if hi[r] > lo[r]:
            count_ends(src[1], seq[seq_at[r] : seq_at[r + 1]], lo[r], hi[r])
        c = cost_of[r]
        cost = (cost_xs[c, : cost_n[c]], cost_ys[c, : cost_n[c]]) if c >= 0 else (empty, empty)
        row_out = (
            out[0][r], out[1][r], out[2][r], out[3][r], out[4][r],
            out[5][r], out[6][r], out[7][r], out[8][r], out[9][r],
        )  # fmt: skip
        sizes[r] = draft_tree(
            src, tails[r, : tlens[r]], limits[r], cost, drawn[r], row_noise(noise, used, r), row_out
        )
