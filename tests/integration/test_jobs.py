"""Best-of-N jobs over real Ray actors: faults lose nothing, re-runs resume, Ray Jobs work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from actors.pool import ResultsFile, TrajectoryPool, start_actors
from jobs.best_of_n import main as job_main
from jobs.best_of_n import run as run_job
from tests.integration.conftest import refuse_to_start
from tts_service.schemas import JobConfig, Problem
from tts_service.timing import TIMING_KEYS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

PROBLEMS = [
    Problem(id="p1", question="What is 1 + 1? Put the answer in \\boxed{}.", answer="2"),
    Problem(
        id="p2",
        question="Which is larger, A) 3 or B) 5? End with Answer: X.",
        task="choice",
        answer="B",
    ),
    Problem(id="p3", question="Compute 2 * 3 and box it.", answer="6"),
]


def _cfg(model_dir, **kw) -> JobConfig:
    base = {
        "model": {"name": str(model_dir), "device": "cpu", "dtype": "float32"},
        "drafter": {"kind": "stand", "num_nodes": 8},
        "sampling": {"temperature": 0.6, "max_new_tokens": 12},
        "n": 4,
        "batch": 1,
        "replicas": 2,
        "cpus_per_replica": 0.5,
    }
    return JobConfig.model_validate({**base, **kw})


def _keys(path: Path) -> list[tuple[str, int]]:
    return [(r["problem_id"], r["index"]) for r in map(json.loads, path.read_text().splitlines())]


def test_killing_an_actor_mid_job_loses_and_doubles_nothing(ray_local, tiny_model_dir, tmp_path):
    # calls long enough (seconds) that a kill a moment after the start lands on calls in flight
    # (a kill at the first result could land after the other actor's batch had finished too:
    # all its rows end at the same step)
    cfg = _cfg(
        tiny_model_dir, sampling={"temperature": 0.6, "max_new_tokens": 256, "ignore_eos": True}
    )
    actors = start_actors(cfg, 2, None)
    results = ResultsFile(tmp_path / "trajectories.jsonl")
    pool = TrajectoryPool(cfg, actors, "kill-test", results)

    def kill_soon() -> None:
        time.sleep(0.5)
        ray_local.kill(actors[0], no_restart=False)  # Ray restarts it: a crash

    threading.Thread(target=kill_soon, daemon=True).start()
    try:
        states = pool.run(PROBLEMS)
    finally:
        for actor in actors:
            ray_local.kill(actor)
    keys = _keys(results.path)
    assert sorted(keys) == sorted((p.id, i) for p in PROBLEMS for i in range(4))  # no dupes
    assert all(sorted(s.records) == [0, 1, 2, 3] for s in states.values())
    assert pool.retries >= 1


def test_a_rerun_resumes_without_redoing_finished_work(ray_local, tiny_model_dir, tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(p.model_dump_json() + "\n" for p in PROBLEMS))
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, replicas=1, batch=2)
    # a crash after some work: keep only the first 5 trajectories of a full run
    run_job(cfg, PROBLEMS, out)
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    (out / "trajectories.jsonl").write_text("\n".join(lines[:5]) + "\n")
    summary = run_job(cfg, PROBLEMS, out)
    keys = _keys(out / "trajectories.jsonl")
    assert len(keys) == len(set(keys)) == 12 and keys[:5] == _keys_of(lines[:5])
    assert summary["trajectories"] == 12 and summary["problems"] == 3
    # tokens/s is this run's work only, not the 5 trajectories it found done
    redone = map(json.loads, (out / "trajectories.jsonl").read_text().splitlines()[5:])
    tokens = sum(r["stats"]["new_tokens"] for r in redone)
    assert summary["resumed_trajectories"] == 5
    assert summary["tokens_per_s"] == pytest.approx(tokens / summary["wall_s"], rel=0.02)
    result = json.loads((out / "problems" / "p2.json").read_text())
    assert {"answer", "votes", "correct", "trajectories", "stats"} <= set(result)
    assert len(result["trajectories"]) == 4


def _keys_of(lines: list[str]) -> list[tuple[str, int]]:
    return [(r["problem_id"], r["index"]) for r in map(json.loads, lines)]


def test_a_resume_with_other_settings_is_refused_or_starts_a_new_run(
    ray_local, tiny_model_dir, tmp_path, capsys
):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEMS[0].model_dump_json() + "\n")
    out = tmp_path / "out"

    def job(out: Path, max_new_tokens: int, *flags: str) -> int:
        sets = (
            f"model.name={tiny_model_dir}",
            "model.device=cpu",
            "model.dtype=float32",
            "n=2",
            "batch=2",
            "replicas=1",
            "cpus_per_replica=0.5",
            f"sampling.max_new_tokens={max_new_tokens}",
        )
        argv = ["--problems", str(problems), "--out", str(out), *flags]
        return job_main(argv + [a for s in sets for a in ("--set", s)])

    assert job(out, 12) == 0
    done = (out / "trajectories.jsonl").read_text()
    capsys.readouterr()
    assert job(out, 24) == 2  # before any actor: nothing reused, nothing added
    err = capsys.readouterr().err
    assert "sampling.max_new_tokens=12, not 24" in err and "--new-run" in err
    assert (out / "trajectories.jsonl").read_text() == done

    assert job(out, 24, "--new-run") == 0  # a fresh directory beside it, all work done anew
    fresh = tmp_path / "out-2"
    assert (
        json.loads((fresh / "run.json").read_text())["settings"]["sampling"]["max_new_tokens"] == 24
    )
    assert json.loads((fresh / "summary.json").read_text())["resumed_trajectories"] == 0
    assert job(out, 24, "--new-run") == 0  # the same command again resumes out-2
    assert len(_keys(fresh / "trajectories.jsonl")) == 2 and not (tmp_path / "out-3").exists()

    unknown = tmp_path / "before-run-json"  # results from before settings were recorded
    unknown.mkdir()
    (unknown / "trajectories.jsonl").write_text(done)
    problems.write_text(PROBLEMS[0].model_copy(update={"question": "2 + 2?"}).model_dump_json())
    capsys.readouterr()
    assert job(unknown, 12) == 2 and "settings are unknown" in capsys.readouterr().err
    assert job(out, 12) == 2 and "'p1' has another question" in capsys.readouterr().err


def test_bad_config_or_problems_exit_2_before_any_actor(tmp_path, capsys):
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"id": "a", "question": "q", "task": "poetry"}\n')
    assert job_main(["--problems", str(problems), "--out", str(tmp_path / "o")]) == 2
    assert "task" in capsys.readouterr().err
    problems.write_text('{"id": "a", "question": "q"}\n')
    assert (
        job_main(["--problems", str(problems), "--out", str(tmp_path / "o"), "--set", "n=0"]) == 2
    )
    assert "n:" in capsys.readouterr().err
    assert (
        job_main(
            [
                "--problems",
                str(problems),
                "--out",
                str(tmp_path / "o"),
                "--set",
                "sampling.temperature=-1",
            ]
        )
        == 2
    )
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real `ray start --head` cluster (the one Ray Jobs need), stopped by its PID."""
    from store.local_server import free_port

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port, dash, agent, agent_grpc, metrics = (free_port() for _ in range(5))
    temp = tmp_path_factory.mktemp("ray")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=2",
            "--include-dashboard=true",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            # Ray's fixed default ports would clash with the session's own local Ray
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 90
    client = None
    while time.monotonic() < deadline:
        try:
            client = JobSubmissionClient(address)
            client.list_jobs()
            break
        except Exception:  # the dashboard is still starting
            client = None
            time.sleep(1)
    assert client is not None, "ray start --head did not come up"
    yield client, address
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def test_best_of_4_through_the_ray_job_api(ray_head, tiny_model_dir, tmp_path):
    client, _ = ray_head
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(p.model_dump_json() + "\n" for p in PROBLEMS[:2]))
    out = tmp_path / "out"
    entry = (
        f"{sys.executable} -m jobs.best_of_n --config configs/best_of_16.yaml "
        f"--problems {problems} --out {out} --set model.name={tiny_model_dir} "
        "--set n=4 --set batch=2 --set sampling.max_new_tokens=12 --set cpus_per_replica=1"
    )
    job_id = None
    for _ in range(60):  # the dashboard answers before its job agent is ready
        try:
            job_id = client.submit_job(
                entrypoint=entry,
                runtime_env={
                    "working_dir": str(REPO),
                    "excludes": [".venv", "runs", ".git"],
                    "env_vars": {"HF_HUB_OFFLINE": "1"},
                },
            )
            break
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            time.sleep(2)
    assert job_id is not None, "the Ray job agent never became ready"
    deadline = time.monotonic() + 300
    status = None
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id).value
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(2)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-3000:]
    assert "[job] trajectories 8/8" in logs
    keys = _keys(out / "trajectories.jsonl")
    assert sorted(keys) == sorted((p.id, i) for p in PROBLEMS[:2] for i in range(4))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 8 and summary["graded"] == 2


