"""The GPU engine's targets, met or not, from one `bash bench/gpu_check.sh` run's JSON.

    python -m bench.gpu_summary runs/gpu --out bench/results/gpu/2026-12-02-h200-summary.json

Reads what the default steps wrote to the run's folder and writes a list of records
`{"target", "figure", "measured", "goal", "met"}`, one per target the run measured (numbered as
docs/gpu.md lists them; 7, this CPU's figures, is measured here, not on the GPU). A target whose
input is missing (a step cut short) is recorded with `measured: null, met: false` and says which
file it lacked. Rooflines use the device's measured copy bandwidth (`bench.device`), the
weights' bytes it implies, and the model shape's KV bytes per token (`bench.predict.SHAPES`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from bench import predict as pr

DEVICE_JSON = "device-7b-compact.json"
REPLAY_JSON = "long/runner-replay.json"
PREDICT_JSON = "predicted-measured.json"
SHAPE = pr.SHAPES["qwen2.5-7b"]


def _read(folder: Path, name: str) -> dict | list:
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(name)
    return json.loads(path.read_text())


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def roofline_s(device: dict, rows: int, context: int) -> float:
    """Seconds a step of `rows` one-token rows over `context` cached tokens must take: the
    weights once and every row's cache once, at the measured copy bandwidth."""
    bandwidth = device["copy_bandwidth_gb_s"] * 1e9
    weights_s = 1 / device["bandwidth_bound_tokens_per_s"]
    return weights_s + rows * (context + 1) * SHAPE.kv_bytes_per_token() / bandwidth


def plain_one_sequence(folder: Path) -> dict:
    device = _read(folder, DEVICE_JSON)
    share = device["plain_tokens_per_s"] / device["bandwidth_bound_tokens_per_s"]
    figure = (
        f"plain, one sequence ({device['forward']} forward): {device['plain_tokens_per_s']} "
        f"tokens/s of {device['bandwidth_bound_tokens_per_s']} at the measured HBM bound"
    )
    return {"figure": figure, "measured": round(share, 3), "goal": ">= 0.75", "met": share >= 0.75}


def plain_16_rows_at_4k(folder: Path) -> dict:
    device = _read(folder, DEVICE_JSON)
    context = device["surface_context"]
    step_s = device["verify_cost_ms"]["16"]["1"] / 1e3
    ratio = step_s / roofline_s(device, 16, context)
    figure = f"plain 16-row forward at {context} tokens of context: {step_s * 1e3:.2f} ms"
    return {"figure": figure, "measured": round(ratio, 3), "goal": "<= 1.5", "met": ratio <= 1.5}


def _replay(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    return _read(folder, DEVICE_JSON), _read(folder, REPLAY_JSON)


def best_of_16_plain(folder: Path) -> dict:
    device, replay = _replay(folder)
    plain = replay["plain"]
    per_row = plain[0]["new_tokens"] / plain[0]["trajectories"]
    context = plain[0]["context"] + per_row / 2  # a row's mean context over its decode
    roofline = 16 / roofline_s(device, 16, round(context))
    share = _median(plain, "tokens_per_s") / roofline
    figure = (
        f"best-of-16 through the live runner, plain, {plain[0]['context']}-token prompts: "
        f"{_median(plain, 'tokens_per_s'):.0f} tokens/s of {roofline:.0f} at the roofline"
    )
    return {"figure": figure, "measured": round(share, 3), "goal": ">= 0.6", "met": share >= 0.6}


def tree_step_over_plain(folder: Path) -> dict:
    _, replay = _replay(folder)

    def step_s(records: list[dict]) -> float:
        return statistics.median(r["seconds"] / r["target_forwards"] for r in records)

    ratio = step_s(replay["stand"]) / step_s(replay["plain"])
    nodes = replay["stand"][-1]["nodes_per_row"][-1]
    figure = f"tree step (stand, [t_s, rows, nodes] {nodes}) ÷ plain step, live runner"
    return {"figure": figure, "measured": round(ratio, 3), "goal": "<= 1.25", "met": ratio <= 1.25}


def auto_over_plain(folder: Path) -> dict:
    _, replay = _replay(folder)
    ratio = _median(replay["auto"], "tokens_per_s") / _median(replay["plain"], "tokens_per_s")
    figure = (
        f"auto ÷ plain, best-of-16, fresh runners, {replay['auto'][0]['context']}-token prompts"
    )
    return {"figure": figure, "measured": round(ratio, 3), "goal": ">= 1.5", "met": ratio >= 1.5}


def refit_within_25_percent(folder: Path) -> dict:
    try:
        records = _read(folder, PREDICT_JSON)
    except FileNotFoundError:
        records = []
    measured = [r for r in records if "refit_error" in r]
    if not measured:
        raise FileNotFoundError(PREDICT_JSON + " (with refitted records)")
    worst = max(measured, key=lambda r: abs(r["refit_error"]))
    figure = (
        f"measured ÷ refitted prediction − 1, worst of {len(measured)} cells "
        f"({worst['method']}, {worst['rows']} rows, {worst['context']} context)"
    )
    err = abs(worst["refit_error"])
    return {
        "figure": figure,
        "measured": worst["refit_error"],
        "goal": "|x| <= 0.25",
        "met": err <= 0.25,
    }


TARGETS: dict[int, Callable[[Path], dict]] = {
    1: plain_one_sequence,
    2: plain_16_rows_at_4k,
    3: best_of_16_plain,
    4: tree_step_over_plain,
    5: auto_over_plain,
    6: refit_within_25_percent,
}


def summarize(folder: Path) -> list[dict]:
    """One record per target, in order; a missing input is a target not met, saying so."""
    out = []
    for target, measure in TARGETS.items():
        try:
            out.append({"target": target, **measure(folder)})
        except FileNotFoundError as e:
            what = f"not measured: {folder / str(e)} missing"
            out.append(
                {"target": target, "figure": what, "measured": None, "goal": None, "met": False}
            )
        except KeyError as e:
            what = f"not measured: a record in {folder} lacks {e}"
            out.append(
                {"target": target, "figure": what, "measured": None, "goal": None, "met": False}
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="bench/gpu_check.sh's output folder")
    ap.add_argument("--out", type=Path, help="also write the records here")
    args = ap.parse_args(argv)
    records = summarize(args.folder)
    text = json.dumps(records, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
