"""The seeds' other tree methods on hand-made inputs: GTCP's cost, threshold and selection, Goose's
spine trees, PTD's progressive tree and pool, STAND + spine, and the method names.

Losslessness of every method is in the shared harnesses (test_engine_greedy, test_engine_sampling,
test_batch, test_verify); these tests pin down what each method drafts.
"""

from __future__ import annotations

import time

import pytest
import torch

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tests.conftest import tiny_llama
from tts_service.config import (
    GooseDrafterConfig,
    GtcpDrafterConfig,
    PtdDrafterConfig,
    RecyclingDrafterConfig,
    StandDrafterConfig,
    StandSpineDrafterConfig,
    resolve_tree_path,
)
from tts_service.drafters.base import DraftContext, NodeTopK
from tts_service.drafters.goose import AdjacencyTable, GooseDrafter, spine_tree_budget
from tts_service.drafters.gt import GtSizedDrafter, GtTreeDrafter, OnPathStats
from tts_service.drafters.matching import ExactMatchIndex
from tts_service.drafters.methods import AUTO_METHOD, method_drafter
from tts_service.drafters.ptd import ProgressiveTree, PtdDrafter, merge_trie
from tts_service.drafters.recycling import TokenRecyclingDrafter
from tts_service.drafters.registry import new_gt_stats
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_spine import StandSpineDrafter, spine_budget
from tts_service.engine.cost import (
    CostModel,
    VerifyCost,
    context_bucket,
    gt_count,
    measure_verify_cost,
    worth_growing,
)
from tts_service.engine.tree import load_tree_shape
from tts_service.engine.verify import Acceptance

# CPU-like: one token is a matrix-vector product, two are a matrix product, then ~linear
CPU = VerifyCost((1, 2, 8, 16, 64, 128), (0.053, 0.088, 0.094, 0.113, 0.2, 0.3), 256)
STEEP = VerifyCost((1, 2, 128), (0.05, 0.06, 1.32), 256)  # 10 ms per extra token
GPU = VerifyCost((1, 2, 64, 128), (0.020, 0.0201, 0.0205, 0.030), 256)  # flat up to 64


def _topk(n: int, vocab: int = 16) -> NodeTopK:
    ids = torch.arange(10).repeat(n, 1) % vocab
    return NodeTopK(ids, torch.full((n, 10), 0.1, dtype=torch.float64))


# -- GTCP: cost curve, threshold, selection ---------------------------------------------------


def test_fit_makes_the_cost_curve_monotone_and_interpolates():
    c = VerifyCost.fit((1, 2, 4), (0.05, 0.04, 0.06), 100)
    assert c.seconds == (0.05, 0.05, 0.06)
    assert c.time(3) == pytest.approx(0.055) and c.time(8) == pytest.approx(0.08)  # extrapolated
    assert c.time(3) - c.time(2) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="non-decreasing"):
        VerifyCost((1, 2), (0.2, 0.1), 10)


def test_gt_count_keeps_the_nodes_worth_their_cost_by_hand():
    # one draft node at 0.2: (1.2)/T(2)=13.6/s < 1/T(1)=18.9/s, so none is kept on the CPU...
    assert gt_count([0.2], CPU, 10) == 0
    # ...but seven good nodes together pay for the jump: (1 + 7 * 0.2) / T(8) = 25.5/s
    assert gt_count([0.2] * 7, CPU, 10) == 7
    # hand-made decaying α̂: the best rate is at k = 5 (checked by brute force)
    alphas = [0.6, 0.4, 0.3, 0.2, 0.12, 0.003, 0.002, 0.001]
    rates = [(1 + sum(alphas[:k])) / CPU.time(k + 1) for k in range(len(alphas) + 1)]
    assert gt_count(alphas, CPU, 8) == max(range(len(rates)), key=rates.__getitem__) == 5
    # where tree tokens are nearly free, everything with α̂ > c ≈ 0 is kept, up to the cap
    assert gt_count(alphas, GPU, 8) == 8 and gt_count(alphas, GPU, 3) == 3


