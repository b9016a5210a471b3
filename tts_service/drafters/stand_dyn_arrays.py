"""`stand-dyn`'s state as arrays, for its compiled drafter (`stand_kernel`): the suffix counts
over a problem's trajectories (`SuffixIndex`, `SuffixCounts`' rule), and per loaded model the
successor table's unigram tier (`SuccessorIndex`, `AdjacencyTable` as `stand-dyn` uses it) and
the calibration (`CalibrationIndex`, `AcceptanceCalibration`'s lines). Each hands its kernels
one named group of arrays (`arrays()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit

from store.hashtable import find_ngram, find_pair, insert_ngram, insert_pair, new_table, room

TAIL = 12  # tokens of context a node keeps (stand_dyn.TAIL)
ORDERS = np.array((12, 8, 6, 5, 4, 3, 2, 1), np.int64)  # stand_dyn.SUFFIX_ORDERS
BINS = 10  # probability bins per candidate kind (AcceptanceCalibration.bins)
KINDS = ((((4 * 10 + 8) * 5 + 4) * 2 + 1) * 4 + 3) + 1  # candidate kinds (stand_dyn)


# -- suffix counts -----------------------------------------------------------------------------
class SuffixTable(NamedTuple):
    """`SuffixIndex`'s arrays: n-grams in slots (`stab` their table, `skt` their keys, `total`
    the positions counted after each, `head` its first item), items (one per (n-gram, next
    token): `ptab` their table, `pk` their keys, `icnt` their counts, `inext` the n-gram's next
    item), and `meta`: (slots used, items used)."""

    stab: np.ndarray
    skt: np.ndarray
    total: np.ndarray
    head: np.ndarray
    ptab: np.ndarray
    pk: np.ndarray
    icnt: np.ndarray
    inext: np.ndarray
    meta: np.ndarray


@njit(cache=True)
def count_suffixes(table: SuffixTable, d, lo: int, hi: int) -> None:
    """Count, for every end in [lo, hi), the token after each order's n-gram ending at `end`
    (`SuffixCounts.sync`'s loop); `d` holds the document from index 0. Items (one per
    (n-gram, next token)) hang off their n-gram's slot in a list (`head`, `inext`)."""
    meta = table.meta
    for end in range(lo, hi):
        token = d[end + 1]
        for n in ORDERS:
            if end + 1 >= n:
                s = find_ngram(table.stab, table.skt, d, end + 1, n)
                if s < 0:
                    s = meta[0]
                    meta[0] += 1
                    insert_ngram(table.stab, table.skt, d, end + 1, n, s)
                    table.total[s], table.head[s] = 0, -1
                table.total[s] += 1
                i = find_pair(table.ptab, table.pk, s, token)
                if i >= 0:
                    table.icnt[i] += 1
                else:
                    i = meta[1]
                    meta[1] += 1
                    insert_pair(table.ptab, table.pk, s, token, i)
                    table.icnt[i], table.inext[i] = 1, table.head[s]
                    table.head[s] = i


@njit(cache=True)
def suffix_lookup(table: SuffixTable, tail, tlen: int) -> tuple[int, int]:
    """(n, slot) of the longest counted suffix of `tail[:tlen]`; (0, -1) if none."""
    for n in ORDERS:
        if tlen >= n:
            s = find_ngram(table.stab, table.skt, tail, tlen, n)
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

    def arrays(self) -> SuffixTable:
        """What a kernel reads and counts into (made at each call: `room` may reallocate)."""
        return SuffixTable(
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
        """Book `tokens` (the document so far) as synced; returns what `count_suffixes` counts:
        the tokens from the first one a new n-gram needs, and the range of ends in them."""
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
            count_suffixes(self.arrays(), np.array(seq, np.int64), lo, hi)

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int]]:
        """`SuffixCounts.lookup`: (n, token -> count) of the longest counted suffix (tests)."""
        tail = np.array(list(context)[-TAIL:], np.int64)
        n, s = suffix_lookup(self.arrays(), tail, len(tail))
        counts: dict[int, int] = {}
        i = int(self.head[s]) if s >= 0 else -1
        while i >= 0:
            counts[int(self.pk[i, 1])] = int(self.icnt[i])
            i = int(self.inext[i])
        return n, counts


# -- per-model state ---------------------------------------------------------------------------
class Successors(NamedTuple):
    """`SuccessorIndex`'s arrays: per token the last top-k seen after it (`n` 0: never)."""

    ids: np.ndarray  # [vocab, k]
    probs: np.ndarray  # [vocab, k]
    n: np.ndarray  # [vocab]


class SuccessorIndex:
    """The unigram tier of `AdjacencyTable` (what `stand-dyn` reads: the last target
    distribution seen after a token, its top `k`) as `[vocab, k]` arrays."""

    def __init__(self, vocab: int, k: int = 10) -> None:
        self.vocab, self.k = vocab, k
        self.ids = np.zeros((vocab, k), np.int64)
        self.probs = np.zeros((vocab, k), np.float64)
        self.n = np.zeros(vocab, np.int64)  # 0: never seen

    def arrays(self) -> Successors:
        return Successors(self.ids, self.probs, self.n)

    def update(self, tokens: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        """Row i: the target's top-k after `tokens[i]` (later rows win, as in the dict)."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab)][0])
            raise IndexError(f"token {bad} outside the vocabulary of {self.vocab}")
        _set_successors(self.arrays(), tokens, ids, probs, min(self.k, ids.shape[1]))


@njit(cache=True)
def _set_successors(succ: Successors, tokens, ids, probs, k: int) -> None:
    for r in range(len(tokens)):  # in order: a repeated token keeps its last row
        t = tokens[r]
        succ.ids[t, :k], succ.probs[t, :k], succ.n[t] = ids[r, :k], probs[r, :k], k


class CalibrationArrays(NamedTuple):
    """`CalibrationIndex`'s arrays (per key: kind × probability decile) and its prior."""

    drawn: np.ndarray
    hits: np.ndarray
    a: np.ndarray  # the line α̂ = a + b·q
    b: np.ndarray
    prior_weight: float
    prior_scale: float


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

    def arrays(self) -> CalibrationArrays:
        return CalibrationArrays(
            self.drawn, self.hits, self.a, self.b, self.prior_weight, self.prior_scale
        )

    def record(self, kinds: np.ndarray, qs: np.ndarray, parents: np.ndarray, on_path) -> None:
        """`StandDynDrafter._learn`'s calibration part for one verified tree of
        `len(parents)` nodes: every node whose parent was reached."""
        _record(self.arrays(), kinds, qs, parents, on_path, len(parents))


@njit(cache=True)
def _record(cal: CalibrationArrays, kinds, qs, parents, on_path, size: int) -> None:
    w, s = cal.prior_weight, cal.prior_scale
    drawn, hits = cal.drawn, cal.hits
    for v in range(1, size):
        p = parents[v]
        if p == 0 or on_path[p]:
            q = qs[v]
            key = kinds[v] * BINS + (int(q * BINS) if q < 1.0 else BINS - 1)
            drawn[key] += 1.0
            hits[key] += 1.0 if on_path[v] else 0.0
            cal.a[key] = (hits[key] + w * 0.0) / (drawn[key] + w)
            cal.b[key] = (0.0 + w * s) / (drawn[key] + w)
