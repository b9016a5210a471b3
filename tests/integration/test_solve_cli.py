"""`tts solve --problems`: every problem through the one runner, a vote per problem, and run
stats that add up."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

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


def test_solve_reports_the_whole_wait_and_shows_it_on_a_terminal(tiny_model_dir):
    """`tts solve --json` as its own process, stderr a terminal: stdout is the JSON alone,
    whose wall time is what the parent waited for, split into setup and decoding; stderr has
    each slow phase's status line and a token bar that ends at every token generated."""
    argv = [
        str(Path(sys.executable).with_name("tts")), "solve", "--model", str(tiny_model_dir),
        "--device", "cpu", "--method", "stand", "--n", "3", "--max-new-tokens", "12", "--json",
        "What is 2 + 3?",
    ]  # fmt: skip
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm's width
    begun = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=secondary, text=True)
    os.close(secondary)
    err = _read_terminal(primary)
    out = proc.communicate(timeout=600)[0]
    waited = time.perf_counter() - begun
    assert proc.returncode == 0, err
    stats = json.loads(out)["stats"]  # stdout is one JSON object, nothing else
    assert 0 < stats["decode_s"] < stats["wall_s"] <= waited
    assert stats["setup_s"] == pytest.approx(stats["wall_s"] - stats["decode_s"], abs=1e-3)
    tokens = stats["new_tokens"]
    assert stats["tokens_per_s"] == pytest.approx(tokens / stats["wall_s"], rel=1e-2)
    assert stats["decode_tokens_per_s"] == pytest.approx(tokens / stats["decode_s"], rel=1e-2)
    lines = err.replace("\r", "\n").splitlines()
    assert "[tts] loading model" in err and "[tts] model loaded in " in err
    first = float(re.search(r"\[tts\] first token after ([\d.]+) s", err).group(1))
    assert 0 < first < stats["wall_s"]
    bars = [line for line in lines if line.startswith("tokens:")]
    assert len(bars) > 1 and f"{tokens}/{tokens}" in bars[-1] and "trajectories 3/3" in bars[-1]


def _read_terminal(fd: int) -> str:
    """Everything written to a pseudo-terminal until its last writer closes it."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")
