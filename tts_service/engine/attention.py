"""Grouped tree attention: SDPA over each KV head once, with the tree mask.

A GQA model (Qwen2.5-7B: 28 query heads over 4 KV heads) verifying a tree passes a mask, and
with a mask transformers' SDPA path copies every KV head once per query head (`repeat_kv`) in
every layer: 7× the cache's bytes written and read again per step, which on a GPU costs more
than the step itself at 16–64 rows (measured: 40 ms for 16 rows × 4k tokens of context on an
H200, against 5 ms of weights and cache to read). Its copy-free path covers one query token
without a mask only. Here the G query heads of one KV head are folded into the query length
(`[R, Hkv, G·N, D]`) and the mask repeated G times along it, so SDPA reads each KV head once;
the arithmetic per (head, token) is unchanged. Long queries (a prefill) keep transformers'
path, where the repeated mask would outweigh the copies.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "tts_grouped_sdpa"
MAX_FOLDED = 512
"""The longest folded query (G · N) run grouped; longer ones go through `repeat_kv`."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` `[R, H, N, D]`, `key`/`value`
    `[R, Hkv, K, D]`, a `[R | 1, 1, N, K]` mask; returns `[R, N, H, D]`."""
    groups = getattr(module, "num_key_value_groups", 1)
    r, heads, n, _ = query.shape
    mask = attention_mask
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux"))
    if (
        groups == 1
        or mask is None
        or mask.shape[1] != 1
        or groups * n > MAX_FOLDED
        or heads != key.shape[1] * groups
        or extras  # what only transformers' path applies (or refuses)
    ):
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout, scaling, is_causal, **kwargs
        )
    # query head h = kv · G + g (repeat_kv's order) becomes query row g · N + i of KV head kv
    folded = query.reshape(r, heads // groups, groups * n, query.shape[-1])
    b, k = mask.shape[0], mask.shape[-1]
    mask = mask[:, :, None].expand(b, 1, groups, n, k).reshape(b, 1, groups * n, k)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(r, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch an SDPA model to grouped tree attention (in place); False if it runs another
    attention implementation, which is left as it is."""
    if model.config._attn_implementation not in ("sdpa", NAME):
        return False
    model.config._attn_implementation = NAME
    for sub in model.modules():  # sub-configs (a text model inside a wrapper) follow theirs
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = NAME
    return True
