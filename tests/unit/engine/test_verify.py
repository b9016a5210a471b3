"""Verifier exactness (docs/design.md#testing-exactness): enumerate every random outcome of a node
verifier on a small vocabulary and compare the emitted distribution with p."""

from __future__ import annotations

import math

import pytest
import torch

from tts_service.engine import verify
from tts_service.engine.acceptance import DenseNodes
from tts_service.engine.tree import DraftTree, SparseDist, TreeBuilder
from tts_service.engine.verify import (
    accept_greedy,
    accept_match,
    draw_match,
    ordered_sum,
    proposal,
    rrs_step,
    sample_and_match_step,
    sparse_match_step,
    sparse_rrs_step,
    verify_greedy,
    verify_node,
    verify_sampling,
)

V = 7


def _rand_dist(gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    x = torch.rand(V, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        x[torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return x / x.sum()


def _sparse(q: torch.Tensor) -> SparseDist:
    ids = torch.nonzero(q).flatten().tolist()
    return SparseDist(tuple(ids), tuple(float(q[i]) for i in ids))


def emitted_distribution(p, q, spec, lossy_iid: bool = False) -> torch.Tensor:
    """Exact output distribution of one node with children `spec`: a list of deterministic token
    ids or the string "q" for a child sampled without replacement from q minus earlier siblings."""
    out = torch.zeros(V, dtype=torch.float64)

    def rec(r, tried, j, prob):
        nonlocal out
        if j == len(spec):
            out += prob * r  # bonus from the residual
            return
        if spec[j] != "q":
            x = spec[j]
            a, r2 = sample_and_match_step(r, x)
            out[x] += prob * a
            rec(r2, [*tried, x], j + 1, prob * (1 - a))
            return
        qi = proposal(_sparse(q), tried, V)
        if qi.sum() == 0:
            out += prob * r
            return
        for x in torch.nonzero(qi).flatten().tolist():
            if lossy_iid:  # SpecInfer's formula for i.i.d. drafts, applied to w/o-replacement draws
                a = min(1.0, float(r[x] / q[x]))
                rest = torch.clamp(r - q, min=0)
                r2 = rest / rest.sum() if rest.sum() > 0 else r
            else:
                a, r2 = rrs_step(r, qi, x)
            out[x] += prob * qi[x] * a
            rec(r2, [*tried, x], j + 1, prob * qi[x] * (1 - a))

    rec(p.clone(), [], 0, 1.0)
    return out


SPECS = {
    "deterministic-1": [3],
    "deterministic-3": [3, 0, 5],
    "stochastic-1": ["q"],
    "stochastic-3": ["q", "q", "q"],
    "stochastic-exhausts-q": ["q"] * 6,
    "mixed-spine-then-3": [4, "q", "q", "q"],
    "mixed-two-spines": [1, 2, "q", "q"],
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", range(8))
def test_node_verifier_output_equals_p(name, seed):
    gen = torch.Generator().manual_seed(seed)
    p = _rand_dist(gen, zeros=seed % 3)
    q = _rand_dist(gen, zeros=2)
    err = (emitted_distribution(p, q, SPECS[name]) - p).abs().max().item()
    assert err < 1e-12, err


def test_the_iid_formula_is_lossy_so_the_harness_can_fail():
    """Test of the test: the with-replacement formula on without-replacement draws is caught."""
    worst = 0.0
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        p, q = _rand_dist(gen), _rand_dist(gen, zeros=2)
        out = emitted_distribution(p, q, ["q", "q", "q"], lossy_iid=True)
        worst = max(worst, (out - p).abs().max().item())
    assert worst > 1e-2


def test_fallback_from_p_instead_of_residual_is_caught():
    gen = torch.Generator().manual_seed(0)
    p = _rand_dist(gen)
    # deterministic child 3 rejected, then the bonus drawn from p (PTD's Algorithm 2 typo)
    wrong = torch.zeros(V, dtype=torch.float64)
    wrong[3] += p[3]
    wrong += (1 - p[3]) * p
    assert (wrong - p).abs().max().item() > 1e-2


def _node_tree(p_children: list, q: torch.Tensor | None, gen: torch.Generator) -> DraftTree:
    """Build a one-node tree, sampling "q" children without replacement like a drafter would."""
    b = TreeBuilder(0)
    tried: list[int] = []
    for c in p_children:
        if c == "q":
            qi = proposal(_sparse(q), tried, V)
            x = int(torch.multinomial(qi, 1, generator=gen))
            b.add(0, x, sampled=True)
        else:
            x = c
            b.add(0, x)
        tried.append(x)
    if q is not None:
        b.set_q(0, _sparse(q))
    return b.build()


@pytest.mark.statistical
def test_verify_node_walker_matches_p_by_monte_carlo():
    """The walker (children order, uniforms, bonus) on a mixed node, 20k draws, 5 sigma."""
    gen = torch.Generator().manual_seed(123)
    p, q = _rand_dist(gen), _rand_dist(gen, zeros=1)
    counts = torch.zeros(V, dtype=torch.float64)
    n = 20_000
    for _ in range(n):
        tree = _node_tree([2, "q", "q"], q, gen)
        acc = verify_sampling(tree, torch.stack([p] + [p] * (tree.size - 1)), gen)
        counts[acc.tokens[0] if acc.tokens else acc.bonus] += 1
    sigma = torch.sqrt(p * (1 - p) / n)
    assert ((counts / n - p).abs() <= 5 * sigma + 1e-9).all(), (counts / n, p)


def test_verify_node_returns_residual_without_children():
    p = torch.tensor([0.2, 0.8], dtype=torch.float64)
    child, r = verify_node(DraftTree.root_only(0), 0, p, torch.Generator())
    assert child is None and torch.equal(r, p)


def test_greedy_follows_argmax_and_prefers_first_matching_child():
    #        0
    #      /   \
    #     1(5)  2(6)
    #     |
    #     3(7)
    tree = DraftTree((9, 5, 6, 7), (-1, 0, 0, 1), (False,) * 4, (None,) * 4)
    logits = torch.full((4, 10), -1.0)
    logits[0, 5] = 1.0  # root -> 5: accept node 1
    logits[1, 7] = 1.0  # node 1 -> 7: accept node 3
    logits[3, 2] = 1.0  # node 3 -> 2: bonus
    acc = verify_greedy(tree, logits)
    assert acc.path == (1, 3) and acc.tokens == (5, 7) and acc.bonus == 2
    logits[0, 5], logits[0, 4] = -1.0, 1.0  # root -> 4: nothing accepted ("not 5, not 6")
    acc = verify_greedy(tree, logits)
    assert acc.path == () and acc.bonus == 4 and acc.committed == (4,)


def test_sampling_accepts_a_certain_draft_and_never_an_impossible_one():
    tree = DraftTree.chain(0, [3, 1])
    p = torch.zeros(3, 5, dtype=torch.float64)
    p[0, 3] = 1.0  # root: 3 for sure
    p[1, 2] = 1.0  # after 3: 2 for sure, so the draft 1 is impossible
    p[2, 4] = 1.0
    for seed in range(20):
        acc = verify_sampling(tree, p, torch.Generator().manual_seed(seed))
        assert acc.committed == (3, 2)


def test_device_greedy_walk_equals_the_logits_walk():
    tree = DraftTree((9, 5, 6, 7), (-1, 0, 0, 1), (False,) * 4, (None,) * 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(4, 10, generator=gen)
        logits[0, 5] += 2 * float(torch.rand((), generator=gen))
        assert accept_greedy(tree, logits.argmax(-1).tolist()) == verify_greedy(tree, logits)


def test_matched_thresholds_renormalise_over_rejected_siblings():
    """Children 3, 3, 0 of the root: the duplicate can never be accepted, and 0 is accepted
    exactly when its uniform is below p(0) / (1 - p(3))."""
    rows = [[0.3, 0.1, 0.1, 0.5], [0.25] * 4, [0.25] * 4, [0.25] * 4]
    p = torch.tensor(rows, dtype=torch.float64)
    tree = DraftTree((2, 3, 3, 0), (-1, 0, 0, 0), (False,) * 4, (None,) * 4)
    drawn = draw_match(tree, p, torch.Generator().manual_seed(0)).tolist()
    assert drawn[:3] == [0.5, 0.5, 0.3]
    threshold = 0.3 / (1 - 0.5)

    def walk(u1: float, u2: float, u3: float):
        return accept_match(tree, [*drawn[:3], u1, u2, u3, *drawn[6:]])

    assert walk(0.49, 0.0, 0.99).path == (1,)
    assert walk(0.5, 0.0, threshold - 1e-9).path == (3,)  # the duplicate (node 2) is skipped
    rejected = walk(0.5, 0.0, threshold + 1e-9)
    assert rejected.path == () and rejected.bonus == int(drawn[6])
    assert rejected.bonus in (1, 2)  # the root's residual: p without 3 and 0


def test_a_child_holding_all_the_mass_left_is_accepted_with_probability_one():
    """p sums to 1 - 2^-52 in floating point, all of it on the drafted token. Its threshold must
    be exactly 1: a threshold of p(x) / 1 lets the largest uniform below 1 reject it, and the
    bonus then comes from an empty residual, a token of probability 0."""
    p = torch.tensor([[0.0, 1.0 - 2.0**-52, 0.0], [1 / 3] * 3], dtype=torch.float64)
    tree = DraftTree((0, 1), (-1, 0), (False, False), (None, None))
    drawn = draw_match(tree, p, torch.Generator().manual_seed(0)).tolist()
    assert drawn[-2:] == [0.0, 1.0]  # the residual masses: none left at the root
    largest_uniform = 1.0 - 2.0**-53
    acc = accept_match(tree, [drawn[0], largest_uniform, *drawn[2:]])
    assert acc.path == (1,) and acc.committed[0] == 1


@pytest.mark.statistical
def test_device_sample_and_match_commits_p_by_monte_carlo():
    """`draw_match` + `accept_match` on a depth-2 tree with a duplicate sibling, 20k draws, 5
    sigma: the first committed token is distributed as p at the root, and the second as p at the
    first token's node (the exact thresholds are checked above)."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.stack([_rand_dist(gen) for _ in range(4)])
    # root -> 3, 3, 0; node 1 (token 3) -> 5
    tree = DraftTree((2, 3, 3, 0, 5), (-1, 0, 0, 0, 1), (False,) * 5, (None,) * 5)
    p = torch.stack([rows[0], rows[1], rows[0], rows[2], rows[3]])
    n = 20_000
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        acc = accept_match(tree, draw_match(tree, p, gen).tolist())
        first[acc.committed[0]] += 1
        if acc.committed[0] == 3:
            second[acc.committed[1]] += 1
    sigma = torch.sqrt(rows[0] * (1 - rows[0]) / n)
    assert ((first / n - rows[0]).abs() <= 5 * sigma + 1e-9).all(), (first / n, rows[0])
    m = second.sum()
    sigma = torch.sqrt(rows[1] * (1 - rows[1]) / m)
    assert ((second / m - rows[1]).abs() <= 5 * sigma + 1e-9).all(), (second / m, rows[1])


def sparse_emitted_distribution(p, q, spec) -> torch.Tensor:
    """`emitted_distribution` with the host's sparse steps (`sparse_match_step`,
    `sparse_rrs_step`): p is seen only on the node's support and as its mass outside it."""
    qs = _sparse(q)
    support = list(dict.fromkeys([*qs.ids, *(x for x in spec if x != "q")]))
    mass_out = float(p.sum() - p[support].sum())
    out = torch.zeros(V, dtype=torch.float64)

    def dense(r) -> torch.Tensor:
        values, c = r
        d = p * c
        for s, v in values.items():
            d[s] = v
        return d / d.sum()

    def rec(r, tried, j, prob):
        nonlocal out
        if j == len(spec):
            out += prob * dense(r)
            return
        if spec[j] != "q":
            x = spec[j]
            a, r2 = sparse_match_step(r, mass_out, x)
            out[x] += prob * a
            rec(r2, [*tried, x], j + 1, prob * (1 - a))
            return
        qi = verify._without(qs, tried)
        if not qi:
            out += prob * dense(r)
            return
        for x, qx in qi.items():
            a, r2 = sparse_rrs_step(r, mass_out, qi, x)
            out[x] += prob * qx * a
            rec(r2, [*tried, x], j + 1, prob * qx * (1 - a))

    rec(({s: float(p[s]) for s in support}, 1.0), [], 0, 1.0)
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", range(8))
def test_the_sparse_host_verifier_output_equals_p(name, seed):
    """Rule (c) from p on the node's support alone (the batched decoder's host walk) emits p
    exactly, every spec of `test_node_verifier_output_equals_p`."""
    gen = torch.Generator().manual_seed(seed)
    p = _rand_dist(gen, zeros=seed % 3)
    q = _rand_dist(gen, zeros=2)
    err = (sparse_emitted_distribution(p, q, SPECS[name]) - p).abs().max().item()
    assert err < 1e-12, err


def test_the_sparse_bonus_inverts_the_support_then_the_outside():
    r = {1: 0.2, 3: 0.3, 4: 0.0}
    draws = [verify._draw(r, 0.5, w, outside=6) for w in (0.0, 0.19, 0.2, 0.49, 0.5, 0.99)]
    assert draws == [1, 1, 3, 3, 6, 6]
    assert verify._draw(r, 0.0, 1.0 - 2.0**-53, outside=6) == 3  # rounding never leaves r


def test_walk_sparse_follows_its_uniforms_and_residuals():
    """Root -> 2 (deterministic), then 5 sampled from q: with u accepting nothing, the bonus is
    drawn from the last residual; with u = 0 the first child is taken and its node walked."""
    q = SparseDist((5, 6), (0.5, 0.5))
    tree = DraftTree((0, 2, 5), (-1, 0, 0), (False, False, True), (q, None, None))
    root = verify.SparseNode([5, 6, 2], [0.1, 0.2, 0.3], 0.4, outside=1)
    leaf = verify.SparseNode([], [], 1.0, outside=3)
    acc = verify.walk_sparse(tree, [root, leaf, leaf], [0, 0.99, 0.99], [0.0, 0.5, 0.5])
    assert acc.path == () and acc.bonus == 1  # rejecting 2 and 5 left mass only outside
    acc = verify.walk_sparse(tree, [root, leaf, leaf], [0, 0.0, 0.0], [0.0, 0.5, 0.5])
    assert acc.path == (1,) and acc.bonus == 3  # the leaf's bonus: its outside draw


def _walk_nodes(tree: DraftTree, p: torch.Tensor) -> DenseNodes:
    """Every node's `SparseNode` from the dense p `[N, V]`, as the engine's CPU walk gets them."""
    return DenseNodes(
        p, [verify.node_support(tree, i) for i in range(tree.size)], [0.5] * tree.size
    )


def test_expected_length_of_a_chain_is_the_product_of_its_probabilities():
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([_rand_dist(gen) for _ in range(3)])
    b = TreeBuilder(0)
    b.add(b.add(0, 2), 5)
    tree = b.build()
    want = 1 + p[0, 2] + p[0, 2] * p[1, 5]
    assert verify.expected_length(tree, _walk_nodes(tree, p)) == pytest.approx(float(want))


@pytest.mark.parametrize("seed", range(3))
def test_expected_length_is_the_mean_of_the_walks(seed):
    """Drawn children (rule (c)) under the root, deterministic ones (with a duplicate) under
    the first drawn child: the exact expectation equals the mean committed length of
    `walk_sparse` over many uniforms."""
    gen = torch.Generator().manual_seed(seed)
    q = _rand_dist(gen, zeros=2)
    qs = _sparse(q)
    b = TreeBuilder(0)
    b.set_q(0, qs)
    x1 = b.add(0, qs.ids[0], sampled=True)
    b.add(0, qs.ids[1], sampled=True)
    c = b.add(x1, 4)
    b.add(x1, 4)  # a duplicate sibling is never accepted
    b.add(x1, 1)
    b.add(c, 6)
    tree = b.build()
    p = torch.stack([_rand_dist(gen) for _ in range(tree.size)])
    nodes = _walk_nodes(tree, p)
    n = 20_000
    u = torch.rand(n, tree.size, generator=gen, dtype=torch.float64).tolist()
    lengths = torch.tensor(
        [1.0 + len(verify.walk_sparse(tree, nodes, uu, [0.5] * tree.size).path) for uu in u],
        dtype=torch.float64,
    )
    want = verify.expected_length(tree, nodes)
    assert abs(lengths.mean().item() - want) <= 5 * lengths.std().item() / n**0.5, (
        lengths.mean(),
        want,
    )


def test_the_reference_adds_floats_in_order_whatever_the_python():
    """The host walks' sums are left to right, as the compiled kernels add (Python 3.12's `sum`
    compensates: 1 + 1e-16 + 1e-16 would read one ulp above 1)."""
    values = [1.0, 1e-16, 1e-16]
    assert ordered_sum(values) == 1.0 and math.fsum(values) > 1.0
    assert ordered_sum([]) == 0.0
    assert ordered_sum(x / 10 for x in range(4)) == ((0.0 + 0.1) + 0.2) + 0.3
