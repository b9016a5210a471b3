"""Keep the accepted path's KV entries after a verify forward, drop the rest of the tree.

transformers 5.x layout: `cache.layers[i].keys/values` are `[B, kv_heads, seq, head_dim]`.
Accepted nodes sit at contiguous depths, so the RoPE keys computed in the tree stay valid.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_kv(cache: DynamicCache, prefix_len: int, keep: list[int]) -> None:
    """Keep the first `prefix_len` entries plus tree nodes `keep` (indices into the tree).

    A contiguous `keep == [0, 1, .., k]` is a crop; anything else an `index_select`.
    """
    total = cache.get_seq_length()
    if keep == list(range(len(keep))):
        drop = total - (prefix_len + len(keep))
        if drop > 0:
            cache.crop(-drop)  # 5.x: a negative count removes a suffix
        return
    device = cache.layers[0].keys.device
    sel = torch.cat(
        [torch.arange(prefix_len, device=device), prefix_len + torch.tensor(keep, device=device)]
    )
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, sel)
        layer.values = layer.values.index_select(-2, sel)
