"""A best-of-N job on a two-node Ray cluster on this machine (issue 30): a head and a worker
node started with `ray start` on loopback, each with one CPU and its own custom resource. The
job spreads its replicas over both nodes; losing the worker node mid-job (its raylet's process
group killed by PID) ends with every trajectory present exactly once, the lost node's
unfinished ones decoded on the other node.

Every Ray started here runs in a subprocess stopped by its PID (never `ray stop`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from store.local_server import free_port
from tests.integration.conftest import stop_served

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROBLEMS = 10
N = 8


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", **extra}


def _node(tmp: str, resource: str, head_port: int, head: bool) -> subprocess.Popen:
    """`ray start --block` of one node (in its own process group), one CPU, loopback only."""
    where = [f"--port={head_port}", "--head"] if head else [f"--address=127.0.0.1:{head_port}"]
    ports = {
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            *where,
            "--block",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--num-gpus=0",
            f"--resources={json.dumps({resource: 1})}",
            "--disable-usage-stats",
            *(["--include-dashboard=false"] if head else []),
            *(f"{flag}={value}" for flag, value in ports.items()),
        ],
        env=_env(RAY_TMPDIR=tmp),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _lose(proc: subprocess.Popen) -> None:
    """SIGKILL the node's whole process tree (raylet, agents, workers), as a lost machine."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert any(p.name() == "raylet" for p in tree), [p.name() for p in tree]
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(tree, timeout=30)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is still there
    proc.wait()


@pytest.fixture
def two_nodes():
    """(RAY_TMPDIR, head address, the worker node's process); both stopped by PID."""
    tmp = tempfile.mkdtemp(prefix="tts-2n-", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    head = _node(tmp, "node_a", port, head=True)
    recorded = Path(tmp, "ray", "ray_current_cluster")
    deadline = time.monotonic() + 120
    while not recorded.is_file() and head.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    worker = _node(tmp, "node_b", port, head=False)
    try:
        assert recorded.is_file(), f"the head node did not come up (exit {head.poll()})"
        yield tmp, f"127.0.0.1:{port}", worker
    finally:
        _stop(worker)
        _stop(head)
        shutil.rmtree(tmp, ignore_errors=True)


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_a_job_spreads_over_two_nodes_and_survives_losing_one(two_nodes, tiny_model_dir, tmp_path):
    tmp, address, worker = two_nodes
    problems = tmp_path / "problems.jsonl"
    problems.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "question": f"Count from {i} to {i + 50}.", "answer": "1"})
            + "\n"
            for i in range(PROBLEMS)
        )
    )
    out = tmp_path / "out"
    sets = [
        f"model.name={tiny_model_dir}",
        "model.device=cpu",
        "model.dtype=float32",
        f"n={N}",
        "batch=2",
        "replicas=2",  # one CPU each: one per node
        "cpus_per_replica=1",
        "sampling.max_new_tokens=200",
        "sampling.ignore_eos=true",
        "max_retries=4",
    ]
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.best_of_n",
            "--problems",
            str(problems),
            "--out",
            str(out),
            *(a for s in sets for a in ("--set", s)),
        ],
        cwd=REPO,
        env=_env(RAY_ADDRESS=address, RAY_TMPDIR=tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    trajectories = out / "trajectories.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            nodes = {r["node"] for r in _records(trajectories)}
            if len(nodes) == 2:  # both nodes decoded: lose the worker now
                break
            time.sleep(0.2)
        before = _records(trajectories)
        assert len({r["node"] for r in before}) == 2, before[:3]  # spread over both nodes
        assert len(before) < PROBLEMS * N, "the job ended before the node could be lost"
        _lose(worker)
        stdout, stderr = job.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr[-3000:]
    records = _records(trajectories)
    keys = [(r["problem_id"], r["index"]) for r in records]
    assert sorted(keys) == sorted((f"p{i}", j) for i in range(PROBLEMS) for j in range(N))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == PROBLEMS * N
    assert summary["retries"] >= 1, stderr[-3000:]  # the lost node's calls went elsewhere


_REPLICA_NODES = """
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = sorted(
    a["Address"]["NodeID"]
    for a in ray._private.state.actors().values()
    if a["State"] == "ALIVE" and a["ActorClassName"].endswith("TTSServer")
)
print(" ".join(nodes))
"""


def test_serve_replicas_spread_over_two_nodes_and_answer(two_nodes, tiny_model_dir, tmp_path):
    """`tts serve` attached to the cluster (RAY_ADDRESS) with 2 one-CPU replicas: one on each
    node, and both answer through the one HTTP endpoint."""
    import urllib.request

    import yaml

    tmp, address, _ = two_nodes
    port = free_port()
    config = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    args = config["applications"][0]["args"]
    args["model"] = {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"}
    args.update(num_replicas=2, cpus_per_replica=1, served_model_name="tiny")
    config["http_options"]["port"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    env = _env(RAY_ADDRESS=address, RAY_TMPDIR=tmp)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tts_service", "serve", "--config", str(path)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while "tts: serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        nodes = subprocess.run(
            [sys.executable, "-c", _REPLICA_NODES, address],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.split()
        assert len(nodes) == 2 and len(set(nodes)) == 2, nodes  # one replica per node
        body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 4}).encode()
        for _ in range(4):  # Serve's router spreads them; every one is answered
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200 and json.loads(r.read())["choices"]
    finally:
        stop_served(proc, log)
