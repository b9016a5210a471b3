"""KV compaction: one tree forward equals a separate forward of every root path, across
compaction steps that keep non-contiguous accepted paths."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import tiny_llama
from tts_service.engine.kv import keep_kv
from tts_service.engine.tree import DraftTree, pack


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
