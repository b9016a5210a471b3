"""`tts serve` with a tensor-parallel replica its cluster cannot place (each rank asks more
CPUs than any machine has): SIGTERM or Ctrl-C while it waits stops it within 10 s leaving no
process of its own (its private Ray included), and a placement timeout is exit 2 naming the
flag as typed and what the cluster has. Real processes, a private Ray on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from store.local_server import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _serve(tmp_path: Path, model_dir: Path, placement_timeout_s: float):
    """A `tts serve --tensor-parallel-size 2` whose ranks each ask 1000 CPUs, and its log."""
    args = {
        "model": {"name": str(model_dir), "device": "cpu", "dtype": "float32"},
        "cpus_per_replica": 1000,
        "placement_timeout_s": placement_timeout_s,
    }
    app = {"name": "tts", "import_path": "tts_service.serve.app:app_builder", "args": args}
    config = tmp_path / "serve.yaml"
    http = {"host": "127.0.0.1", "port": free_port()}
    config.write_text(yaml.safe_dump({"http_options": http, "applications": [app]}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own private Ray
    argv = [sys.executable, "-m", "tts_service", "serve", "--config", str(config)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--tensor-parallel-size", "2"],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return proc, log


def _wait_for(proc, log: Path, text: str, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_placing_stops_it_within_10_s_leaving_nothing(tmp_path, tiny_model_dir, sig):
    proc, log = _serve(tmp_path, tiny_model_dir, placement_timeout_s=600)
    try:
        _wait_for(proc, log, "tts: placing the 2 ranks")
        own = psutil.Process(proc.pid).children(recursive=True)  # its Ray among them
        assert own, "a private Ray runs beneath it"
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(own, timeout=10)
        assert not alive, [p.info for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_unplaceable_replica_is_exit_2_naming_the_flag_and_the_cluster(tmp_path, tiny_model_dir):
    proc, log = _serve(tmp_path, tiny_model_dir, placement_timeout_s=2)
    try:
        assert proc.wait(timeout=300) == 2, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    error = next(line for line in log.read_text().splitlines() if line.startswith("tts: error"))
    assert error.startswith("tts: error: --tensor-parallel-size 2: 2 bundles of CPU 1000")
    assert "the cluster has CPU" in error and "no node has CPU 2000" in error