def test_worth_growing_looks_past_the_first_token_jump():
    assert not worth_growing(CPU, 1, 1.0, 0.3, 2)  # only one more token allowed: not worth it
    assert worth_growing(CPU, 1, 1.0, 0.3, 16)  # a bigger tree at this quality is
    assert not worth_growing(CPU, 8, 2.0, 0.001, 128)
    assert worth_growing(GPU, 40, 2.0, 0.01, 64)


def test_measured_cost_curve_is_monotone_and_calibrates_in_seconds():
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    t0 = time.perf_counter()
    cost = measure_verify_cost(model, 200, sizes=(1, 4, 16, 64, 256), repeats=2)
    assert time.perf_counter() - t0 < 30  # seconds, not minutes (SmolLM2 here: ~6 s)
    assert cost.context_len == 200
    assert all(b >= a for a, b in zip(cost.seconds, cost.seconds[1:], strict=False))
    assert cost.time(256) > cost.time(1)  # a 256-token forward is measurably dearer


def test_cost_model_measures_again_when_contexts_grow_into_a_new_bucket():
    asked = []

    def fake_measure(n: int) -> VerifyCost:
        asked.append(n)
        return CPU

    costs = CostModel(fake_measure, max_context=10_000)
    for n in (10, 200, 256, 300, 900, 2000, 9000):
        costs.at(n)
    assert asked == [256, 1024, 4096, 10_000 - 128]
    assert context_bucket(257) == 1024 and context_bucket(1) == 256


def _stand_store() -> InMemoryNgramStore:
    store = InMemoryNgramStore()
    # after token 1: 2 (0.9); after 2: 3 (0.8); after 3: 4 (0.5) / 5 (0.3)
    store.add(
        [
            NgramRow((1,), (2, 9), (0.9, 0.1)),
            NgramRow((2,), (3, 9), (0.8, 0.2)),
            NgramRow((3,), (4, 5, 9), (0.5, 0.3, 0.2)),
            NgramRow((4,), (6,), (1.0,)),
        ]
    )
    return store


def test_gt_dynamic_tree_follows_path_probabilities_and_the_measured_cost():
    ctx = DraftContext([7, 1], prompt_len=1, max_nodes=64, greedy=True)
    cfg = GtcpDrafterConfig(stochastic=False)
    gpu = GtTreeDrafter(cfg, _stand_store(), CostModel.fixed(GPU)).draft(ctx)
    # every stored continuation is cheap enough on the flat curve: 2, 9 | 3, 9 | 4, 5, 9 | 6
    assert gpu.path_tokens(gpu.size - 1)  # well formed
    assert sorted(gpu.tokens[1:]) == [2, 3, 4, 5, 6, 9, 9, 9]
    cpu = GtTreeDrafter(cfg, _stand_store(), CostModel.fixed(STEEP)).draft(ctx)
    # 10 ms a token: 2 (α̂ 0.9) and 3 (0.72) pay, 4 (0.36) would lower the rate at any size
    assert cpu.tokens == (1, 2, 3) and cpu.parents == (-1, 0, 1)


def test_gt_dynamic_tree_under_sampling_draws_children_in_gumbel_order_with_q():
    ctx = DraftContext([7, 1], prompt_len=1, max_nodes=64)
    tree = GtTreeDrafter(GtcpDrafterConfig(), _stand_store(), CostModel.fixed(GPU)).draft(ctx)
    assert all(tree.sampled[1:])
    for node, kids in enumerate(tree.children):
        if kids:
            assert tree.q[node] is not None  # the snapshot the RRS verifier needs
            assert len({tree.tokens[k] for k in kids}) == len(kids)  # without replacement


