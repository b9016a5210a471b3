"""Target logits -> `p`, the exact distribution plain decoding samples from.

Every verifier and every store update reads `p` through this one function, so speculative and
plain decoding can never disagree on temperature, top-k, top-p or min-p (docs/design.md,
"Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch where tensors are made: the CLI's parser imports this module
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one trajectory's next token is chosen, as the engine reads it: exactly what plain
    decoding samples from, plus where it stops. A frozen copy of the edge's validated
    `SamplingConfig` (`of`), so nothing below the runner depends on the request schema."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    max_new_tokens: int = 256
    seed: int = 0  # seeds the trajectory's sampling and drafting streams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    salt: str = ""  # the verify stream's salt beside the seed (`streams.row_salt`)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, cfg: Any, salt: str | None = None) -> SamplingParams:
        """The engine's copy of a validated config (any object with these attributes but
        `salt`), salted with `salt` (the runner's `streams.row_salt`; None: as it is)."""
        if isinstance(cfg, cls):
            return cfg if salt is None or cfg.salt == salt else replace(cfg, salt=salt)
        kept = {f.name: getattr(cfg, f.name) for f in fields(cls) if f.name != "salt"}
        return cls(**kept, salt=salt or "")


def target_probs(logits: torch.Tensor, cfg: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution `p`, row-wise.

    Args:
        logits: `[n, V]` target logits, any float dtype.
        cfg: temperature (> 0 here; greedy never samples), then top-k, top-p and min-p, in
            transformers' order.

    Returns:
        `[n, V]` float64 probabilities; each row sums to 1.
    """
    import torch

    if cfg.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    # one [n, V] float64 copy, worked on in place (on a CPU each further copy of a 49k
    # vocabulary at every tree node cost as much as the arithmetic, in fresh pages)
    x = logits.to(torch.float64, copy=True).div_(cfg.temperature)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x.masked_fill_(x < kth, float("-inf"))
    p = softmax_(x)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
    if cfg.min_p > 0.0:  # the top token always survives (its p >= min_p x itself)
        p = p.masked_fill(p < cfg.min_p * p.amax(dim=-1, keepdim=True), 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


IN_PLACE_ENTRIES = 2**22
"""From this many entries (32 MiB of float64) `softmax_` works in place on a CPU."""


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a float64 `x`; in place on a CPU from
    `IN_PLACE_ENTRIES` on (`x` is returned), where a fresh tensor of a vocabulary at every tree
    node costs as much in new pages as the arithmetic. Smaller ones, and any on a GPU (memory
    cached, traffic the cost), take the fused kernel, in fewer ops."""
    import torch

    if x.device.type != "cpu" or x.numel() < IN_PLACE_ENTRIES:
        return torch.softmax(x, dim=-1)
    return x.sub_(x.amax(-1, keepdim=True)).exp_().div_(x.sum(-1, keepdim=True))


def store_probs(logits: torch.Tensor, cfg: SamplingParams) -> torch.Tensor:
    """The distribution drafters learn from: `p` when sampling, softmax(logits) under greedy."""
    import torch

    if cfg.greedy:
        return softmax_(logits.to(torch.float64, copy=True))
    return target_probs(logits, cfg)


def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a `[V]` distribution (any positive scale) with an explicit random
    stream, by inverting its CDF at one uniform.

    Exact, and ~20x cheaper than `torch.multinomial` on a 49k float64 vocabulary on a CPU
    (which showed up as 6% of a batched step). Ids with zero probability are never drawn."""
    import torch

    cdf = torch.cumsum(p, dim=-1)
    u = torch.rand((), generator=generator, dtype=cdf.dtype, device=generator.device)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if idx >= p.shape[-1] or p[idx] <= 0:  # u * total rounded onto the last step
        idx = int(torch.nonzero(p > 0).max())
    return idx
