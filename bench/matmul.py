"""The per-shape matrix-product choice (`engine/matmul.py`) on this device: which row counts
use `(W @ xᵀ)ᵀ`, and the batched verify cost surface T(rows, tokens per row) without and with
it, measured in the same run.

    python bench/matmul.py [--max-rows 16] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import time

from tts_service.config import ModelConfig
from tts_service.engine.allocate import measure_batch_cost
from tts_service.engine.matmul import tune_linear_products
from tts_service.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = load_model(ModelConfig(name="smollm2-135m", tune_matmul=False)).model
    before = measure_batch_cost(model, args.context, args.max_rows, args.max_tokens)
    t0 = time.perf_counter()
    choice = tune_linear_products(model)
    tune_s = time.perf_counter() - t0
    after = measure_batch_cost(model, args.context, args.max_rows, args.max_tokens)
    print(
        json.dumps(
            {"tune_s": round(tune_s, 2), "transposed_rows": {str(k): v for k, v in choice.items()}}
        )
    )
    print("| rows | tokens per row | F.linear ms | per-shape choice ms |")
    print("|---|---|---|---|")
    for i, rows in enumerate(before.rows):
        for j, width in enumerate(before.widths):
            if rows * width <= args.max_tokens:
                print(
                    f"| {rows} | {width} | {before.seconds[i][j] * 1e3:.0f} "
                    f"| {after.seconds[i][j] * 1e3:.0f} |"
                )


if __name__ == "__main__":
    main()