def test_gt_sized_static_tree_is_small_on_the_cpu_and_large_on_the_gpu():
    store = _stand_store()
    cfg = StandDrafterConfig(num_nodes=80, tree="stand-80", sizing="gt")
    freq = [1.0, 0.2, 0.085, 0.083, 0.04] + [0.01] * 76
    ctx = DraftContext([7, 1], prompt_len=1, max_nodes=80)
    cpu = GtSizedDrafter(StandDrafter(cfg, store), CostModel.fixed(CPU), OnPathStats(freq))
    gpu = GtSizedDrafter(StandDrafter(cfg, store), CostModel.fixed(GPU), OnPathStats(freq))
    cpu.draft(ctx)
    gpu.draft(ctx)
    assert cpu.kept == 0  # 1.2 / 88 ms < 1 / 53 ms: plain decoding is faster here
    assert gpu.kept > 60  # up to where the flat curve turns up
    # evidence that nodes 1-4 are accepted 90% of the time: now a 4-node tree pays on the CPU
    cpu.stats.drafted[1:5] = [50.0] * 4
    cpu.stats.hits[1:5] = [45.0] * 4
    cpu.draft(ctx)
    assert cpu.kept >= 4 and cpu.threshold > 0.5


def test_gt_sized_drafter_keeps_exactly_the_nodes_worth_their_cost_not_a_prefix():
    # stand-80 starts: node 1 and 2 are root children, 3 is 1's child, 4 is 3's child
    prior = [1.0, 0.9, 0.01, 0.8, 0.7] + [0.01] * 76
    cfg = StandDrafterConfig(num_nodes=80, tree="stand-80", sizing="gt", stochastic=False)
    gt = GtSizedDrafter(
        StandDrafter(cfg, _stand_store()), CostModel.fixed(STEEP), OnPathStats(prior)
    )
    ctx = DraftContext([7, 1], prompt_len=1, max_nodes=80, greedy=True)
    gt.draft(ctx)  # the first step also explores
    gt.draft(ctx)
    # 10 ms a token: 1, 3, 4 pay (rate 42.5/s at three nodes); node 2 (α̂ 0.01) would not
    assert gt.kept == 3 and sorted(gt._offered) == [1, 3, 4]
    assert gt.threshold == pytest.approx(0.7)


def test_gt_sized_drafter_counts_drafts_and_hits_per_shape_node():
    cfg = StandDrafterConfig(num_nodes=80, tree="stand-80", sizing="gt", stochastic=False)
    gt = GtSizedDrafter(
        StandDrafter(cfg, _stand_store()), CostModel.fixed(GPU), OnPathStats([1.0] * 81)
    )
    tree = gt.draft(DraftContext([7, 1], prompt_len=1, max_nodes=80, greedy=True))
    two, three = tree.tokens.index(2), tree.tokens.index(3)  # the store's chain 1 -> 2 -> 3
    assert tree.parents[three] == two
    gt.observe(tree, Acceptance((two, three), (2, 3), 4), _topk(tree.size))
    shape_nodes = [gt._shape_ids[v] for v in (two, three)]
    assert all(gt.stats.hits[v] == 1.0 for v in shape_nodes)
    # counted over the nodes the store could fill, not the 80 slots offered
    assert gt.kept == 80 and sum(gt.stats.drafted) == tree.size - 1 < 80


def test_on_path_statistics_follow_the_last_offers_and_leave_unoffered_nodes_alone():
    stats = OnPathStats([1.0, 0.5, 0.5])
    for _ in range(200):  # node 1 accepted every time, node 2 offered but never accepted
        stats.record([1, 2], [1])
    _, a1, a2 = stats.alphas()
    assert a1 > 0.95 and a2 < 0.05
    before = list(stats.drafted)
    stats.record([1], [])  # node 2 not offered: its evidence stays as it was
    assert stats.drafted[2] == before[2] and stats.drafted[1] != before[1]
    # no calibrated frequency in Token Recycling's file: the prior halves with depth
    prior = new_gt_stats(RecyclingDrafterConfig(sizing="gt")).prior
    assert prior[:2] == [1.0, 0.5] and min(prior) == 0.5 ** max(_depths("recycling-80"))


