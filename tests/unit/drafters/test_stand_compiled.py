"""`stand` drafted by the compiled kernel (`stand_compiled`): the Python drafter's trees, node
for node and snapshot for snapshot, through the runner and on random stores."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from store.base import NgramRow
from store.memory import InMemoryNgramStore, TieredStore
from tts_service.drafters.stand import StandDrafter, compiled_applies
from tts_service.drafters.stand_compiled import CompiledStand, new_group, warm
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import DraftContext
from tts_service.engine.treebatch import SparseLayout


def _twin_stores(
    rng: random.Random,
    zeros: bool = False,
    rows: int = 150,
    width: int | None = None,
    topk: int = 10,
) -> tuple[InMemoryNgramStore, ...]:
    """Two in-process stores of top-k `topk` holding the same `rows` random rows over 8 tokens
    (the second to be indexed), of `width` ids each or a random number; `zeros`: some ids stored
    at probability 0."""
    stores = InMemoryNgramStore(topk=topk), InMemoryNgramStore(topk=topk)
    for _ in range(rows):
        ctx = tuple(rng.randrange(8) for _ in range(rng.randrange(1, 5)))
        n = width if width is not None else rng.randrange(1, 7 if zeros else 6)
        ids = tuple(rng.sample(range(8), n))
        probs = tuple(rng.choice([0.0, rng.random()]) if zeros else rng.random() for _ in ids)
        for store in stores:
            store.add([NgramRow(ctx, ids, probs)])
    return stores


def test_random_stores_give_the_python_trees_through_noise_refills():
    """Random stores and contexts, greedy rows among sampled ones, a small noise buffer (a
    refill every few steps, the tail discarded), whole trees and GT-chosen subtrees."""
    rng = random.Random(3)
    refills = 0
    for trial in range(12):
        plain, indexed = _twin_stores(rng)
        cfg = StandDrafterConfig(tree="stand-625", num_nodes=24, noise_buffer=250)
        python = StandDrafter(cfg, plain, seed=trial)
        group = new_group(cfg)
        group.bind(indexed.compiled())
        compiled = CompiledStand(cfg, indexed, group, seed=trial)
        for _ in range(25):
            tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 9))]
            ctx = DraftContext(tokens, 1, rng.choice([2, 8, 24]), greedy=rng.random() < 0.2)
            assert compiled.draft(ctx) == python.draft(ctx)
            keep = frozenset(range(1, 1 + rng.randrange(1, 12)))  # closed: a prefix of the shape
            assert compiled.draft_subtree(ctx, keep) == python.draft_subtree(ctx, keep)
        assert compiled.noise.refills == python.noise.refills
        refills += compiled.noise.refills
        assert plain.stats() == indexed.stats()  # the same lookups, counted alike
    assert refills > 20


def test_the_compiled_drafter_applies_where_its_trees_are_the_python_ones():
    store = InMemoryNgramStore()
    assert compiled_applies(StandDrafterConfig(), store)
    assert not compiled_applies(StandDrafterConfig(compiled=False), store)
    assert not compiled_applies(StandDrafterConfig(), TieredStore(store, InMemoryNgramStore()))
    # a step may read (nodes + 1) x topk noise values: a smaller buffer keeps the Python drafter
    assert compiled_applies(StandDrafterConfig(num_nodes=15, noise_buffer=160), store)
    assert not compiled_applies(StandDrafterConfig(num_nodes=16, noise_buffer=160), store)


def test_warm_compiles_and_runs_every_kernel():
    assert warm() > 1


def assert_arrays_lay_out_as_the_trees(trees: list, n: int, bucket: bool) -> None:
    """`SparseLayout.of` from the trees' `DrawnArrays` equals the loop over their nodes, field
    for field."""
    fast = SparseLayout.of(trees, n, bucket)
    slow = SparseLayout.of([dataclasses.replace(t, arrays=None) for t in trees], n, bucket)
    assert fast.n == slow.n
    for name in ("ids", "lens", "parents"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    for name in ("node", "slot", "drawn", "q"):
        got, want = getattr(fast.kids, name), getattr(slow.kids, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


@pytest.mark.parametrize("bucket", [False, True])
def test_the_drafters_arrays_lay_out_as_the_trees_do(bucket):
    """`SparseLayout.of` from the trees' `DrawnArrays` equals the loop over their nodes, field
    for field: random stores (some ids stored at probability 0, skipped as candidates but kept
    in q), random budgets, trees of different sizes from two batches in one step."""
    rng = random.Random(11)
    for trial in range(20):
        store = _twin_stores(rng, zeros=True)[1]
        cfg = StandDrafterConfig(tree="stand-625", num_nodes=24)
        group = new_group(cfg)
        group.bind(store.compiled())
        rows = [CompiledStand(cfg, store, group, seed=trial * 10 + i) for i in range(6)]
        ctxs = [
            DraftContext([rng.randrange(8) for _ in range(5)], 1, rng.choice([1, 4, 24]))
            for _ in rows
        ]
        # two calls (two problems' batches in one step), their trees interleaved
        trees = group.draft_all(rows[:4], ctxs[:4]) + group.draft_all(rows[4:], ctxs[4:])
        trees = [trees[i] for i in (4, 0, 1, 5, 2, 3)]
        assert all(t.arrays is not None for t in trees)  # sampled rows carry their arrays
        n = max(t.size for t in trees) + rng.randrange(0, 3)
        assert_arrays_lay_out_as_the_trees(trees, n, bucket)


def test_rows_of_one_group_read_as_much_noise_as_their_own_trees_can():
    """Two configs over one tree shape share a group (one kernel call): a small tree with a
    small noise buffer beside a big one reads windows its own size, so its noise is the Python
    drafter's, refills included."""
    rng = random.Random(5)
    plain, indexed = _twin_stores(rng)
    big = StandDrafterConfig(tree="stand-625", num_nodes=24, noise_buffer=4096)
    small = StandDrafterConfig(tree="stand-625", num_nodes=2, noise_buffer=30)
    assert compiled_applies(small, indexed)
    group = new_group(big)
    group.bind(indexed.compiled())
    rows = [CompiledStand(cfg, indexed, group, seed=s) for s, cfg in ((1, big), (2, small))]
    python = [StandDrafter(cfg, plain, seed=s) for s, cfg in ((1, big), (2, small))]
    for _ in range(40):
        ctxs = [DraftContext([rng.randrange(8) for _ in range(6)], 1, 24) for _ in rows]
        want = [d.draft(c) for d, c in zip(python, ctxs, strict=True)]
        assert group.draft_all(rows, ctxs) == want
    assert rows[1].noise.refills == python[1].noise.refills > 3
