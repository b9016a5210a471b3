"""`jobs.evaluate` end to end on the shipped fixtures with a tiny model over a local Ray: the
report files appear, methods are compared, and a re-run resumes instead of redoing work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.evaluate import main

pytestmark = pytest.mark.slow


def _run(out: Path, model_dir: Path, task: str, method: str, limit: int = 2) -> None:
    argv = [
        "--task",
        task,
        "--data",
        "fixtures",
        "--method",
        method,
        "--n",
        "2",
        "--limit",
        str(limit),
        "--out",
        str(out),
        "--set",
        f"model.name={model_dir}",
        "--set",
        "model.device=cpu",
        "--set",
        "model.dtype=float32",
        "--set",
        "sampling.max_new_tokens=8",
        "--set",
        "batch=2",
        "--set",
        "replicas=1",
        "--set",
        "cpus_per_replica=1",
    ]
    assert main(argv) == 0


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_evaluation_writes_the_report_and_a_rerun_resumes(ray_local, tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    _run(out, tiny_model_dir, "aime24", "stand")
    _run(out, tiny_model_dir, "aime24", "plain")
    _run(out, tiny_model_dir, "lcb", "stand")
    for name in ("report.json", "report.md", "accuracy_vs_n.png", "speed.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    runs = {(r["task"], r["method"]): r for r in report["runs"]}
    assert set(runs) == {("aime24", "stand"), ("aime24", "plain"), ("lcb", "stand")}
    assert runs[("aime24", "plain")]["metrics"]["acceptance_length"]["value"] == 1.0
    assert runs[("aime24", "stand")]["speedup_vs_plain"] is not None
    assert report["sandbox"]["kill_on_timeout"]
    stand = out / "aime24" / "stand"
    rows = [json.loads(line) for line in _lines(stand / "items.jsonl")]
    # rows are written as items finish; an actor's concurrent calls may finish item 2 first
    ids = sorted(r["id"] for r in rows)
    assert ids == ["1", "2"] and all(len(r["correct"]) == 2 for r in rows)
    assert "| stand |" in (out / "report.md").read_text()

    # a crash after the first item and one trajectory of the second: redo only what is missing
    trajectories = _lines(stand / "trajectories.jsonl")
    item_one = next(r for r in _lines(stand / "items.jsonl") if json.loads(r)["id"] == "1")
    (stand / "items.jsonl").write_text(item_one + "\n")
    kept = [t for t in trajectories if json.loads(t)["problem_id"] == "1"]
    kept.append(next(t for t in trajectories if json.loads(t)["problem_id"] == "2"))
    (stand / "trajectories.jsonl").write_text("\n".join(kept) + "\n")
    _run(out, tiny_model_dir, "aime24", "stand")
    after = _lines(stand / "trajectories.jsonl")
    assert after[:3] == kept and len(after) == 4  # one trajectory redone, none doubled
    assert [json.loads(r)["id"] for r in _lines(stand / "items.jsonl")] == ["1", "2"]  # 1 kept

    # a finished run is not redone; a larger --limit runs only the new item
    _run(out, tiny_model_dir, "aime24", "stand")
    assert _lines(stand / "trajectories.jsonl") == after
    _run(out, tiny_model_dir, "aime24", "stand", limit=3)
    assert (
        len(_lines(stand / "items.jsonl")) == 3 and len(_lines(stand / "trajectories.jsonl")) == 6
    )
