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
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


class _ExitedEarly(Exception):
    """redis-server exited while starting (most often: its port was taken meanwhile)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port(taken: frozenset[int] = frozenset()) -> int:
    """A free port p whose cluster bus port p + 10000 is free too (both below 65536), neither of
    them one of the `taken` ports (the other nodes' ports and bus ports)."""
    for _ in range(200):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port + 10000 > 65535 or {port, port + 10000} & taken:
                continue
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RedisServerError("no free port pair for a cluster node (port, port + 10000)")


class LocalRedisServer:
    """One redis-server. Without a `port` it takes a free one from `pick_port` and, should the
    port be taken between that choice and the server's bind (another process on this shared
    machine), starts again on a fresh one; its log is `redis.log` in its data directory."""

    START_TRIES = 5

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: tuple[str, ...] = (),
        pick_port: Callable[[], int] = free_port,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerError(
                "redis-server not found: install it (apt-get install -y redis-server) "
                "or pass --store redis://host:port/db"
            )
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tts-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.pick_port = None if port else pick_port
        self.port = port or pick_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tries = 1
        while True:
            try:
                self._start_once(timeout_s)
                self.pick_port = None  # a restart keeps the port its peers and clients know
                return self
            except _ExitedEarly as exc:
                if self.pick_port is None or tries == self.START_TRIES:
                    self.stop()
                    raise RedisServerError(str(exc)) from None
                self.port, tries = self.pick_port(), tries + 1

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _start_once(self, timeout_s: float) -> None:
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
            "--logfile",
            str(self.log_path.resolve()),  # redis-server reads it after moving into --dir
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        once = Retry(NoBackoff(), 0)  # each ping asks once: the loop re-checks the process
        client = redis.Redis(
            port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5, retry=once
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise _ExitedEarly(
                    f"redis-server on port {self.port} exited with code {self.proc.returncode}: "
                    + self._log_tail()
                )
            try:
                if client.info("server")["process_id"] == self.proc.pid:
                    return
                time.sleep(0.05)  # another server holds the port: ours exits at its bind
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or not redis
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port}")

    def _log_tail(self, lines: int = 3) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return " | ".join(tail) or "(empty log)"

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
        self.nodes: list[LocalRedisServer] = []
        for _ in range(masters * (1 + replicas)):
            node = LocalRedisServer(
                pick_port=self._free_node_port,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                ),
            )  # fmt: skip
            self.nodes.append(node)

    def _free_node_port(self) -> int:
        taken = frozenset(p for n in self.nodes for p in (n.port, n.port + 10000))
        return free_cluster_port(taken)

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
