"""Tree packing (positions and the ancestor mask), tree shapes (ranks, errors, loading) and a
compiled drafter's q read from its arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_service.config import resolve_tree_path
from tts_service.engine.tree import (
    DraftTree,
    DrawnQ,
    SparseDist,
    TreeShape,
    ancestor_mask,
    load_tree_shape,
    pack,
)


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


def test_drawn_q_reads_its_row_of_the_arrays_and_equals_the_tuple_of_its_nodes():
    at = np.array([[True, False, True, False], [False, True, False, False]])
    q_len = np.array([[2, 1, 3, -1], [-1, 2, -1, -1]])
    q_ids = np.arange(2 * 4 * 5).reshape(2, 4, 5)
    q_probs = q_ids / 100.0
    q = DrawnQ(at, q_len, q_ids, q_probs, 0, 3)  # row 0's first 3 nodes
    want = (SparseDist((0, 1), (0.0, 0.01)), None, SparseDist((10, 11, 12), (0.1, 0.11, 0.12)))
    assert len(q) == 3 and tuple(q) == want and q == want and want == q
    assert q[1] is None and q[-1] == want[2] and q != want[:2] and q != (None,) * 3
    assert q != list(want)  # as a tuple is not equal to a list
    with pytest.raises(IndexError):
        q[3]  # past the tree's nodes, though the arrays hold more
    tree = DraftTree((7, 1, 2), (-1, 0, 0), (False, True, True), q)
    assert tree == DraftTree((7, 1, 2), (-1, 0, 0), (False, True, True), want)
    assert hash(tree) == hash(DraftTree((7, 1, 2), (-1, 0, 0), (False, True, True), want))
    assert DrawnQ(at, q_len, q_ids, q_probs, 1, 2)[1] == SparseDist((25, 26), (0.25, 0.26))
