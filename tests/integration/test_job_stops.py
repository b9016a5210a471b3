"""A best-of-N job stopped by SIGTERM or Ctrl-C while it decodes exits within 10 s with the
status a supervisor reads as stopped by that signal, leaving no process of its own (its private
Ray included), and keeps every finished trajectory; killed with SIGKILL, its private Ray goes
within seconds too: a real process, a private Ray on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_while_decoding_stops_the_job_within_10_s_leaving_nothing(tmp_path, sig):
    out, log = tmp_path / "out", tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own private Ray
    argv = [
        sys.executable, "-m", "jobs.best_of_n", "--problems", "jobs/demo_problems.jsonl",
        "--out", str(out), "--set", "n=8", "--set", "sampling.max_new_tokens=128",
    ]  # fmt: skip
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=f, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "[job] trajectories 1/" not in log.read_text():  # decoding, one trajectory done
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        own = psutil.Process(proc.pid).children(recursive=True)
        assert own, "a private Ray and the generator actor run beneath it"
        proc.send_signal(sig)
        status = proc.wait(timeout=10)
        if sig != signal.SIGKILL:  # 143, 130: stopped by that signal (was -6, SIGABRT)
            assert status == 128 + sig, log.read_text()[-3000:]
            assert "run the same command to resume" in log.read_text()
        _, alive = psutil.wait_procs(own, timeout=10)
        assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kept = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    assert kept and all(r["token_ids"] for r in kept)  # what finished is there to resume from
