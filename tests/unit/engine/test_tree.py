"""Tree packing (positions and the ancestor mask) and tree shapes (ranks, errors, loading)."""

from __future__ import annotations

import pytest
import torch

from tts_service.config import resolve_tree_path
from tts_service.engine.tree import DraftTree, TreeShape, ancestor_mask, load_tree_shape, pack


def test_pack_positions_and_mask():
    #   root(0) -> 1 -> 3 ; root -> 2
    tree = DraftTree((9, 4, 5, 6), (-1, 0, 0, 1), (False,) * 4, (None,) * 4)
    ids, pos, mask = pack(tree, prefix_len=3, dtype=torch.float32, device=torch.device("cpu"))
    assert ids.tolist() == [[9, 4, 5, 6]]
    assert pos.tolist() == [[3, 4, 4, 5]]  # siblings share prefix_len + depth
    allowed = mask[0, 0] == 0
    assert mask.shape == (1, 1, 4, 7) and mask.dtype == torch.float32
    assert allowed[:, :3].all()  # everyone sees the cached prefix
    assert allowed[:, 3:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],  # node 2 does not see its sibling 1
        [True, True, False, True],
    ]
    assert mask[~allowed.unsqueeze(0).unsqueeze(0)].eq(torch.finfo(torch.float32).min).all()


def test_ancestor_mask_of_chain_is_lower_triangular():
    assert torch.equal(ancestor_mask([-1, 0, 1, 2]), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_tree_shape_ranks_prefix_and_errors(tmp_path):
    shape = TreeShape((-1, 0, 0, 1, 1, 2))
    assert shape.ranks == (0, 0, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="precede"):
        TreeShape((-1, 2, 0))
    with pytest.raises(ValueError, match="not found"):
        resolve_tree_path("no-such-tree")
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": []}')
    with pytest.raises(ValueError, match="parents"):
        load_tree_shape(bad)
    tr = load_tree_shape(resolve_tree_path("recycling-80"))
    assert tr.num_nodes == 80 and max(tr.ranks) == 7
