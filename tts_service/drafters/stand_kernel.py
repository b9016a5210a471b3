"""`stand-dyn` drafting compiled: the same trees as `StandDynDrafter`, drafted by one numba
call per row-step instead of ~10 Python candidate lists per opened node (docs/design.md, "The
compiled drafter"; issue 27's host budget).

Everything the Python drafter reads lives here as arrays a kernel can walk without the
interpreter:

* the problem's store: `InMemoryNgramStore.compiled()`, where its entries live from then on;
* the suffix counts over the problem's trajectories (`SuffixIndex`, `SuffixCounts`' rule);
* the successor table's unigram tier (`SuccessorIndex`, `AdjacencyTable` as `stand-dyn` uses
  it) and the calibration (`CalibrationIndex`, `AcceptanceCalibration`'s lines), per model.

`draft_tree` is `StandDynDrafter.draft` statement for statement: the same candidates, rates, heap
order and stopping rule, and with `drawn` (under sampling) the same choice of which nodes draw their
children, drawn from the row's own `GumbelNoise` in the same order (a step reads a window of it, as
`stand_compiled` does, and says how far it read), so a tree is identical to the Python drafter's,
node for node, its drawn flags and q included (tests compare them through the runner). Where it does
not apply (a Redis or tiered store, a noise buffer smaller than a step can read, numba missing) the
Python drafter runs (`stand_dyn._build`). Kernels are cached on disk (`cache=True`): the first run
after an install compiles them (`python -m tts_service.drafters.stand_kernel` does it ahead,
`scripts/setup.sh` runs it); later processes load them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
from numba import njit

from store.base import NgramRow, NgramStore
from store.hashtable import find_ngram, find_pair, insert_ngram, insert_pair, new_table, room
from store.index import StoreIndex, lookup_slot
from tts_service.drafters.gumbel import GumbelNoise
from tts_service.drafters.stand_compiled import gumbel_order, noise_windows
from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig
from tts_service.drafters.store_feed import feed_index, feed_root, learned_nodes
from tts_service.engine import walk_compiled
from tts_service.engine.cost import VerifyCost, VerifyCostSource
from tts_service.engine.seam import Deferred, DraftContext, NodeTopK
from tts_service.engine.tree import DraftTree, DrawnArrays, DrawnBatch, DrawnQ
from tts_service.engine.verify import Acceptance

TAIL = 12  # tokens of context a node keeps (stand_dyn.TAIL)
ORDERS = np.array((12, 8, 6, 5, 4, 3, 2, 1), np.int64)  # stand_dyn.SUFFIX_ORDERS
MIN_SUFFIX = 4
STORE, BACKOFF, SUFFIX, SUCCESSOR, DRAWN = range(5)
AGREE = 4  # stand_dyn.AGREE
BINS = 10
KINDS = ((((4 * 10 + 8) * 5 + 4) * 2 + 1) * 4 + 3) + 1  # candidate kinds (stand_dyn)


@njit(cache=True)
def _kind(source: int, order: int, count: int) -> int:
    """stand_dyn.KINDS[source][order][min(count, 4)]."""
    return (((source * 10 + order) * 5 + min(count, 4)) * 2) * 4


# -- suffix counts -----------------------------------------------------------------------------
@njit(cache=True)
def _count(stab, skt, total, head, ptab, pk, icnt, inext, meta, d, lo: int, hi: int) -> None:
    """Count, for every end in [lo, hi), the token after each order's n-gram ending at `end`
    (`SuffixCounts.sync`'s loop); `d` holds the document from index 0. Items (one per
    (n-gram, next token)) hang off their n-gram's slot in a list (`head`, `inext`)."""
    for end in range(lo, hi):
        token = d[end + 1]
        for n in ORDERS:
            if end + 1 >= n:
                s = find_ngram(stab, skt, d, end + 1, n)
                if s < 0:
                    s = meta[0]
                    meta[0] += 1
                    insert_ngram(stab, skt, d, end + 1, n, s)
                    total[s], head[s] = 0, -1
                total[s] += 1
                i = find_pair(ptab, pk, s, token)
                if i >= 0:
                    icnt[i] += 1
                else:
                    i = meta[1]
                    meta[1] += 1
                    insert_pair(ptab, pk, s, token, i)
                    icnt[i], inext[i] = 1, head[s]
                    head[s] = i


