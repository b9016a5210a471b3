"""`tts job submit` passes the whole entrypoint to Ray's job client."""

from __future__ import annotations

import sys
import types

from tts_service.cli import main


def test_submit_sends_the_whole_entrypoint(monkeypatch, capsys):
    submitted = {}

    class FakeClient:
        def __init__(self, address):
            submitted["address"] = address

        def submit_job(self, entrypoint, runtime_env):
            submitted["entrypoint"] = entrypoint
            return "raysubmit_1"

    fake = types.ModuleType("ray.job_submission")
    fake.JobSubmissionClient = FakeClient
    monkeypatch.setitem(sys.modules, "ray.job_submission", fake)
    argv = [
        "job",
        "--address",
        "http://127.0.0.1:1",
        "submit",
        "--",
        "python",
        "-m",
        "jobs.evaluate",
        "--task",
        "gpqa",
        "--data",
        "fixtures",
    ]
    assert main(argv) == 0
    assert submitted["entrypoint"] == "python -m jobs.evaluate --task gpqa --data fixtures"
    assert submitted["address"] == "http://127.0.0.1:1"
    assert capsys.readouterr().out.strip() == "raysubmit_1"
