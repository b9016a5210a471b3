"""A private `redis-server` on a free loopback port: for `--store local-redis` and for tests.

It binds 127.0.0.1 only, is started and stopped by PID (never `redis-cli shutdown` of someone
else's server), and keeps its data under its own directory.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisServer:
    def __init__(
        self, data_dir: Path | None = None, port: int | None = None, appendonly: bool = False
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerError(
                "redis-server not found: install it (apt-get install -y redis-server) "
                "or pass --store redis://host:port/db"
            )
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tts-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--daemonize",
            "no",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with code {self.proc.returncode}")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port}")

    def send_signal(self, sig: signal.Signals) -> None:
        """Signal this server only (tests: SIGSTOP and SIGCONT make a hung server)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