@njit(cache=True)
def _suffix_lookup(stab, skt, tail, tlen: int) -> tuple[int, int]:
    """(n, slot) of the longest counted suffix of `tail[:tlen]`; (0, -1) if none."""
    for n in ORDERS:
        if tlen >= n:
            s = find_ngram(stab, skt, tail, tlen, n)
            if s >= 0:
                return n, s
    return 0, -1


class SuffixIndex:
    """`SuffixCounts` (next-token counts after every 1..12-gram of a problem's documents, with
    its memory bound) as arrays; one per problem. It keeps each document's length, not its
    tokens: a document is the row's own token list, passed in at every draft."""

    def __init__(self, max_tokens: int = 1 << 17) -> None:
        self.max_tokens = max_tokens
        self.size = 0
        self.lengths: list[int] = []  # per doc: tokens seen
        self._indexed: list[int] = []  # per doc: n-grams ending before this are counted
        self._reset()

    def _reset(self, slots: int = 4096) -> None:
        self.stab, self.ptab = new_table(slots), new_table(slots)
        self.meta = np.zeros(2, np.int64)  # slots used, items used
        self.skt = np.zeros((slots, 1 + TAIL), np.int64)  # slot -> its n-gram
        self.total = np.zeros(slots, np.int64)
        self.head = np.full(slots, -1, np.int64)
        self.pk = np.zeros((slots, 2), np.int64)  # item -> (slot, token)
        self.icnt = np.zeros(slots, np.int64)
        self.inext = np.full(slots, -1, np.int64)

    def room(self, new: int) -> None:
        """Make room for counting `new` more positions (at most one slot and one item per
        order each)."""
        add = new * len(ORDERS)
        for used, names in ((0, ("skt", "total", "head")), (1, ("pk", "icnt", "inext"))):
            need = int(self.meta[used]) + add
            cur = getattr(self, names[0])
            if need > cur.shape[0]:
                size = max(need, 2 * cur.shape[0])
                for name in names:
                    old = getattr(self, name)
                    fill = -1 if name in ("head", "inext") else 0
                    arr = np.full((size, *old.shape[1:]), fill, np.int64)
                    arr[: old.shape[0]] = old
                    setattr(self, name, arr)
        self.stab = room(self.stab, self.skt, int(self.meta[0]), add)
        self.ptab = room(self.ptab, self.pk, int(self.meta[1]), add, pairs=True)

    def arrays(self) -> tuple:
        return (
            self.stab, self.skt, self.total, self.head, self.ptab, self.pk, self.icnt,
            self.inext, self.meta,
        )  # fmt: skip

    def new_doc(self) -> int:
        self.lengths.append(0)
        self._indexed.append(0)
        return len(self.lengths) - 1

    def needs_reset(self, doc: int, length: int) -> bool:
        """Whether syncing `doc` to `length` tokens passes the memory bound (`SuffixCounts`:
        then every count is dropped and only this document is counted again)."""
        known = self.lengths[doc]
        return self.size + length - known > self.max_tokens and self.size > known

    def reset_for(self, doc: int) -> None:
        self._reset()
        for i in range(len(self.lengths)):
            if i != doc:
                self.lengths[i] = 0
            self._indexed[i] = 0
        self.size = self.lengths[doc]

    def advance(self, doc: int, tokens: Sequence[int]) -> tuple[list[int], int, int]:
        """Book `tokens` (the document so far) as synced; returns what `_count` counts: the
        tokens from the first one a new n-gram needs, and the range of ends in them."""
        self.size += len(tokens) - self.lengths[doc]
        self.lengths[doc] = len(tokens)
        lo, hi = self._indexed[doc], len(tokens) - 1
        self._indexed[doc] = max(lo, hi)
        if hi <= lo:
            return [], 0, 0
        start = max(0, lo + 1 - TAIL)  # the longest n-gram ending at lo + 1
        return list(tokens[start:]), lo - start, hi - start

    def sync(self, doc: int, tokens: Sequence[int]) -> None:
        """`SuffixCounts.sync`: count what is new in `doc` (`tokens`: the document so far)."""
        if self.needs_reset(doc, len(tokens)):
            self.reset_for(doc)
        seq, lo, hi = self.advance(doc, tokens)
        if hi > lo:
            self.room(hi - lo)
            _count(*self.arrays(), np.array(seq, np.int64), lo, hi)

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int]]:
        """`SuffixCounts.lookup`: (n, token -> count) of the longest counted suffix (tests)."""
        tail = np.array(list(context)[-TAIL:], np.int64)
        n, s = _suffix_lookup(self.stab, self.skt, tail, len(tail))
        counts: dict[int, int] = {}
        i = int(self.head[s]) if s >= 0 else -1
        while i >= 0:
            counts[int(self.pk[i, 1])] = int(self.icnt[i])
            i = int(self.inext[i])
        return n, counts


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
        size = KINDS * BINS
        self.drawn = np.zeros(size, np.float64)
        self.hits = np.zeros(size, np.float64)
        self.a = np.zeros(size, np.float64)
        self.b = np.full(size, prior_scale, np.float64)