def test_a_job_can_write_a_trajectory_log_that_replay_reads(ray_local, tiny_model_dir, tmp_path):
    from tts_service.replay import read_log

    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, replicas=1, batch=2, n=2, log_trajectories=True)
    run_job(cfg, PROBLEMS[:2], out)
    problems, errors = read_log(out / "trajectory-log.jsonl", strict=True)
    # one line per problem as each finishes; an actor's concurrent calls may finish p2 first
    assert not errors and sorted(p.prompt_id for p in problems) == ["p1", "p2"]
    assert all(len(p.responses) == 2 and p.top_ids is not None for p in problems)
    assert (
        "top_ids" not in json.loads((out / "problems" / "p1.json").read_text())["trajectories"][0]
    )


def test_gpu_placement_of_job_actors_with_declared_gpus(ray_local, tiny_model_dir, tmp_path):
    """The session's Ray declares 8 GPUs: the plan gives each replica one, in its own group."""
    from ray.util import remove_placement_group

    from jobs.actor_set import placed_actors

    cfg = _cfg(
        tiny_model_dir,
        replicas=2,
        n=2,
        batch=2,
        model={"name": str(tiny_model_dir), "device": "auto", "dtype": "float32"},
    )
    placed, replicas, gpus, strategies = placed_actors(cfg)
    actors = []
    try:
        assert (replicas, gpus, len(strategies)) == (2, 1, 2)
        assert placed.model.max_memory is None  # one GPU per replica: no sharding
        actors = start_actors(placed, replicas, None, gpus, strategies)
        ids = ray_local.get(
            [a.__ray_call__.remote(lambda self: ray_local.get_gpu_ids()) for a in actors]
        )
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 2
        pool = TrajectoryPool(placed, actors, "gpu", ResultsFile(tmp_path / "t.jsonl"))
        states = pool.run(PROBLEMS[:1])
        assert sorted(states["p1"].records) == [0, 1]
    finally:
        for actor in actors:
            ray_local.kill(actor)
        for strategy in strategies or []:
            remove_placement_group(strategy.placement_group)


