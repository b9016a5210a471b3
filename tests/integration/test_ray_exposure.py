"""The Ray that `tts serve` and the jobs use, attacked from this machine (loopback only, every
wait bounded): every socket the private instance opens is on 127.0.0.1; a `ray start` cluster
on the machine is left alone unless RAY_ADDRESS names it; a RAY_ADDRESS cluster is attached to
without passing resources; replicas it cannot hold fail in bounded time, saying why.

Every Ray started here runs in a subprocess stopped by its PID (never `ray stop`)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from store.local_server import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROBLEM = {"id": "p1", "question": "What is 1 + 1? Put the answer in \\boxed{}.", "answer": "2"}


def _env(**extra: str) -> dict[str, str]:
    """This checkout first on the path (Ray workers inherit it), no cluster unless given."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", **extra}


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `procs`."""
    found = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # a worker may exit while we look
            found += [
                (proc.name(), c.laddr.ip, c.laddr.port)
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
    return found


def _assert_loopback_only(pid: int) -> None:
    sockets = _listening(_tree(pid))
    names = {name for name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets  # the check sees Ray's own servers
    exposed = [s for s in sockets if not _is_loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def _stop(proc: subprocess.Popen, procs: list[psutil.Process], sig: int) -> None:
    """Ask `proc` to stop, then kill whatever of its recorded tree is left (by PID)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(procs, timeout=30)
    for leftover in alive:
        with contextlib.suppress(psutil.Error):  # psutil refuses a reused PID
            leftover.kill()


