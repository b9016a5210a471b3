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
    mask = attention_mask
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux"))
    if (
        not foldable(query, key, mask)
        or query.shape[1] != key.shape[1] * groups
        or dropout
        or extras  # what only transformers' path applies (or refuses)
    ):
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout, scaling, is_causal, **kwargs
        )
    return folded_sdpa(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def foldable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `folded_sdpa` serves this call: a GQA model, a mask shared by the heads, and a
    folded query short enough that the repeated mask costs less than copying the keys."""
    groups = query.shape[1] // key.shape[1]
    return (
        groups > 1
        and mask is not None
        and mask.shape[1] == 1
        and groups * query.shape[2] <= MAX_FOLDED
    )


def folded_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """SDPA of `query` `[R, H, N, D]` over `key`/`value` `[R, Hkv, K, D]` under a
    `[R | 1, 1, N, K]` mask, each KV head read once; returns `[R, H, N, D]`."""
    r, heads, n, _ = query.shape
    groups = heads // key.shape[1]
    # query head h = kv · G + g (repeat_kv's order) becomes query row g · N + i of KV head kv
    folded = query.reshape(r, heads // groups, groups * n, query.shape[-1])
    b, k = mask.shape[0], mask.shape[-1]
    mask = mask[:, :, None].expand(b, 1, groups, n, k).reshape(b, 1, groups * n, k)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, scale=scale
    )
    return out.reshape(r, heads, n, value.shape[-1])


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """The compact forward's attention, `[R, H, N, D]` out: each KV head read once wherever
    a fused kernel can (folded under a mask; SDPA's own GQA without one), otherwise
    transformers' choice, the keys repeated (a long prefill under a mask: on a GPU, SDPA's
    GQA with a mask falls back to its unfused math kernel)."""
    groups = query.shape[1] // key.shape[1]
    if foldable(query, key, mask):
        return folded_sdpa(query, key, value, mask, scale)
    if groups > 1 and mask is not None:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=groups > 1
    )


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
