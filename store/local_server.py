"""A private `redis-server` on a free loopback port: for `--store local-redis` and for tests;
and a private Redis Cluster of such servers (`LocalRedisCluster`: tests and the benchmark).

They bind 127.0.0.1 only, are started and stopped by PID (never `redis-cli shutdown` of someone
else's server), and keep their data under their own directories.
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


def free_cluster_port() -> int:
    """A free port p whose cluster bus port p + 10000 is free too (both below 65536)."""
    for _ in range(200):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port + 10000 > 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RedisServerError("no free port pair for a cluster node (port, port + 10000)")


class LocalRedisServer:
    def __init__(
        self,
        data_dir: Path | None = None,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: tuple[str, ...] = (),
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
        self.extra_args = extra_args
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
            *self.extra_args,
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


class LocalRedisCluster:
    """A Redis Cluster of `masters` masters with `replicas` replicas each, every node a
    `LocalRedisServer` on its own loopback port; `url` is the `redis+cluster://` URL of all of
    them. `node_timeout_ms` is how long a master may be silent before its replica takes over."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1500) -> None:
        if shutil.which("redis-cli") is None:
            raise RedisServerError("redis-cli not found: apt-get install -y redis-tools")
        self.masters, self.replicas = masters, replicas
        self.nodes = [
            LocalRedisServer(
                port=free_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                ),
            )  # fmt: skip
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],  # fmt: skip
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0, nodes: list[LocalRedisServer] | None = None) -> None:
        """Until every live node says `cluster_state:ok` and every replica has synced."""
        deadline = time.monotonic() + timeout_s
        for node in nodes or self.live():
            client = redis.Redis(port=node.port, socket_connect_timeout=0.5)
            while True:
                info = client.execute_command("CLUSTER INFO")  # parsed by redis-py
                repl = client.info("replication")
                synced = repl["role"] == "master" or repl.get("master_link_status") == "up"
                if info.get("cluster_state") == "ok" and synced:
                    break
                if time.monotonic() > deadline:
                    raise RedisServerError(f"the cluster is not ok on port {node.port}: {info}")
                time.sleep(0.1)
            client.close()

    def live(self) -> list[LocalRedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def master_of(self, key: str) -> LocalRedisServer:
        """The live node that serves `key`'s slot now (its master)."""
        node = self.live()[0]
        client = redis.Redis(port=node.port)
        slot = client.execute_command("CLUSTER KEYSLOT", key)
        for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                port = int(master[1])
                client.close()
                return next(n for n in self.nodes if n.port == port)
        raise RedisServerError(f"no master serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
