"""What a step's acceptance costs on the device at a real vocabulary: p under sampling
(`sampling.store_probs`) and the verdict (`treebatch.verdict`: rules (a) and (b), the bonus,
the drafters' top-k) over random logits, per (rows, tokens a row). The host benchmark's
stand-in has a 256-token vocabulary, where this is nothing; at SmolLM2's 49,152 a 16-row tree
step computes it over 7M float64 entries.

    python -m bench.acceptance_cost [--vocab 49152] [--cells 16x1 16x9 16x17 4x9 1x9]
        [--threads 1] [--json PATH]
    python -m bench.acceptance_cost --device cuda --vocab 152064 --cells 16x1 16x9 16x17 64x5

Each cell: the best of `--repeats` timings after one untimed call, in ms.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tts_service.config import SamplingConfig
from tts_service.engine.sampling import store_probs
from tts_service.engine.tree import DraftTree
from tts_service.engine.treebatch import verdict
from tts_service.engine.treepack import TreeBatch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after their launch returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(rows: int, tokens: int, vocab: int, repeats: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dev = torch.device(device)
    trees = [DraftTree.chain(1, list(range(2, tokens + 1)))] * rows
    tb = TreeBatch.of(trees, tokens, dev, [16] * rows)
    logits = torch.randn(rows, tokens, vocab, generator=gen, device=dev) * 3
    cfg = SamplingConfig(temperature=0.6, max_new_tokens=16)
    u, v = (torch.rand(rows, tokens, generator=gen, device=dev, dtype=torch.float64) for _ in "uv")
    best_p = best_v = float("inf")
    for i in range(repeats + 1):
        sync(dev)
        t0 = time.perf_counter()
        p = store_probs(logits, cfg)
        sync(dev)
        t1 = time.perf_counter()
        verdict(tb, logits, p, 8, (u, v)).cpu()
        t2 = time.perf_counter()
        if i:
            best_p, best_v = min(best_p, t1 - t0), min(best_v, t2 - t1)
    return {
        "rows": rows,
        "tokens": tokens,
        "vocab": vocab,
        "probs_ms": round(best_p * 1e3, 2),
        "verdict_ms": round(best_v * 1e3, 2),
        "total_ms": round((best_p + best_v) * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--cells", nargs="+", default=["16x1", "16x9", "16x17", "4x9", "1x9"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    records = []
    for cell in args.cells:
        rows, tokens = (int(x) for x in cell.split("x"))
        records.append(measure(rows, tokens, args.vocab, args.repeats, args.device))
        print(json.dumps(records[-1]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
