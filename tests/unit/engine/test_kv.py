"""The preallocated KV cache: one tree forward equals a separate forward of every root path,
across compaction steps that keep non-contiguous accepted paths, and the in-place row
operations (join, leave, compact, grow) keep every row's entries."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from tests.conftest import tiny_llama
from tts_service.engine.kv import StaticKV, fill_holes
from tts_service.engine.tree import DraftTree, pack


def _random_tree(rng: random.Random, root: int, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [root] + [rng.randrange(vocab) for _ in range(1, n)]
    return DraftTree(tuple(tokens), tuple(parents), (False,) * n, (None,) * n)


def _prefilled(model, ids: list[list[int]]) -> tuple[DynamicCache, torch.Tensor]:
    cache = DynamicCache(config=model.config)
    model(torch.tensor(ids), past_key_values=cache)
    return cache, torch.ones(len(ids), len(ids[0]), dtype=torch.bool)


@pytest.mark.parametrize(
    "dtype,attn", [(torch.float32, "sdpa"), (torch.float32, "eager"), (torch.float64, "sdpa")]
)
def test_tree_logits_equal_root_path_forwards_across_compaction_steps(dtype, attn):
    model = tiny_llama(vocab_size=64, seed=3, dtype=dtype, scale=4.0)
    model.config._attn_implementation = attn
    rng = random.Random(0)
    committed = [rng.randrange(64) for _ in range(9)]
    kv = StaticKV(model, rows=1, capacity=4)  # grows as the steps need
    with torch.inference_mode():
        kv.append_rows(*_prefilled(model, [committed[:-1]]))
        for _step in range(6):
            tree = _random_tree(rng, committed[-1], rng.randrange(1, 12), 64)
            prefix_len = kv.length
            assert prefix_len == len(committed) - 1
            kv.reserve(1, prefix_len + tree.size)
            ids, pos, mask = pack(tree, prefix_len, dtype, torch.device("cpu"))
            logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=kv).logits[0]
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
            kv.keep_region(prefix_len, np.array([[0, *keep[::-1]]]))
            committed += tree.path_tokens(node) + [rng.randrange(64)]
    assert kv.epoch > 1  # it grew at least once, keeping every entry


def _entries(kv: StaticKV, row: int) -> torch.Tensor:
    """Row `row`'s valid keys of layer 0, in slot order."""
    slots = torch.nonzero(kv.valid[row, : kv.length]).flatten()
    return kv.layers[0].keys[row, :, slots]


def test_rows_join_leave_and_compact_in_place():
    model = tiny_llama(vocab_size=64, seed=1, dtype=torch.float32)
    with torch.inference_mode():
        kv = StaticKV(model, rows=1, capacity=2)
        short, long = _prefilled(model, [[1, 2, 3]]), _prefilled(model, [[4, 5, 6, 7, 8]])
        kv.append_rows(*short)
        kv.append_rows(*long)  # wider: the first row moves right, left padded
        assert (kv.rows, kv.length) == (2, 5)
        assert kv.valid[0, :5].tolist() == [False, False, True, True, True]
        torch.testing.assert_close(_entries(kv, 0), short[0].layers[0].keys[0])
        torch.testing.assert_close(_entries(kv, 1), long[0].layers[0].keys[0])
        kv.append_rows(*short)  # narrower: right-aligned under the others
        assert kv.valid[2, :5].tolist() == [False, False, True, True, True]
        kv.select_rows([1, 2])  # row 0 leaves
        assert kv.rows == 2 and not kv.valid[2].any()
        torch.testing.assert_close(_entries(kv, 0), long[0].layers[0].keys[0])
        torch.testing.assert_close(_entries(kv, 1), short[0].layers[0].keys[0])
        kv.valid[0, 1] = False  # a hole, as a rejected tree node leaves
        before = [_entries(kv, b).clone() for b in range(2)]
        idx = torch.tensor([[0, 2, 3, 4], [2, 2, 3, 4]])
        kv.gather_slots(idx, torch.tensor([[True] * 4, [False, True, True, True]]))
        assert kv.length == 4
        for b in range(2):
            torch.testing.assert_close(_entries(kv, b), before[b])
        kv.clear()
        assert (kv.rows, kv.length) == (0, 0) and not kv.valid.any()


def test_the_prompt_cache_keeps_the_latest_prompts_left_padded():
    from tts_service.engine.kv import LayerKV, PromptCache, padded_rows

    cache = PromptCache(capacity=2)
    for p in [(1, 2, 3), (4,), (5, 6)]:
        kv = torch.arange(len(p), dtype=torch.float32).reshape(1, 1, len(p), 1) + 10 * p[0]
        cache.put(p, [LayerKV(kv, -kv)])
    assert cache.get((1, 2, 3)) is None and cache.get((4,)) and cache.get((5, 6))
    cache.put((), [])  # a one-token prompt has nothing to prefill
    rows = padded_rows([(5, 6), ()], [cache.get((5, 6)), cache.get(())])
    assert rows.valid.tolist() == [[True, True], [False, False]]
    assert rows.layers[0].keys[0, 0, :, 0].tolist() == [50.0, 51.0]
    assert rows.layers[0].values[1].abs().sum() == 0