@njit(cache=True)
def _record(drawn, hits, la, lb, kinds, qs, parents, on_path, size: int, w: float, s: float):
    """`StandDynDrafter._learn`'s calibration part: every node whose parent was reached."""
    for v in range(1, size):
        p = parents[v]
        if p == 0 or on_path[p]:
            q = qs[v]
            key = kinds[v] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
            drawn[key] += 1.0
            hits[key] += 1.0 if on_path[v] else 0.0
            la[key] = (hits[key] + w * 0.0) / (drawn[key] + w)
            lb[key] = (0.0 + w * s) / (drawn[key] + w)


# -- the draft ---------------------------------------------------------------------------------
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
def _candidates(
    tab, keytok, ids, probs, nids, count, meta, max_order,
    stab, skt, total, head, ptab, pk, icnt, inext,
    succ_ids, succ_p, succ_n, la, lb,
    tail, tlen, slot, o, n, ss, f_tok, f_kind, f_q, f_neg,
):  # fmt: skip
    """`StandDynDrafter._ranked`: the node's candidates in f_* (best first by −α̂, then
    token; room for every one); returns how many. `slot`, `o`: the store's longest entry (-1:
    none); `n`, `ss`: the longest counted suffix (`_suffix_lookup`)."""
    absent, named = 0, 0
    if n >= MIN_SUFFIX:
        absent, named = 1, 3 if n >= 8 else 2
    nf = 0
    if slot >= 0:
        sh, sho = -1, 0
        if o > 1:
            sh, sho = lookup_slot(tab, keytok, meta, tail, tlen, o - 1)
        base = _kind(STORE, o, count[slot])
        inv = _inverse_mass(probs, slot, nids[slot])
        for j in range(nids[slot]):
            p = probs[slot, j]
            if p > 0:
                token = ids[slot, j]
                flag = named if named and find_pair(ptab, pk, ss, token) >= 0 else absent
                at = _found_at(f_tok, nf, token)
                if at < 0:
                    at = nf
                    nf += 1
                f_tok[at], f_kind[at], f_q[at] = token, base + flag, p * inv
        if sh >= 0:
            top = ids[sh, 0] if nids[sh] > 0 else -1
            at = _found_at(f_tok, nf, top)
            if at >= 0:
                f_kind[at] += AGREE
            base = _kind(BACKOFF, sho, count[sh])
            inv = _inverse_mass(probs, sh, nids[sh])
            for j in range(nids[sh]):
                p = probs[sh, j]
                token = ids[sh, j]
                if p > 0 and _found_at(f_tok, nf, token) < 0:
                    flag = named if named and find_pair(ptab, pk, ss, token) >= 0 else absent
                    f_tok[nf], f_kind[nf], f_q[nf] = token, base + flag, p * inv
                    nf += 1
    if n >= MIN_SUFFIX:
        inv = 1.0 / total[ss]
        kind = _kind(SUFFIX, 0, 0) + named
        i = head[ss]
        while i >= 0:
            if _found_at(f_tok, nf, pk[i, 1]) < 0:
                f_tok[nf], f_kind[nf], f_q[nf] = pk[i, 1], kind, icnt[i] * inv
                nf += 1
            i = inext[i]
    if nf == 0 and tlen > 0:
        if n:
            inv = 1.0 / total[ss]
            kind = _kind(SUFFIX, n, 0)
            i = head[ss]
            while i >= 0:
                f_tok[nf], f_kind[nf], f_q[nf] = pk[i, 1], kind, icnt[i] * inv
                nf += 1
                i = inext[i]
        last = tail[tlen - 1]
        base = _kind(SUCCESSOR, 0, 0)
        for j in range(succ_n[last]):
            p = succ_p[last, j]
            token = succ_ids[last, j]
            if p > 0 and _found_at(f_tok, nf, token) < 0:
                flag = named if named and find_pair(ptab, pk, ss, token) >= 0 else absent
                f_tok[nf], f_kind[nf], f_q[nf] = token, base + flag, p
                nf += 1
    for i in range(nf):  # −α̂ = −a − b·q of the key's line
        q = f_q[i]
        key = f_kind[i] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
        f_neg[i] = -la[key] - lb[key] * q
    for i in range(1, nf):  # best first: (−α̂, token), as Python sorts the tuples
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
def _drawn_plan(c_ids, c_p, nc: int, rank, base: int, la, lb, f_tok, f_kind, f_q, f_neg, qs) -> int:
    """`StandDynDrafter.drawn_plan` given the draw order `rank` of the `nc` stored ids
    (`gumbel_order`): the children in that order in f_*, slot j calibrated on the j-th largest
    normalised probability (kind `base` + min(j, 3), sorted in `qs`); returns nc."""
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
def draft_tree(
    tab, keytok, ids, probs, nids, count, meta, max_order,
    stab, skt, total, head, ptab, pk, icnt, inext,
    succ_ids, succ_p, succ_n, la, lb,
    root_tail, limit, xs, ys, drawn, cur, rem, nxt, noise_used,
    out_parent, out_token, out_kind, out_q,
    out_draws, out_sampled, out_slot, out_qn, out_qids, out_qp,
):  # fmt: skip
    """`StandDynDrafter.draft`: the tree in out_* (node 0 the root); returns its size. `xs`,
    `ys`: the verify cost's sizes and seconds (empty: fill the budget). With `drawn`, a node
    may draw its children (`_drawn_plan`; `out_draws`), which `out_sampled` marks, and each
    node's support is laid out as `tree.DrawnBatch` holds it: `out_qids[node, :out_qn[node]]`
    (-1: none), a drawing node's stored ids with a positive probability (`out_qp`, its q), else
    its deterministic children's tokens (`out_qp` 0); `out_slot`: a child's place in it. Noise
    as `stand_compiled.stand_tree` reads it: `cur` holds the current buffer's next values,
    `rem` how many it has left, `nxt` the next buffer's first; `noise_used` gets (1 if it moved
    to the next buffer, values read from the one it ended in)."""
    tails = np.full((limit + 1, TAIL), -1, np.int64)
    tlens = np.zeros(limit + 1, np.int64)
    alpha = np.zeros(limit + 1, np.float64)
    plan_at = np.zeros(limit + 1, np.int64)  # node -> its candidates' start in the flat plan
    plan_n = np.zeros(limit + 1, np.int64)
    cap = 64 * (limit + 1)
    p_tok = np.empty(cap, np.int64)
    p_kind = np.empty(cap, np.int64)
    p_q = np.empty(cap, np.float64)
    p_neg = np.empty(cap, np.float64)
    f_tok = np.empty(64, np.int64)
    f_kind = np.empty(64, np.int64)
    f_q = np.empty(64, np.float64)
    f_neg = np.empty(64, np.float64)
    width = ids.shape[1]
    c_p = np.empty(width, np.float64)  # a drawn plan's positive stored probabilities
    keys = np.empty(width, np.float64)
    by_key = np.empty(width, np.int64)  # a drawn plan's draw order
    sorted_q = np.empty(width, np.float64)  # a drawn plan's probabilities, largest first
    pos, moved = 0, False
    rl = len(root_tail)
    tails[0, :rl] = root_tail
    tlens[0] = rl
    alpha[0] = 1.0
    out_parent[0], out_token[0], out_kind[0], out_q[0] = -1, root_tail[rl - 1], -1, 0.0
    used = 0
    heap = [(-1.0, 0, -1)]
    expected, size = 1.0, 1
    sized = len(xs) > 0
    while len(heap) > 0 and size <= limit:
        neg, node, rank = heapq.heappop(heap)
        if rank < 0:
            tl = tlens[node]
            slot, o = lookup_slot(tab, keytok, meta, tails[node], tl, max_order)
            n, ss = _suffix_lookup(stab, skt, tails[node], tl)
            room = 2 * ids.shape[1] + succ_ids.shape[1] + (total[ss] if ss >= 0 else 0)
            if room > f_tok.shape[0]:  # distinct suffix tokens <= their total count
                f_tok = np.empty(room, np.int64)
                f_kind = np.empty(room, np.int64)
                f_q = np.empty(room, np.float64)
                f_neg = np.empty(room, np.float64)
            nf = _candidates(
                tab, keytok, ids, probs, nids, count, meta, max_order,
                stab, skt, total, head, ptab, pk, icnt, inext,
                succ_ids, succ_p, succ_n, la, lb,
                tails[node], tl, slot, o, n, ss, f_tok, f_kind, f_q, f_neg,
            )  # fmt: skip
            if drawn and slot >= 0 and _draws_first(probs, nids, count, la, lb, slot, o, f_neg, nf):
                # `StandDynDrafter.drawn_plan`, the noise taken as `GumbelNoise.take` hands it
                nc = 0
                for j in range(nids[slot]):
                    if probs[slot, j] > 0:
                        out_qids[node, nc], out_qp[node, nc] = ids[slot, j], probs[slot, j]
                        c_p[nc] = probs[slot, j]
                        nc += 1
                out_qn[node] = nc
                pos, moved = gumbel_order(c_p, nc, cur, rem, nxt, pos, moved, keys, by_key)
                nf = _drawn_plan(
                    out_qids[node], c_p, nc, by_key, _kind(DRAWN, o, count[slot]), la, lb,
                    f_tok, f_kind, f_q, f_neg, sorted_q,
                )  # fmt: skip
                out_draws[node] = True
            if nf > 0:
                if used + nf > p_tok.shape[0]:
                    grow = max(2 * p_tok.shape[0], used + nf)
                    p_tok = np.concatenate((p_tok, np.empty(grow, np.int64)))
                    p_kind = np.concatenate((p_kind, np.empty(grow, np.int64)))
                    p_q = np.concatenate((p_q, np.empty(grow, np.float64)))
                    p_neg = np.concatenate((p_neg, np.empty(grow, np.float64)))
                p_tok[used : used + nf] = f_tok[:nf]
                p_kind[used : used + nf] = f_kind[:nf]
                p_q[used : used + nf] = f_q[:nf]
                p_neg[used : used + nf] = f_neg[:nf]
                plan_at[node], plan_n[node] = used, nf
                used += nf
                heapq.heappush(heap, (alpha[node] * p_neg[used - nf], node, 0))
            continue
        if sized and not _worth_growing(xs, ys, size, expected, -neg, limit + 1):
            break
        c = plan_at[node] + rank
        token = p_tok[c]
        child = size
        out_parent[child], out_token[child] = node, token
        out_kind[child], out_q[child] = p_kind[c], p_q[c]
        if drawn:  # the child's place in its parent's support
            out_sampled[child] = out_draws[node]
            if out_draws[node]:
                out_slot[child] = _found_at(out_qids[node], out_qn[node], token)
            else:
                k = max(out_qn[node], 0)
                out_qids[node, k], out_slot[child], out_qn[node] = token, k, k + 1
        size += 1
        tl = tlens[node]
        if tl < TAIL:
            tails[child, :tl] = tails[node, :tl]
            tails[child, tl] = token
            tlens[child] = tl + 1
        else:
            tails[child, : TAIL - 1] = tails[node, 1:]
            tails[child, TAIL - 1] = token
            tlens[child] = TAIL
        alpha[child] = -neg
        expected -= neg
        if rank + 1 < plan_n[node]:
            heapq.heappush(heap, (alpha[node] * p_neg[c + 1], node, rank + 1))
        heapq.heappush(heap, (neg, child, -1))
    noise_used[0], noise_used[1] = moved, pos
    return size


