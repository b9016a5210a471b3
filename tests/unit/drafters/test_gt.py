"""GT sizing and GTCP on hand-made inputs: the dynamic tree on path probabilities and the
measured cost, the sized static tree's threshold and selection (not a prefix), and the on-path
statistics.

Losslessness is in the shared harnesses (tests/unit/engine/: test_decode, test_decode_sampling,
test_batch, test_verify); these tests pin down what the method drafts.
"""

from __future__ import annotations

import numpy as np
import pytest

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tests.unit.engine.test_cost import CPU, GPU
from tts_service.config import resolve_tree_path
from tts_service.drafters.gt import GtSizedDrafter, OnPathStats, new_gt_stats
from tts_service.drafters.gtcp import GtcpDrafterConfig, GtTreeDrafter
from tts_service.drafters.recycling import RecyclingDrafterConfig
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.cost import CostModel, VerifyCost
from tts_service.engine.seam import DraftContext, NodeTopK
from tts_service.engine.tree import load_tree_shape
from tts_service.engine.verify import Acceptance

STEEP = VerifyCost((1, 2, 128), (0.05, 0.06, 1.32), 256)  # 10 ms per extra token


def _topk(n: int, vocab: int = 16) -> NodeTopK:
    ids = np.tile(np.arange(10), (n, 1)) % vocab
    return NodeTopK(ids, np.full((n, 10), 0.1))


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
