"""Batched acceptance (`engine.treebatch`) equals the per-row reference walks of
`engine.verify`, token for token, on random trees and random target distributions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tts_service.engine.acceptance import DenseNodes
from tts_service.engine.streams import LANES, counter_uniforms
from tts_service.engine.tree import DraftTree, SparseDist, ancestor_mask
from tts_service.engine.treebatch import (
    SparseLayout,
    accepted_path,
    gather_sparse,
    gather_support,
    greedy_choice,
    match_choice,
    residual_at,
    residual_bonus,
    residual_mass,
    walk_sparse_all,
)
from tts_service.engine.treepack import TreeBatch, shape_rows
from tts_service.engine.verify import (
    SparseNode,
    accept_greedy,
    accept_match,
    node_support,
    walk_sparse,
)

V = 5  # a small vocabulary: duplicate siblings and exhausted residuals are common


def random_tree(rng: random.Random, size: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    tokens = [rng.randrange(V) for _ in range(size)]
    return DraftTree(tuple(tokens), tuple(parents), (False,) * size, (None,) * size)


def random_p(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """Dirichlet-like rows, a third with zeros, some with all their mass on one token."""
    p = torch.rand(rows, n, V, generator=gen, dtype=torch.float64) ** 3
    p = p * (torch.rand(rows, n, V, generator=gen) > 0.33)
    p[..., 0] += 1e-3
    certain = torch.rand(rows, n, generator=gen) < 0.2
    one = torch.nn.functional.one_hot(torch.randint(V, (rows, n), generator=gen), V)
    p = torch.where(certain[..., None], one.to(torch.float64), p)
    return p / p.sum(-1, keepdim=True)


def reference_drawn(tree: DraftTree, p: torch.Tensor, u: list[float], v: list[float]) -> list:
    """`verify.draw_match`'s layout, from given uniforms: what `accept_match` walks."""
    n = tree.size
    parents = torch.tensor(tree.parents[1:], dtype=torch.long)
    drafts = torch.tensor(tree.tokens[1:], dtype=torch.long)
    child_p = p[parents, drafts]
    residual = p.index_put((parents, drafts), torch.zeros_like(child_p))
    cdf = torch.cumsum(residual, dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(
        torch.tensor(v, dtype=torch.float64)[:, None] * total,
        torch.nextafter(total, torch.zeros_like(total)),
    )
    bonus = torch.searchsorted(cdf, x, right=True).clamp_(max=V - 1)[:, 0]
    return [*child_p.tolist(), *u[1:n], *bonus.tolist(), *total[:, 0].tolist()]


def batched(trees, p, u, v, greedy: bool):
    width = max(t.size for t in trees)
    tb = TreeBatch.of(trees, width, torch.device("cpu"))
    if greedy:
        best = p.argmax(-1)
        last, on_path = accepted_path(tb, greedy_choice(tb, best))
        bonus = best.gather(1, last[:, None])[:, 0]
    else:
        chosen, px = match_choice(tb, p, u)
        last, on_path = accepted_path(tb, chosen)
        bonus = residual_bonus(residual_at(tb, p, px, last), v.gather(1, last[:, None])[:, 0])
    out = []
    for b, tree in enumerate(trees):
        path = tuple(i for i in range(1, tree.size) if on_path[b, i])
        assert not on_path[b, tree.size :].any() and on_path[b, 0]
        assert (path[-1] if path else 0) == int(last[b])
        out.append((path, int(bonus[b])))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("greedy", [True, False])
def test_batched_acceptance_equals_the_per_row_walk(seed, greedy):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(20):
        trees = [random_tree(rng, rng.randint(1, 12)) for _ in range(rng.randint(1, 7))]
        width = max(t.size for t in trees)
        p = random_p(gen, len(trees), width)
        u = torch.rand(len(trees), width, generator=gen, dtype=torch.float64)
        v = torch.rand(len(trees), width, generator=gen, dtype=torch.float64)
        got = batched(trees, p, u, v, greedy)
        for b, tree in enumerate(trees):
            n = tree.size
            if greedy:
                ref = accept_greedy(tree, p[b, :n].argmax(-1).tolist())
            else:
                drawn = reference_drawn(tree, p[b, :n], u[b, :n].tolist(), v[b, :n].tolist())
                ref = accept_match(tree, drawn)
            assert got[b] == (ref.path, ref.bonus), (tree, b)


@pytest.mark.parametrize("seed", range(4))
def test_the_residual_without_building_it_equals_the_whole_rows_residual(seed):
    """`residual_mass` and `residual_at` against the `[R, N, V]` residual they replace (each
    node's p less its children's): the mass within rounding and exactly 0 where the residual is
    empty (a residual within rounding of empty reads 0 too), the last node's row bit for bit."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(20):
        trees = [random_tree(rng, rng.randint(1, 12)) for _ in range(rng.randint(1, 7))]
        width = max(t.size for t in trees)
        tb = TreeBatch.of(trees, width, torch.device("cpu"))
        p = random_p(gen, len(trees), width)
        u = torch.rand(len(trees), width, generator=gen, dtype=torch.float64)
        _, px = match_choice(tb, p, u)
        flat = p.flatten(0, 1)
        whole = flat.index_put((tb.parent_at, tb.tokens), -px, accumulate=True).view_as(p)
        mass = residual_mass(tb, p, px)
        empty = whole.sum(-1) <= 1e-14
        assert (mass[empty] == 0).all() and (mass[~empty] > 0).all()
        assert (mass[(whole == 0).all(-1)] == 0).all()
        torch.testing.assert_close(mass, whole.sum(-1), rtol=0, atol=1e-12)
        last = torch.tensor([rng.randrange(t.size) for t in trees])
        rows = torch.arange(len(trees))
        assert torch.equal(residual_at(tb, p, px, last), whole[rows, last])


def test_a_child_holding_all_the_mass_is_accepted_at_the_largest_uniform():
    """p sums to 1 - 2^-52, all of it on the drafted token: the threshold is exactly 1, so the
    largest uniform below 1 accepts it and no bonus comes from an empty residual."""
    p = torch.tensor([[[0.0, 1.0 - 2.0**-52, 0.0], [1 / 3] * 3]], dtype=torch.float64)
    tree = DraftTree((0, 1), (-1, 0), (False, False), (None, None))
    tb = TreeBatch.of([tree], 2, torch.device("cpu"))
    u = torch.full((1, 2), 1.0 - 2.0**-53, dtype=torch.float64)
    chosen, _ = match_choice(tb, p, u)
    last, on_path = accepted_path(tb, chosen)
    assert int(last[0]) == 1 and on_path[0].tolist() == [True, True]


def test_duplicate_siblings_are_never_accepted_twice():
    """Root -> 3, 3: under greedy with argmax 3 the first is taken; under sampling the second
    (the same token, its mass already rejected) never is."""
    tree = DraftTree((2, 3, 3), (-1, 0, 0), (False,) * 3, (None,) * 3)
    tb = TreeBatch.of([tree], 3, torch.device("cpu"))
    best = torch.tensor([[3, 0, 0]])
    assert greedy_choice(tb, best).tolist() == [[False, True, False]]
    p = torch.full((1, 3, V), 1 / V, dtype=torch.float64)
    for x in torch.linspace(0, 0.999, 50).tolist():
        u = torch.tensor([[0.0, x, 0.0]], dtype=torch.float64)
        chosen, _ = match_choice(tb, p, u)
        assert not chosen[0, 2]


def reference_siblings(tb: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier siblings and first-of-their-token children from the batch's parents and tokens
    (tensor ops: what the templates replace)."""
    n = tb.shape[1]
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)
    draft = tb.real & (tb.parents >= 0)
    same = tb.parents[:, :, None] == tb.parents[:, None, :]
    before = same & earlier & draft[:, None, :] & draft[:, :, None]
    dup = (before & (tb.tokens[:, :, None] == tb.tokens[:, None, :])).any(-1)
    return before, draft & ~dup


