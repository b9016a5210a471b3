"""The static-tree drafter protocol, over its implementations (STAND, Token Recycling):
`draft_subtree` returns each tree node's shape node."""

from __future__ import annotations

import pytest
import torch

from tests.unit.drafters.test_gt import _stand_store
from tts_service.drafters.recycling import RecyclingDrafterConfig, TokenRecyclingDrafter
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import DraftContext


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