def _depths(tree: str) -> list[int]:
    shape = load_tree_shape(resolve_tree_path(tree))
    depth = [0]
    for p in shape.parents[1:]:
        depth.append(depth[p] + 1)
    return depth


def test_gt_statistics_must_fit_the_tree():
    with pytest.raises(ValueError, match="on_path_frequency"):
        OnPathStats([0.5, 0.5])
    cfg = StandDrafterConfig(tree="stand-80", sizing="gt")
    with pytest.raises(ValueError, match="another tree"):
        GtSizedDrafter(
            StandDrafter(cfg, _stand_store()),
            CostModel.fixed(CPU),
            OnPathStats([1.0, 0.5, 0.5, 0.25]),
        )


# -- exact matches, Goose ---------------------------------------------------------------------


def test_exact_match_index_finds_matches_across_documents_longest_first():
    index = ExactMatchIndex((3, 2))
    a, b = index.new_doc(), index.new_doc()
    index.sync(a, [1, 2, 3, 4, 5, 6])
    index.sync(b, [9, 2, 3])
    found = index.matches(b, 3)
    assert [(m.order, m.continuation) for m in found] == [(2, (4, 5, 6))]
    index.sync(b, [9, 2, 3, 4])
    assert index.matches(b, 2)[0].order == 3 and index.matches(b, 2)[0].continuation == (5, 6)


def test_exact_match_index_forgets_finished_documents_past_its_token_bound():
    index = ExactMatchIndex((2,), max_tokens=10)
    old, live = index.new_doc(), index.new_doc()
    index.sync(old, [1, 2, 3, 4, 5, 6])
    index.sync(live, [7, 8, 1, 2])
    assert index.matches(live, 2)[0].continuation == (3, 4)
    index.sync(live, [7, 8, 1, 2, 9])  # 11 tokens > 10: the other document goes
    assert index.size == 5 and index.docs[old] == []
    index.sync(live, [7, 8, 1, 2, 9, 7, 8])
    assert index.matches(live, 3)[0].continuation == (1, 2, 9)  # the live one still indexes


def test_goose_budget_split_is_the_papers_worked_example():
    assert spine_tree_budget(59, 5, 0.30, 0.5) == (5, 27, [11, 5, 3, 2, 2])
    assert spine_tree_budget(59, 7, 0.30, 0.5) == (7, 26, [10, 5, 3, 2, 2, 1, 1])
    assert spine_tree_budget(59, 0, 0.30, 0.5)[:2] == (0, 29)  # no match: a TR-only tree


def _goose_with_table(vocab: int = 32) -> GooseDrafter:
    table = AdjacencyTable(vocab, 10)
    # every token t is followed by t+1 (0.6), t+2 (0.3), t+3 (0.05)
    toks = list(range(vocab))
    ids = torch.tensor([[(t + j) % vocab for j in (1, 2, 3)] for t in toks])
    probs = torch.tensor([[0.6, 0.3, 0.05]] * vocab, dtype=torch.float64)
    table.update([-1] * vocab, toks, ids, probs)
    drafter = GooseDrafter(GooseDrafterConfig(num_nodes=20), table)
    drafter.start([])
    return drafter


def test_goose_lays_the_spine_first_and_branches_off_it():
    drafter = _goose_with_table()
    # "5 6 7" earlier; the suffix matches under n=3 only, 6 tokens follow: no bypass
    tokens = [5, 6, 7, 20, 21, 22, 5, 6, 7]
    tree = drafter.draft(DraftContext(tokens, prompt_len=3, max_nodes=20))
    spine = [1, 2, 3, 4, 5, 6]
    assert [tree.tokens[v] for v in spine[:3]] == [20, 21, 22]
    for v in range(tree.size):  # the spine child is tried first at every spine node
        kids = tree.children[v]
        if v in (0, *spine[:2]) and kids:
            assert kids[0] == (spine[spine.index(v) + 1] if v else 1)
        assert len({tree.tokens[k] for k in kids}) == len(kids)  # distinct children
    assert tree.size - 1 <= 20 and tree.size > 8  # branches were hung
    assert tree.tokens[tree.children[0][1]] == 8  # the root's best successor (7 -> 8)
    assert not any(tree.sampled)


