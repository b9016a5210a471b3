"""Timing replay through the live runner on a GPU: plain, `auto` and `stand` interleaved, each
run best-of-N of the logged problems as one job waits for it (cost surface from its prior,
planner, lazy CUDA graphs), then `auto` once under cProfile.

    python -m bench.runner_replay --out runs/gpu      # about 90 s on one H100, 7B shape
    python -m bench.runner_replay --out runs/gpu --served   # a Serve replica's later jobs
    python -m bench.runner_replay --out runs/gpu-eager --eager-acceptance  # the acceptance eager

By default every run is a fresh runner, as a first job (or a one-off `tts solve`) meets it:
cost surface from its prior, every CUDA graph still to capture. `--served` keeps one runner per
method across the runs and measures them after one unmeasured job each, as a Serve replica's
later jobs run: surface, slot statistics and captured graphs kept. Every job replays the same
problems, so a served job also finds its prompts in the prompt cache and α̂ learned on the same
trajectories: somewhat kinder than a replica's next job on new problems.

Writes `runner-replay.json` ({method: [records of `bench.device.timing_replay`]}) and
`prof-auto.txt` to `--out`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

import torch

from bench import device as dv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-config", choices=sorted(dv.ARCHITECTURES), default="qwen2.5-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--served", action="store_true", help="one warm runner per method")
    ap.add_argument(
        "--eager-acceptance",
        action="store_true",
        help="every runner's acceptance eager (model.graph_acceptance=false; by default it is "
        "captured beside the forward's graphs)",
    )
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, _ = dv.build_model(args.model_config, None, args.device, dtype)
    problems = dv.read_log(dv.LOG, args.problems, args.max_tokens)
    # the process's first run pays the first captures and kernel loads: not measured
    ga = False if args.eager_acceptance else None
    print("warm-up", json.dumps(dv.timing_replay(model, "plain", problems, None, ga)), flush=True)
    methods = ("plain", "auto", "stand")
    runners = {m: dv.replay_runner(model, problems, ga) for m in methods} if args.served else {}
    for method, runner in runners.items():  # each replica's first job: not measured
        print("first job", method, json.dumps(dv.timing_replay(model, method, problems, runner)))
    res: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for method in methods:
            got = dv.timing_replay(model, method, problems, runners.get(method), ga)
            res.setdefault(method, []).append(got)
            print(method, json.dumps(res[method][-1]), flush=True)
            (args.out / "runner-replay.json").write_text(json.dumps(res, indent=1) + "\n")
    prof = cProfile.Profile()
    prof.enable()
    got = dv.timing_replay(model, "auto", problems, runners.get("auto"), ga)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats("tts_service|store", 50)
    (args.out / "prof-auto.txt").write_text(json.dumps(got) + "\n" + text.getvalue())
    print("profiled auto", json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
