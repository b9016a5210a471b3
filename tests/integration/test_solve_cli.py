"""`tts solve --problems`: every problem through the one runner, a vote per problem, and run
stats that add up."""

from __future__ import annotations

import json

from tts_service.cli import main


def test_solve_runs_a_problems_file_and_votes(tiny_model_dir, tmp_path, capsys):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(
        '{"id": "a", "question": "What is 2 + 3?"}\n'
        '{"id": "b", "question": "Name a prime number.", "task": "math"}\n'
    )
    argv = [
        "solve", "--model", str(tiny_model_dir), "--device", "cpu", "--method", "stand",
        "--problems", str(problems), "--n", "3", "--max-new-tokens", "12", "--max-rows", "4",
        "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["id"] for p in out["problems"]] == ["a", "b"]
    for p in out["problems"]:
        assert [t["index"] for t in p["trajectories"]] == [0, 1, 2]
        assert [t["seed"] for t in p["trajectories"]] == [0, 1, 2]
        assert {"answer", "votes", "share", "no_answer"} <= set(p)
        assert p["no_answer"] + sum(p["votes"].values()) == 3
    stats = out["stats"]
    tokens = sum(len(t["token_ids"]) for p in out["problems"] for t in p["trajectories"])
    assert stats["new_tokens"] == tokens and stats["num_trajectories"] == 6
    assert stats["target_forwards"] < stats["row_forwards"]  # rows shared forwards
    assert 1 < stats["mean_rows_per_forward"] <= 4
    assert stats["tokens_per_s"] > 0 and stats["wall_s"] > 0


def test_solve_one_question_votes_by_task_with_the_default_method(tiny_model_dir, capsys):
    argv = [
        "solve", "--model", str(tiny_model_dir), "--device", "cpu", "--task", "choice",
        "--n", "3", "--max-new-tokens", "8", "--json", "Which is larger, A) 3 or B) 5?",
    ]  # fmt: skip
    assert main(argv) == 0
    (p,) = json.loads(capsys.readouterr().out)["problems"]
    assert {"answer", "votes", "share", "no_answer", "winner_indices"} <= set(p)
    assert p["no_answer"] + sum(p["votes"].values()) == 3
    assert p["answer"] is None or p["answer"] in "ABCDEFGHIJ"