def test_goose_bypasses_to_a_chain_on_a_long_match_and_learns_the_spine_rate():
    drafter = _goose_with_table(64)
    long = list(range(40, 52))
    tokens = [3, 4, 5, *long, 9, 3, 4, 5]
    tree = drafter.draft(DraftContext(tokens, prompt_len=3, max_nodes=20))
    assert tree.tokens[1:13] == tuple(long)  # the match's continuation...
    assert tree.parents == tuple(range(-1, tree.size - 1))  # ...as a plain chain
    drafter.observe(tree, Acceptance((1, 2, 3), (40, 41, 42), 43), _topk(tree.size))
    assert drafter.spine_rate == pytest.approx(0.7 * 0.3 + 0.3 * 3 / (tree.size - 1))
    # harvesting: every node's successors were overwritten, rejected ones included
    assert drafter.table.successors(50, 51)[0][0] == 0


def test_goose_falls_back_to_the_root_alone_with_nothing_to_draft():
    drafter = GooseDrafter(GooseDrafterConfig(), AdjacencyTable(16, 10))
    drafter.start([])
    assert drafter.draft(DraftContext([1, 2, 3], 3, 59)).size == 1


# -- PTD --------------------------------------------------------------------------------------


def test_progressive_tree_grows_by_predictions_within_width_and_steps_when_deep():
    t = ProgressiveTree([10, 11], max_children=2, max_depth=4, max_nodes=50)
    t.expand({0: 12, 1: 13})  # root gets 12 next to 11; 11 gets 13
    assert [t.nodes[v].token for v, _ in t.order()] == [10, 11, 12, 13]
    t.expand({0: 11, 1: 14, 2: 15, 3: 16})  # 11 is already a child; the root is full anyway
    assert t.depth() == 4 and len(t.order()) == 7
    t.expand({v: 20 + v for v, _ in t.order()})  # depth 5 > 4: step to the earliest child
    assert t.nodes[t.root].token == 11
    assert t.depth() == 4 and {t.nodes[v].token for v, _ in t.order()} >= {11, 13, 14, 16}
    assert 12 not in {t.nodes[v].token for v, _ in t.order()}  # its branch was pruned


def test_merge_trie_is_a_union_that_keeps_first_insertion_order():
    pool = {1: {2: {}}}
    merge_trie(pool, {1: {3: {}}, 4: {}}, depth=6)
    assert pool == {1: {2: {}, 3: {}}, 4: {}} and list(pool) == [1, 4]
    merge_trie(pool, {5: {6: {7: {}}}}, depth=2)
    assert pool[5] == {6: {}}  # cut at the depth limit


def test_ptd_drafts_pool_candidates_for_the_root_token_and_the_perturbation_tree():
    drafter = PtdDrafter(PtdDrafterConfig(candidate_nodes=4, perturbation_nodes=16), seed=1)
    drafter.start([3, 4, 5])
    ctx = DraftContext([3, 4, 5], prompt_len=3, max_nodes=12)
    tree = drafter.draft(ctx)
    assert tree.size == 1 + len(drafter.tree.order())  # empty pool: perturbation only
    # the target predicts "after token t comes t+1" everywhere
    topk = NodeTopK((torch.tensor(tree.tokens)[:, None] + 1) % 64, torch.ones(tree.size, 1))
    drafter.observe(tree, Acceptance((), (), 6), topk)
    assert all(drafter.pool[t] for t in set(tree.tokens[1:]))  # every node's subtree was filed
    root = tree.tokens[1]
    tree2 = drafter.draft(DraftContext([3, 4, 5, root], prompt_len=3, max_nodes=12))
    filed = list(drafter.pool[root])
    first = [tree2.tokens[c] for c in tree2.children[0]][: len(filed)]
    assert first == filed[: len(first)] and root + 1 in filed  # pool candidates come first


