"""Token Recycling on hand-made token sequences, with the reason next to each case."""

from __future__ import annotations

import numpy as np

from tests.unit.drafters.test_pld import _ctx
from tts_service.drafters.recycling import RecyclingDrafterConfig, TokenRecyclingDrafter
from tts_service.engine.seam import NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


def _observe(d: TokenRecyclingDrafter, tree: DraftTree, rows: list[list[int]]) -> None:
    ids = np.array(rows, np.int64)
    d.observe(tree, Acceptance((), (), 0), NodeTopK(ids, np.ones(ids.shape)))


def test_recycling_fills_a_tree_from_the_table_and_prunes_unknown_tokens():
    d = TokenRecyclingDrafter(RecyclingDrafterConfig(k=2, num_nodes=80), vocab_size=20)
    # template order: node 1 = rank 0 of root, node 2 = rank 0 of node 1, node 3 = rank 1 of root
    _observe(d, DraftTree.chain(4, [7]), [[7, 9], [11, 12]])  # 4 -> (7, 9); 7 -> (11, 12)
    tree = d.draft(_ctx([1, 4]))
    assert tree.tokens[0] == 4
    first_level = [tree.tokens[c] for c in tree.children[0]]
    assert first_level == [7, 9]  # rank order; ranks >= k=2 do not exist
    node7 = tree.children[0][0]
    assert [tree.tokens[c] for c in tree.children[node7]] == [11, 12]
    assert tree.children[tree.children[0][1]] == ()  # 9 has no row yet: its subtree is pruned
    assert len(d.draft(_ctx([1, 3])).tokens) == 1  # unknown root: nothing to draft


def test_recycling_overwrites_rows_and_keeps_them_across_trajectories():
    d = TokenRecyclingDrafter(RecyclingDrafterConfig(k=2, num_nodes=4), vocab_size=20)
    _observe(d, DraftTree.root_only(4), [[7, 9]])
    _observe(d, DraftTree.root_only(4), [[3, 2]])  # the paper replaces, it does not merge
    d.start([0])  # hot start: the table persists
    tree = d.draft(_ctx([4], max_nodes=3))  # rank 0 of 3 is unknown and pruned
    assert tree.size == 3 and [tree.tokens[c] for c in tree.children[0]] == [3, 2]
