"""Open-addressing hash tables over numpy arrays, for numba kernels: n-gram keys and
(slot, token) pairs mapped to slots.

numba's typed dict costs about a microsecond per tuple-keyed operation here, as much as a
Python dict; drafting does dozens per tree node. These tables hash in a few integer
operations, probe linearly, and compare the key where it already lies (the context array), so
a key is never built.

A table is an int64 array of power-of-two size holding slot ids (-1 empty, -2 deleted); the
keys live in the owner's rows: an n-gram key in `kt[slot]` as (n, token_1, ..., token_n, -1
padding), a pair in `pk[slot]` as (slot, token). Tables never grow inside a kernel: the caller
makes room first (`room`), as a kernel cannot rebind its arguments.
"""

from __future__ import annotations

import numpy as np
from numba import int64, njit, uint64

EMPTY, DELETED = -1, -2
_PRIME = uint64(0x100000001B3)  # FNV-1a's
_MIX1 = uint64(0xFF51AFD7ED558CCD)  # splitmix64's finaliser
_MIX2 = uint64(0xC4CEB9FE1A85EC53)


def new_table(keys: int) -> np.ndarray:
    """An empty table with room for `keys` keys at load 1/2."""
    size = 16
    while size < 2 * keys:
        size *= 2
    return np.full(size, EMPTY, np.int64)


@njit(cache=True, inline="always")
def _mix(h: uint64) -> uint64:
    h ^= h >> uint64(33)
    h *= _MIX1
    h ^= h >> uint64(33)
    h *= _MIX2
    h ^= h >> uint64(33)
    return h


@njit(cache=True, inline="always")
def ngram_hash(ctx: np.ndarray, end: int, n: int) -> uint64:
    """The hash of the n tokens of `ctx` that end before `end`."""
    h = uint64(n) * _PRIME
    for j in range(end - n, end):
        h = (h ^ uint64(ctx[j])) * _PRIME
    return _mix(h)


@njit(cache=True, inline="always")
def pair_hash(a: int, b: int) -> uint64:
    return _mix((uint64(a) * _PRIME) ^ uint64(b))


@njit(cache=True, inline="always")
def _free_position(tab, h: uint64) -> int:
    """The first position at or after `h`'s that holds no key (empty or deleted)."""
    mask = len(tab) - 1
    i = int64(h & uint64(mask))
    while tab[i] >= 0:
        i = (i + 1) & mask
    return i


@njit(cache=True)
def find_ngram(tab, kt, ctx, end: int, n: int) -> int:
    """The slot of the n-gram `ctx[end - n:end]`, -1 if absent."""
    mask = len(tab) - 1
    i = int64(ngram_hash(ctx, end, n) & uint64(mask))
    while True:
        s = tab[i]
        if s == EMPTY:
            return -1
        if s >= 0 and kt[s, 0] == n:
            same = True
            for j in range(n):
                if kt[s, 1 + j] != ctx[end - n + j]:
                    same = False
                    break
            if same:
                return s
        i = (i + 1) & mask


@njit(cache=True)
def insert_ngram(tab, kt, ctx, end: int, n: int, s: int) -> None:
    """Map the (absent) n-gram `ctx[end - n:end]` to slot `s`, writing its key into `kt[s]`."""
    kt[s, :] = -1
    kt[s, 0] = n
    for j in range(n):
        kt[s, 1 + j] = ctx[end - n + j]
    tab[_free_position(tab, ngram_hash(ctx, end, n))] = s


@njit(cache=True)
def delete_ngram(tab, kt, s: int) -> None:
    """Unmap slot `s` (its key is `kt[s]`)."""
    n = kt[s, 0]
    mask = len(tab) - 1
    i = int64(ngram_hash(kt[s, 1:], n, n) & uint64(mask))
    while tab[i] != s:
        i = (i + 1) & mask
    tab[i] = DELETED


@njit(cache=True)
def find_pair(tab, pk, a: int, b: int) -> int:
    mask = len(tab) - 1
    i = int64(pair_hash(a, b) & uint64(mask))
    while True:
        s = tab[i]
        if s == EMPTY:
            return -1
        if s >= 0 and pk[s, 0] == a and pk[s, 1] == b:
            return s
        i = (i + 1) & mask


@njit(cache=True)
def insert_pair(tab, pk, a: int, b: int, s: int) -> None:
    pk[s, 0], pk[s, 1] = a, b
    tab[_free_position(tab, pair_hash(a, b))] = s


@njit(cache=True)
def _rehash(old, keys, size: int, pairs: bool):
    """A table of `size` with `old`'s keys (rows of `keys`: n-grams, or pairs)."""
    tab = np.full(size, EMPTY, np.int64)
    for s in old:
        if s >= 0:
            if pairs:
                h = pair_hash(keys[s, 0], keys[s, 1])
            else:
                h = ngram_hash(keys[s, 1:], keys[s, 0], keys[s, 0])
            tab[_free_position(tab, h)] = s
    return tab


def room(tab: np.ndarray, keys: np.ndarray, used: int, new: int, pairs: bool = False):
    """`tab`, or a larger one with the same keys, with room for `new` more keys at load 1/2
    (deleted entries count as used until a rehash drops them)."""
    if 2 * (used + new) <= len(tab):
        return tab
    live = int((tab >= 0).sum())
    size = len(new_table(2 * (live + new)))
    return _rehash(tab, keys, size, pairs)
