"""The in-process store: stats per order (entries, hits, misses, evictions), and bad
arguments."""

from __future__ import annotations

import pytest

from store.base import NgramRow
from store.memory import InMemoryNgramStore


def test_memory_store_stats_count_entries_per_order_hits_misses_and_evictions():
    s = InMemoryNgramStore(max_order=4, max_entries=3)
    s.add([NgramRow((1, 2), (3,), (1.0,)), NgramRow((2, 3), (4,), (1.0,))])  # 4 n-grams: 1 goes
    s.lookup([1, 2])
    s.lookup([7])
    st = s.stats()
    assert st["entries"] == 3 and st["entries_by_order"] == {"1": 1, "2": 2, "3": 0, "4": 0}
    assert st["hits_by_order"]["2"] == 1 and st["misses"] == 1 and st["evictions"] == 1
    s.clear()
    assert s.stats()["entries"] == 0


def test_bad_store_arguments():
    with pytest.raises(ValueError):
        InMemoryNgramStore(max_order=0)