@pytest.mark.parametrize("size", [1, 2, 8, 9, 33, 65])
def test_the_batch_masks_are_each_trees_own(size):
    """`TreeBatch.of`'s masks (unpacked from `shape_rows`' bits, cached per shape), depths and
    first children are every tree's own, whatever the trees beside it and however they are
    padded; a shape seen again is served from the cache."""
    shape_rows.cache_clear()
    rng = random.Random(size)
    trees = [random_tree(rng, size) for _ in range(3)] + [
        DraftTree.chain(0, [1] * (size - 1)),  # the deepest: a chain
        random_tree(rng, max(1, size // 2)),  # padded
    ]
    roots = [5 * b + 3 for b in range(len(trees))]
    for _ in range(2):
        tb = TreeBatch.of(trees, size, torch.device("cpu"), roots)
        before, firsts = reference_siblings(tb)
        assert torch.equal(tb.siblings_before, before) and torch.equal(tb.firsts, firsts)
        values = torch.arange(len(trees) * size).view(len(trees), size)
        assert torch.equal(tb.at_parent(values), values.gather(1, tb.parents.clamp(min=0)))
        for b, tree in enumerate(trees):
            n = tree.size
            want = torch.eye(size, dtype=torch.bool)  # pads see themselves only
            want[:n, :n] = ancestor_mask(tree.parents)
            assert torch.equal(tb.ancestors[b], want)
            assert tb.depths[b, :n].tolist() == list(tree.depths)
            assert tb.positions[b, :n].tolist() == [roots[b] + d for d in tree.depths]
            assert tb.parents[b, :n].tolist() == list(tree.parents)
    assert shape_rows.cache_info().hits >= len(trees) or size == 1  # 1: no masks to build


def test_pad_nodes_see_only_themselves_and_no_real_node_sees_them():
    trees = [DraftTree.chain(4, [1, 2]), DraftTree.root_only(7)]
    tb = TreeBatch.of(trees, 3, torch.device("cpu"))
    assert tb.tokens[1].tolist() == [7, 7, 7] and tb.real[1].tolist() == [True, False, False]
    assert torch.equal(tb.ancestors[1], torch.eye(3, dtype=torch.bool))
    assert tb.depths.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_counter_uniforms_are_splitmix64_and_uniform():
    """A Python reference of the hash (modulo 2^64) gives the same numbers, so uint64 products
    wrap here as the algorithm needs; and 10^6 draws look uniform."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    def ref(key: int, counter: int, lane: int) -> float:
        x = (key + (counter * LANES + lane + 1) * 0x9E3779B97F4A7C15) & mask
        return (mix(mix(x)) >> 11) / 2**53

    keys, counters = [12345, 2**62 + 7, 2**63 - 1], [5, 99_999, 2**40]
    got = counter_uniforms(keys, counters, 6)
    want = [[ref(k, c, j) for j in range(6)] for k, c in zip(keys, counters, strict=True)]
    assert got.dtype == np.float64 and got.tolist() == want
    many = torch.from_numpy(counter_uniforms(range(1000), [0] * 1000, 1000))
    hist = torch.histc(many.flatten(), bins=10, min=0.0, max=1.0)
    assert ((hist - 1e5).abs() < 5 * (1e5 * 0.9) ** 0.5).all(), hist
    assert not torch.equal(many[0], many[1])  # rows are distinct streams


def random_drawn_tree(rng: random.Random, p: torch.Tensor) -> DraftTree:
    """A random tree whose children are drawn (rule (c)), deterministic (rule (b)) or mixed
    (rule (d)) at random, duplicates included; a parent of drawn children gets a random q (or,
    at times, exactly p: the residual empties and every draft is accepted)."""
    size = p.shape[0]
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    tokens = [rng.randrange(V) for _ in range(size)]
    sampled = [False] + [rng.random() < 0.6 for _ in range(1, size)]
    q: list[SparseDist | None] = [None] * size
    for node in range(size):
        if any(sampled[c] for c in range(1, size) if parents[c] == node):
            if rng.random() < 0.2:
                q[node] = SparseDist(tuple(range(V)), tuple(p[node].tolist()))
            else:
                ids = rng.sample(range(V), rng.randint(1, V))
                q[node] = SparseDist(tuple(ids), tuple(rng.random() ** 2 for _ in ids))
    return DraftTree(tuple(tokens), tuple(parents), tuple(sampled), tuple(q))


def gathered_nodes(
    layout: SparseLayout, data: np.ndarray, b: int
) -> tuple[list[SparseNode], list[float], list[float]]:
    """Row `b`'s `verify.SparseNode`s as `gather_sparse`'s copy `data` holds them, and its
    uniforms (u, w): what the reference walk reads of a GPU step's copy."""
    rows, k = data[b], data.shape[-1] - 4
    nodes = []
    for node in range(layout.n):
        support, row = layout.support(b, node), rows[node]
        nodes.append(
            SparseNode(support, row[: len(support)].tolist(), float(row[k]), int(row[k + 1]))
        )
    return nodes, rows[:, k + 2].tolist(), rows[:, k + 3].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_sparse_walks_of_all_rows_equal_the_per_row_walk(seed):
    """Rules (b)-(d) for every row at once (`walk_sparse_all`, compiled) commit exactly what the
    reference `verify.walk_sparse` commits row by row from the same p and uniforms, from the
    dense p (the CPU path) and from the gathered copy (`gathered_nodes`, what the compiled walk
    reads)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    drawn_accepted = 0
    for _ in range(30):
        rows = rng.randint(1, 6)
        sizes = [rng.randint(1, 10) for _ in range(rows)]
        n = max(sizes)
        p = random_p(gen, rows, n)
        trees = [random_drawn_tree(rng, p[b, : sizes[b]]) for b in range(rows)]
        uvw = [torch.rand(rows, n, generator=gen, dtype=torch.float64) for _ in range(3)]
        layout = SparseLayout.of(trees, n)
        data = gather_sparse(p, layout, *uvw)
        got = walk_sparse_all(layout, data.numpy())
        for b, tree in enumerate(trees):
            nodes, u_copy, w_copy = gathered_nodes(layout, data.numpy(), b)
            assert walk_sparse(tree, nodes, u_copy, w_copy) == got[b]
            supports = [node_support(tree, i) for i in range(tree.size)]
            assert [layout.support(b, i) for i in range(tree.size)] == supports
            u, v, w = (x[b].tolist() for x in uvw)
            expected = walk_sparse(tree, DenseNodes(p[b], supports, v), u, w)
            assert got[b] == expected, (seed, b, tree)
            drawn_accepted += sum(tree.sampled[c] for c in expected.path)
    assert drawn_accepted > 20  # drawn children were accepted, not only root bonuses drawn


@pytest.mark.parametrize("seed", range(4))
def test_a_bucket_gathers_every_row_on_the_walked_rows_supports(seed):
    """A captured step's rule (c) (`step_verdict_walked`): the walked rows' supports at a power-
    of-two width (`SparseLayout.of(bucket=True)`), placed in the bucket (`supports`, every other
    row empty) and gathered for every row (`gather_support`): the walked rows read exactly what
    `gather_sparse` gathers for them alone, and commit what the dense walk commits."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(100 + seed)
    for _ in range(20):
        rows = rng.randint(2, 8)
        sizes = [rng.randint(1, 10) for _ in range(rows)]
        n = max(sizes)
        p = random_p(gen, rows, n)
        walked = sorted(rng.sample(range(rows), rng.randint(1, rows)))
        trees = [random_drawn_tree(rng, p[b, : sizes[b]]) for b in walked]
        uvw = [torch.rand(rows, n, generator=gen, dtype=torch.float64) for _ in range(3)]
        layout = SparseLayout.of(trees, n, bucket=True)
        k = layout.ids.shape[-1]
        assert k & (k - 1) == 0 and k >= layout.lens.max()
        sup = torch.from_numpy(layout.supports(walked, rows))
        data = gather_support(p, sup[..., :-1], sup[..., -1].bool(), *uvw).numpy()[walked]
        at = torch.tensor(walked)
        alone = gather_sparse(p[at], layout, *(x[at] for x in uvw)).numpy()
        assert np.array_equal(data, alone)
        got = walk_sparse_all(layout, data)
        for i, (b, tree) in enumerate(zip(walked, trees, strict=True)):
            supports = [node_support(tree, j) for j in range(tree.size)]
            u, v, w = (x[b].tolist() for x in uvw)
            assert got[i] == walk_sparse(tree, DenseNodes(p[b], supports, v), u, w)