# -- STAND + spine ----------------------------------------------------------------------------


def test_spine_budget_front_loads_the_branches():
    m, alloc = spine_budget(16, 20, 0.5)
    assert m == 8 and alloc == [7, 1, 0, 0, 0, 0, 0, 0]
    assert spine_budget(16, 3, 0.5) == (3, [8, 3, 2])


def test_stand_spine_copies_an_earlier_trajectory_and_needs_the_stores_consensus():
    store = InMemoryNgramStore()
    index = ExactMatchIndex((6, 5, 4, 3, 2))
    cfg = StandSpineDrafterConfig(num_nodes=12, tree="stand-80", min_match=3, stochastic=False)
    first = StandSpineDrafter(cfg, store, index)
    first.start([1, 2])
    index.sync(first.doc, [1, 2, 30, 31, 32, 33, 34, 35, 36])  # trajectory 1's text
    second = StandSpineDrafter(cfg, store, index)
    second.start([1, 2])
    ctx = DraftContext([1, 2, 30, 31, 32], prompt_len=2, max_nodes=12, greedy=True)
    tree = second.draft(ctx)
    assert tree.tokens[1:5] == (33, 34, 35, 36) and second.spine_steps == 1
    # the store disagrees on the first spine token: no spine, a plain STAND tree
    store.add([NgramRow((30, 31, 32), (7, 8, 9), (0.5, 0.3, 0.2))])
    tree = second.draft(ctx)
    assert second.spine_steps == 1 and 33 not in tree.tokens
    # it agrees (33 in the top 3): spine first, STAND branches after it, 33 never repeated
    store.add([NgramRow((30, 31, 32), (33, 8, 9), (1.0, 0.0, 0.0))] * 3)
    tree = second.draft(ctx)
    assert second.spine_steps == 2 and tree.children[0][0] == 1 and tree.tokens[1] == 33
    assert [tree.tokens[c] for c in tree.children[0]].count(33) == 1


# -- method names -----------------------------------------------------------------------------


def test_method_names_build_their_drafter_fields_and_auto_follows_the_device():
    assert method_drafter("stand-gt", {"stand": {"num_nodes": 16, "tree": "stand-80"}}) == {
        "kind": "stand",
        "num_nodes": 80,  # GT decides the size; the whole tree is the cap
        "tree": "stand-80",
        "sizing": "gt",
    }
    assert method_drafter("stand+spine", {})["kind"] == "stand_spine"
    cpu, gpu = method_drafter("auto", {}, "cpu"), method_drafter("auto", {}, "cuda:1")
    assert cpu == method_drafter(AUTO_METHOD["cpu"], {}) and gpu == method_drafter(
        AUTO_METHOD["cuda"], {}
    )
    with pytest.raises(ValueError, match="unknown method"):
        method_drafter("eagle", {})


def _recycling_with_table() -> TokenRecyclingDrafter:
    drafter = TokenRecyclingDrafter(RecyclingDrafterConfig(num_nodes=40), 16)
    drafter.table[:, :3] = torch.tensor(
        [[(t + 1) % 16, (t + 2) % 16, (t + 5) % 16] for t in range(16)]
    )
    return drafter


@pytest.mark.parametrize("make", ["stand", "recycling"])
def test_a_static_drafter_returns_each_tree_node_s_shape_node(make):
    """`draft_subtree`'s shape ids follow the tree: a node's shape parent is its parent's."""
    drafter = (
        StandDrafter(StandDrafterConfig(num_nodes=80, stochastic=False), _stand_store())
        if make == "stand"
        else _recycling_with_table()
    )
    keep = frozenset(range(1, 30))
    shaped = drafter.draft_subtree(DraftContext([7, 1], 1, 80, greedy=True), keep)
    ids, tree = shaped.shape_ids, shaped.tree
    assert len(ids) == tree.size > 2 and ids[0] == 0 and set(ids[1:]) <= keep
    assert all(drafter.shape.parents[ids[v]] == ids[tree.parents[v]] for v in range(1, tree.size))