def test_every_layer_is_a_view_of_one_tensor_across_growth():
    """A rewrite (accepted slots, compaction, rows leaving) is one gather over `kv`, the one
    tensor every layer's keys and values view: that holds after the cache grows, and growing
    keeps every row's entries."""
    model = tiny_llama(vocab_size=64, seed=0)
    kv = StaticKV(model, rows=2, capacity=4)
    with torch.inference_mode():
        kv.append_rows(*_prefilled(model, [[1, 2, 3], [4, 5, 6]]))
        before = [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]
        kv.reserve(3, 9)
    assert kv.kv.shape[:2] == (2, len(kv.layers)) and kv.kv.shape[2] >= 3 and kv.kv.shape[4] >= 9
    for i, layer in enumerate(kv.layers):
        assert layer.keys.data_ptr() == kv.kv[0, i].data_ptr()
        assert layer.values.data_ptr() == kv.kv[1, i].data_ptr()
        keys, values = before[i]
        assert torch.equal(layer.keys[:2, :, :3], keys[:2, :, :3])
        assert torch.equal(layer.values[:2, :, :3], values[:2, :, :3])


def test_fill_holes_moves_no_more_rows_than_left():
    assert fill_holes([1, 2, 3]) == [3, 1, 2]  # row 0 left: the last row takes its place
    assert fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert fill_holes([0, 1]) == [0, 1] and fill_holes([4]) == [4] and fill_holes([]) == []
    for keep in ([0, 3, 4, 7, 9], [5, 6, 7], [1, 2, 3, 4]):
        order = fill_holes(keep)
        assert sorted(order) == sorted(keep)
        moved = [i for i, b in enumerate(order) if b != i]
        assert len(moved) <= 10 - len(keep)  # of 10 rows


def test_select_rows_copies_only_the_rows_that_move():
    """One copy for every layer, of the rows that move only (a leave used to copy every
    surviving row's cache); a moved row's entries and flags arrive whole, the others stay."""
    model = tiny_llama(vocab_size=64, seed=1, dtype=torch.float32)
    copies: list[torch.Size] = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index_put_.default:
                copies.append(args[2].shape)  # the values written
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        kv = StaticKV(model, rows=1, capacity=2)
        for p in [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]:
            kv.append_rows(*_prefilled(model, [p]))
        before = [_entries(kv, b).clone() for b in range(4)]
        flags = kv.valid[:4].clone()
        with Copies():
            kv.select_rows(fill_holes([0, 2, 3]))  # row 1 leaves: row 3 takes its place
        assert kv.rows == 3
        layers = kv.kv.shape[1]
        assert copies[0][:3] == (2, layers, 1)  # the cache: one row, every layer at once
        for new, old in enumerate([0, 3, 2]):
            torch.testing.assert_close(_entries(kv, new), before[old])
            assert kv.valid[new].tolist() == flags[old].tolist()
        assert not kv.valid[3].any()


def test_the_prompt_cache_keeps_no_more_bytes_than_its_budget():
    """A prompt larger than the budget is not kept; older ones leave to keep within it."""
    from tts_service.engine.kv import LayerKV, PromptCache

    def entry(n: int) -> list[LayerKV]:
        kv = torch.zeros(1, 1, n, 1, dtype=torch.float32)  # 4 bytes a slot, keys and values
        return [LayerKV(kv, kv.clone())]

    cache = PromptCache(capacity=8, max_bytes=80)
    cache.put((1,), entry(4))  # 32 bytes
    cache.put((2,), entry(11))  # 88: over the budget, not kept
    assert cache.get((2,)) is None and cache.get((1,)) and cache.nbytes == 32
    cache.put((3,), entry(5))  # 40: 72 in all
    cache.put((4,), entry(2))  # 16: (1,) leaves
    assert cache.get((1,)) is None and cache.get((3,)) and cache.get((4,)) and cache.nbytes == 56


def test_a_cache_grown_for_a_long_row_shrinks_when_it_leaves(monkeypatch):
    """Growing slots allocates exactly the rows asked for (spare rows would be as long), half
    as many slots again; once the long row is gone and the cache is over four times what its
    rows use, it shrinks, keeping every row's entries."""
    import tts_service.engine.kv as kv_module

    monkeypatch.setattr(kv_module, "SHRINK_FLOOR_BYTES", 0)
    model = tiny_llama(vocab_size=64, seed=0)
    kv = StaticKV(model, rows=8, capacity=4)
    with torch.inference_mode():
        kv.append_rows(*_prefilled(model, [[1, 2, 3], [4, 5, 6]]))
        kv.reserve(2, 40)
        assert (kv.row_capacity, kv.capacity) == (2, 40)
        kv.reserve(2, 41)
        assert kv.capacity == 60  # half again
        kv.reserve(3, 41)
        assert kv.row_capacity == 3
        before = kv.kv[:, :, :2, :, :3].clone()
        assert kv.shrink()  # 3 x 60 slots held, 2 x 4 in use
        assert (kv.row_capacity, kv.capacity) == (2, 6) and not kv.shrink()
        assert torch.equal(kv.kv[:, :, :2, :, :3], before)
        assert kv.valid[:2, :3].all()
