"""PTD on hand-made inputs: the progressive tree, the pool's trie merge, and a draft of pool
candidates plus the perturbation tree.

Losslessness is in the shared harnesses (tests/unit/engine/: test_decode, test_decode_sampling,
test_batch, test_verify); these tests pin down what the method drafts.
"""

from __future__ import annotations

import numpy as np

from tts_service.drafters.ptd import ProgressiveTree, PtdDrafter, PtdDrafterConfig, merge_trie
from tts_service.engine.seam import DraftContext, NodeTopK
from tts_service.engine.verify import Acceptance


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
    topk = NodeTopK((np.array(tree.tokens)[:, None] + 1) % 64, np.ones((tree.size, 1)))
    drafter.observe(tree, Acceptance((), (), 6), topk)
    assert all(drafter.pool[t] for t in set(tree.tokens[1:]))  # every node's subtree was filed
    root = tree.tokens[1]
    tree2 = drafter.draft(DraftContext([3, 4, 5, root], prompt_len=3, max_nodes=12))
    filed = list(drafter.pool[root])
    first = [tree2.tokens[c] for c in tree2.children[0]][: len(filed)]
    assert first == filed[: len(first)] and root + 1 in filed  # pool candidates come first
