"""What docs/real-models.md says a researcher runs, checked where it can be here (no GPU, no
hub): the reasoning preset validates with the settings the page gives, both jobs take `--model`
over it, and an evaluation runs from a local copy of a task's data (the offline path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobs import best_of_n, evaluate
from jobs.common import JobInputError, load_config
from tts_service.tasks.loaders import FIXTURES_DIR

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "reasoning.yaml"


def test_the_reasoning_preset_holds_what_the_page_says():
    cfg = load_config(PRESET, [])
    assert cfg.model.name == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert cfg.sampling.max_new_tokens == 32768 and cfg.model.max_model_len >= 32768 + 1024
    assert (cfg.sampling.temperature, cfg.sampling.top_p) == (0.6, 0.95)
    assert cfg.n == 16 and not cfg.early_stop
    assert "configs/reasoning.yaml" in (REPO / "docs" / "real-models.md").read_text()


def test_both_jobs_take_model_over_the_preset(tiny_model_dir, tmp_path):
    """`--model` replaces the preset's model (a local directory here), a `--set` still wins,
    and a model that is not there is refused naming the field."""
    common = ["--config", str(PRESET), "--out", str(tmp_path / "o")]
    problems = ["--problems", str(REPO / "jobs" / "demo_problems.jsonl")]
    cfg, _, _ = best_of_n.parse([*common, *problems, "--model", str(tiny_model_dir)])
    assert cfg.model.name == str(tiny_model_dir) and cfg.sampling.max_new_tokens == 32768
    cfg, _, _ = best_of_n.parse(
        [*common, *problems, "--model", "smollm2-135m", "--set", f"model.name={tiny_model_dir}"]
    )
    assert cfg.model.name == str(tiny_model_dir)
    jobs = evaluate.parse(
        [*common, "--tasks", "aime24", "--data", "fixtures", "--model", str(tiny_model_dir)]
    )
    assert {j.cfg.model.name for j in jobs} == {str(tiny_model_dir)}
    with pytest.raises(JobInputError, match="model.name: model 'nowhere/at-all'"):
        best_of_n.parse([*common, *problems, "--model", "nowhere/at-all"])


def test_an_evaluation_runs_from_a_local_copy_of_its_data(ray_local, tiny_model_dir, tmp_path):
    """The page's offline path: a task exported to a file and passed with --data-files."""
    copy = tmp_path / "aime24.jsonl"
    shutil.copy(FIXTURES_DIR / "aime24.jsonl", copy)
    argv = [
        "--config", str(PRESET), "--tasks", "aime24", "--data-files", str(copy),
        "--limit", "1", "--n", "2", "--out", str(tmp_path / "eval"),
        "--model", str(tiny_model_dir), "--set", "model.device=cpu",
        "--set", "model.max_model_len=null", "--set", "sampling.max_new_tokens=8",
        "--set", "replicas=1", "--set", "cpus_per_replica=1",
    ]  # fmt: skip
    assert evaluate.main(argv) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    (run,) = report["runs"]
    assert run["data"] == "files" and run["metrics"]["items"] == 1
