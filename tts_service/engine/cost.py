"""Measured verify cost and the Greater-Than principle (GTCP; docs/design.md#gt-sizing-and-gtcp).

A model-free drafter spends nothing per draft node; a node's cost is the extra time it adds to
the target's verify forward. That cost depends on the device, the model, the context length and
the tree size, so it is measured, never assumed: `measure_verify_cost` times verify forwards of
1..128 tree tokens over a cache of the working context length, and `CostModel` keeps one curve
per context bucket, measuring the next bucket when contexts grow into it.

GT rule, as throughput: a step that sends N tree tokens takes T(N) and commits A(N) = 1 + Σ α̂
tokens on average (α̂ = probability that a node lies on the accepted path). One more node with
α̂ raises tokens per second iff α̂ > c(N) = ΔT(N) · A(N) / T(N), the tokens its extra forward time
would have bought at the current rate. With A ≈ 1 this is GTCP's c = Φ_MT(N) / M_T.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from tts_service.engine.tree import DraftTree, pack

if TYPE_CHECKING:  # torch and transformers only where a model is timed: drafters import this
    import torch
    from transformers import PreTrainedModel

Curve = TypeVar("Curve")
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_BUCKET = 256  # contexts up to this length share one curve; each next bucket is 4x longer


@dataclass(frozen=True)
class VerifyCost:
    """Verify-forward time against tree tokens (root included) at one context length.

    `seconds` is made non-decreasing when fitted (a bigger tree never costs less; measurement
    noise on a busy CPU can say otherwise), and is linear between the measured sizes.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context_len: int

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError("sizes: at least two, strictly increasing, from 1")
        if len(self.seconds) != len(self.sizes) or min(self.seconds) <= 0:
            raise ValueError("seconds: one positive time per size")
        if any(b < a for a, b in zip(self.seconds, self.seconds[1:], strict=False)):
            raise ValueError("seconds must be non-decreasing (use VerifyCost.fit)")

    @classmethod
    def fit(cls, sizes: Sequence[int], seconds: Sequence[float], context_len: int) -> VerifyCost:
        """Monotone fit of raw timings: each time is at least every smaller tree's."""
        monotone: list[float] = []
        for s in seconds:
            monotone.append(max(s, monotone[-1]) if monotone else s)
        return cls(tuple(sizes), tuple(monotone), context_len)

    def time(self, n: float) -> float:
        """Forward time for `n` tree tokens (linear between sizes, last slope beyond them)."""
        xs, ys = self.sizes, self.seconds
        if n <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, n), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        return {
            "context_len": self.context_len,
            "sizes": list(self.sizes),
            "ms": [round(s * 1e3, 3) for s in self.seconds],
        }


GPU_LIKE_COST = VerifyCost((1, 2, 64, 128, 256), (1.0, 1.0, 1.02, 1.1, 1.5), 256)
"""A hypothetical GPU-like curve: tree tokens nearly free up to 64, then slowly dearer. GT
sizing where no model is timed (`tts replay`, `bench/methods.py --assume-flat-cost`)."""


def gt_count(alphas: Sequence[float], cost: VerifyCost, max_nodes: int) -> int:
    """How many nodes of a best-first list (α̂ non-increasing) to keep: the size with the best
    expected tokens per second, (1 + Σ α̂) / T(k + 1).

    Where the cost curve is convex this is exactly GT's marginal rule (keep adding while
    α̂ > c(N)). Measured curves are not convex: on a CPU the first draft token turns a
    matrix-vector product into a matrix product (53 -> 88 ms for SmolLM2) and the next 14 are
    nearly free, so the marginal test alone would stop at zero nodes; comparing every size
    sees past the jump.
    """
    best_k, best_rate, expected = 0, 1.0 / cost.time(1), 1.0
    for k, a in enumerate(alphas[:max_nodes], start=1):
        expected += a
        rate = expected / cost.time(k + 1)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def worth_growing(
    cost: VerifyCost, tree_tokens: int, expected_len: float, alpha: float, max_tokens: int
) -> bool:
    """Can adding nodes of α̂ <= `alpha` to a tree of `tree_tokens` tokens raise the expected
    rate at any size up to `max_tokens`? A stopping rule for trees grown best first (later
    nodes are no better), which looks past cost jumps instead of stopping at them.

    (1 + Σ α̂) / T(m) is linear over linear between measured sizes, so checking the next size
    and every measured size beyond it is exact.
    """
    if tree_tokens >= max_tokens:
        return False
    rate = expected_len / cost.time(tree_tokens)
    if (expected_len + alpha) / cost.time(tree_tokens + 1) > rate:  # the usual answer: cheap
        return True
    ends = [m for m in cost.sizes if tree_tokens + 1 < m < max_tokens]
    return any(
        (expected_len + (m - tree_tokens) * alpha) / cost.time(m) > rate
        for m in (*ends, max_tokens)
    )


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU are otherwise launch times)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def measure_verify_cost(
    model: PreTrainedModel,
    context_len: int,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    repeats: int = 3,
    seed: int = 0,
) -> VerifyCost:
    """Time one verify forward of each tree size over a `context_len` cache, on this device.

    The trees are chains packed exactly like a real verify step (4-D mask, explicit positions);
    sizes are interleaved across repeats so drift hits them all alike, and the median is kept.
    """
    import torch

    with torch.inference_mode():
        return _measure_verify_cost(model, context_len, sizes, repeats, seed)


