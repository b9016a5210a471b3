"""Keep the accepted path's KV entries after a verify forward, drop the rest of the tree.

transformers 5.x layout: `cache.layers[i].keys/values` are `[B, kv_heads, seq, head_dim]`.
Accepted nodes sit at contiguous depths, so the RoPE keys computed in the tree stay valid.
One sequence and a batch use the same region rewrite; a batch also drops rows and compacts.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_region(cache: DynamicCache, start: int, idx: torch.Tensor) -> None:
    """Rewrite the region after `start` in place with its slots `start + idx[b]` (`[B, m]`),
    then crop to `start + m`: only the tree's region is copied, never the prefix."""
    m = idx.shape[1]
    for layer in cache.layers:
        sel = (start + idx.to(layer.keys.device))[:, None, :, None].expand(
            -1, layer.keys.shape[1], -1, layer.keys.shape[-1]
        )
        kept_k, kept_v = layer.keys.gather(2, sel), layer.values.gather(2, sel)
        layer.keys[:, :, start : start + m] = kept_k
        layer.values[:, :, start : start + m] = kept_v
        layer.keys = layer.keys[:, :, : start + m]
        layer.values = layer.values[:, :, : start + m]


def keep_kv(cache: DynamicCache, prefix_len: int, keep: list[int]) -> None:
    """One sequence: keep the first `prefix_len` entries plus tree nodes `keep` (tree indices)."""
    keep_region(cache, prefix_len, torch.tensor([keep]))


def gather_slots(cache: DynamicCache, idx: torch.Tensor) -> None:
    """Keep, per row, the cache slots `idx[b]` (`[B, m]`), in order; the cache becomes m long."""
    for layer in cache.layers:
        sel = idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, sel)
        layer.values = layer.values.gather(2, sel)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` (finished rows leave the batch)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
