"""The held-out and unseen prompt sets are valid problems files for `jobs.best_of_n`, and share
nothing with the prompts used for tuning (issues 19 and 31: report on prompts the drafters never
saw); `--log` writes the trajectory log."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.best_of_n import load_problems

ROOT = Path(__file__).resolve().parents[3]


def test_heldout_prompts_are_new_and_load_as_problems():
    problems = load_problems(ROOT / "bench/heldout_prompts.jsonl")
    assert len(problems) >= 12 and {p.task for p in problems} == {"math", "choice", "code"}
    tuning = [
        json.loads(line)
        for f in ("bench/prompts.jsonl", "configs/calibration.jsonl")
        for line in (ROOT / f).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert not {p.id for p in problems} & {t["id"] for t in tuning}
    assert not {p.question for p in problems} & {t["prompt"] for t in tuning}


def test_unseen_sets_are_new_and_differ_in_source():
    """Issue 31's unseen sets: competition math and science (AIME and GPQA fixtures) and code
    (LiveCodeBench fixtures), none of them a tuning or held-out prompt."""
    seen = {
        json.loads(line).get("prompt") or json.loads(line).get("question")
        for f in ("bench/prompts.jsonl", "configs/calibration.jsonl", "bench/heldout_prompts.jsonl")
        for line in (ROOT / f).read_text(encoding="utf-8").splitlines()
        if line.strip()
    }
    science = load_problems(ROOT / "bench/unseen_math_science.jsonl")
    code = load_problems(ROOT / "bench/unseen_code.jsonl")
    assert {p.task for p in science} == {"math", "choice"} and {p.task for p in code} == {"code"}
    assert not {p.question for p in science + code} & seen


def test_log_flag_turns_the_trajectory_log_on(tmp_path):
    from jobs.best_of_n import parse

    problems = str(ROOT / "jobs" / "demo_problems.jsonl")
    cfg, _, _ = parse(["--problems", problems, "--out", str(tmp_path / "a")])
    assert not cfg.log_trajectories
    cfg, _, _ = parse(["--problems", problems, "--out", str(tmp_path / "b"), "--log"])
    assert cfg.log_trajectories


def test_from_any_directory_the_preset_is_found_and_an_out_that_is_a_file_exits_2(
    tmp_path, monkeypatch, capsys
):
    """The default `--config` is the repository's, not one relative to the working directory;
    `--out` naming a file is one line and exit 2, not a traceback."""
    from jobs.best_of_n import main

    (tmp_path / "results").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    problems = str(ROOT / "jobs" / "demo_problems.jsonl")
    assert main(["--problems", problems, "--out", "results/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "jobs.best_of_n: error: --out: cannot write results to results/run: "
        + str(tmp_path / "results")
        + " is a file"
    )


def test_the_summary_says_why_a_drafting_method_ran_mostly_plain():
    from jobs.best_of_n import plain_steps_line
    from tts_service.drafters.registry import method_drafter
    from tts_service.schemas import JobConfig

    auto = JobConfig(drafter=method_drafter("auto", {}, "cpu"))  # stand-dyn, GT-sized
    summary = {"method": "stand-dyn", "plain_steps": 97, "row_forwards": 100}
    line = plain_steps_line(summary, auto)
    assert line.startswith("[job] stand-dyn ran 97% of its steps plain: its measured verify cost")
    assert plain_steps_line({**summary, "plain_steps": 50}, auto) is None  # half: not mostly
    fixed = JobConfig(drafter={"kind": "pld"})
    assert "no continuation" in plain_steps_line({**summary, "method": "pld"}, fixed)
    plain = JobConfig(drafter={"kind": "plain"})
    assert plain_steps_line({**summary, "method": "plain"}, plain) is None


def test_a_step_without_a_draft_counts_as_plain():
    from tts_service.engine.metrics import GenerationStats

    stats = GenerationStats()
    stats.record_step(0, 0, 1)
    stats.record_step(4, 2, 3)
    assert stats.to_dict()["plain_steps"] == 1 and stats.target_forwards == 2


def test_a_run_recorded_before_a_field_existed_resumes_at_its_default(tmp_path):
    """`aggregate` came later: a run.json without it is the majority run it was; one that
    records another vote is another run."""
    from jobs.best_of_n import resume_conflict
    from jobs.common import run_settings
    from tts_service.schemas import JobConfig

    cfg = JobConfig()
    settings = run_settings(cfg)
    del settings["aggregate"]
    (tmp_path / "run.json").write_text(json.dumps({"settings": settings, "questions": {}}))
    assert resume_conflict(tmp_path, cfg, []) is None
    other = cfg.model_copy(update={"aggregate": "filtered"})
    assert "aggregate='majority', not 'filtered'" in resume_conflict(tmp_path, other, [])