def test_early_stop_decides_once_the_leader_cannot_be_overtaken(tiny_model_dir):
    """The decision itself, on hand-made trajectories (no actor runs)."""
    from actors.pool import ProblemState, stop_early

    cfg = _cfg(tiny_model_dir, n=8, early_stop=True)
    state = ProblemState(PROBLEMS[0])
    for i, text in enumerate(["\\boxed{2}", "\\boxed{2}", "\\boxed{3}", "\\boxed{2}"]):
        state.records[i] = {"index": i, "text": text}
    stop_early(cfg, state)
    assert not state.stopped_early  # 3 vs 1 with 4 to go: 3 could still reach 5
    for i in range(4, 6):
        state.records[i] = {"index": i, "text": "so \\boxed{2}"}
    stop_early(cfg, state)
    assert state.stopped_early  # 5 vs 1 with 2 to go: decided


def test_what_is_still_to_run_skips_finished_and_decided_problems(tiny_model_dir):
    """The pool's resume point and a job's nothing-to-do check are one rule: a problem with
    all n trajectories, or whose vote early stop has decided, has nothing left to run."""
    from actors.pool import still_to_run

    texts = {"p1": ["\\boxed{2}"] * 5 + ["\\boxed{3}"], "p2": ["\\boxed{5}"] * 2}
    records = [
        {"problem_id": pid, "index": i, "text": t}
        for pid, ts in texts.items()
        for i, t in enumerate(ts)
    ]
    records.append({"problem_id": "p3", "index": 8, "text": "\\boxed{6}"})  # beyond n: ignored
    cfg = _cfg(tiny_model_dir, n=8, batch=4, early_stop=True)
    states, chunks = still_to_run(cfg, PROBLEMS, records)
    assert states["p1"].stopped_early and len(states["p1"].records) == 6  # 5 of 8: decided
    # under early stop one trajectory a call, so the vote is decided as each one ends
    assert [(c.problem.id, c.indices) for c in chunks] == [
        *(("p2", [i]) for i in range(2, 8)),
        *(("p3", [i]) for i in range(8)),
    ]
    without = cfg.model_copy(update={"early_stop": False})
    assert [c.indices for c in still_to_run(without, PROBLEMS[:1], records)[1]] == [[6, 7]]
    assert [c.indices for c in still_to_run(without, PROBLEMS[2:], records)[1]] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_a_rerun_with_nothing_missing_starts_neither_ray_nor_a_model(
    ray_local, tiny_model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, replicas=1, batch=2, n=2)
    first = run_job(cfg, PROBLEMS[:2], out)
    assert 0 < first["decode_s"] <= first["wall_s"]
    assert first["setup_s"] == pytest.approx(first["wall_s"] - first["decode_s"], abs=1e-3)
    assert first["tokens_per_s"] == pytest.approx(first["total_tokens"] / first["wall_s"], 0.01)
    written = ("results.jsonl", "problems/p1.json", "problems/p2.json", "trajectories.jsonl")
    before = {name: (out / name).read_text() for name in written}
    started = refuse_to_start(monkeypatch)
    again = run_job(cfg, PROBLEMS[:2], out)
    assert started == []
    assert {name: (out / name).read_text() for name in written} == before
    assert json.loads((out / "summary.json").read_text()) == again
    assert again["resumed_trajectories"] == again["trajectories"] == 4
    for key in ("problems", "accuracy", "graded", "total_tokens", "mean_acceptance_length"):
        assert again[key] == first[key]
    # the record keeps the run's speed, and says a session did nothing after it
    assert {k: again[k] for k in TIMING_KEYS} == {k: first[k] for k in TIMING_KEYS}
    assert [s["new_tokens"] for s in again["sessions"]] == [first["total_tokens"], 0]
    assert again["sessions"][1]["decode_s"] == again["sessions"][1]["tokens_per_s"] == 0.0


