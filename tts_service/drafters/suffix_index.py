"""A problem's suffix counts as arrays a kernel walks (`SuffixCounts`' rule: next-token counts
after every 1..12-gram of the problem's documents, with its memory bound): what the compiled
`stand-dyn` drafter (`stand_dyn_compiled`, `stand_kernel`) reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit

from store.hashtable import find_ngram, find_pair, insert_ngram, insert_pair, new_table, room
from tts_service.drafters.stand_dyn_config import SUFFIX_ORDERS, TAIL

ORDERS = np.array(SUFFIX_ORDERS, np.int64)


class SuffixArrays(NamedTuple):
    """The index's arrays as its kernels read them (as a plain tuple in this order: numba types
    a named tuple's fields one by one in Python at every call, a plain one by its C
    fingerprint). N-grams (`stab` the table, `skt` slot -> its n-gram, `total` its count, `head`
    its first item) and items, one per (n-gram, next token) (`ptab` the table, `pk` item ->
    (slot, token), `icnt` its count, `inext` the next item of its n-gram), `meta` (slots used,
    items used)."""

    stab: np.ndarray
    skt: np.ndarray
    total: np.ndarray
    head: np.ndarray
    ptab: np.ndarray
    pk: np.ndarray
    icnt: np.ndarray
    inext: np.ndarray
    meta: np.ndarray


# -- suffix counts -----------------------------------------------------------------------------
@njit(cache=True)
def count_ends(suffix, d, lo: int, hi: int) -> None:
    """Count, for every end in [lo, hi), the token after each order's n-gram ending at `end`
    (`SuffixCounts.sync`'s loop) into `suffix` (`SuffixArrays`); `d` holds the document from
    index 0. Items hang off their n-gram's slot in a list (`head`, `inext`)."""
    stab, skt, total, head, ptab, pk, icnt, inext, meta = suffix
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
def suffix_lookup(stab, skt, tail, tlen: int) -> tuple[int, int]:
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
        """`SuffixArrays` as a kernel takes them (a plain tuple)."""
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
            count_ends(self.arrays(), np.array(seq, np.int64), lo, hi)

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int]]:
        """`SuffixCounts.lookup`: (n, token -> count) of the longest counted suffix (tests)."""
        tail = np.array(list(context)[-TAIL:], np.int64)
        n, s = suffix_lookup(self.stab, self.skt, tail, len(tail))
        counts: dict[int, int] = {}
        i = int(self.head[s]) if s >= 0 else -1
        while i >= 0:
            counts[int(self.pk[i, 1])] = int(self.icnt[i])
            i = int(self.inext[i])
        return n, counts