def _job(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """`python -m jobs.best_of_n ARGS` in its own session; killed with its group on timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.best_of_n", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job still ran after {timeout:g}s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


def _job_args(model_dir: Path, tmp_path: Path, *sets: str) -> list[str]:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(PROBLEM) + "\n")
    base = [
        f"model.name={model_dir}",
        "model.device=cpu",
        "model.dtype=float32",
        "n=2",
        "batch=2",
        "sampling.max_new_tokens=8",
    ]
    sets_args = [a for s in (*base, *sets) for a in ("--set", s)]
    return ["--problems", str(problems), "--out", str(tmp_path / "out"), *sets_args]


# ---------------------------------------------------------------- the private local instance

_JOB_RAY = """
import sys

import ray

from jobs.common import init_ray
from tts_service.schemas import JobConfig

init_ray(JobConfig(replicas=1, cpus_per_replica=1))


@ray.remote(num_cpus=0)
class Probe:
    def ping(self) -> str:
        return "pong"


probe = Probe.remote()  # a worker process, with its own gRPC server
assert ray.get(probe.ping.remote(), timeout=120) == "pong"
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_jobs_private_ray_listens_on_loopback_only():
    proc = subprocess.Popen(
        [sys.executable, "-c", _JOB_RAY],
        cwd=REPO,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs = [psutil.Process(proc.pid)]
    try:
        deadline, line = time.monotonic() + 180, "started"
        while line and line.strip() != "ready":  # "" once the script has exited
            wait = deadline - time.monotonic()
            readable = wait > 0 and select.select([proc.stdout], [], [], wait)[0]
            line = proc.stdout.readline() if readable else ""
        assert line, f"the job's Ray did not start in time (exit {proc.poll()})"
        procs = _tree(proc.pid)
        _assert_loopback_only(proc.pid)
    finally:
        proc.stdin.close()  # the script returns, Ray shuts down with it
        _stop(proc, procs, signal.SIGTERM)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def test_tts_serve_listens_on_loopback_only(tiny_model_dir, tmp_path):
    port = free_port()
    config = tmp_path / "serve.yaml"
    app = {
        "model": {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
        "served_model_name": "tiny",
        "cpus_per_replica": 0.5,
        "drafters": {"stand": {"tree": "stand-80", "num_nodes": 8}},
    }
    config.write_text(
        yaml.safe_dump(
            {
                "http_options": {"host": "127.0.0.1", "port": port},
                "applications": [{"name": "tts", "route_prefix": "/", "args": app}],
            }
        )
    )
    code = "import sys; from tts_service.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--config", str(config)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    procs = [psutil.Process(proc.pid)]
    try:
        deadline = time.monotonic() + 240
        while not _healthy(port):
            assert proc.poll() is None, f"tts serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "tts serve did not answer /healthz in time"
            time.sleep(1)
        procs = _tree(proc.pid)
        _assert_loopback_only(proc.pid)
    finally:
        _stop(proc, procs, signal.SIGINT)  # Ctrl-C: serve.shutdown(), then Ray's


# ---------------------------------------------------------------- beside a `ray start` cluster


def _stop_ray_start(proc: subprocess.Popen, tmp: str) -> None:
    """A `ray start --block` stopped by its PID (never `ray stop`), then its RAY_TMPDIR."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is still there
    proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A 2-CPU `ray start --head` cluster, as another user of the machine might run one: it
    records itself in $RAY_TMPDIR/ray/ray_current_cluster, where Ray looks for "the" local
    cluster. It listens on 127.0.0.1 only (Ray's single-node mode) and is stopped by its PID.
    Yields (RAY_TMPDIR, GCS address)."""
    tmp = tempfile.mkdtemp(prefix="tts-ray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    env = _env(RAY_TMPDIR=tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ports = {
        "--port": port,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
    }
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            *(f"{flag}={value}" for flag, value in ports.items()),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    recorded = Path(tmp, "ray", "ray_current_cluster")
    deadline = time.monotonic() + 120
    while not recorded.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        assert recorded.is_file(), f"ray start --head did not come up (exit {proc.poll()})"
        yield tmp, recorded.read_text().strip()
    finally:
        _stop_ray_start(proc, tmp)


def test_a_job_beside_a_running_cluster_starts_its_own_ray(ray_cluster, tiny_model_dir, tmp_path):
    """No RAY_ADDRESS: the job must neither attach to the machine's cluster (and crash passing
    it resources) nor run its work there."""
    ray_tmp, _ = ray_cluster
    args = _job_args(tiny_model_dir, tmp_path, "replicas=1", "cpus_per_replica=1")
    code, out, err = _job(args, _env(RAY_TMPDIR=ray_tmp), timeout=300)
    assert code == 0, err[-3000:]
    assert "[job] Ray: a private local Ray on 127.0.0.1 only" in out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["trajectories"] == 2


def test_a_job_attaches_to_ray_address_without_passing_resources(
    ray_cluster, tiny_model_dir, tmp_path
):
    _, address = ray_cluster
    args = _job_args(tiny_model_dir, tmp_path, "replicas=1", "cpus_per_replica=1")
    code, out, err = _job(args, _env(RAY_ADDRESS=address), timeout=300)
    assert code == 0, err[-3000:]
    assert f"[job] Ray: the Ray cluster at RAY_ADDRESS={address}" in out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["trajectories"] == 2


def test_replicas_the_cluster_cannot_hold_fail_in_bounded_time(
    ray_cluster, tiny_model_dir, tmp_path
):
    """2 replicas of 2 CPUs on a 2-CPU cluster: exit 2 naming what was asked and what the
    cluster has, instead of waiting forever for the second actor."""
    _, address = ray_cluster
    sets = ("replicas=2", "cpus_per_replica=2", "placement_timeout_s=5")
    start = time.monotonic()
    code, out, err = _job(
        _job_args(tiny_model_dir, tmp_path, *sets), _env(RAY_ADDRESS=address), timeout=120
    )
    assert code == 2, err[-3000:]
    assert time.monotonic() - start < 120
    message = err.strip().splitlines()[-1]
    assert message.startswith("jobs.best_of_n: error: replicas=2 with cpus_per_replica=2")
    assert "within 5s" in message and "CPU 4 in all" in message
    assert "the cluster has CPU 2" in message
    assert not (tmp_path / "out" / "trajectories.jsonl").exists()


DOCS_RAY_START = (
    "ray start --head --num-cpus=2 --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1"
)


def test_the_docs_one_machine_ray_start_listens_on_loopback_only():
    """The jobs manual's `ray start` for one machine, word for word (with `--block`, so that this
    test stops it by its PID, and a private RAY_TMPDIR), in the environment the manual gives:
    every listening socket of its process tree is on 127.0.0.1."""
    manual = (REPO / "docs" / "jobs.md").read_text()
    assert f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 {DOCS_RAY_START}" in manual
    tmp = tempfile.mkdtemp(prefix="tts-ray-", dir="/tmp")
    env = _env(RAY_TMPDIR=tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ray = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen(
        [ray, *DOCS_RAY_START.split()[1:], "--block", "--disable-usage-stats"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            names = {name for name, _, _ in _listening(_tree(proc.pid))}
            if {"gcs_server", "raylet"} <= names:
                break
            time.sleep(1.0)
        time.sleep(5.0)  # the dashboard and the agents come up after the raylet
        _assert_loopback_only(proc.pid)
    finally:
        _stop_ray_start(proc, tmp)
