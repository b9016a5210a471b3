"""A compact forward for the Llama and Qwen2 families: the loaded model's weights, few kernels.

transformers' modelling code runs about a thousand small kernels a step on a 7B model (per
layer: three projections for q, k and v, two for gate and up, RMSNorm as five element-wise ops,
rotary as six), and on a GPU half of a small step is that overhead, not weights nor KV
(docs/benchmarks.md). Here each layer is: RMSNorm, one fused QKV product (its bias for Qwen2),
rotary, the cache write, attention over each KV head once under the engine's additive mask
(`engine.attention.tree_attention`: on a GPU, SDPA's own GQA under a mask runs its unfused math
kernel), the output product, RMSNorm, one fused gate-up product, SiLU-and-multiply, the down
product: the same arithmetic in fewer, larger kernels, which `torch.compile` can fuse further.
The model still loads through transformers (config, tokenizer, weights); its rotary module
makes cos/sin, so every RoPE scaling it knows is kept. Other families keep transformers'
forward.

`CompactCausalLM` is called as the engine calls a transformers model (`ids`, a `[R, 1, N, K]`
additive mask, explicit positions, a cache with `update(key, value, layer)`,
`logits_to_keep`) and returns an object with `.logits`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from tts_service.engine.attention import tree_attention

FAMILIES = frozenset({"llama", "qwen2"})
"""`config.model_type`s the compact forward covers."""


def supports(model: PreTrainedModel) -> bool:
    """Whether `model` is a family the compact forward covers, with nothing it leaves out
    (MLP biases, a sliding window, tied attention variants)."""
    cfg = model.config
    if cfg.model_type not in FAMILIES or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    return getattr(cfg, "hidden_act", "silu") == "silu"


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's head layout."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class CompactLayer(nn.Module):
    """One decoder layer over the fused weights of a transformers layer (views, no copy of
    the norms; the QKV and gate-up weights concatenated once)."""

    def __init__(self, layer: nn.Module, shape: LayerShape, index: int) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.shape, self.index = shape, index
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.scaling = attn.scaling

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache,
        kernels: Kernels,
    ) -> torch.Tensor:
        """`x` after this layer; the products are the linear modules' (so CPU tuning of them
        holds), everything between them one of `kernels`."""
        s = self.shape
        q, k, v = kernels.rotated_heads(self.qkv(kernels.norm(x, self.norm_in, s.eps)), *rotary, s)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        out = tree_attention(q, k, v, mask, self.scaling)
        x, h = kernels.add_norm(
            x, self.o_proj(out.transpose(1, 2).flatten(2)), self.norm_post, s.eps
        )
        return x + self.down(kernels.silu_mul(self.gate_up(h)))


class Kernels(NamedTuple):
    """What a layer runs between its products: eager, or each compiled into one fused kernel
    (`compiled_kernels`). Pure functions of tensors, shared by every layer, so one compiled
    graph serves them all."""

    norm: Callable
    rotated_heads: Callable
    add_norm: Callable
    silu_mul: Callable


def rotated_heads(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, s: LayerShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV product's output as `[R, H, N, D]` queries and `[R, Hkv, N, D]` keys
    and values, the queries and keys rotated."""
    rows, n, _ = qkv.shape
    q, k, v = qkv.split(
        [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
    )
    q = q.view(rows, n, s.heads, s.head_dim).transpose(1, 2)
    k = k.view(rows, n, s.kv_heads, s.head_dim).transpose(1, 2)
    v = v.view(rows, n, s.kv_heads, s.head_dim).transpose(1, 2)
    q, k = rotate(q, k, cos, sin)
    return q, k, v


def add_norm(
    x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after `update`, and its RMSNorm."""
    x = x + update
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def compiled_kernels() -> Kernels:
    """`Kernels` through `torch.compile` (inductor), once per process, for any size (sizes of
    1 apart: `engine.warmup` calls each variant once); inductor keeps what it compiled on disk
    (`inductor_cache_dir`), so a later process loads it."""
    return Kernels(*(torch.compile(f, dynamic=True) for f in EAGER))


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled kernels (`$TORCHINDUCTOR_CACHE_DIR`, by default
    `/tmp/torchinductor_$USER`)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


class CompactCausalLM(nn.Module):
    """A transformers Llama / Qwen2 causal LM's forward in few kernels, over its weights."""

    def __init__(self, model: PreTrainedModel) -> None:
        if not supports(model):
            raise ValueError(f"no compact forward for {model.config.model_type!r}")
        super().__init__()
        cfg, inner = model.config, model.model
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = LayerShape(
            cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.rms_norm_eps
        )
        self.config, self.generation_config = cfg, model.generation_config
        self.embed, self.rotary_emb = inner.embed_tokens, inner.rotary_emb
        self.layers = nn.ModuleList(
            CompactLayer(layer, shape, i) for i, layer in enumerate(inner.layers)
        )
        self.norm, self.eps, self.lm_head = inner.norm.weight, cfg.rms_norm_eps, model.lm_head
        self.kernels = EAGER

    def compile(self) -> None:  # type: ignore[override]  # nn.Module.compile wraps forward
        """Run the layers' element-wise work as compiled kernels (`compiled_kernels`); the
        products, the cache writes and attention stay as they are (cuBLAS, SDPA), and on a
        GPU the CUDA graphs capture it all."""
        self.kernels = compiled_kernels()

    @property
    def compiled(self) -> bool:
        return self.kernels is not EAGER

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        logits_to_keep: int = 0,
        **_: object,
    ) -> SimpleNamespace:
        """`attention_mask`: `[R | 1, 1, N, K]` additive (0 attends, finfo.min blocks), K the
        keys the cache returns; None: causal, each new token after every cached one."""
        x, n = self.embed(input_ids), input_ids.shape[1]
        if position_ids is None or attention_mask is None:  # not the engine's calls: it passes both
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=x.device)[None]
        rotary = self.rotary_emb(x, position_ids)
        if attention_mask is not None:
            mask = attention_mask.to(x.dtype)
        else:
            mask = causal_mask(n, past, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, rotary, mask, past_key_values, self.kernels)
        x = rms_norm(x[:, -logits_to_keep:] if logits_to_keep else x, self.norm, self.eps)
        return SimpleNamespace(logits=self.lm_head(x), past_key_values=past_key_values)


def causal_mask(n: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[N, past + N]` additive: new token i attends to every cached key and new ones ≤ i."""
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.zeros((), dtype=dtype, device=device).where(allowed, blocked)


def _fused(projections: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing `projections` side by side (their outputs concatenated).
    The projections' weights become views of the fused one, so memory holds them once and
    the transformers model they belong to still computes what it did."""
    first = projections[0]
    fused = nn.Linear(first.in_features, 1, bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in projections]), requires_grad=False)
    fused.out_features = fused.weight.shape[0]
    start = 0
    for p in projections:
        end = start + p.out_features
        p.weight = nn.Parameter(fused.weight[start:end], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: in float32, scaled by `weight` in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on `[R, H, N, D]` queries and keys (`cos`/`sin` `[R, N, D]`,
    transformers' half-split layout)."""
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + _half_turn(q) * sin, k * cos + _half_turn(k) * sin


def _half_turn(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


EAGER = Kernels(rms_norm, rotated_heads, add_norm, silu_mul)