def _measure_verify_cost(
    model: PreTrainedModel, context_len: int, sizes: Sequence[int], repeats: int, seed: int
) -> VerifyCost:
    import torch
    from transformers import DynamicCache

    device = model.device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    prefix = torch.randint(vocab, (1, max(1, context_len)), generator=gen).to(device)
    model(prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefix_len = cache.get_seq_length()
    inputs = {}
    for n in sizes:
        tokens = torch.randint(vocab, (n,), generator=gen).tolist()
        inputs[n] = pack(DraftTree.chain(tokens[0], tokens[1:]), prefix_len, model.dtype, device)
    timings: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):  # the first round warms up kernels and allocators
        for n in sizes:
            ids, pos, mask = inputs[n]
            sync_device(device)
            t0 = time.perf_counter()
            model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            sync_device(device)
            if r:
                timings[n].append(time.perf_counter() - t0)
            cache.crop(-(cache.get_seq_length() - prefix_len))
    return VerifyCost.fit(sizes, [statistics.median(timings[n]) for n in sizes], prefix_len)


def context_bucket(context_len: int) -> int:
    """The context length a curve is measured at: 256, 1024, 4096, ... (the bucket's top)."""
    bucket = MIN_BUCKET
    while bucket < context_len:
        bucket *= 4
    return bucket


class VerifyCostSource(Protocol):
    """Where GT sizing reads the verify cost at a context: a learned surface
    (`engine.surface.SurfaceVerifyCost`), a measured `CostModel` or a fixed curve."""

    def at(self, context_len: int) -> VerifyCost: ...


class CostModel(Generic[Curve]):
    """One measured cost curve per context bucket, measured the first time it is needed: a
    `VerifyCost` for one row, or the runner's `BatchCost` surface.

    Measurement is lazy so a model that never uses a GT-sized drafter pays nothing; a run whose
    contexts grow from 300 to 3000 tokens measures twice (1024, 4096), a few seconds each.
    """

    def __init__(self, measure: Callable[[int], Curve], max_context: int | None = None) -> None:
        self._measure = measure
        self.max_context = max_context
        self.curves: dict[int, Curve] = {}

    @classmethod
    def for_model(cls, model: PreTrainedModel, repeats: int = 3) -> CostModel[VerifyCost]:
        limit = getattr(model.config, "max_position_embeddings", None)
        return cls(lambda n: measure_verify_cost(model, n, repeats=repeats), limit)

    @classmethod
    def fixed(cls, cost: Curve) -> CostModel[Curve]:
        """The same curve at every context (tests, replay)."""
        return cls(lambda _: cost)

    def at(self, context_len: int) -> Curve:
        bucket = context_bucket(context_len)
        if self.max_context is not None:
            bucket = min(bucket, max(1, self.max_context - CALIBRATION_SIZES[-1]))
        if bucket not in self.curves:
            self.curves[bucket] = self._measure(bucket)
        return self.curves[bucket]


@dataclass(frozen=True)
class BatchCost:
    """Time of one batched verify forward, `seconds[i][j]` for `rows[i]` rows of `widths[j]`
    tokens each, over a cache of `context_len`. Linear in between, last slope beyond."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    context_len: int

    @classmethod
    def fit(
        cls,
        rows: Sequence[int],
        widths: Sequence[int],
        seconds: Sequence[Sequence[float]],
        context_len: int,
    ) -> BatchCost:
        """Monotone fit: more rows or more tokens per row never cost less (noise says otherwise
        on a busy machine)."""
        import torch

        t = torch.tensor(seconds, dtype=torch.float64)
        t = torch.cummax(torch.cummax(t, dim=0).values, dim=1).values
        return cls(tuple(rows), tuple(widths), tuple(map(tuple, t.tolist())), context_len)

    @staticmethod
    def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        if x <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def time(self, rows: int, width: int) -> float:
        per_rows = [self._interp(self.widths, line, width) for line in self.seconds]
        return self._interp(self.rows, per_rows, rows)

    def to_dict(self) -> dict:
        return {
            "context_len": self.context_len,
            "rows": list(self.rows),
            "widths": list(self.widths),
            "ms": [[round(s * 1e3, 3) for s in line] for line in self.seconds],
        }