def test_tts_job_submits_follows_lists_and_stops_through_a_real_job_server(
    ray_head, tmp_path, capsys
):
    from tts_service.cli import main

    _, address = ray_head

    def tts_job(action: str, *args: str) -> tuple[int, str, str]:
        rc = main(["job", action, "--address", address, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    def submit(*entry: str) -> str:
        for _ in range(60):  # the dashboard answers before its job agent is ready
            rc, out, err = tts_job("submit", "--working-dir", str(tmp_path), "--", *entry)
            if rc == 0:
                return out.strip()
            assert "No available agent" in err, err
            time.sleep(2)
        raise AssertionError("the Ray job agent never became ready")

    job_id = submit(sys.executable, "-c", "print('hello from the job')")
    rc, out, _ = tts_job("logs", job_id, "--follow")  # returns when the job ends
    assert rc == 0 and "hello from the job" in out
    assert tts_job("status", job_id)[1].strip() == "SUCCEEDED"
    assert any(line.startswith(f"{job_id}\tSUCCEEDED") for line in tts_job("list")[1].splitlines())

    sleeper = submit("sleep", "300")
    assert tts_job("stop", sleeper)[:2] == (0, "stopped\n")
    deadline = time.monotonic() + 60
    while tts_job("status", sleeper)[1].strip() != "STOPPED":
        assert time.monotonic() < deadline
        time.sleep(1)

    rc, out, err = tts_job("status", "raysubmit_nosuchjob")
    assert rc == 2 and out == "" and "no job 'raysubmit_nosuchjob'" in err


def test_an_unreachable_store_is_exit_2_before_any_actor(ray_local, tmp_path, capsys):
    from store.local_server import free_port

    problems = tmp_path / "p.jsonl"
    problems.write_text(PROBLEMS[0].model_dump_json() + "\n")
    url = f"redis://127.0.0.1:{free_port()}/0"
    argv = ["--problems", str(problems), "--out", str(tmp_path / "o"), "--set", f"store.url={url}"]
    assert job_main(argv) == 2
    assert f"store.url: cannot reach Redis at {url}" in capsys.readouterr().err
    assert not (tmp_path / "o" / "trajectories.jsonl").exists()
