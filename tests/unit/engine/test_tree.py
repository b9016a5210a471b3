"""Tree packing and KV compaction: one tree forward equals a separate forward of every root path."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import tiny_llama
from tts_service.config import resolve_tree_path
from tts_service.engine.kv import keep_kv
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


def _random_tree(rng: random.Random, root: int, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [root] + [rng.randrange(vocab) for _ in range(1, n)]
    return DraftTree(tuple(tokens), tuple(parents), (False,) * n, (None,) * n)


@pytest.mark.parametrize(
    "dtype,attn", [(torch.float32, "sdpa"), (torch.float32, "eager"), (torch.float64, "sdpa")]
)
def test_tree_logits_equal_root_path_forwards_across_compaction_steps(dtype, attn):
    model = tiny_llama(vocab_size=64, seed=3, dtype=dtype, scale=4.0)
    model.config._attn_implementation = attn
    rng = random.Random(0)
    committed = [rng.randrange(64) for _ in range(9)]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([committed[:-1]]), past_key_values=cache)
        for _step in range(6):
            tree = _random_tree(rng, committed[-1], rng.randrange(1, 12), 64)
            prefix_len = cache.get_seq_length()
            assert prefix_len == len(committed) - 1
            ids, pos, mask = pack(tree, prefix_len, dtype, torch.device("cpu"))
            logits = model(
                ids, attention_mask=mask, position_ids=pos, past_key_values=cache
            ).logits[0]
            for node in range(tree.size):
                path = committed + tree.path_tokens(node)
                ref = model(torch.tensor([path])).logits[0, -1]
                torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=0)
            # accept the root path of a random node (often non-contiguous), plus a "bonus"
            node = rng.randrange(tree.size)
            keep, n = [], node
            while n > 0:
                keep.append(n)
                n = tree.parents[n]
            keep_kv(cache, prefix_len, [0, *keep[::-1]])
            committed += tree.path_tokens(node) + [rng.randrange(64)]
