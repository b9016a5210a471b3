"""`bench/device.py` runs on a bare machine in CI-sized time, and its report has every field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {
    "device",
    "model",
    "plain_tokens_per_s",
    "hf_generate_tokens_per_s",
    "bandwidth_bound_tokens_per_s",
    "verify_cost_ms",
    "replay",
    "hf_n16_tokens_per_s",
    "greedy_mismatch",
}


def test_the_device_benchmark_reports_every_field_on_tiny(tmp_path):
    out = tmp_path / "device.json"
    cmd = [sys.executable, "-m", "bench.device", "--model-config", "tiny", "--device", "cpu"]
    cmd += ["--problems", "1", "--max-tokens", "12", "--new-tokens", "8"]
    cmd += ["--rows", "1,4", "--tokens", "1,4", "--json", str(out)]
    # the benchmark must not need Ray, Redis or HTTP: they are made unimportable
    guard = "import sys; [sys.modules.__setitem__(m, None) for m in ('ray', 'redis', 'httpx', "
    guard += "'requests', 'fastapi', 'starlette')]; import runpy; sys.argv = sys.argv[1:]; "
    guard += "runpy.run_module('bench.device', run_name='__main__')"
    res = subprocess.run(
        [sys.executable, "-c", guard, *cmd[2:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report.keys() >= FIELDS
    assert report["model"] == "tiny" and report["device"].endswith("(cpu)")
    assert report["verify_cost_ms"].keys() == {"1", "4"}
    assert all(v.keys() == {"1", "4"} for v in report["verify_cost_ms"].values())
    assert report["replay"].keys() == {"plain", "stand", "auto"}
    for method in report["replay"].values():
        assert method["tokens_per_s"] > 0 and method["acceptance_length"] >= 1.0
    # every method commits exactly the logged tokens; plain one per row-forward
    assert len({m["new_tokens"] for m in report["replay"].values()}) == 1
    assert report["replay"]["plain"]["acceptance_length"] == 1.0
    # what the planner's fresh decisions rested on (plain plans nothing)
    assert report["replay"]["plain"]["decisions"] == []
    decisions = report["replay"]["auto"]["decisions"]
    assert decisions and decisions[0].keys() >= {"nodes", "explored", "tokens", "seconds", "sigma"}
    assert report["replay"]["auto"]["graphs"] is None  # a CPU runs no CUDA graphs
    assert report["greedy_mismatch"]["float32"]["differing"] == 0


def test_a_served_runner_reports_each_job_alone():
    """`--served`: one runner across jobs, as a Serve replica keeps it. Each job's phases are
    its own (the per-step figures divide this job's time by this job's steps), its tokens
    are the log's, and the runner's planner and slot statistics carry over."""
    import torch

    from bench import device as dv

    torch.set_grad_enabled(False)
    model, _ = dv.build_model("tiny", None, "cpu", torch.float32)
    problems = dv.read_log(dv.LOG, 1, 12)
    runner = dv.replay_runner(model, problems)
    first = dv.timing_replay(model, "auto", problems, runner)
    planner = runner.planner
    steps = planner.steps if planner is not None else 0
    second = dv.timing_replay(model, "auto", problems, runner)
    assert all(d["step"] > steps for d in second["decisions"])  # this job's decisions only
    assert second["new_tokens"] == first["new_tokens"] > 0
    assert runner.decoder.phases.steps == second["target_forwards"]
    assert runner.planner is planner is not None and second["graphs"] is None