@njit(cache=True)
def draft_rows(
    tab, keytok, ids, probs, nids, count, meta, max_order,
    stab, skt, total, head, ptab, pk, icnt, inext, smeta,
    succ_ids, succ_p, succ_n, la, lb,
    seq, seq_at, lo, hi, tails, tlens, limits, cost_xs, cost_ys, cost_n, cost_of,
    drawn, cur, cur_at, rem, nxt, nxt_at, used,
    out_parent, out_token, out_kind, out_q,
    out_draws, out_sampled, out_slot, out_qn, out_qids, out_qp, sizes,
):  # fmt: skip
    """Every row's suffix counting and tree, row after row, as the rows would run one by one:
    row r counts `seq[seq_at[r]:seq_at[r + 1]]`'s ends in [lo[r], hi[r]), then drafts from
    `tails[r, :tlens[r]]` at most `limits[r]` nodes, sized by cost `cost_of[r]` (-1: none),
    drawing children where `drawn[r]` (its noise as `stand_compiled.noise_windows` lays it
    out, and `used[r]`)."""
    empty = np.zeros(0, np.float64)
    for r in range(len(limits)):
        if hi[r] > lo[r]:
            _count(
                stab, skt, total, head, ptab, pk, icnt, inext, smeta,
                seq[seq_at[r] : seq_at[r + 1]], lo[r], hi[r],
            )  # fmt: skip
        c = cost_of[r]
        xs = cost_xs[c, : cost_n[c]] if c >= 0 else empty
        ys = cost_ys[c, : cost_n[c]] if c >= 0 else empty
        sizes[r] = draft_tree(
            tab, keytok, ids, probs, nids, count, meta, max_order,
            stab, skt, total, head, ptab, pk, icnt, inext,
            succ_ids, succ_p, succ_n, la, lb,
            tails[r, : tlens[r]], limits[r], xs, ys, drawn[r], cur[cur_at[r] : cur_at[r + 1]],
            rem[r], nxt[nxt_at[r] : nxt_at[r + 1]], used[r],
            out_parent[r], out_token[r], out_kind[r], out_q[r],
            out_draws[r], out_sampled[r], out_slot[r], out_qn[r], out_qids[r], out_qp[r],
        )  # fmt: skip


