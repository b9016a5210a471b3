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


def append_rows(
    cache: DynamicCache, valid: torch.Tensor, new: DynamicCache, new_valid: torch.Tensor
) -> torch.Tensor:
    """Add `new`'s rows below `cache`'s (rows joining a running batch); returns the joint
    `valid`. The narrower side is left padded with invalid slots, which no row attends to.

    A layer not yet written (every prompt so far was one token) counts as width 0."""
    width = max(valid.shape[1], new_valid.shape[1])
    for a, b in zip(cache.layers, new.layers, strict=True):
        if not a.is_initialized and not b.is_initialized:
            continue  # both sides are 0 wide: the first forward creates the layer
        ref = a if a.is_initialized else b
        parts = []
        for layer, rows in ((a, valid.shape[0]), (b, new_valid.shape[0])):
            k, v = (layer.keys, layer.values) if layer.is_initialized else (None, None)
            if k is None or k.dim() != 4:  # unwritten, or emptied to a 1-D placeholder
                shape = (rows, ref.keys.shape[1], 0, ref.keys.shape[3])
                k, v = ref.keys.new_zeros(shape), ref.values.new_zeros(shape)
            pad = width - k.shape[2]
            if pad:
                k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                v = torch.nn.functional.pad(v, (0, 0, pad, 0))
            parts.append((k, v))
        if not a.is_initialized:
            a.lazy_initialization(ref.keys, ref.values)
        a.keys = torch.cat([parts[0][0], parts[1][0]], dim=0)
        a.values = torch.cat([parts[0][1], parts[1][1]], dim=0)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=False)

    return torch.cat([padded(valid), padded(new_valid.to(valid.device))], dim=0)
