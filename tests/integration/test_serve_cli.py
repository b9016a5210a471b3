"""`tts serve` as a user runs it: vLLM's flags, bearer auth with --api-key, and SIGTERM stops
the application (the process exits and the port closes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from store.local_server import free_port

pytestmark = pytest.mark.slow
KEY = "s3cret"


def call(base: str, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _serving(flags: list[str], log) -> subprocess.Popen:
    """`tts serve` with `flags` on a private Ray, in a session of its own, once it serves."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray
    env.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tts_service", "serve", *flags],
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    deadline = time.monotonic() + 400
    while "tts: serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(1)
    return proc


def test_tts_serve_takes_vllm_flags_checks_the_key_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    flags = [
        "--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", "24", "--api-key", KEY,
    ]  # fmt: skip
    proc = _serving(flags, log)
    try:
        started = log.read_text()  # each slow startup phase says what it waits for
        assert "tts: starting Ray ..." in started and "tts: Ray ready in " in started
        assert "tts: deploying" in started and "tts: deployed in " in started
        base = f"http://127.0.0.1:{port}"
        for path in ("/v1/models", "/healthz"):  # every route
            for key in (None, "wrong"):
                status, body = call(base, path, key)
                assert status == 401 and body["error"]["param"] == "authorization"
        status, body = call(base, "/v1/models", KEY)
        assert status == 200 and body["data"][0]["id"] == "tiny"
        short = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
        status, body = call(base, "/v1/completions", KEY, short)
        assert status == 200, body
        status, body = call(base, "/v1/completions", KEY, {**short, "prompt": "Hi " * 30})
        assert status == 400 and "24" in body["error"]["message"]  # --max-model-len

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert not _port_open(port)
        # quiet by default: one access line per request (the 401s too), none of Ray's INFO
        lines = log.read_text().splitlines()
        access = [line for line in lines if '"GET /' in line or '"POST /' in line]
        assert len(access) == 7, lines  # 4 refused, /v1/models, 2 completions
        assert any('"POST /v1/completions" 400' in line for line in access)
        assert not [line for line in lines if "INFO" in line], lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_stops_serve_within_10_s(tiny_model_dir, tmp_path, sig):
    """What `timeout`, `kill -TERM -PGID` and systemd send: Ray's own processes get the signal
    too, and Serve's shutdown waited 30 s for its dead controller (31-41 s in all). Exit within
    10 s, nothing of it left."""
    import psutil

    port = free_port()
    log = tmp_path / "serve.log"
    proc = _serving(["--model", str(tiny_model_dir), "--port", str(port)], log)
    try:
        own = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 <= 10, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(own, timeout=10)
        assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
        assert not _port_open(port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
