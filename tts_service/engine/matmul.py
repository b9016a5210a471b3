"""Pick, per weight shape and per number of rows, the faster matrix product of `nn.Linear`.

On a CPU, torch's `F.linear(x, W)` with a handful of rows is far slower than the
matrix-vector product it does for one row: the 49152 × 576 LM head of SmolLM2 takes 17 ms for
2 rows against 7 ms for 1, while `(W @ xᵀ)ᵀ` takes 4.4 ms. That jump is what makes a 2-token
verify forward cost 1.6× a 1-token step here, and so what makes small trees not pay. The other
form is slower for many rows (16 rows × 1 token: 117 → 185 ms for the whole model), so the
choice is made per shape from timings taken at load (`tune_linear_products`) and applied by a
wrapper around each layer's forward; the model's code is untouched. Both forms compute the
same products (logits agree within float rounding, ~1e-5).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tts_service.engine.surface import write_json

# rows at which the two forms are timed: 1 row is a matrix-vector product, already fast, and
# more than 8 favour F.linear (16 rows x 1 token: 117 -> 185 ms for the model the other way)
ROWS = (2, 3, 4, 5, 6, 7, 8)
MARGIN = 0.8  # the transposed form must be at least 20% faster: timing noise must not pick it


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def faster_transposed_rows(
    weight: torch.Tensor, rows: Iterable[int] = ROWS, repeats: int = 3
) -> frozenset[int]:
    """The row counts at which `(W @ xᵀ)ᵀ` beats `F.linear(x, W)` for this weight."""
    out = set()
    for m in rows:
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        linear = _time(lambda x=x: F.linear(x, weight), repeats)
        transposed = _time(lambda x=x: (weight @ x.T).T, repeats)
        if transposed < MARGIN * linear:
            out.add(m)
    return frozenset(out)


class _Choice:
    """The replacement forward of one `nn.Linear`: the picked product for this many rows."""

    def __init__(self, layer: nn.Linear, transposed_rows: frozenset[int]) -> None:
        self.layer = layer
        self.rows = transposed_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layer.weight, self.layer.bias
        m = x.numel() // x.shape[-1]
        if m not in self.rows:
            return F.linear(x, w, b)
        y = (w @ x.reshape(m, -1).T).T.reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b


def _read_choices(cache: Path | None) -> dict[str, list[int]]:
    try:
        data = json.loads(cache.read_text(encoding="utf-8")) if cache is not None else {}
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and all(
        isinstance(v, list) and all(isinstance(r, int) for r in v) for v in data.values()
    )
    return data if ok else {}


def restore_linear_products(model: nn.Module) -> None:
    """Undo `tune_linear_products`: every linear layer uses `F.linear` again (benchmarks run
    the peers on the model as a user would load it)."""
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and isinstance(layer.__dict__.get("forward"), _Choice):
            del layer.forward


def tune_linear_products(
    model: nn.Module, cache: Path | None = None
) -> dict[tuple[int, int], list[int]]:
    """Time both products for every distinct weight shape of the model's linear layers and
    wrap the layers whose shape gains at some row count. Returns the choice per shape (rows
    that use the transposed form), for reports. A second call re-measures.

    `cache`: a JSON file of choices for this CPU, threads and dtype: shapes found there are
    not timed again (0.6 s of every start for SmolLM2), new ones are added to it."""
    restore_linear_products(model)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    known = _read_choices(cache)
    choice: dict[tuple[int, int], frozenset[int]] = {}
    for layer in layers:
        shape = tuple(layer.weight.shape)
        if shape not in choice:
            key = "x".join(map(str, shape))
            choice[shape] = (
                frozenset(known[key]) if key in known else faster_transposed_rows(layer.weight)
            )
            known[key] = sorted(choice[shape])
    if cache is not None:  # unwritable: the next load times them again
        write_json(cache, known)
    for layer in layers:
        rows = choice[tuple(layer.weight.shape)]
        if rows:
            layer.forward = _Choice(layer, rows)
    return {shape: sorted(rows) for shape, rows in choice.items()}
