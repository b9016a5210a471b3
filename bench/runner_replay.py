"""Timing replay through the live runner on a GPU: plain, `auto` and `stand` interleaved, each
run best-of-N of the logged problems as one job waits for it (cost surface from its prior,
planner, lazy CUDA graphs), then where each step's time goes.

    python -m bench.runner_replay --out runs/gpu      # about 90 s on one H100, 7B shape
    python -m bench.runner_replay --out runs/gpu --context 4096 --forward compact
                                                      # reasoning-length contexts, our forward
    python -m bench.runner_replay --out runs/gpu --served   # a Serve replica's later jobs
    python -m bench.runner_replay --out runs/gpu-eager --eager-acceptance  # the acceptance eager

By default every run is a fresh runner, as a first job (or a one-off `tts solve`) meets it:
cost surface from its prior, every CUDA graph still to capture. `--served` keeps one runner per
method across the runs and measures them after one unmeasured job each, as a Serve replica's
later jobs run: surface, slot statistics and captured graphs kept. Every job replays the same
problems, so a served job also finds its prompts in the prompt cache and α̂ learned on the same
trajectories: somewhat kinder than a replica's next job on new problems. `--context N` lengthens
every prompt to N tokens of other logged text (`bench.device.long_prompt`), so rows decode at
a reasoning trace's length of context.

Writes to `--out`: `runner-replay.json` ({method: [records of `bench.device.timing_replay`]}),
`step-timeline.json` (per method, each phase's milliseconds a step with the device awaited at
every phase boundary, so a phase holds the device work it queued; and, from the torch
profiler, kernels launched a step, the device's busy milliseconds a step and the costliest
kernels) and `prof-auto.txt` (the host's Python profile of one `auto` job).
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
from tts_service.engine.cost import sync_device
from tts_service.engine.metrics import StepPhases

METHODS = ("plain", "auto", "stand")


class DevicePhases(StepPhases):
    """Step phases with the device awaited at each boundary: each phase's time includes the
    device work it queued (a serialized timeline: the overlap of host and device is lost)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def clock(self) -> float:
        sync_device(self.device)
        return super().clock()


def step_timeline(model, method: str, problems, runner, ga) -> dict:
    """One job of `method` twice more: with `DevicePhases` (ms a step per phase) and under the
    torch profiler (kernels and the device's busy time a step, the 15 costliest kernels)."""
    runner = runner or dv.replay_runner(model, problems, ga)
    phases = DevicePhases(model.device)
    dv.timing_replay(model, method, problems, runner, ga, phases=phases)
    out = {
        "synced_step_ms": {k: round(v / phases.steps * 1e3, 3) for k, v in phases.seconds.items()}
    }
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        got = dv.timing_replay(model, method, problems, runner, ga)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = max(got["target_forwards"], 1)
    busy_us = sum(e.self_device_time_total for e in kernels)
    out.update(
        kernels_per_step=round(sum(e.count for e in kernels) / steps, 1),
        device_busy_ms_per_step=round(busy_us / steps / 1e3, 3),
        wall_ms_per_step=round(got["seconds"] / steps * 1e3, 3),
        top_kernels=[
            {"name": e.key[:120], "count": e.count, "ms": round(e.self_device_time_total / 1e3, 3)}
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
        ],
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-config", choices=sorted(dv.ARCHITECTURES), default="qwen2.5-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=0, help="prompts lengthened to N tokens")
    ap.add_argument("--forward", choices=dv.FORWARDS, default="transformers")
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
    model = dv.engine_forward(model, args.forward)
    problems = dv.read_log(dv.LOG, args.problems, args.max_tokens, args.context)
    trajectories = sum(len(p.responses) for p in problems)
    context = round(sum(len(p.prompt_ids) for p in problems) / len(problems))  # prompt tokens
    # the process's first run pays the first captures and kernel loads: not measured
    ga = False if args.eager_acceptance else None
    print("warm-up", json.dumps(dv.timing_replay(model, "plain", problems, None, ga)), flush=True)
    runners = {m: dv.replay_runner(model, problems, ga) for m in METHODS} if args.served else {}
    for method, runner in runners.items():  # each replica's first job: not measured
        print("first job", method, json.dumps(dv.timing_replay(model, method, problems, runner)))
    res: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for method in METHODS:
            got = dv.timing_replay(model, method, problems, runners.get(method), ga)
            got.update(context=context, forward=args.forward, trajectories=trajectories)
            res.setdefault(method, []).append(got)
            print(method, json.dumps(res[method][-1]), flush=True)
            (args.out / "runner-replay.json").write_text(json.dumps(res, indent=1) + "\n")
    timeline = {}
    for method in ("plain", "auto"):
        timeline[method] = step_timeline(model, method, problems, runners.get(method), ga)
        print("timeline", method, json.dumps(timeline[method]), flush=True)
        (args.out / "step-timeline.json").write_text(json.dumps(timeline, indent=1) + "\n")
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
