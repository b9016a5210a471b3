"""Where one verify step's device time goes: a plain step (rows × 1 token) against tree steps
(rows × w tokens), timed graph-replayed (as the runner runs it) and eagerly, with SDPA's
attention and with the grouped tree attention (`engine.attention`), and the eager step's
kernels by device time. On an H100 a 16-row tree step of 8-16 tokens a row costs 1.8-2x a
plain step, where the roofline says 1.0-1.2x: this says which kernels take the difference.

    python -m bench.step_kernels [--rows 16] [--widths 1 8 16] [--contexts 256 4096]
        [--model-config qwen2.5-7b] [--json PATH]      # ~1 minute on one H100

Writes a list of records: {attention, rows, width, context, graph_ms, eager_ms} per cell, and
{attention, rows, width, context, kernels: [[name, ms per step, share]]} for the profiled ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench import device as dv
from tts_service.engine.attention import NAME as GROUPED
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.options import DecoderOptions

REPEATS = 10
TOP_KERNELS = 12


def set_attention(model, name: str) -> None:
    """Every (sub)config of `model` runs attention `name` ("sdpa" or the grouped one)."""
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) in ("sdpa", GROUPED):
            cfg._attn_implementation = name


def step_ms(decoder: BatchDecoder, rows: int, width: int) -> float:
    """Median of `REPEATS` timed steps after two untimed ones (a graph's capture among them)."""
    for _ in range(2):
        decoder.time_forward(rows, width)
    return statistics.median(decoder.time_forward(rows, width) for _ in range(REPEATS)) * 1e3


def kernels(decoder: BatchDecoder, rows: int, width: int) -> list[list]:
    """The eager step's ops by self device time (CPU time where there is no GPU), per step."""
    cuda = decoder.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU]
    acts += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(REPEATS):
            decoder.time_forward(rows, width)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, key))
    return [
        [e.key[:80], round(getattr(e, key) / REPEATS / 1e3, 4), round(getattr(e, key) / total, 4)]
        for e in events[:TOP_KERNELS]
    ]


def measure(model, rows: int, widths: list[int], contexts: list[int]) -> list[dict]:
    out: list[dict] = []
    for attention in ("sdpa", GROUPED):
        set_attention(model, attention)
        for context in contexts:
            graphed = BatchDecoder(
                model, eos_ids=[], options=DecoderOptions(grouped_attention=False)
            )
            eager = BatchDecoder(
                model,
                eos_ids=[],
                options=DecoderOptions(grouped_attention=False, cuda_graphs=False),
            )
            for decoder in (graphed, eager):
                decoder.fill_random(rows, context)
            for width in widths:
                rec = {"attention": attention, "rows": rows, "width": width, "context": context}
                rec["graph_ms"] = round(step_ms(graphed, rows, width), 3)
                rec["eager_ms"] = round(step_ms(eager, rows, width), 3)
                print(json.dumps(rec), flush=True)
                out.append(rec)
                if context == contexts[0] and width in (widths[0], widths[-1]):
                    top = kernels(eager, rows, width)
                    out.append({**rec, "kernels": top})
                    for name, ms, share in top:
                        print(f"    {ms:8.3f} ms {share:6.1%}  {name}", flush=True)
            del graphed, eager
    set_attention(model, "sdpa")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", choices=sorted(dv.ARCHITECTURES), default="qwen2.5-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, _ = dv.build_model(args.model_config, None, args.device, dtype)
    records = measure(model, args.rows, args.widths, args.contexts)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
