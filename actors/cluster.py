"""Which Ray a driver uses: the cluster named by RAY_ADDRESS, else a private local instance that
listens on 127.0.0.1 only. Never a cluster that merely runs on the same machine (Ray's own
default is to attach to the last `ray start`), and never with resources passed to a cluster it
attaches to (Ray refuses those).

Ray rewrites a loopback node IP into the host's routable address unless it believes it runs
single-node (its macOS/Windows mode), and its gRPC servers (GCS, raylet, every worker) bind all
interfaces unless the node IP is literally 127.0.0.1. So `ray.init` runs in that single-node
mode: the private instance gets node IP, dashboard host and agents on loopback, and a
RAY_ADDRESS of 127.0.0.1:port reaches a loopback-bound cluster where it listens.
`tests/integration/test_ray_exposure.py` checks every listening socket of the instance.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Iterator
from typing import Any

LOOPBACK = "127.0.0.1"


def cluster_address() -> str | None:
    """RAY_ADDRESS, unless unset, empty or "local" (Ray's word for a new local instance)."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return address if address and address != "local" else None


@contextlib.contextmanager
def _loopback_kept() -> Iterator[None]:
    """Ray's single-node mode while addresses are resolved: 127.0.0.1 stays 127.0.0.1."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def grpc_servers_on_loopback() -> None:
    """Worker setup hook of the private instance. Ray Serve binds every replica's
    inter-deployment gRPC server to [::]:0, all interfaces, whatever the node IP; bind it to
    loopback, where the node's processes dial it (at the node IP, 127.0.0.1). Runs before the
    worker imports Serve's replica module, which copies the function at import."""
    from ray._common import tls_utils

    add_port = tls_utils.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return add_port(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0") else address)

    tls_utils.add_port_to_grpc_server = on_loopback


def start_local(num_cpus: int | None = None, **options: Any) -> None:
    """A private Ray on 127.0.0.1 only; `options` are further `ray.init` options (num_gpus,
    object_store_memory, log_to_driver). Token auth follows RAY_AUTH_MODE, default disabled:
    the instance is reachable from this machine only.

    Raises:
        RuntimeError: Ray put the node on another address (a Ray upgrade changed how the
            node IP is chosen); the instance is shut down rather than left exposed.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    with _loopback_kept():
        ray.init(
            address="local",  # not the cluster some `ray start` left on the machine
            num_cpus=num_cpus,
            include_dashboard=False,
            dashboard_host=LOOPBACK,
            _node_ip_address=LOOPBACK,
            runtime_env={"worker_process_setup_hook": f"{__name__}.grpc_servers_on_loopback"},
            **options,
        )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} put the local node on {node_ip}, not loopback")
    _reaped()


@functools.cache
def _reaped() -> subprocess.Popen | None:
    """Once per process: the private Ray's processes end with this one, however it ends
    (`actors.reaper`)."""
    from actors import reaper

    return reaper.start()


def connect(num_cpus: int | None = None, **options: Any) -> str:
    """Attach to RAY_ADDRESS, else `start_local(num_cpus, **options)`: the sizes are for the
    private instance only, a cluster's resources are its own. Returns a line for the log."""
    import ray

    if ray.is_initialized():
        return "the Ray this process is already connected to"
    address = cluster_address()
    if address is None:
        start_local(num_cpus, **options)
        return f"a private local Ray on {LOOPBACK} only (set RAY_ADDRESS to use a cluster)"
    with _loopback_kept():
        ray.init(address=address)
    return f"the Ray cluster at RAY_ADDRESS={address}"
