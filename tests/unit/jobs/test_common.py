"""What the job entrypoints share: progress lines speak `metrics.summarize()`'s tokens/s, and
`load_config` sets the drafter from the method over the preset (`auto` resolves for the device
the job runs on; a --set still wins)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.common import JobInputError, Progress, generation_stats, load_config
from tts_service.engine.metrics import ForwardStats, GenerationStats, summarize

ROOT = Path(__file__).resolve().parents[3]
PRESET = str(ROOT / "configs" / "best_of_16.yaml")


def _record(tokens: int, forwards: int) -> dict:
    return {"stats": GenerationStats(new_tokens=tokens, target_forwards=forwards).to_dict()}


def test_progress_prints_plain_lines_with_the_runners_tokens_per_s(capsys):
    progress = Progress(num_trajectories=2, num_problems=1)  # stderr is no terminal here
    assert progress.bar is None
    progress.begin()
    time.sleep(0.05)  # a measurable elapsed time
    records = [_record(30, 10), _record(50, 25)]
    for rec in records:
        progress.trajectory(rec)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" tok/s")[0].rsplit(" ", 1)[0] for line in lines] == [
        "[job] trajectories 1/2 problems 0/1",
        "[job] trajectories 2/2 problems 0/1",
    ]
    printed = float(re.search(r"([\d.]+) tok/s", lines[-1]).group(1))
    summary = progress.summary()
    expected = summarize([generation_stats(r["stats"]) for r in records], ForwardStats(), 1.0)
    assert summary["new_tokens"] == progress.tokens == 80
    assert summary["acceptance_length"] == expected["acceptance_length"]
    assert summary["tokens_per_s"] == pytest.approx(80 / summary["wall_s"], rel=0.01)
    assert printed == round(summary["tokens_per_s"], 1)  # the same figure
    time.sleep(0.05)  # grading after the last trajectory is not decoding time
    assert progress.summary() == summary


def test_generation_stats_take_an_endpoints_subset():
    stats = generation_stats({"new_tokens": 7, "target_forwards": 0, "wall_s": 1.5, "extra": 1})
    assert (stats.new_tokens, stats.target_forwards, stats.wall_s) == (7, 0, 1.5)


def test_the_method_sets_the_drafter_over_the_preset():
    assert load_config(PRESET, [], method="pld").drafter.kind == "pld"
    dyn = load_config(PRESET, ["model.device=cpu"]).drafter  # the preset's auto, on a CPU
    assert (dyn.kind, dyn.num_nodes, dyn.sizing) == ("stand_dyn", 80, "gt")
    stand = load_config(PRESET, [], method="stand").drafter  # the preset's stand fields
    assert (stand.kind, stand.tree, stand.num_nodes, stand.sizing) == (
        "stand",
        "stand-80",
        16,
        "fixed",
    )


def test_auto_resolves_for_the_device_a_set_asks_and_a_set_still_wins():
    gt = load_config(PRESET, ["model.device=cuda"], method="stand-gt").drafter  # no CUDA needed
    assert (gt.kind, gt.sizing, gt.num_nodes) == ("stand", "gt", 80)
    capped = load_config(PRESET, ["model.device=cuda", "drafter.num_nodes=32"]).drafter
    assert (capped.kind, capped.sizing, capped.num_nodes) == ("stand_dyn", "gt", 32)


def test_an_unknown_method_names_the_flag():
    with pytest.raises(JobInputError, match="--method: unknown 'medusa'"):
        load_config(PRESET, [], method="medusa")


def test_a_jobs_driver_imports_no_model_library():
    """A job's driver validates, starts actors and reports: the engine (transformers) loads in
    its actors only, so that ~2-3 s of imports stay off the path to starting Ray."""
    code = (
        "import sys, jobs.best_of_n, jobs.evaluate, actors.pool; from jobs.common import Progress; "
        "Progress(4, 1).summary(); print(sorted(m for m in sys.modules if m.split('.')[0] == "
        "'transformers'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