def _drawn_arrays(drawn: np.ndarray, nodes: int, width: int) -> tuple[np.ndarray, ...]:
    """`draft_rows`' drawn outputs `[R, M]` / `[R, M, K]` (draws, sampled, slot, q_len, q_ids,
    q_probs): M one slot where no row draws (none is written); K the store's top-k or a
    deterministic node's most children, whichever is more."""
    rows = len(drawn)
    m, k = (nodes, max(width, nodes - 1)) if drawn.any() else (1, 1)
    return (
        np.zeros((rows, m), np.bool_),
        np.zeros((rows, m), np.bool_),
        np.full((rows, m), -1, np.int64),
        np.full((rows, m), -1, np.int64),
        np.zeros((rows, m, k), np.int64),
        np.zeros((rows, m, k)),
    )


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
        assert self.index is not None and self.successors is not None
        assert self.calibration is not None
        sfx, seqs, seq_at = self.suffix, [], [0]
        lo, hi = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        tails = np.zeros((rows, TAIL), np.int64)
        tlens, limits = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        cost_of = np.full(rows, -1, np.int64)
        costs: list[tuple[np.ndarray, np.ndarray]] = []
        seen: dict[int, int] = {}
        new = 0
        for r, (m, ctx, (seq, a, b)) in enumerate(zip(members, ctxs, counted, strict=True)):
            lo[r], hi[r] = a, b
            seqs += seq
            seq_at.append(len(seqs))
            new += b - a
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
        sfx.room(new)
        width = max(2, *(len(x) for x, _ in costs)) if costs else 2
        cost_xs = np.zeros((max(len(costs), 1), width), np.float64)
        cost_ys = np.zeros_like(cost_xs)
        cost_n = np.zeros(len(cost_xs), np.int64)
        for c, (xs, ys) in enumerate(costs):
            cost_xs[c, : len(xs)], cost_ys[c, : len(ys)], cost_n[c] = xs, ys, len(xs)
        nodes = int(limits.max()) + 1
        parent = np.full((rows, nodes), -1, np.int64)  # past a tree's nodes: none
        token = np.zeros((rows, nodes), np.int64)
        kind = np.zeros((rows, nodes), np.int64)
        q = np.zeros((rows, nodes), np.float64)
        sizes = np.zeros(rows, np.int64)
        idx, succ, cal = self.index, self.successors, self.calibration
        drawn = np.array(
            [m.drawn and not ctx.greedy for m, ctx in zip(members, ctxs, strict=True)], np.bool_
        )
        # a drawing row's window of its noise: as much as its own tree can read (every node
        # opened, every stored id drawn), which its buffer holds (`stand_dyn.compiled_applies`)
        noise = noise_windows(
            [m.noise if d else None for m, d in zip(members, drawn.tolist(), strict=True)],
            ((limits + 1) * idx.topk).tolist(),
        )
        used = np.zeros((rows, 2), np.int64)
        draws, sampled, slot, q_len, q_ids, q_probs = _drawn_arrays(drawn, nodes, idx.topk)
        draft_rows(
            *idx.arrays(), idx.max_order, *sfx.arrays(), succ.ids, succ.probs, succ.n,
            cal.a, cal.b, np.array(seqs, np.int64), np.array(seq_at, np.int64), lo, hi,
            tails, tlens, limits, cost_xs, cost_ys, cost_n, cost_of, drawn, *noise, used,
            parent, token, kind, q, draws, sampled, slot, q_len, q_ids, q_probs, sizes,
        )  # fmt: skip
        out = []
        tokens, parents = token.tolist(), parent.tolist()
        if drawn.any():  # the drawing rows' trees carry the arrays rule (c) lays out
            flags = sampled.tolist()
            batch = DrawnBatch(parent, slot, q_len, q_ids, q_probs, sampled)
        for r, (m, n) in enumerate(zip(members, sizes.tolist(), strict=True)):
            m.kinds, m.qs = kind[r, :n], q[r, :n]  # what each node was drafted as
            if drawn[r]:
                m.noise.advance(bool(used[r, 0]), int(used[r, 1]))
                tree = DraftTree(
                    tuple(tokens[r][:n]),
                    tuple(parents[r][:n]),
                    tuple(flags[r][:n]),
                    DrawnQ(draws, q_len, q_ids, q_probs, r, n),  # at most the store's top-k
                    DrawnArrays(batch, r),
                )
            else:
                tree = DraftTree(
                    tuple(tokens[r][:n]), tuple(parents[r][:n]), (False,) * n, (None,) * n
                )
            out.append(tree)
        return out

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
        _record(
            cal.drawn, cal.hits, cal.a, cal.b, kinds, qs, parents, on_path, n,
            cal.prior_weight, cal.prior_scale,
        )  # fmt: skip
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
