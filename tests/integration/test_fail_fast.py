"""A first real run's mistakes answered before Ray starts: a mistyped model (serve, both jobs,
a job submission), a taken port and an unreachable store are one line and exit 2, and nothing
of Ray starts (the commands as a user runs them, in subprocesses)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from store.local_server import free_port

DEMO = "jobs/demo_problems.jsonl"
TYPO = "Did you mean 'smollm2-135m'?"


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray if any
    env.update(RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", *argv], env=env, capture_output=True, text=True, timeout=120
    )


def _refused(proc: subprocess.CompletedProcess, *says: str) -> None:
    """Exit 2, one line of error naming what is wrong, and no Ray started."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert all(s in lines[0] for s in says), lines[0]
    assert "Ray" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ("tts_service", "serve", "smollm2-136m"),
        ("jobs.best_of_n", "--problems", DEMO, "--out", "{out}", "--model", "smollm2-136m"),
        ("jobs.best_of_n", "--problems", DEMO, "--out", "{out}",
         "--set", "model.name=smollm2-136m"),
        ("jobs.evaluate", "--tasks", "aime24", "--data", "fixtures", "--out", "{out}",
         "--model", "smollm2-136m"),
        ("tts_service", "job", "submit", "--", "python", "-m", "jobs.best_of_n", "--problems",
         DEMO, "--out", "{out}", "--model", "smollm2-136m"),
    ],
    ids=["serve", "job", "job-set", "evaluate", "submit"],
)  # fmt: skip
def test_a_mistyped_model_is_one_line_and_exit_2_naming_the_alias(argv, tmp_path: Path):
    out = tmp_path / "out"
    _refused(_run(*(a.format(out=out) for a in argv)), "smollm2-136m", TYPO)
    assert not out.exists()  # nothing claimed: the corrected command runs into the same --out


def test_an_uncached_hub_model_offline_says_so(tmp_path: Path):
    proc = _run(
        "jobs.best_of_n", "--problems", DEMO, "--out", str(tmp_path / "o"),
        "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    )  # fmt: skip
    _refused(proc, "model.name:", "not in the hub cache", "HF_HUB_OFFLINE")


def test_a_taken_port_is_refused_before_ray():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _refused(_run("tts_service", "serve", "--port", str(port)), f"--port: 127.0.0.1:{port}")


@pytest.mark.parametrize("module", ["jobs.best_of_n", "jobs.evaluate"])
def test_an_unreachable_store_is_refused_before_ray(module: str, tmp_path: Path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    task = ["--problems", DEMO] if module == "jobs.best_of_n" else ["--tasks", "aime24"]
    data = [] if module == "jobs.best_of_n" else ["--data", "fixtures"]
    proc = _run(module, *task, *data, "--out", str(tmp_path / "o"), "--set", f"store.url={url}")
    _refused(proc, f"store.url: cannot reach Redis at {url}")


@pytest.mark.slow
def test_a_replica_that_fails_anyway_reports_its_cause_once(tmp_path: Path):
    """A model that passes the checks and still does not load (weights that are not weights):
    the deployment fails at its first replica, and the command says why in one line."""
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = _run("tts_service", "serve", str(model), "--port", str(free_port()))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tts: error:")]
    assert len(errors) == 1 and "a replica of tts failed to start: " in errors[0], errors
    assert proc.stderr.count("Exception in Replica") == 1  # Serve did not retry it
    assert "has no attribute 'engine'" not in proc.stderr  # nor a half-built replica's error
